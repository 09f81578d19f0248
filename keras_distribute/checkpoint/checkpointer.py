"""The checkpointer: how a save runs across the processes of a job.

One save at a time per checkpoint object; the chief's path (other processes
may pass their own); the barrier after the chief prepared the directory;
each process's entries gathered on the caller's thread, written there or in
the background (`CheckpointOptions.enable_async`), the chief committing
once every process wrote its shards. What a checkpoint holds is the
object-graph API's business (`sharded_checkpoint`); how files are written
and committed is `writing`'s.
"""

import concurrent.futures
import os
import shutil
import tempfile
import time
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.checkpoint import progress
from keras_distribute.checkpoint.objects import saved_objects
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.storage import format as ckpt_format
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage import remote_writing
from keras_distribute.checkpoint.storage import writing as ckpt_writing
from keras_distribute.checkpoint.storage.format import CheckpointError

# What a save writes: `gather(buffers)` returns this process's entries and
# the index's metadata (the chief's is written).
Gather = Callable[[Optional[saved_objects.HostBuffers]],
                  Tuple[Dict[str, tuple], Dict[str, Any]]]


class Checkpointer:
    """Runs the saves of one checkpoint object, one at a time.

    Background saves copy the values into host buffers kept from one save
    to the next (`host_buffers`) and run on one thread; the next save, a
    read or `sync()` waits for the one before it and raises its error.

    Example:

    ```python
    checkpointer = Checkpointer()
    checkpointer.write(engine, "/tmp/ckpt/run-1", gather, CheckpointOptions())
    checkpointer.sync()
    ```
    """

    def __init__(self) -> None:
        self._pending: Optional[concurrent.futures.Future] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # Asynchronous saves copy into these, reused from save to save.
        self.host_buffers = saved_objects.HostBuffers()

    def write(self, engine: ReplicaEngine, path: str, gather: Gather,
              options: CheckpointOptions,
              started: Optional[float] = None,
              owner: Optional[str] = None) -> str:
        """Writes a checkpoint at `path`, every process of `engine` taking
        part (`then` runs a function once it is committed).

        Args:
            engine: The engine whose processes save together.
            path: The checkpoint directory (made absolute; in a job, the
                chief's).
            gather: Returns this process's entries and the index metadata;
                called on the caller's thread, with the host buffers for a
                background save (`None` otherwise).
            options: The `CheckpointOptions` (background writing, timeout,
                verbose).
            started: When the save began (`time.perf_counter()`), for the
                progress line.
            owner: The writer recorded in the index (and, in object
                storage, in the save's generation marker).

        Returns:
            The path written (with `enable_async`, being written).

        Raises:
            CheckpointError: if another process failed to write its shards;
                with `enable_async`, raised by the next call instead.
        """
        if started is None:
            started = time.perf_counter()
        self.sync()  # one save at a time; re-raises a failed background one
        process_id, process_count = engine.process_id, engine.process_count
        if not object_store.is_remote(path):
            path = os.path.abspath(path)
        if process_count > 1:
            path = chief_path(engine, path)
        if object_store.is_remote(path):
            return self._write_remote(engine, path, gather, options, started,
                                      owner)
        if process_id == 0:
            ckpt_writing.prepare(path)
        engine.barrier("keras_distribute.checkpoint.prepare")
        entries, index_metadata = self._gather(gather, options)

        def finish() -> None:
            _finish_save(path, entries, process_id, process_count,
                         index_metadata, options, started)

        self._run(finish, options)
        return path

    def _gather(self, gather: Gather, options: CheckpointOptions
                ) -> Tuple[Dict[str, tuple], Dict[str, Any]]:
        """This process's entries and the index metadata; for a background
        save copied into the host buffers (training goes on while it
        writes)."""
        buffers = None
        if options.enable_async:
            buffers = self.host_buffers
            buffers.begin()
        entries, index_metadata = gather(buffers)
        if buffers is not None:
            buffers.end()
        return entries, index_metadata

    def _run(self, finish: Callable[[], None],
             options: CheckpointOptions) -> None:
        """Runs `finish` now, or with `enable_async` on the save thread."""
        if options.enable_async:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kd-checkpoint")
            self._pending = self._executor.submit(finish)
            _in_flight.add(self)
        else:
            finish()

    def _write_remote(self, engine: ReplicaEngine, path: str,
                      gather: Gather, options: CheckpointOptions,
                      started: float, owner: Optional[str]) -> str:
        """`write` into object storage (`remote_checkpoints`): the chief
        starts a generation and tells every process its name (or why it
        refused), each uploads its own files, the chief commits."""
        process_id, process_count = engine.process_id, engine.process_count
        generation, heartbeat, refusal = "", None, None
        if process_id == 0:
            try:
                generation, heartbeat = remote_writing.prepare(path,
                                                                   owner)
            except Exception as error:  # noqa: BLE001 - every process raises
                refusal = error
        if process_count > 1:
            told = engine.broadcast_text(
                generation if refusal is None else f"!{refusal}")
            if told.startswith("!") and refusal is None:
                raise CheckpointError(f"Saving {path!r} was refused by the "
                                      f"chief (process 0): {told[1:]}")
            generation = told
        if refusal is not None:
            raise refusal
        try:
            entries, index_metadata = self._gather(gather, options)
        except BaseException:
            if heartbeat is not None:
                heartbeat.stop()
                remote_checkpoints.remove_generation(path, generation)
            raise

        def finish() -> None:
            try:
                _finish_remote_save(path, generation, entries, process_id,
                                    process_count, index_metadata, options,
                                    started)
            finally:
                if heartbeat is not None:
                    heartbeat.stop()

        self._run(finish, options)
        return path

    def then(self, fn: Callable[[], None]
             ) -> Optional[concurrent.futures.Future]:
        """Runs `fn` once the pending save succeeded (now if none is);
        returns the future that runs it (`None`: it ran now)."""
        previous, executor = self._pending, self._executor
        if previous is None or executor is None:
            fn()
            return None

        def after() -> None:
            previous.result()  # a failed save: raise that, skip `fn`
            fn()

        self._pending = executor.submit(after)  # runs after `previous`
        return self._pending

    def sync(self) -> None:
        """Waits for a background save to finish.

        Raises:
            Exception: the one the background save raised, if it failed
                (raised once).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def chief_path(engine: ReplicaEngine, path: str) -> str:
    """Where a multi-process save goes: the chief's `path`.

    As the tf.distribute multi-worker tutorials do, other processes may
    pass their own (temporary) directory: their part of the checkpoint
    goes into the chief's, and their own directory is only created (the
    tutorials delete it after each save).
    """
    chief = engine.broadcast_text(path)
    if chief != path and not object_store.is_remote(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return chief


def _finish_save(path: str, entries: dict, process_id: int,
                 process_count: int, metadata: dict,
                 options: CheckpointOptions,
                 started: float) -> None:
    """Writes this process's shards; the chief then commits."""
    timeout_s = options.timeout_seconds
    temporary = ckpt_writing.temporary_path(path)
    try:
        ckpt_writing.write_process_shards(temporary, entries, process_id)
    except BaseException as error:
        ckpt_writing.report_failure(temporary, process_id, error)
        if process_id == 0:
            ckpt_writing.abandon(path)
        raise
    if process_id == 0:
        ckpt_writing.commit(path, process_count, metadata, timeout_s)
    else:
        ckpt_writing.wait_committed(path, timeout_s)
        if not os.path.isfile(os.path.join(path, ckpt_format.INDEX)):
            raise CheckpointError(
                f"Saving {path!r} failed on the chief (process 0); see its "
                "error. The previous checkpoint is kept.")
    progress.report(options.verbose, "saved", path, sum(
        array.nbytes for entry in entries.values() for _, array in entry[3]),
        started, process_id, process_count)


def _finish_remote_save(path: str, generation: str, entries: dict,
                        process_id: int, process_count: int,
                        metadata: dict, options: CheckpointOptions,
                        started: float) -> None:
    """Writes this process's shards into a private staging directory and
    uploads them; the chief then commits (`remote_checkpoints`)."""
    timeout_s = options.timeout_seconds
    staging = tempfile.mkdtemp(prefix="kd-staging-")
    try:
        try:
            remote_writing.upload_process_shards(path, generation, staging,
                                                 entries, process_id)
        except BaseException as error:
            remote_writing.report_failure(path, generation, process_id,
                                              error)
            if process_id == 0:
                remote_checkpoints.remove_generation(path, generation)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if process_id == 0:
        remote_writing.commit(path, generation, process_count, metadata,
                                  timeout_s)
    else:
        remote_writing.wait_committed(path, generation, timeout_s,
                                          process_id)
    progress.report(options.verbose, "saved", path, sum(
        array.nbytes for entry in entries.values() for _, array in entry[3]),
        started, process_id, process_count)


# Checkpointers with a background save that may still run (weakly held).
_in_flight: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


def finish_background_saves() -> List[BaseException]:
    """Waits for every background save of this process still running.

    A `fit` stopped by an exception (an interrupt in a notebook) leaves its
    last asynchronous save running; a new `fit` resuming from the same
    directory must not read the directory before that save is committed or
    abandoned. Failures are returned, not raised: they belong to the run
    that was stopped, whose previous checkpoint is kept.

    Returns:
        The exceptions of the saves that failed.
    """
    failures = []
    for checkpointer in list(_in_flight):
        try:
            checkpointer.sync()
        except BaseException as error:  # noqa: BLE001 - reported to caller
            failures.append(error)
        _in_flight.discard(checkpointer)
    return failures
