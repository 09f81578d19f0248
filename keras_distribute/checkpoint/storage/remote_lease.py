"""One prefix, one job, in object storage: the lease of `lease`, without
`O_EXCL`.

The lease is the object `<directory>/.keras_distribute-lease`, naming the
job (`lease.job_token()`), its host and process id and a heartbeat the
holder rewrites (`remote_checkpoints.Heartbeat`). Where the store honours
conditional writes (`conditional_writes`: S3's `If-None-Match` /
`If-Match`), the store itself decides every step in one request:

- a job takes a free lease by creating the object only where none is; a
  stale one (its heartbeat stopped for `STALE_AFTER_S`, by the store's own
  clock) or its own, by replacing the version it read — of two jobs racing,
  exactly one succeeds, the other reads the winner's live lease and is
  refused;
- the holder renews it by replacing the version it last wrote: a holder
  that froze past the expiry and resumes finds the lease changed, stops
  beating and holds it no more;
- fencing: the chief renews it, conditionally, right before the commit of
  every save (`confirm`); a job that lost its lease commits nothing and
  raises `lease.DirectoryInUseError`;
- it is deleted only while it is still the version this job wrote.

Elsewhere (GCS through gcsfs, servers that ignore the headers) the lease is
written and read back after a moment (two jobs that wrote it at once both
read the last writer's; the other is refused), and a renewal first reads
it and stops if another job's is there. An object at the lease's key that
is not a lease of kd's is never overwritten or deleted: the directory is
refused. Another job's live lease makes `take` raise
`lease.DirectoryInUseError`, which names the holder. Framework-free.
"""

import json
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Dict
from typing import Optional

from keras_distribute.checkpoint.storage import conditional_writes
from keras_distribute.checkpoint.storage import lease
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage.object_store import Store

LEASE = lease.LEASE
STALE_AFTER_S = 60.0
# How long a writer waits before reading its lease back (without
# conditional writes).
SETTLE_S = 1.0
# (a record as small as a generation's marker)
_RECORD_BYTES = remote_checkpoints.MARKER_BYTES
# Rounds of create / read / replace before a take gives up (each lost
# round means another job wrote the lease meanwhile).
_TAKE_ROUNDS = 4

_held: Dict[str, "_Held"] = {}
_lock = threading.Lock()


class _Held:
    """A lease this process holds: its users, the version it last wrote
    (`None` where the store does not honour conditional writes), whether it
    was lost, and its heartbeat (which first lets go of what collected
    writers held, `release_collected`)."""

    def __init__(self, store: Store, directory: str, key: str, record: dict,
                 version: Optional[str]):
        self.users = 0
        self.store, self.directory, self.key = store, directory, key
        self.record, self.version = dict(record), version
        self.lost: Optional[str] = None
        self._lock = threading.Lock()
        self.heartbeat = remote_checkpoints.Heartbeat(
            key, record, before_beat=release_collected, write=self.renew)

    def renew(self, record: Optional[dict] = None) -> None:
        """Writes the lease again (a heartbeat), only while it is still
        this job's.

        Raises:
            lease.DirectoryInUseError: it was lost (now or before).
        """
        record = dict(record or dict(self.record, beat=time.time()),
                      write=secrets.token_hex(8))
        data = json.dumps(record).encode()
        with self._lock:
            if self.lost is not None:
                raise lease.DirectoryInUseError(self.lost)
            if self.version is None:
                holder = remote_checkpoints.read_record(self.key)
                if holder is not None and holder.get("job") != (
                        lease.job_token()):
                    self._lose(holder)
                self.store.write_bytes(self.key, data)
                return
            try:
                self.version = conditional_writes.replace(
                    self.store, self.key, data, self.version)
            except (conditional_writes.VersionChanged, FileNotFoundError):
                found = conditional_writes.read(self.store, self.key,
                                                _RECORD_BYTES)
                holder = _lease_record(found[0]) if found else None
                if found is not None and holder is not None and holder.get(
                        "write") == record["write"]:
                    self.version = found[1]  # (it landed; the answer was lost)
                    return
                self._lose(holder or {})

    def _lose(self, holder: dict) -> None:
        self.lost = (
            f"This job no longer holds the lease of {self.directory!r}: "
            f"{self.key!r} now names host {holder.get('host')!r}, process "
            f"{holder.get('pid')!r} (this job's heartbeat stopped for longer "
            f"than {STALE_AFTER_S:.0f} s, e.g. the process was paused, and "
            "another job took the directory over). Nothing more is "
            "committed there; the checkpoints saved before are intact. Stop "
            "one of the two jobs, or give each its own directory.")
        raise lease.DirectoryInUseError(self.lost)


def _refusal(directory: str, holder: dict) -> lease.DirectoryInUseError:
    return lease.DirectoryInUseError(
        f"Another job saves checkpoints into {directory!r}: its lease "
        f"{object_store.join(directory, LEASE)!r} names host "
        f"{holder.get('host')!r}, process {holder.get('pid')!r}, and its "
        f"heartbeat is live. Two jobs saving into one prefix would delete "
        "each other's checkpoints. Give this job its own directory, or "
        "stop the other job (its lease is taken over "
        f"{STALE_AFTER_S:.0f} s after its heartbeat stops).")


def _lease_record(raw: bytes) -> Optional[dict]:
    """The lease `raw` holds, or `None` if it is not one of kd's."""
    try:
        record = json.loads(raw) if len(raw) <= _RECORD_BYTES else None
    except ValueError:
        return None
    if not (isinstance(record, dict) and isinstance(record.get("job"), str)
            and isinstance(record.get("host"), str)
            and isinstance(record.get("pid"), int)
            and isinstance(record.get("beat"), (int, float))):
        return None
    return record


def _not_a_lease(directory: str, key: str) -> lease.DirectoryInUseError:
    return lease.DirectoryInUseError(
        f"{key!r} holds an object keras_distribute did not write (it is not "
        f"a lease of kd's), so {directory!r} cannot be leased: kd never "
        "overwrites or deletes an object it did not create. Give the job "
        "another directory, or remove that object if it is not needed.")


def take(directory: str) -> str:
    """Takes (or joins, for this job) the lease of `directory`.

    Returns:
        The lease's key (pass it to `release`).

    Raises:
        lease.DirectoryInUseError: if another live job holds it, or its key
            holds an object kd did not write.
    """
    key = object_store.join(directory, LEASE)
    release_collected()
    with _lock:
        held = _held.get(key)
        if held is not None:
            held.users += 1
            return key
    store = object_store.store_for(key)
    record = {"job": lease.job_token(), "host": socket.gethostname(),
              "pid": os.getpid(), "beat": time.time(),
              "write": secrets.token_hex(8)}
    if conditional_writes.honoured(store, directory):
        version: Optional[str] = take_conditionally(store, directory, key,
                                                    record)
    else:
        version = None
        _take_by_reading_back(store, directory, key, record)
    with _lock:
        held = _held.get(key)
        if held is None:
            held = _held[key] = _Held(store, directory, key, record, version)
        held.users += 1
    _end_all_at_exit()
    return key


def take_conditionally(store: Store, directory: str, key: str,
                       record: dict) -> str:
    """Takes the lease `key` for `record`'s job with conditional writes.

    Returns:
        The version of the lease written.

    Raises:
        lease.DirectoryInUseError: another job's live lease is there (or
            another job won every round of a race), or an object kd did
            not write.
    """
    data = json.dumps(record).encode()
    holder: dict = {}
    for _ in range(_TAKE_ROUNDS):
        try:
            return conditional_writes.create(store, key, data)
        except FileExistsError:
            pass
        found = conditional_writes.read(store, key, _RECORD_BYTES)
        if found is None:
            continue  # let go meanwhile: create it again
        raw, version = found
        read = _lease_record(raw)
        if read is None:
            raise _not_a_lease(directory, key)
        holder = read
        if holder.get("write") == record["write"]:
            return version  # (this create landed; its answer was lost)
        if holder["job"] != record["job"] and remote_checkpoints.is_live(
                key, holder, STALE_AFTER_S):
            raise _refusal(directory, holder)
        try:
            return conditional_writes.replace(store, key, data, version)
        except (conditional_writes.VersionChanged, FileNotFoundError):
            continue  # another job wrote it meanwhile: read it again
    raise _refusal(directory, holder)


def _take_by_reading_back(store: Store, directory: str, key: str,
                          record: dict) -> None:
    try:
        raw: Optional[bytes] = store.read_bytes(key, _RECORD_BYTES)
    except FileNotFoundError:
        raw = None
    holder = None if raw is None else _lease_record(raw)
    if raw is not None and holder is None:
        raise _not_a_lease(directory, key)
    if holder is not None and holder["job"] != lease.job_token() and (
            remote_checkpoints.is_live(key, holder, STALE_AFTER_S)):
        raise _refusal(directory, holder)
    store.write_bytes(key, json.dumps(record).encode())
    time.sleep(SETTLE_S)
    holder = remote_checkpoints.read_record(key)
    if holder is None or holder.get("job") != lease.job_token():
        raise _refusal(directory, holder or {})


def confirm(path: str) -> None:
    """Fencing, before a commit at `path`: where this process holds the
    lease of `path`'s directory, renews it now (conditionally, where the
    store allows), so a job that lost it commits nothing.

    Raises:
        lease.DirectoryInUseError: this job held the lease and lost it.
    """
    directory = path.rstrip("/").rpartition("/")[0]
    with _lock:
        held = _held.get(object_store.join(directory, LEASE))
    if held is not None:
        held.renew()


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
    """Stops `held`'s heartbeat and deletes the lease if it is still the
    version this job wrote (or, without conditional writes, still names
    this job)."""
    held.heartbeat.stop()
    if held.lost is not None:
        return  # another job's now
    try:
        if held.version is not None:
            conditional_writes.remove(held.store, key, held.version)
            return
        holder = remote_checkpoints.read_record(key)
        if holder is not None and holder.get("job") == lease.job_token():
            held.store.remove([key])
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
