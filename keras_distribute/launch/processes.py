"""The local processes of a launch: their environment, signals, ports,
limits, and how a failed or frozen one is found and named.

Shared by `kd.launch` (`launch/launcher.py`) and the `python -m
keras_distribute.launch` script (`launch/script.py`); imports no framework.
The exit code a preempted process and the launcher agree on is
`job.exit_codes.PREEMPTION_EXIT_CODE`.
"""

import math
import os
import signal
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Set

from keras_distribute.job import process_notes
from keras_distribute.job.ports import PORT_SEARCH_SPAN  # noqa: F401
from keras_distribute.job.ports import free_port

DEFAULT_TIMEOUT_S = 900.0
GRACE_S = 5.0
# After SIGTERM/SIGINT reached the launcher and was passed on, how long the
# workers have to save and exit before they are killed (a scheduler's grace
# period is usually 30 s or more).
DEFAULT_SIGNAL_GRACE_S = 25.0
FORWARDED = (signal.SIGTERM, signal.SIGINT)


class SignalForwarder:
    """Passes SIGTERM/SIGINT sent to the launcher on to its workers.

    A scheduler stops a job by signalling the process it started (the
    launcher); left alone, the launcher died at once and its workers ran on
    as orphans. While active (main thread only: Python delivers signals
    there), each such signal is sent to every live worker and recorded, so
    that the launcher waits for them and exits with 128 + the signal.
    """

    def __init__(self, send: Callable[[int], None]):
        self._send = send
        self.received: List[int] = []
        self._previous: Dict[int, Any] = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED:
                self._previous[signum] = signal.signal(signum, self._forward)
        return self

    def _forward(self, signum, frame) -> None:
        self.received.append(signum)
        self._send(signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def signal_exit_code(signum: int) -> int:
    return 128 + int(signum)


def free_ports(count: int) -> List[int]:
    ports: Set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def process_env(rank: int, world_size: int, port: int,
                job_ports: Sequence[int] = (),
                notes_dir: Optional[str] = None) -> dict:
    """The environment of process `rank` of a job on this host.

    The torchrun variables (for `kd.MirroredStrategy` on torch), plus Keras'
    `KERAS_DISTRIBUTION_*` with one address per process, which every
    backend's `kd.MultiWorkerMirroredStrategy` reads (TensorFlow needs a
    server port per worker).
    """
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
    }
    if job_ports:
        env.update({
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": ",".join(
                f"127.0.0.1:{p}" for p in job_ports),
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(world_size),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
        })
    if notes_dir:
        env[process_notes.NOTES_VARIABLE] = notes_dir
    if not os.environ.get("PYTHONFAULTHANDLER"):
        # A process a fatal signal ends (SIGABRT from a native library,
        # SIGSEGV) prints every thread's Python stack to its stderr: which
        # call it died in, not only "killed by SIGABRT".
        env["PYTHONFAULTHANDLER"] = "1"
    return env


# More local processes than this many per CPU core is refused unless
# KERAS_DISTRIBUTE_MAX_PROCESSES allows it (each process imports a framework:
# thousands would exhaust the machine before the first one runs).
PROCESSES_PER_CORE = 4
MIN_PROCESS_LIMIT = 16


def max_local_processes() -> int:
    """How many local processes a launch may start: 4 per CPU core (at
    least 16), or `KERAS_DISTRIBUTE_MAX_PROCESSES` when set."""
    override = os.environ.get("KERAS_DISTRIBUTE_MAX_PROCESSES")
    if override is not None:
        try:
            return int(override)
        except ValueError:
            raise ValueError(
                "KERAS_DISTRIBUTE_MAX_PROCESSES must be an integer. "
                f"Received: {override!r}.") from None
    return max(MIN_PROCESS_LIMIT,
               PROCESSES_PER_CORE * (os.cpu_count() or 1))


def check_num_processes(num_processes: Any,
                        name: str = "num_processes") -> None:
    """Raises `ValueError` unless `num_processes` is a positive int this
    machine can start (`max_local_processes`); `name`: the argument's name
    in the message."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) \
            or num_processes < 1:
        raise ValueError(
            f"Expected `{name}` to be a positive int. Received: "
            f"{name}={num_processes!r}."
        )
    limit = max_local_processes()
    if num_processes > limit:
        raise ValueError(
            f"Expected at most {limit} local processes on this machine "
            f"({os.cpu_count()} CPU cores). Received: "
            f"{name}={num_processes}. Use one process per device; to "
            "start more anyway, set KERAS_DISTRIBUTE_MAX_PROCESSES="
            f"{num_processes}.")


def check_timeout(timeout: Any, name: str = "timeout") -> None:
    """Raises `ValueError` unless `timeout` is a finite, positive number of
    seconds (a launch never waits forever); `name`: the argument's name in
    the message."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"Expected `{name}` to be a finite, positive number of seconds. "
            f"Received: {name}={timeout!r}. Pass e.g. {name}=3600.")


def is_frozen(pid: Optional[int]) -> bool:
    """Whether the process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger):
    alive, but it will never answer a collective."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (name) state ...": the name may hold spaces or ")".
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, TypeError):
        return False  # gone, or no /proc (macOS): not known to be frozen


def first_frozen(processes) -> Optional[int]:
    """The first rank whose process is frozen (an ended one is not)."""
    return next((rank for rank, process in enumerate(processes)
                 if is_frozen(process.pid)), None)


def stop_process(process) -> None:
    """SIGTERM, or SIGKILL for a frozen process (a stopped process holds
    SIGTERM until it is continued)."""
    (process.kill if is_frozen(process.pid) else process.terminate)()


def frozen_message(rank: int, count: int) -> str:
    """What a launcher says of a frozen process."""
    return (f"Process {rank} of {count} is frozen (stopped by SIGSTOP, "
            "SIGTSTP or a debugger) and never answered")


def attach_notes(process: Any, notes_dir: str) -> None:
    """Remembers on a started process where its notes are written."""
    setattr(process, "kd_notes", notes_dir)


def notes_of(process: Any) -> Optional[str]:
    """The notes directory `attach_notes` gave `process`, or `None`."""
    return getattr(process, "kd_notes", None)


def blamed_peer(processes, rank: int) -> Optional[int]:
    """The peer process `rank` named as lost, if any (see
    `process_notes.named_lost_peer`)."""
    return process_notes.named_lost_peer(
        notes_of(processes[rank]), rank, len(processes))


def last_note(processes, rank: int, exitcode: Optional[int]) -> str:
    """What process `rank` noted it was doing, when a signal ended it (a
    runtime's abort leaves no Python traceback to report)."""
    if exitcode is None or exitcode >= 0:
        return ""
    note = process_notes.read(notes_of(processes[rank]), rank)
    return f" while {note}" if note else ""


def signal_name(exitcode: int) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f" (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return ""
    return ""
