"""Run a function, or a script, in N local processes that form a group.

Each process gets the environment `torchrun` would give it (`MASTER_ADDR`,
`MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`), so a
`kd.MirroredStrategy()` created inside joins the group. Every wait is bounded;
when one process fails the others are ended (only processes started here)
and the failure is raised with that rank's traceback.

    python -m keras_distribute.launch --nproc 2 train.py --epochs 3
"""

import contextlib
import faulthandler
import os
import pickle
import queue as queue_module
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

from keras_distribute.job import process_notes
from keras_distribute.launch import starting
from keras_distribute.launch.processes import DEFAULT_SIGNAL_GRACE_S
from keras_distribute.launch.processes import DEFAULT_TIMEOUT_S
from keras_distribute.launch.processes import GRACE_S
from keras_distribute.launch.processes import SignalForwarder
from keras_distribute.launch.processes import attach_notes
from keras_distribute.launch.processes import blamed_peer
from keras_distribute.launch.processes import check_num_processes
from keras_distribute.launch.processes import check_timeout
from keras_distribute.launch.processes import first_frozen
from keras_distribute.launch.processes import free_port
from keras_distribute.launch.processes import free_ports
from keras_distribute.launch.processes import frozen_message
from keras_distribute.launch.processes import last_note
from keras_distribute.launch.processes import notes_of
from keras_distribute.launch.processes import process_env
from keras_distribute.launch.processes import signal_name
from keras_distribute.launch.processes import stop_process


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
            job_ports, results, notes_dir=None, launcher=None) -> None:
    starting.become_launched(launcher)
    os.environ.update(process_env(rank, world_size, port, job_ports,
                                  notes_dir))
    if os.environ.get("PYTHONFAULTHANDLER") and not faulthandler.is_enabled():
        faulthandler.enable()  # (read at start-up only; this one started)
    try:
        starting.raise_preload_failure()
        import cloudpickle

        fn, args = cloudpickle.loads(payload)
        try:
            value = fn(*args)
        finally:
            _end_checkpoint_leases()
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
        starting.leave_launched(launcher)


def _end_checkpoint_leases() -> None:
    """The job is over: its checkpoint directories' leases go now, before
    the launcher hears of it (it ends a process that is slow to exit, and
    a lease left behind would wait for its heartbeat to stop)."""
    lease = sys.modules.get("keras_distribute.checkpoint.storage.lease")
    if lease is not None:
        lease.end_all()


def _destroy_process_group() -> None:
    peers = sys.modules.get("keras_distribute.job.peer_board")
    if peers is not None:  # its peers then know it left, not froze
        peers.stop()
    torch_distributed = sys.modules.get("torch.distributed")
    if torch_distributed is not None and torch_distributed.is_initialized():
        torch_distributed.destroy_process_group()


def _end(processes) -> None:
    for process in processes:
        if process.is_alive():
            stop_process(process)
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(GRACE_S)


def launch(fn: Callable, num_processes: int, args: Sequence[Any] = (), *,
           timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """Runs `fn(*args)` in `num_processes` local processes forming a group.

    Functions defined in a script or a notebook both work: `fn` travels by
    value (cloudpickle). Return values must be picklable.

    The processes are forked from a server that imported Keras once (see
    `keras_distribute.launch.starting`): only the first launch of a
    process pays for the import. `KERAS_DISTRIBUTE_START_METHOD=spawn`
    starts a fresh interpreter per process instead.

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
    context, forks = starting.context_for_launch()
    launcher = starting.launcher_state() if forks else None
    results = context.Queue()
    port, job_ports = free_port(), free_ports(num_processes)
    notes_dir = tempfile.mkdtemp(prefix="keras_distribute-notes-")
    processes = [
        context.Process(target=_worker,
                        args=(payload, rank, num_processes, port, job_ports,
                              results, notes_dir, launcher))
        for rank in range(num_processes)
    ]
    for process in processes:
        attach_notes(process, notes_dir)

    def send(signum):
        for process in processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except OSError:
                    pass

    with starting.server_start_environment(timeout) if forks else (
            contextlib.nullcontext()):
        for process in processes:
            process.start()
    with SignalForwarder(send) as forwarder:
        try:
            return _collect(processes, results, timeout, forwarder)
        finally:
            _end(processes)
            shutil.rmtree(notes_dir, ignore_errors=True)


def _collect(processes, results, timeout: float,
             forwarder: Optional[SignalForwarder] = None) -> List[Any]:
    values: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    exited_at: Dict[int, float] = {}
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


def _failure(processes, values, rank: int, trace: str) -> LaunchError:
    """The error for a failed rank, naming a peer that died or froze first
    if any (the failed one only reported the loss)."""
    frozen = first_frozen(processes)
    if frozen is not None:
        return LaunchError(
            f"{frozen_message(frozen, len(processes))}; process {rank} "
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
    dead: List[Any] = []
    while time.monotonic() < deadline and not dead:
        dead = [r for r, p in enumerate(processes)
                if r != rank and r not in values
                and p.exitcode not in (None, 0)]
        time.sleep(0.05)
    if dead:
        cause = dead[0]
        code = processes[cause].exitcode
        return LaunchError(
            f"Process {cause} of {len(processes)} died with exit code {code}"
            f"{signal_name(code)}{last_note(processes, cause, code)}; "
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
            why = process_notes.reason(notes_of(process), rank)
            raise LaunchError(
                f"Process {lost} of {len(processes)} was lost (named by "
                f"process {rank}, which then exited with code "
                f"{process.exitcode}): {why}. The other processes were "
                "ended.", lost)
        if process.exitcode != 0 or now - exited_at[rank] > GRACE_S:
            raise LaunchError(
                f"Process {rank} of {len(processes)} died with exit code "
                f"{process.exitcode} before returning"
                f"{signal_name(process.exitcode)}"
                f"{last_note(processes, rank, process.exitcode)}"
                f"{_gone(values)}. The other processes were "
                "ended.", rank)


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

