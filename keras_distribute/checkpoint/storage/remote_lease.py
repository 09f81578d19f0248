"""One prefix, one job, in object storage: the lease of `lease`, without
`O_EXCL`.

An object store has no exclusive create that every S3-API server honours,
so the lease is the object `<directory>/.keras_distribute-lease`, naming the
job (`lease.job_token()`), its host and process id and a heartbeat the
holder rewrites (`remote_checkpoints.Heartbeat`). A job takes it when
there is none, when it is its own, or when the holder's heartbeat stopped
(`STALE_AFTER_S`, by the store's own clock: when it stamped the lease
against when it stamps a probe now, never the holder's clock); it then
writes it and reads it
back after a moment: two jobs that wrote it at once both read the last
writer's, and the other one is refused. Another job's live lease makes
`take` raise `lease.DirectoryInUseError`, which names the holder.
Framework-free.
"""

import json
import os
import socket
import threading
import time
import weakref
from typing import Dict
from typing import Optional

from keras_distribute.checkpoint.storage import lease
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import remote_checkpoints

LEASE = lease.LEASE
STALE_AFTER_S = 60.0
# How long a writer waits before reading its lease back.
SETTLE_S = 1.0

_held: Dict[str, "_Held"] = {}
_lock = threading.Lock()


class _Held:
    """A lease this process holds: its users and its heartbeat (which
    first lets go of what collected writers held, `release_collected`)."""

    def __init__(self, key: str, record: dict):
        self.users = 0
        self.heartbeat = remote_checkpoints.Heartbeat(
            key, record, before_beat=release_collected)


def _refusal(directory: str, holder: dict) -> lease.DirectoryInUseError:
    return lease.DirectoryInUseError(
        f"Another job saves checkpoints into {directory!r}: its lease "
        f"{object_store.join(directory, LEASE)!r} names host "
        f"{holder.get('host')!r}, process {holder.get('pid')!r}, and its "
        f"heartbeat is live. Two jobs saving into one prefix would delete "
        "each other's checkpoints. Give this job its own directory, or "
        "stop the other job (its lease is taken over "
        f"{STALE_AFTER_S:.0f} s after its heartbeat stops).")


def take(directory: str) -> str:
    """Takes (or joins, for this job) the lease of `directory`.

    Returns:
        The lease's key (pass it to `release`).

    Raises:
        lease.DirectoryInUseError: if another live job holds it.
    """
    key = object_store.join(directory, LEASE)
    release_collected()
    with _lock:
        held = _held.get(key)
        if held is not None:
            held.users += 1
            return key
    holder = remote_checkpoints.read_record(key)
    if holder is not None and holder.get("job") != lease.job_token() and (
            remote_checkpoints.is_live(key, holder, STALE_AFTER_S)):
        raise _refusal(directory, holder)
    record = {"job": lease.job_token(), "host": socket.gethostname(),
              "pid": os.getpid(), "beat": time.time()}
    store = object_store.store_for(key)
    store.write_bytes(key, json.dumps(record).encode())
    time.sleep(SETTLE_S)
    holder = remote_checkpoints.read_record(key)
    if holder is None or holder.get("job") != lease.job_token():
        raise _refusal(directory, holder or {})
    with _lock:
        held = _held.get(key)
        if held is None:
            held = _held[key] = _Held(key, record)
        held.users += 1
    _end_all_at_exit()
    return key


def release(key: str) -> None:
    """Lets go of a lease `take` returned; the last user of this job
    deletes it (if it is still this job's)."""
    release_collected()
    _release_one(key)


_collected = lease.CollectedWriters(lambda key: _release_one(key))


def release_collected() -> None:
    """Lets go of the uses whose writers were collected meanwhile."""
    _collected.release()


def _release_one(key: str) -> None:
    with _lock:
        held = _held.get(key)
        if held is None:
            return
        held.users -= 1
        if held.users > 0:
            return
        del _held[key]
    _end(key, held)


def _end(key: str, held: _Held) -> None:
    """Stops `held`'s heartbeat and deletes the lease if it is still this
    job's."""
    held.heartbeat.stop()
    try:
        holder = remote_checkpoints.read_record(key)
        if holder is not None and holder.get("job") == lease.job_token():
            object_store.store_for(key).remove([key])
    except Exception:  # noqa: BLE001 - stale in STALE_AFTER_S anyway
        pass


_registered_in: Optional[int] = None  # the process that registered end_all


def _end_all_at_exit() -> None:
    """Ends every lease this process holds when it exits (once per
    process, `lease.at_exit`)."""
    global _registered_in
    if _registered_in == os.getpid():
        return
    _registered_in = os.getpid()
    lease.at_exit(end_all)


def end_all() -> None:
    """Lets go of every lease this process holds (its job is over)."""
    with _lock:
        held = list(_held.items())
        _held.clear()
    _collected.clear()
    for key, lease_held in held:
        _end(key, lease_held)


class ReleaseWhenCollected:
    """A writer's hold on a lease `take` returned, let go by `detach()` or
    when the writer is collected (as `lease.release_when_collected`)."""

    def __init__(self, writer: object, key: str):
        self._key = key
        self._finalizer = weakref.finalize(writer, _collected.record, key)

    def detach(self) -> None:
        """Lets go now (once). Returns `None`: nothing is left to
        release."""
        if self._finalizer.detach() is not None:
            release(self._key)
        return None


def _after_fork() -> None:
    # A forked child is a job of its own (`lease`): it holds nothing.
    global _lock
    _held.clear()
    _collected.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
