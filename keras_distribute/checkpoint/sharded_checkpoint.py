"""`ShardedCheckpoint`: save and restore Keras state, reshardable, portable."""

import concurrent.futures
import dataclasses
import functools
import os
import tempfile
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from keras_distribute.checkpoint import format as ckpt_format
from keras_distribute.checkpoint import iterator_state
from keras_distribute.checkpoint.format import CheckpointError
from keras_distribute.checkpoint.load_status import InitializationOnlyStatus
from keras_distribute.checkpoint.load_status import LoadStatus
from keras_distribute.distributed_iterator import DistributedIterator


@dataclasses.dataclass
class CheckpointOptions:
    """How a save runs (the counterpart of `tf.train.CheckpointOptions`).

    Args:
        enable_async: Write in the background: the call returns once every
            value is copied to host memory; `sync()` (or the next save or
            restore) waits for the write and re-raises its error.
        experimental_enable_async_checkpoint: `tf.train.CheckpointOptions`'
            name for `enable_async`, accepted when porting.
        timeout_seconds: How long the chief waits for the other processes'
            shards before the save fails (the previous checkpoint is kept).

    Example:

    ```python
    options = kd.checkpoint.CheckpointOptions(enable_async=True)
    checkpoint.save("/tmp/ckpt/run", options=options)
    checkpoint.sync()
    ```
    """

    enable_async: bool = False
    experimental_enable_async_checkpoint: Optional[bool] = None
    timeout_seconds: float = 600.0

    def __post_init__(self):
        if self.experimental_enable_async_checkpoint is not None:
            self.enable_async = bool(self.experimental_enable_async_checkpoint)
        if not self.timeout_seconds > 0:
            raise ValueError(
                "timeout_seconds must be positive. Received: "
                f"timeout_seconds={self.timeout_seconds}.")


# Checkpoints with restores waiting for their variables to be created.
_waiting: "weakref.WeakSet[ShardedCheckpoint]" = weakref.WeakSet()


def apply_deferred_restores() -> None:
    """Restores every deferred object whose variables now exist.

    Called by the Keras hooks after a layer or optimizer is built and before
    `fit` & co. start; a user rarely needs it.
    """
    for checkpoint in list(_waiting):
        checkpoint._apply_deferred()


class ShardedCheckpoint:
    """Saves Keras models, optimizers, metrics and variables, sharded.

    Each variable is written as its unique pieces (a replicated variable
    once, by one process; a sharded one shard by shard, each by the process
    holding it) with its **logical** layout, so a checkpoint written on 8
    devices restores onto 1, 2 or 4, onto another mesh, another process
    count or another Keras backend, bit for bit. Restore reads only the
    slices each local device needs. Saves are atomic (every process writes
    into a temporary directory, the chief commits it by a rename) and every
    piece carries a sha256 checked on read.

    Restoring into an object whose variables do not exist yet (a model not
    built, an optimizer before its first step) is deferred until they are
    created, as `tf.train.Checkpoint` does.

    A `tf.data` iterator (`iter(dataset)`) can be saved too, on every
    backend: its position is stored (per process), so a resumed loop
    continues with the next batch. As on `tf.train.Checkpoint`, the objects
    are attributes (`checkpoint.step`), and assigning a new attribute adds
    an object (`checkpoint.model = model`).

    Args:
        root: An optional object saved under the name `"root"`.
        **objects: Named Keras models, layers, optimizers, metrics,
            variables or `tf.data` iterators, e.g.
            `model=model, optimizer=optimizer`.

    Raises:
        ValueError: for an object that is none of these.

    Example:

    ```python
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    path = checkpoint.save("/tmp/ckpt/run")      # /tmp/ckpt/run-1
    checkpoint.restore(path).assert_consumed()
    ```

    The TF "Training checkpoints" guide's loop, ported:

    ```python
    ckpt = kd.checkpoint.ShardedCheckpoint(
        step=keras.Variable(1), optimizer=optimizer, net=net,
        iterator=iter(dataset))
    manager = kd.checkpoint.CheckpointManager(ckpt, "./ckpts", max_to_keep=3)
    ckpt.restore(manager.latest_checkpoint)
    for _ in range(50):
        train_step(net, next(ckpt.iterator), optimizer)
        ckpt.step.assign_add(1)
        if int(ckpt.step) % 10 == 0:
            manager.save()
    ```
    """

    def __init__(self, root: Any = None, **objects: Any):
        if root is not None:
            objects = {"root": root, **objects}
        for name, obj in objects.items():
            _check_object(name, obj)
        self._objects = objects
        self.save_counter = 0
        self._pending: Optional[concurrent.futures.Future] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # object name -> (checkpoint path, its parsed variables index)
        self._deferred: Dict[str, tuple] = {}
        self._lock = threading.Lock()

    # -------------------------------------------- objects as attributes
    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: the saved objects.
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(
            f"This ShardedCheckpoint has no object {name!r}. Its objects: "
            f"{sorted(objects)}.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name == "save_counter":
            object.__setattr__(self, name, value)
            return
        _check_object(name, value)
        self._objects[name] = value

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_objects", {}):
            del self._objects[name]
        else:
            object.__delattr__(self, name)

    def _host_array_holders(self) -> Dict[str, Any]:
        """Objects whose state is host arrays (`_host_arrays()`), e.g. the
        other callbacks' `best_weights` a training backup keeps."""
        return {name: obj for name, obj in self._objects.items()
                if hasattr(obj, "_host_arrays")}

    def _iterators(self) -> Dict[str, Any]:
        return {name: obj for name, obj in self._objects.items()
                if iterator_state.is_data_iterator(obj)}

    # ------------------------------------------------------------ variables
    def _variables_by_object(self) -> Dict[str, Dict[str, Any]]:
        """`object name -> {key -> variable}`. Keys follow the object
        structure, as `tf.train.Checkpoint`'s do: the object's name and the
        variable's position in it (`"model/3"`), not Keras' auto-numbered
        names (`dense_3`, `adam_1`), which differ between two builds.
        """
        import keras

        found, seen = {}, set()
        for name, obj in self._objects.items():
            if iterator_state.is_data_iterator(obj) or hasattr(
                    obj, "_host_arrays"):
                continue
            if isinstance(obj, keras.Variable):
                found[name] = {name: obj}
                continue
            found[name] = {}
            for position, variable in enumerate(obj.variables):
                if id(variable) not in seen:
                    seen.add(id(variable))
                    found[name][f"{name}/{position}"] = variable
        return found

    def _variables(self) -> Dict[str, Any]:
        return {key: variable
                for variables in self._variables_by_object().values()
                for key, variable in variables.items()}

    def _engine(self) -> Any:
        """The engine of the strategy the objects were created under (a
        model's, a distributed iterator's), else the current one; outside
        every scope in a multi-process job, the job's strategy: a save is
        a collective with one chief, never one chief per process."""
        from keras_distribute import context
        from keras_distribute import keras_hooks
        from keras_distribute import strategy as strategy_module

        for obj in self._objects.values():
            strategy = keras_hooks.model_strategy(obj) if hasattr(
                obj, "__dict__") else None
            if isinstance(obj, DistributedIterator):
                strategy = obj._strategy
            if strategy is not None:
                return strategy._engine
        engine = context.get_strategy()._engine
        if engine.process_count == 1:
            job = strategy_module.latest_job_strategy()
            if job is not None:
                return job._engine
        return engine

    # ---------------------------------------------------------------- write
    def write(self, path: str, options: Optional[CheckpointOptions] = None,
              metadata: Optional[Dict[str, Any]] = None) -> str:
        """Writes a checkpoint at `path` (replacing one there, atomically).

        In a multi-process job every process must call it (as with any
        collective); each writes the pieces it owns, the chief commits. The
        checkpoint goes to the chief's `path`: other processes may pass
        their own temporary directory, as the tf.distribute multi-worker
        tutorials do (it is created, and holds nothing).

        Args:
            path: The checkpoint directory.
            options: A `CheckpointOptions` (e.g. asynchronous writing).
            metadata: JSON-able values stored in the index (e.g. the epoch);
                `kd.checkpoint.read_metadata(path)` returns them.

        Returns:
            The path written: `path`, or in a multi-process job the chief's.

        Raises:
            CheckpointError: if another process failed to write its shards;
                with `enable_async`, raised by the next call instead.
        """
        return self._write(path, options, metadata)

    def _write(self, path: str, options: Optional[CheckpointOptions],
               metadata: Optional[Dict[str, Any]],
               on_commit: Optional[Callable[[], None]] = None) -> str:
        """`write`; the chief calls `on_commit()` once `path` is committed."""
        from keras_distribute.backend import get_backend

        options = options or CheckpointOptions()
        self.sync()  # one save at a time; re-raises a failed background one
        path = os.path.abspath(path)
        engine = self._engine()
        process_id, process_count = engine.process_id, engine.process_count
        if process_count > 1:
            path = _chief_path(engine, path)
        if process_id == 0:
            ckpt_format.prepare(path)
        engine.barrier("keras_distribute.checkpoint.prepare")

        backend = get_backend()
        pieces_of = getattr(backend, "checkpoint_pieces", None)
        copy = options.enable_async  # training goes on meanwhile
        entries = {}
        for key, variable in self._variables().items():
            if pieces_of is not None:
                pieces = pieces_of(variable)
            else:  # replicated everywhere: process 0 writes it once
                # (every process reads it: on TF a sync-on-read variable's
                # read is a collective every worker must join)
                pieces = _whole_value(variable, backend)
                pieces = pieces if process_id == 0 else []
            if copy:
                pieces = [(region, np.array(array, copy=True))
                          for region, array in pieces]
            entries[key] = (tuple(variable.shape), _dtype_name(variable),
                             _layout(variable), pieces, variable.path)
        for name, holder in self._host_array_holders().items():
            # The same values in every process: process 0 writes them.
            for key, array in holder._host_arrays().items():
                array = np.array(array, copy=True)
                pieces = ([(tuple((0, n) for n in array.shape), array)]
                          if process_id == 0 else [])
                entries[f"{name}/{key}"] = (
                    array.shape, array.dtype.name, [None] * array.ndim,
                    pieces, f"{name}/{key} (host array)")
        for name, iterator in self._iterators().items():
            state = iterator_state.save(iterator)  # a fresh copy
            entries[iterator_state.state_key(name, process_id)] = (
                state.shape, "uint8", [None], [(((0, state.size),), state)],
                f"{name} (tf.data iterator)")
        mesh = getattr(engine, "device_mesh", None)
        index_metadata = {
            "save_counter": self.save_counter,
            "backend": backend.name,
            "mesh_shape": list(mesh.shape) if mesh is not None else None,
            "metadata": dict(metadata or {}),
        }
        finish = functools.partial(
            _finish_save, path, entries, process_id, process_count,
            index_metadata, options.timeout_seconds, on_commit)
        if options.enable_async:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kd-checkpoint")
            self._pending = self._executor.submit(finish)
            _in_flight.add(self)
        else:
            finish()
        return path

    def save(self, file_prefix: str,
             options: Optional[CheckpointOptions] = None,
             metadata: Optional[Dict[str, Any]] = None) -> str:
        """Writes `<file_prefix>-<n>`, numbered by `save_counter`.

        Args:
            file_prefix: Directory and name stem, e.g. `"/tmp/ckpt/run"`.
            options: A `CheckpointOptions` (e.g. asynchronous writing).
            metadata: JSON-able values stored in the index.

        Returns:
            The path written (with `enable_async`, being written).
        """
        return self._save(file_prefix, options, metadata)

    def _save(self, file_prefix: str, options, metadata,
              on_commit: Optional[Callable[[], None]] = None) -> str:
        self.sync()
        self.save_counter += 1
        try:
            return self._write(f"{file_prefix}-{self.save_counter}", options,
                               metadata, on_commit)
        except BaseException:
            self.save_counter -= 1
            raise

    def _then(self, fn: Callable[[], None]) -> None:
        """Runs `fn` once the pending save succeeded (now if none is)."""
        previous = self._pending
        if previous is None:
            fn()
            return

        def after():
            previous.result()  # a failed save: raise that, skip `fn`
            fn()

        self._pending = self._executor.submit(after)  # runs after `previous`

    def sync(self) -> None:
        """Waits for a background save to finish.

        Raises:
            The exception the background save raised, if it failed (once).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ----------------------------------------------------------------- read
    def read(self, path: str) -> LoadStatus:
        """Restores every variable the checkpoint at `path` holds.

        Objects whose variables do not exist yet are restored when they are
        created (see `LoadStatus.assert_consumed`).

        Args:
            path: A committed checkpoint directory, or `None` (nothing is
                restored, as with `tf.train.Checkpoint.restore(None)`).

        Returns:
            A `LoadStatus` (call `assert_consumed()` to require a full match);
            for `None` an `InitializationOnlyStatus`.

        Raises:
            CheckpointError: if `path` is not a committed checkpoint, a file
                is corrupt, or a variable's shape differs from the saved one.
        """
        import keras

        self.sync()
        if path is None:
            return InitializationOnlyStatus()
        path = os.path.abspath(path)
        saved = ckpt_format.read_index(path)["variables"]
        by_object = self._variables_by_object()
        for name, variables in by_object.items():
            wanted = _saved_keys_of(saved, name)
            obj = self._objects[name]
            if len(variables) < len(wanted) and not isinstance(
                    obj, keras.Variable):
                self._deferred[name] = (path, saved)  # not created yet
                _waiting.add(self)
                _install_deferred_hooks()
                continue
            self._deferred.pop(name, None)
            self._restore(path, saved, variables)
        restored = {key for name, variables in by_object.items()
                    if name not in self._deferred for key in variables}
        restored |= self._restore_iterators(path, saved)
        for name, holder in self._host_array_holders().items():
            keys = _saved_keys_of(saved, name)
            holder._restore_host_arrays({
                key[len(name) + 1:]: ckpt_format.read_regions(
                    path, saved[key],
                    [tuple((0, n) for n in saved[key]["shape"])])[0]
                for key in keys})
            restored |= set(keys)
        deferred_keys = {key for name in self._deferred
                         for key in _saved_keys_of(saved, name)}
        return LoadStatus(
            sorted(set(saved) - restored - deferred_keys),
            sorted(restored - set(saved)), checkpoint=self)

    def _restore(self, path: str, saved: dict, variables: Dict[str, Any]):
        from keras_distribute.backend import get_backend

        assign = getattr(get_backend(), "checkpoint_assign", _assign_whole)
        for key, variable in variables.items():
            record = saved.get(key)
            if record is None:
                continue
            if tuple(record["shape"]) != tuple(variable.shape):
                raise CheckpointError(
                    f"The checkpoint's {key!r} ({record.get('path')}) has "
                    f"shape {tuple(record['shape'])} but the variable "
                    f"{variable.path!r} has {tuple(variable.shape)}. Build the "
                    "model as it was when saved.")
            assign(variable, lambda regions, record=record: (
                ckpt_format.read_regions(path, record, regions)))

    def _restore_iterators(self, path: str, saved: dict) -> set:
        """Restores this process's iterators; returns the keys consumed (a
        process takes its own state; the others' are theirs)."""
        consumed = set()
        process_id = self._engine().process_id
        process_count = self._engine().process_count
        for name, iterator in self._iterators().items():
            key = iterator_state.state_key(name, process_id)
            saved_count = iterator_state.saved_processes(saved, name)
            if saved_count == 0:
                consumed.add(key)  # reported as missing below
                continue
            if saved_count != process_count:
                raise CheckpointError(
                    f"The checkpoint holds the input iterator {name!r} of "
                    f"{saved_count} processes, but this run has "
                    f"{process_count}: each process resumes its own input. "
                    "Restore with the same number of processes, or leave "
                    "the iterator out of the ShardedCheckpoint and call "
                    "expect_partial().")
            record = saved[key]
            (state,) = ckpt_format.read_regions(
                path, record, [((0, record["shape"][0]),)])
            iterator_state.load(iterator, state, name)
            consumed |= {k for k in saved if k.startswith(name + "/process-")}
        return consumed

    def _apply_deferred(self) -> None:
        with self._lock:
            if not self._deferred:
                return
            by_object = self._variables_by_object()
            for name, (path, saved) in list(self._deferred.items()):
                if len(by_object[name]) >= len(_saved_keys_of(saved, name)):
                    del self._deferred[name]
                    self._restore(path, saved, by_object[name])
            if not self._deferred:
                _waiting.discard(self)

    def restore(self, save_path: str) -> LoadStatus:
        """`read`, and take over the checkpoint's `save_counter`.

        Args:
            save_path: A path `save` returned (or `latest_checkpoint`), or
                `None`: nothing is restored (a first run).

        Returns:
            A `LoadStatus`.
        """
        status = self.read(save_path)
        if save_path is None:
            return status
        self.save_counter = int(ckpt_format.read_index(save_path).get(
            "save_counter", 0))
        return status


def _chief_path(engine: Any, path: str) -> str:
    """Where a multi-process save goes: the chief's `path`.

    As the tf.distribute multi-worker tutorials do, other processes may
    pass their own (temporary) directory: their part of the checkpoint
    goes into the chief's, and their own directory is only created (the
    tutorials delete it after each save).
    """
    chief_path = engine.broadcast_text(path)
    if chief_path != path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return chief_path


def _finish_save(path: str, entries: dict, process_id: int,
                 process_count: int, metadata: dict,
                 timeout_s: float,
                 on_commit: Optional[Callable[[], None]]) -> None:
    """Writes this process's shards; the chief then commits."""
    temporary = ckpt_format.temporary_path(path)
    try:
        ckpt_format.write_process_shards(temporary, entries, process_id)
    except BaseException as error:
        ckpt_format.report_failure(temporary, process_id, error)
        if process_id == 0:
            ckpt_format.abandon(path)
        raise
    if process_id == 0:
        ckpt_format.commit(path, process_count, metadata, timeout_s)
        if on_commit is not None:
            on_commit()
    else:
        ckpt_format.wait_committed(path, timeout_s)
        if not os.path.isfile(os.path.join(path, ckpt_format.INDEX)):
            raise CheckpointError(
                f"Saving {path!r} failed on the chief (process 0); see its "
                "error. The previous checkpoint is kept.")


def _check_object(name: str, obj: Any) -> None:
    """Raises `ValueError` unless `obj` can be saved under `name`."""
    import keras

    if type(obj).__name__ == "DistributedIterator" and type(
            obj).__module__.startswith("tensorflow."):
        raise ValueError(
            "tf.distribute's own distributed iterators (what "
            "experimental_distribute_dataset returns on the TensorFlow "
            "backend) cannot be saved; tf.train.Checkpoint refuses them too. "
            f"Received: {name}=a tf.distribute DistributedIterator. Save the "
            "step number instead and skip that many steps on restore, or "
            "save the iterator of the dataset before distribution.")
    if not (isinstance(obj, keras.Variable) or hasattr(obj, "variables")
            or iterator_state.is_data_iterator(obj)
            or hasattr(obj, "_host_arrays")):
        raise ValueError(
            "Expected Keras models, layers, optimizers, metrics, variables "
            f"or tf.data iterators. Received: {name}={type(obj).__name__}.")
    if hasattr(obj, "_check_saveable"):  # a kd.DistributedIterator
        obj._check_saveable(name)
    if "/" in name:
        raise ValueError(
            f"Object names cannot contain '/'. Received: {name!r}.")
    if hasattr(ShardedCheckpoint, name):
        raise ValueError(
            f"{name!r} is a ShardedCheckpoint method or property; choose "
            f"another name for the object. Received: {name}=...")


def _saved_keys_of(saved: dict, name: str) -> List[str]:
    return [key for key in saved
            if key == name or key.startswith(name + "/")]


def _install_deferred_hooks() -> None:
    from keras_distribute import keras_hooks

    keras_hooks.install_checkpoint_hooks()


def export_weights(checkpoint_path: str, model: Any, filepath: str,
                   object_name: str = "model") -> str:
    """Writes a checkpoint's model as a Keras `.weights.h5` file.

    The checkpoint is restored into `model` (built like the saved one), and
    `model.save_weights(filepath)` writes it; in a multi-process job only
    process 0 writes the file (with a model sharded over the processes,
    every process must call it: reading the weights whole is a collective).
    `model.load_weights(filepath)` reads it back on any backend, without
    keras_distribute.

    Args:
        checkpoint_path: A committed checkpoint directory.
        model: A built Keras model with the saved architecture.
        filepath: The file to write; must end in `.weights.h5`.
        object_name: The name the model was saved under.

    Returns:
        `filepath`.

    Raises:
        ValueError: if `filepath` does not end in `.weights.h5`.
        AssertionError: if a model variable is not in the checkpoint.

    Example:

    ```python
    kd.checkpoint.export_weights(path, model, "/tmp/model.weights.h5")
    ```
    """
    if not str(filepath).endswith(".weights.h5"):
        raise ValueError(
            "Keras weight files end in '.weights.h5'. Received: "
            f"filepath={filepath!r}.")
    checkpoint = ShardedCheckpoint(**{object_name: model})
    checkpoint.read(checkpoint_path).assert_existing_objects_matched()
    if checkpoint._deferred:
        raise ValueError(
            "The model is not built, so its weights cannot be exported. "
            "Build it first (call it on a batch, or model.build(shape)).")
    engine = checkpoint._engine()
    if engine.process_id == 0:
        model.save_weights(filepath, overwrite=True)
    elif getattr(engine, "collective_reads", False):
        # Reading sharded weights whole is a collective: join the chief's.
        with tempfile.TemporaryDirectory(prefix="kd-export-") as scratch:
            model.save_weights(os.path.join(scratch, "w.weights.h5"))
    return filepath


# Checkpoints with a background save that may still run (weakly held).
_in_flight: "weakref.WeakSet[ShardedCheckpoint]" = weakref.WeakSet()


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
    for checkpoint in list(_in_flight):
        try:
            checkpoint.sync()
        except BaseException as error:  # noqa: BLE001 - reported to caller
            failures.append(error)
        _in_flight.discard(checkpoint)
    return failures


def _dtype_name(variable: Any) -> str:
    return np.dtype(variable.dtype).name if variable.dtype != "bfloat16" else (
        "bfloat16")


def _layout(variable: Any) -> list:
    layout = getattr(variable, "_layout", None)
    axes = getattr(layout, "axes", None)
    return list(axes) if axes is not None else [None] * len(variable.shape)


def _whole_value(variable: Any, backend: Any) -> list:
    import keras

    value_of = getattr(backend, "checkpoint_value", None)
    value = (value_of(variable) if value_of is not None
             else keras.ops.convert_to_numpy(variable.value))
    return [(tuple((0, n) for n in value.shape), value)]


def _assign_whole(variable: Any, read_regions) -> None:
    (value,) = read_regions([tuple((0, n) for n in variable.shape)])
    variable.assign(value)
