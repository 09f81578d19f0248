"""How kd's TensorFlow multi-worker strategy notices workers that never
join or are lost, without a timeout on each collective (see
`bounded_multi_worker_strategy`)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from typing import TYPE_CHECKING
from typing import Any
from typing import Iterator
from typing import Optional

import tensorflow as tf

from keras_distribute.common.errors import WorkerLostError

if TYPE_CHECKING:
    from keras_distribute.cluster_resolver.base import ClusterResolver

# How TensorFlow names a task in its errors.
_TASK_IN_TEXT = re.compile(r"/job:(chief|worker)(?:/replica:\d+)?/task:(\d+)")
# What TensorFlow raises in a worker whose peer is lost (dead, frozen, or
# cut off by the network): the collective's or the coordination service's.
_LOST_PEER_ERRORS = (tf.errors.UnavailableError,
                     tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                     tf.errors.CancelledError, tf.errors.InternalError)


@contextlib.contextmanager
def naming_a_lost_worker(
        resolver: ClusterResolver | None) -> Iterator[None]:
    """Turns TensorFlow's error for a lost worker into `kd.WorkerLostError`
    naming it and its address (TensorFlow's error stays its cause).

    TensorFlow names a lost task as `/job:worker/replica:0/task:1` at best;
    a worker cut off from the coordination service's host (process 0) gets
    only a failed heartbeat RPC. With several workers, the process named is
    the task in TensorFlow's text, else process 0 (the coordination
    service's host) for a process that is not process 0."""
    try:
        yield
    except WorkerLostError:
        raise
    except _LOST_PEER_ERRORS as error:
        if resolver is None or resolver.num_processes <= 1:
            raise
        lost = _lost_process(str(error), resolver)
        if lost is None:
            raise
        count = resolver.num_processes
        rank = resolver.process_id
        address = resolver.addresses[lost]
        _bound_the_exit(f"process {rank} of {count} lost process {lost} "
                        f"at {address}")
        via = ("its collective with it failed"
               if lost != 0 or rank == 0 else
               "the job's coordination service, which it hosts, stopped "
               "answering")
        raise WorkerLostError(
            f"Process {rank} of {count} lost process {lost} of {count} at "
            f"{address}: {via} ({type(error).__name__}). It died, froze, or "
            "its machine is unreachable (down, or the network between them "
            "cut). Check that process's own log; a restart resumes from the "
            "last checkpoint (BackupAndRestore). TensorFlow said: "
            f"{_first_line(error)}", lost) from error


# How long this process may take to exit after it lost a worker.
EXIT_AFTER_LOSS_S = 20.0
_exit_bounded = False


def _bound_the_exit(what: str) -> None:
    """After a lost worker, bounds how long this process takes to exit.

    TensorFlow's own shutdown (its coordination service agent's) waits on
    the lost peer in native code, holding the interpreter: a worker cut off
    by a network partition raised its error and then never ended. At exit,
    a watcher process (as for the join) ends it if it has not ended within
    `EXIT_AFTER_LOSS_S`, saying why; a process that goes on living (a
    notebook that caught the error) is left alone until it exits.
    """
    global _exit_bounded
    if _exit_bounded:
        return
    _exit_bounded = True
    import atexit

    message = (f"TensorFlow did not shut down within {EXIT_AFTER_LOSS_S:.0f}"
               f" s after {what} (its shutdown waits on the lost peer), so "
               "keras_distribute ended this process")

    def watch_the_exit() -> None:
        # Never waited for: it ends when this process does (its stdin
        # closes) or ends this process when the time is up.
        _start_watcher(EXIT_AFTER_LOSS_S, message)

    atexit.register(watch_the_exit)


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines()
             if line.strip() and "Detected at node" not in line
             and not line.lstrip().startswith("File ")]
    return (lines[0] if lines else type(error).__name__)[:300]


def _lost_process(text: str, resolver: ClusterResolver) -> Optional[int]:
    """The process of the job that TensorFlow's error `text` points at."""
    spec = resolver.cluster_spec()
    chiefs = len(spec.get("chief", []))
    for job, task in _TASK_IN_TEXT.findall(text):
        process = int(task) if job == "chief" else chiefs + int(task)
        if process != resolver.process_id and (
                process < resolver.num_processes):
            return process
    if "Coordination" in text and resolver.process_id != 0:
        return 0
    return None


def bounded_multi_worker_strategy(tf_resolver: Any, timeout_s: float) -> Any:
    """A `tf.distribute.MultiWorkerMirroredStrategy` that finds a worker that
    never joins or is lost within `timeout_s`, with no timeout on each
    collective.

    A per-collective timeout (`CommunicationOptions(timeout_seconds=...)`)
    makes TensorFlow start a thread per collective that sleeps for the whole
    timeout: a `fit` of a few steps a second held ~1,300 threads with the
    60 s default (benchmarks/soak.py). Instead, TensorFlow's coordination
    service (which the strategy starts anyway) is configured as the strategy
    would, with `timeout_s` as the heartbeat timeout after which a lost
    worker fails the collectives. Joining waits without end in TensorFlow's
    native code (a worker that never started hung the others): a watchdog
    ends this process after `timeout_s`, saying why (stderr and the note
    its launcher reports), since no exception can reach the waiting call.
    """
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.distribute.collective_all_reduce_strategy import (
        coordination_config_pb2,
    )
    from tensorflow.python.eager import context as tf_context

    spec = tf_resolver.cluster_spec()
    if tf_context.context().coordination_service is None:
        milliseconds = int(timeout_s * 1000)
        tf_context.context().configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(spec),
            coordinated_jobs=[
                coordination_config_pb2.CoordinatedJob(
                    name=job, num_tasks=spec.num_tasks(job))
                for job in ("chief", "worker") if job in spec.jobs],
            heartbeat_timeout_in_ms=milliseconds)
    task = f"{tf_resolver.task_type} {tf_resolver.task_id}"
    watchdog = _JoinWatchdog(timeout_s, (
        f"joining the TensorFlow job {spec.as_dict()} as {task}: not every "
        f"worker joined within {timeout_s:.0f} s (TensorFlow waits without "
        "end, so keras_distribute ended this process). Check that every "
        "worker started with the same TF_CONFIG and can reach the others; "
        "raise CommunicationOptions(timeout_seconds=...) for slow starts"))
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=tf_resolver)
    finally:
        watchdog.joined()


# A separate tiny process watches the join: TensorFlow's native wait holds
# the GIL, so no thread (or signal handler) of this process can run.
_WATCHER = """
import os, select, signal, sys
parent, seconds, message = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if not ready:
    sys.stderr.write("keras_distribute: " + message + ".\\n")
    sys.stderr.flush()
    os.kill(parent, signal.SIGKILL)
"""


def _start_watcher(timeout_s: float, message: str) -> subprocess.Popen:
    """Starts `_WATCHER` over this process: it ends this process after
    `timeout_s`, saying `message`, unless its stdin closes first."""
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(os.getpid()), str(timeout_s),
         message], stdin=subprocess.PIPE)


class _JoinWatchdog:
    """Ends this process after `timeout_s` unless `joined()` is called first,
    saying why on stderr and in the note its launcher reports."""

    def __init__(self, timeout_s: float, message: str):
        from keras_distribute.job import process_notes

        process_notes.write(message)
        self._watcher = _start_watcher(timeout_s, message)

    def joined(self) -> None:
        from keras_distribute.job import process_notes

        process_notes.write("")
        stdin = self._watcher.stdin
        if stdin is not None:  # made with stdin=PIPE
            stdin.close()  # readable (EOF): the watcher exits
        self._watcher.wait()


class _CoordinationText:
    """TensorFlow's coordination service (its key-value store) as the peer
    board's text store. A key is not overwritten in place: it is deleted
    and set again, so a reader that finds it missing looks once more."""

    def __init__(self, tf_context: Any):
        self._context = tf_context

    def set(self, key: str, text: str) -> None:
        try:
            self._context.delete_config_key_value(key)
        except Exception:  # not there yet
            pass
        self._context.set_config_key_value(key, text)

    def get(self, key: str) -> Any:
        for _ in range(3):
            try:
                return self._context.get_config_key_value(
                    key, timeout_in_ms=200)
            except Exception:  # between a delete and a set, or never set
                continue
        return None


def check_same_cluster(resolver: ClusterResolver, timeout_s: float) -> None:
    """Refuses, in every worker alike, a job whose workers were given
    different cluster descriptions or the same task index, before a step
    runs (#43: TensorFlow failed the first collective, in its words, "is
    joining a group with size3, but that group has size 2")."""
    from tensorflow.python.eager import context as tf_context

    from keras_distribute.job import cluster_agreement

    service = tf_context.context()
    store = cluster_agreement.CoordinationServiceStore(
        set_once=service.set_config_key_value,
        set_over=_CoordinationText(service).set,
        get_waiting=lambda key, timeout_ms: service.get_config_key_value(
            key, timeout_in_ms=timeout_ms))
    cluster_agreement.check_same_cluster(
        store, resolver.process_id,
        resolver.num_processes, cluster_agreement.describe(resolver),
        timeout_s)


def watch_peers(rank: int, world_size: int, timeout_s: float,
                host: Optional[str] = None,
                store_address: Optional[str] = None) -> None:
    """Names a peer that hangs while this process waits for it (see
    `keras_distribute.job.peer_board`): TensorFlow's heartbeat fails the others
    when a worker dies or freezes, but a worker that is alive and never
    reaches the collective leaves them waiting without end."""
    import atexit

    from tensorflow.python.eager import context as tf_context

    from keras_distribute.job import peer_board

    peer_board.start(_CoordinationText(tf_context.context()), rank,
                     world_size, timeout_s,
                     on_stall=peer_board.ending_this_process("TensorFlow"),
                     host=host, store_address=store_address)
    atexit.register(peer_board.stop)
