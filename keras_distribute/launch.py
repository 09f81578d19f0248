"""Run a function, or a script, in N local processes that form a group.

Each process gets the environment `torchrun` would give it (`MASTER_ADDR`,
`MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), so a
`kd.MirroredStrategy()` created inside joins the group. Every wait is bounded;
when one process fails the others are ended (only processes started here)
and the failure is raised with that rank's traceback.

    python -m keras_distribute.launch --nproc 2 train.py --epochs 3
"""

import math
import multiprocessing
import os
import pickle
import queue as queue_module
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

from keras_distribute import process_notes

DEFAULT_TIMEOUT_S = 900.0
_GRACE_S = 5.0
# After SIGTERM/SIGINT reached the launcher and was passed on, how long the
# workers have to save and exit before they are killed (a scheduler's grace
# period is usually 30 s or more).
DEFAULT_SIGNAL_GRACE_S = 25.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
# The exit code of a process that saved its state on a preemption signal
# (`kd.callbacks.PreemptionCheckpoint`): restart me. tf.distribute's
# PreemptionCheckpointHandler uses the same.
PREEMPTION_EXIT_CODE = 42


class _SignalForwarder:
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
        self._previous = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in _FORWARDED:
                self._previous[signum] = signal.signal(signum, self._forward)
        return self

    def _forward(self, signum, frame) -> None:
        self.received.append(signum)
        self._send(signum)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _signal_exit_code(signum: int) -> int:
    return 128 + int(signum)


class LaunchError(RuntimeError):
    """A launched process failed, died or did not finish in time.

    `rank` is the process that failed first: a peer that died, froze or
    was named lost by the survivor (`kd.WorkerLostError`), never a survivor
    that only reported the loss; `None` when the whole launch timed out or
    was ended by a signal.

    Example:

    >>> try:
    ...     kd.launch(train, num_processes=2)  # doctest: +SKIP
    ... except kd.LaunchError as error:
    ...     print("look at the log of process", error.rank)  # doctest: +SKIP
    """

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_ports(count: int) -> List[int]:
    ports = set()
    while len(ports) < count:
        ports.add(_free_port())
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
    return env


def _check_main_guard() -> None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.exists(path):
        return  # notebook or interactive session: nothing is re-imported
    with open(path, encoding="utf-8", errors="replace") as source:
        text = source.read()
    if "__name__" not in text or "__main__" not in text:
        raise LaunchError(
            f"The script {path} calls kd.launch at import time. Each new "
            "process imports the script again and would launch again. "
            "Received: a script without a main guard. Put the launching code "
            "under a guard:\n\n    if __name__ == \"__main__\":\n"
            "        kd.launch(train, num_processes=2)\n"
        )


def _worker(payload: bytes, rank: int, world_size: int, port: int,
            job_ports, results, notes_dir=None) -> None:
    os.environ.update(process_env(rank, world_size, port, job_ports,
                                  notes_dir))
    try:
        import cloudpickle

        fn, args = cloudpickle.loads(payload)
        value = fn(*args)
        try:  # (the queue pickles in a thread of its own, where it is lost)
            pickle.dumps(value)
        except Exception as error:
            raise TypeError(
                f"The value process {rank}'s function returned cannot be "
                f"pickled, so it cannot be sent back: {type(value).__name__}"
                f" ({type(error).__name__}: {error}). Return plain values "
                "(numbers, strings, numpy arrays, lists, dicts); convert "
                "tensors with keras.ops.convert_to_numpy.") from error
        results.put((rank, True, value))
    except BaseException:  # reported to the launcher with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        _destroy_process_group()


def _destroy_process_group() -> None:
    peers = sys.modules.get("keras_distribute.peer_board")
    if peers is not None:  # its peers then know it left, not froze
        peers.stop()
    torch_distributed = sys.modules.get("torch.distributed")
    if torch_distributed is not None and torch_distributed.is_initialized():
        torch_distributed.destroy_process_group()


def _end(processes) -> None:
    for process in processes:
        if process.is_alive():
            _stop(process)
    deadline = time.monotonic() + _GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(_GRACE_S)


# More local processes than this many per CPU core is refused unless
# KERAS_DISTRIBUTE_MAX_PROCESSES allows it (each process imports a framework:
# thousands would exhaust the machine before the first one runs).
_PROCESSES_PER_CORE = 4
_MIN_PROCESS_LIMIT = 16


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
    return max(_MIN_PROCESS_LIMIT,
               _PROCESSES_PER_CORE * (os.cpu_count() or 1))


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


def launch(fn: Callable, num_processes: int, args: Sequence[Any] = (), *,
           timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """Runs `fn(*args)` in `num_processes` local processes forming a group.

    Functions defined in a script or a notebook both work: `fn` travels by
    value (cloudpickle). Return values must be picklable.

    Args:
        fn: The function each process runs.
        num_processes: How many processes (one replica each on PyTorch).
        args: Positional arguments for `fn`. Defaults to `()`.
        timeout: Seconds before the whole launch is ended as hung.
            Defaults to 900.

    Returns:
        `fn`'s return values, in rank order.

    Raises:
        ValueError: if `num_processes` is not a positive int (or more than
            `max_local_processes()`), `timeout` is not a finite positive
            number, or `fn` is not callable.
        LaunchError: if a process raised (its traceback is in the message),
            died, or the launch ran past `timeout`; the other processes are
            ended first.

    Example:

    ```python
    def train():
        strategy = kd.MirroredStrategy()
        return strategy.num_replicas_in_sync

    if __name__ == "__main__":
        print(kd.launch(train, num_processes=2))   # [2, 2]
    ```
    """
    import cloudpickle

    check_num_processes(num_processes)
    check_timeout(timeout)
    if not callable(fn):
        raise ValueError(f"Expected `fn` to be callable. Received: fn={fn!r}.")
    _check_main_guard()
    payload = cloudpickle.dumps((fn, tuple(args)))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port, job_ports = _free_port(), _free_ports(num_processes)
    notes_dir = tempfile.mkdtemp(prefix="keras_distribute-notes-")
    processes = [
        context.Process(target=_worker,
                        args=(payload, rank, num_processes, port, job_ports,
                              results, notes_dir))
        for rank in range(num_processes)
    ]
    for process in processes:
        process.kd_notes = notes_dir
    def send(signum):
        for process in processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except OSError:
                    pass

    for process in processes:
        process.start()
    with _SignalForwarder(send) as forwarder:
        try:
            return _collect(processes, results, timeout, forwarder)
        finally:
            _end(processes)
            shutil.rmtree(notes_dir, ignore_errors=True)


def _collect(processes, results, timeout: float,
             forwarder: Optional[_SignalForwarder] = None) -> List[Any]:
    values, deadline = {}, time.monotonic() + timeout
    exited_at = {}
    while len(values) < len(processes):
        if forwarder is not None and forwarder.received:
            signum = forwarder.received[0]
            _wait_for_exit(processes, DEFAULT_SIGNAL_GRACE_S)
            raise LaunchError(
                f"The launcher received {signal.Signals(signum).name} and "
                "passed it on to every process; the launch was ended.", None)
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(processes))) - set(values))
            raise LaunchError(
                f"The launch ran past its timeout of {timeout:.0f} s; "
                f"process(es) {missing} had not finished. Raise `timeout`, "
                "or look for a process stuck in a collective.")
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue_module.Empty:
            if not (forwarder is not None and forwarder.received):
                _check_dead(processes, values, exited_at)
            continue
        if not ok:
            raise _failure(processes, values, rank, value)
        values[rank] = value
    return [values[rank] for rank in range(len(processes))]


def _wait_for_exit(processes, grace_s: float) -> None:
    """Waits up to `grace_s` for every process (they were signalled)."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _is_frozen(pid: Optional[int]) -> bool:
    """Whether the process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger):
    alive, but it will never answer a collective."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (name) state ...": the name may hold spaces or ")".
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, TypeError):
        return False  # gone, or no /proc (macOS): not known to be frozen


def _first_frozen(processes) -> Optional[int]:
    """The first rank whose process is frozen (an ended one is not)."""
    return next((rank for rank, process in enumerate(processes)
                 if _is_frozen(process.pid)), None)


def _stop(process) -> None:
    """SIGTERM, or SIGKILL for a frozen process (a stopped process holds
    SIGTERM until it is continued)."""
    (process.kill if _is_frozen(process.pid) else process.terminate)()


def _frozen_message(rank: int, count: int) -> str:
    """What a launcher says of a frozen process."""
    return (f"Process {rank} of {count} is frozen (stopped by SIGSTOP, "
            "SIGTSTP or a debugger) and never answered")


def _failure(processes, values, rank: int, trace: str) -> LaunchError:
    """The error for a failed rank, naming a peer that died or froze first
    if any (the failed one only reported the loss)."""
    frozen = _first_frozen(processes)
    if frozen is not None:
        return LaunchError(
            f"{_frozen_message(frozen, len(processes))}; process {rank} "
            f"then failed waiting for it:\n{trace}", frozen)
    lost = blamed_peer(processes, rank)
    if (lost is not None and lost not in values
            and processes[lost].exitcode is None):
        # Alive but hung: the failed process named it (`kd.WorkerLostError`);
        # a peer that died or finished is reported below.
        return LaunchError(
            f"Process {lost} of {len(processes)} was lost (named by process "
            f"{rank}, which then failed){_gone(values)}:\n{trace}", lost)
    deadline = time.monotonic() + 2.0  # a dead peer's exit code lands soon
    dead = []
    while time.monotonic() < deadline and not dead:
        dead = [r for r, p in enumerate(processes)
                if r != rank and r not in values and p.exitcode not in (None, 0)]
        time.sleep(0.05)
    if dead:
        cause = dead[0]
        code = processes[cause].exitcode
        return LaunchError(
            f"Process {cause} of {len(processes)} died with exit code {code}"
            f"{_signal_name(code)}{_last_note(processes, cause, code)}; "
            f"process {rank} then failed:\n{trace}", cause)
    return LaunchError(
        f"Process {rank} of {len(processes)} failed{_gone(values)}"
        f":\n{trace}", rank)


def _gone(values) -> str:
    """Names processes that left early (returned) while others still ran.

    A process that returned its value is leaving, whether or not its exit
    was already seen: its peer often fails on the closed connection before
    the exit code lands (a race seen in CI).
    """
    early = list(values)
    if not early:
        return ""
    return (f" after process(es) {sorted(early)} had already finished and "
            "left the group")


def _check_dead(processes, values, exited_at) -> None:
    now = time.monotonic()
    for rank, process in enumerate(processes):
        if rank in values or process.exitcode is None:
            continue
        # A clean exit may still have its result in flight: wait a little.
        exited_at.setdefault(rank, now)
        lost = blamed_peer(processes, rank)
        # (The named peer may be gone by now: a JAX job's processes abort
        # once the one hosting its coordinator ended.)
        if process.exitcode != 0 and lost is not None and lost not in values:
            why = process_notes.reason(getattr(process, "kd_notes", None), rank)
            raise LaunchError(
                f"Process {lost} of {len(processes)} was lost (named by "
                f"process {rank}, which then exited with code "
                f"{process.exitcode}): {why}. The other processes were "
                "ended.", lost)
        if process.exitcode != 0 or now - exited_at[rank] > _GRACE_S:
            raise LaunchError(
                f"Process {rank} of {len(processes)} died with exit code "
                f"{process.exitcode} before returning"
                f"{_signal_name(process.exitcode)}"
                f"{_last_note(processes, rank, process.exitcode)}"
                f"{_gone(values)}. The other processes were "
                "ended.", rank)


def blamed_peer(processes, rank: int) -> Optional[int]:
    """The peer process `rank` named as lost, if any (see
    `process_notes.named_lost_peer`)."""
    return process_notes.named_lost_peer(
        getattr(processes[rank], "kd_notes", None), rank, len(processes))


def _last_note(processes, rank: int, exitcode: Optional[int]) -> str:
    """What process `rank` noted it was doing, when a signal ended it (a
    runtime's abort leaves no Python traceback to report)."""
    if exitcode is None or exitcode >= 0:
        return ""
    note = process_notes.read(getattr(processes[rank], "kd_notes", None), rank)
    return f" while {note}" if note else ""


def _signal_name(exitcode: int) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f" (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return ""
    return ""


def notebook_launcher(fn: Callable, num_processes: int,
                      args: Sequence[Any] = (), *,
                      timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """`kd.launch` for Jupyter: runs a function defined in the notebook.

    Args:
        fn: The function each process runs (may be defined in a cell).
        num_processes: How many processes.
        args: Positional arguments for `fn`. Defaults to `()`.
        timeout: Seconds before the launch is ended as hung. Defaults to 900.

    Returns:
        `fn`'s return values, in rank order.

    Raises:
        LaunchError: as `kd.launch`.

    Example:

    ```python
    def train():
        return kd.MirroredStrategy().num_replicas_in_sync
    kd.notebook_launcher(train, num_processes=2)   # [2, 2]
    ```
    """
    return launch(fn, num_processes, args, timeout=timeout)


if __name__ == "__main__":
    from keras_distribute.launch_script import main as _main

    sys.exit(_main())
