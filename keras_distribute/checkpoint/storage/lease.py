"""One directory, one job: the lease a job holds on its checkpoint directory.

Two jobs saving into one directory would remove each other's unfinished
saves (a manager clears the unfinished saves it finds when it starts) and
number their checkpoints over one another. So the first kd writer of a job
to use a directory takes a lease on it: the file `LEASE` in that directory,
created atomically (`O_CREAT | O_EXCL`), naming the job (a random token),
its host, process id and the time it began. Every writer of the same job
(this process's managers and callbacks) shares it; another job's writer is
refused with `DirectoryInUseError`, which names the holder.

A lease is released when the last writer of the job lets go of it
(`CheckpointManager.close()`, a callback's `on_train_end`, the manager
collected) or the process exits. One left by a job that died is taken over:
- from the same host (same boot), at once when its process is gone (its id
  and start time, read from /proc, tell a reused process id apart);
- from another host, when its heartbeat stopped: the holder rewrites the
  file every `HEARTBEAT_S` seconds, and a lease whose beat did not change
  for `STALE_AFTER_S` seconds (watched from here, not by clocks that may
  disagree across hosts) is stale.

This module imports no framework; only process 0 of a job takes the lease
(the manager hands its verdict to the other processes).
"""

import json
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional

LEASE = ".keras_distribute-lease"
HEARTBEAT_S = 2.0
STALE_AFTER_S = 3 * HEARTBEAT_S
# A holder on this host whose process is ending (a restart that began
# before the last process was reaped) is waited for this long.
ENDING_WAIT_S = 5.0
# This process's job token: every writer in the process is the same job.
_TOKEN = secrets.token_hex(16)


def _new_job_after_fork() -> None:
    """A forked child (e.g. a worker of `kd.launch`) is a job of its own:
    a new token, no lease held (its parent's heartbeats did not follow)."""
    global _TOKEN, _held, _lock, _registered_in
    _TOKEN = secrets.token_hex(16)
    _held = {}
    _lock = threading.Lock()
    _registered_in = None


def job_token() -> str:
    """This job's token (the same for every writer of this process; a new
    one in a forked child)."""
    return _TOKEN


class DirectoryInUseError(RuntimeError):
    """Another live job holds the checkpoint directory's lease.

    Raised, in every process of the job, by a `kd.checkpoint.CheckpointManager`
    (and so by the checkpoint callbacks) made on a directory that another
    running job saves into.
    """


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> Optional[int]:
    """The start time of process `pid` in clock ticks since boot, or None
    (no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])


def _process_alive(pid: int, start_ticks: Optional[int]) -> bool:
    if os.path.isdir("/proc/self"):
        ticks = _start_ticks(pid)
        if ticks is None:
            return False
        if start_ticks is not None and ticks != start_ticks:
            return False  # the id was reused by another process
        try:  # a zombie has ended: its lease is stale
            with open(f"/proc/{pid}/stat") as file:
                state = file.read().rsplit(")", 1)[1].split()[0]
            return state not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(record: Dict[str, Any]) -> str:
    began = record.get("began")
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began))
            if isinstance(began, (int, float)) else "?")
    return (f"job {record.get('job', '?')} on host {record.get('host', '?')!r},"
            f" process id {record.get('pid', '?')}, since {when}")


class _Held:
    """A lease this process holds: its users and its heartbeat."""

    def __init__(self, path: str, record: Dict[str, Any]):
        self.path = path
        self.record = record
        self.users = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._beat, name=f"kd-lease {path}", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            release_collected()  # what collected writers let go of
            self.record["beat"] += 1
            try:
                if _read(self.path).get("job") != _TOKEN:
                    return  # taken from us (e.g. judged stale): not ours
                _write_over(self.path, self.record)
            except OSError:
                pass  # a lost mount: the next beat tries again

    def end(self) -> None:
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=HEARTBEAT_S + 1)
        try:
            if _read(self.path).get("job") == _TOKEN:
                os.remove(self.path)
        except OSError:
            pass


_held: Dict[str, _Held] = {}
_lock = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_job_after_fork)


def _read(path: str) -> Dict[str, Any]:
    """The lease at `path` ({} for an unreadable or foreign file)."""
    with open(path, "rb") as file:
        data = file.read(4096)
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_over(path: str, record: Dict[str, Any]) -> None:
    """A heartbeat: the lease rewritten whole (readers see the old or the
    new one). No fsync: a beat lost in a crash only looks like a stopped
    heartbeat, which is what a crash is; other hosts see it on close."""
    temporary = f"{path}.{_TOKEN}.tmp"
    with open(temporary, "w") as file:
        json.dump(record, file)
    os.replace(temporary, path)


def _create(path: str, record: Dict[str, Any]) -> bool:
    """Creates the lease file; False when one exists."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                             0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as file:
        json.dump(record, file)
        file.flush()
        os.fsync(file.fileno())
    return True


def _is_stale(path: str, record: Dict[str, Any]) -> bool:
    """Whether the lease `record` (read from `path`) was left by a job that
    ended. May wait: up to `ENDING_WAIT_S` for an ending process of this
    host, `STALE_AFTER_S` for another host's heartbeat."""
    same_boot = (record.get("host") == socket.gethostname()
                 and record.get("boot") is not None
                 and record.get("boot") == _boot_id())
    pid = record.get("pid")
    if same_boot and isinstance(pid, int):
        deadline = time.monotonic() + ENDING_WAIT_S
        while _process_alive(pid, record.get("start_ticks")):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
    if (record.get("host") == socket.gethostname() and
            record.get("boot") != _boot_id() and _boot_id() is not None):
        return True  # this host rebooted since: the process is gone
    # Another host (or an unreadable lease): watch its heartbeat.
    beat = record.get("beat")
    deadline = time.monotonic() + STALE_AFTER_S
    while time.monotonic() < deadline:
        time.sleep(min(0.5, HEARTBEAT_S / 4))
        try:
            now = _read(path)
        except FileNotFoundError:
            return True  # released meanwhile
        if now.get("job") != record.get("job") or now.get("beat") != beat:
            return False
    return True


def take(directory: str) -> str:
    """Takes (or shares, within this job) the lease on `directory`.

    Args:
        directory: An existing checkpoint directory.

    Returns:
        The lease file's path; hand it to `release` when done.

    Raises:
        DirectoryInUseError: another live job holds the lease.

    Example:

    ```python
    path = lease.take("/tmp/ckpts")
    try:
        ...  # save checkpoints into /tmp/ckpts
    finally:
        lease.release(path)
    ```
    """
    path = os.path.join(os.path.abspath(directory), LEASE)
    release_collected()
    with _lock:
        held = _held.get(path)
        if held is not None:
            held.users += 1
            return path
        record = {"job": _TOKEN, "host": socket.gethostname(),
                  "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
                  "boot": _boot_id(), "began": time.time(), "beat": 0}
        for _ in range(3):
            if _create(path, record):
                break
            try:
                other = _read(path)
            except FileNotFoundError:
                continue  # released meanwhile: try again
            if other.get("job") == _TOKEN:
                break  # ours from before (e.g. after a fork): keep it
            if not _is_stale(path, other):
                raise DirectoryInUseError(
                    f"Another job saves checkpoints into {directory!r}: "
                    f"{_describe(other)} holds its lease ({path}). Two jobs "
                    "in one directory would remove each other's unfinished "
                    "saves. Give this job a directory of its own, or end the "
                    "other job first (a lease left by a job that died is "
                    "taken over: at once on the same host, after "
                    f"{STALE_AFTER_S:.0f} s without a heartbeat from "
                    "another host).")
            _take_over(path, other)
        else:
            raise DirectoryInUseError(
                f"Could not take the lease on {directory!r}: other writers "
                f"kept creating it ({path}). Give each job its own "
                "directory.")
        held = _held[path] = _Held(path, record)
        held.users = 1
        _end_all_at_exit()
        return path


_registered_in: Optional[int] = None  # the process that registered end_all


def _end_all_at_exit() -> None:
    """Ends every lease this process holds when it exits (once per
    process, `at_exit`)."""
    global _registered_in
    if _registered_in == os.getpid():
        return
    _registered_in = os.getpid()
    at_exit(end_all)


def at_exit(end: Callable[[], None]) -> None:
    """Runs `end` when this process exits: at interpreter exit, and at a
    multiprocessing child's exit (`kd.launch`'s workers end through
    `os._exit`, which runs no `atexit` handler, only multiprocessing's
    finalizers, registered after the child started)."""
    import atexit
    import multiprocessing.util

    atexit.register(end)
    multiprocessing.util.Finalize(None, end, exitpriority=10)


def end_all() -> None:
    """Lets go of every lease this process holds (its job is over)."""
    with _lock:
        held = list(_held.values())
        _held.clear()
    for lease_held in held:
        lease_held.end()


def _take_over(path: str, stale: Dict[str, Any]) -> None:
    """Removes the stale lease `stale` (if it is still the one there); a
    file in its place that is no lease kd wrote is moved aside, kept."""
    aside = f"{path}.{_TOKEN}.stale"
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = _read(aside)
    except OSError:
        moved = {}
    if moved.get("job") != stale.get("job"):
        # Another writer took it over between our read and the move: put
        # theirs back (ours will then find it and be refused).
        try:
            os.link(aside, path)
        except OSError:
            pass
    if not _is_lease_record(moved):
        return  # not a lease kd wrote (garbage in its place): kept aside
    try:
        os.remove(aside)
    except OSError:
        pass


def _is_lease_record(record: Dict[str, Any]) -> bool:
    """Whether `record` is a lease as `take` writes it (kd may remove only
    what it wrote)."""
    return (isinstance(record.get("job"), str)
            and isinstance(record.get("host"), str)
            and isinstance(record.get("pid"), int))


def release(path: str) -> None:
    """Lets go of one use of the lease at `path` (from `take`); the file is
    removed when this job's last writer lets go."""
    release_collected()
    _release_one(path)


class CollectedWriters:
    """The keys (lease paths) whose writers were garbage-collected. A
    finalizer may run inside any allocation, even one made while a lease's
    lock is held, so it only records the key (`record`: a list append is
    atomic); `release` lets go of them later, from `take`, `release` or
    the next heartbeat, through `release_one(key)`."""

    def __init__(self, release_one: Callable[[str], None]):
        self._keys: List[str] = []
        self._release_one = release_one

    def record(self, key: str) -> None:
        """Notes that a writer holding `key` was collected."""
        self._keys.append(key)

    def release(self) -> None:
        """Lets go of the uses whose writers were collected meanwhile."""
        while self._keys:
            try:
                key = self._keys.pop()
            except IndexError:  # emptied by another thread meanwhile
                return
            self._release_one(key)

    def clear(self) -> None:
        """Forgets every key (a forked child holds nothing)."""
        self._keys.clear()


_collected = CollectedWriters(lambda path: _release_one(path))


def release_collected() -> None:
    """Lets go of the uses whose writers were collected meanwhile."""
    _collected.release()


def _release_one(path: str) -> None:
    with _lock:
        held = _held.get(path)
        if held is None:
            return
        held.users -= 1
        if held.users > 0:
            return
        del _held[path]
    held.end()


def drop(directory: str) -> bool:
    """Lets go of this job's lease on `directory` whoever still uses it
    (for a writer about to remove the directory it made).

    Returns:
        Whether this process held it.
    """
    path = os.path.join(os.path.abspath(directory), LEASE)
    with _lock:
        held = _held.pop(path, None)
    if held is None:
        return False
    held.end()
    return True


def release_when_collected(owner: Any, path: str) -> "weakref.finalize":
    """Lets go of one use of `path` soon after `owner` is garbage-collected
    (at the next `take`, `release` or heartbeat; `end_all` at exit). To let
    go now: `release(path)` after `finalizer.detach()`."""
    return weakref.finalize(owner, _collected.record, path)


def holder(directory: str) -> Optional[Dict[str, Any]]:
    """The lease on `directory` (its recorded job, host, pid, ...), or None."""
    try:
        return _read(os.path.join(directory, LEASE))
    except OSError:
        return None
