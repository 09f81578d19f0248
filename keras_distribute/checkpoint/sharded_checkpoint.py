"""`ShardedCheckpoint`: save and restore Keras state, reshardable, portable."""

import concurrent.futures
import os
import sys
import threading
import time
import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional

from keras_distribute.checkpoint import checkpointer
from keras_distribute.checkpoint import progress
from keras_distribute.checkpoint import restoring
from keras_distribute.checkpoint.load_status import InitializationOnlyStatus
from keras_distribute.checkpoint.load_status import LoadStatus
from keras_distribute.checkpoint.objects import attached_containers
from keras_distribute.checkpoint.objects import host_state
from keras_distribute.checkpoint.objects import object_paths
from keras_distribute.checkpoint.objects import saved_objects
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.storage import format as ckpt_format
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import ownership
from keras_distribute.checkpoint.storage import paths as ckpt_paths
from keras_distribute.checkpoint.storage import reading
from keras_distribute.checkpoint.storage import remote_reading
from keras_distribute.checkpoint.storage.format import CheckpointMismatchError
from keras_distribute.input.iterator import DistributedIterator
from keras_distribute.training import divergence


class ShardedCheckpoint:
    """Saves Keras models, optimizers, metrics and variables, sharded.

    Each variable is written as its unique pieces (a replicated variable
    once, by one process; a sharded one shard by shard, each by the process
    holding it) with its **logical** layout, so a checkpoint written on 8
    devices restores onto 1, 2 or 4, onto another mesh, another process
    count or another Keras backend, bit for bit. Restore reads only the
    slices each local device needs. Saves are atomic (every process writes
    into a temporary directory, the chief commits it by a rename) and every
    piece carries a checksum (XXH3-128) checked on read.

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
            `model=model, optimizer=optimizer`; also nested
            `ShardedCheckpoint`s, and lists or dicts of these (as in the TF
            checkpoint guide), saved under `"name/..."` keys.

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
            saved_objects.check_object(name, obj, ShardedCheckpoint)
        self._objects = objects
        self.save_counter = 0
        # Runs the saves: one at a time, barriers, the chief, background.
        self._checkpointer = checkpointer.Checkpointer()
        # object name -> (checkpoint path, its parsed variables index)
        self._deferred: Dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._bytes_read = 0  # by the current read (its progress line)
        # After a read: (path, saved variables, object paths, this
        # checkpoint's prefix in the one read), for objects attached later.
        self._restored_from: Optional[tuple] = None
        # Once dropped with restores deferred (`_wait_weakly`): the objects
        # those restores wait for, by name, as weak references.
        self._weak_leaves: Optional[Dict[str, weakref.ref]] = None

    def __del__(self) -> None:
        # A restore deferred until an object's variables exist outlives
        # this object, as tf.train.Checkpoint's does: the checkpoint is kept
        # (`restoring.keep_after_drop`) until it applies.
        if self.__dict__.get("_deferred") and (
                self.__dict__.get("_weak_leaves") is None) and (
                    not sys.is_finalizing()):
            restoring.keep_after_drop(self)

    def _wait_weakly(self, released: Callable[[], None]) -> None:
        """Holds only weak references to the objects the deferred restores
        wait for, and none to the others; `released()` once they are all
        collected (nothing left to restore)."""
        weak: Dict[str, weakref.ref] = {}

        def collected(_: Any) -> None:
            if all(ref() is None for ref in weak.values()):
                released()

        for name, (_, _, _, prefix) in self._deferred.items():
            leaves = saved_objects.leaf_objects(self._objects,
                                                ShardedCheckpoint, prefix)
            if name in leaves:
                weak[name] = weakref.ref(leaves[name], collected)
        self._weak_leaves = weak
        self._objects = {}
        if not weak:
            released()

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
        saved_objects.check_object(name, value, ShardedCheckpoint)
        restored_from = self.__dict__.get("_restored_from")
        if restored_from is not None:
            value = attached_containers.attach(value, self, name)
        self._objects[name] = value
        if restored_from is not None:
            # Deferred restoration, as tf.train.Checkpoint does it: an
            # object attached after a restore gets its saved values now
            # (or when its variables are created).
            self._restore_attached("", name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_objects", {}):
            del self._objects[name]
        else:
            object.__delattr__(self, name)

    def objects_by_name(self) -> Dict[str, Any]:
        """The objects it saves, by name (a new dict: changing it changes
        nothing here; set or delete attributes for that).

        Returns:
            `{name: object}`, as given to the constructor or set since.

        Example:

        >>> checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
        ...                                              step=step)
        >>> sorted(checkpoint.objects_by_name())
        ['model', 'step']
        """
        return dict(self._objects)

    def _leaf_objects(self) -> Dict[str, Any]:
        """The saved objects, nested checkpoints, lists and dicts flattened
        (`"l1/model"`, `"layers/0"`): the names their keys start with."""
        return saved_objects.leaf_objects(self._objects, ShardedCheckpoint)

    # ------------------------------------------------------------ variables
    def _variables_by_object(self, leaves: Optional[Dict[str, Any]] = None
                             ) -> Dict[str, Dict[str, Any]]:
        """`object name -> {key -> variable}`. Keys follow the object
        structure, as `tf.train.Checkpoint`'s do: the object's name and the
        variable's position in it (`"model/3"`), not Keras' auto-numbered
        names (`dense_3`, `adam_1`), which differ between two builds.
        (Restores also match by attribute path: `object_paths`.)
        """
        import keras

        found, seen = {}, set()
        if leaves is None:
            leaves = self._leaf_objects()
        for name, obj in leaves.items():
            if host_state.kind_of(obj) is not None:
                continue  # its state is host values
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

    def resolve_engine(self) -> Any:
        """The engine this checkpoint's saves and restores run on.

        The precedence, resolved at each call (objects may be attached
        later): the strategy a tracked object was created under (a model's,
        a distributed iterator's), else the current strategy; outside every
        scope in a multi-process job, the job's strategy (a save is a
        collective with one chief, never one chief per process).

        Returns:
            A `keras_distribute.backend.interface.ReplicaEngine`.

        Example:

        >>> checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
        >>> checkpoint.resolve_engine().process_id
        0
        """
        from keras_distribute.common import context

        for obj in self._leaf_objects().values():
            strategy = context.model_strategy(obj)
            if isinstance(obj, DistributedIterator):
                strategy = obj._strategy
            if strategy is not None:
                return strategy.engine
        engine = context.get_strategy().engine
        if engine.process_count == 1:
            job = context.latest_job_strategy()
            if job is not None:
                return job.engine
        return engine

    # ---------------------------------------------------------------- write
    def write(self, path: str, options: Optional[CheckpointOptions] = None,
              metadata: Optional[Dict[str, Any]] = None,
              owner: Optional[str] = None) -> str:
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
            owner: A name recorded in the index: the writer that may delete
                the checkpoint later (a `CheckpointManager` deletes only
                checkpoints recorded with its `owner`). `None` records none:
                no manager ever deletes it.

        Returns:
            The path written: `path`, or in a multi-process job the chief's.

        Raises:
            CheckpointError: if another process failed to write its shards;
                with `enable_async`, raised by the next call instead.
            ReplicasDivergedError: in a job of several processes, if the
                processes hold different values of a trainable or optimizer
                variable it saves (they trained apart); nothing is written
                (`kd.set_divergence_check("warn")` writes and warns).
            ValueError: for a path with a scheme other than `s3://` and
                `gs://` (object storage, through the `[s3]` / `[gcs]`
                extras).
        """
        path = ckpt_paths.checkpoint_path(path)
        started = time.perf_counter()
        options = options or CheckpointOptions()
        ckpt_format.check_metadata(metadata)
        engine = self.resolve_engine()

        def gather(buffers: Optional[saved_objects.HostBuffers]):
            """This process's entries and the index metadata, gathered
            after the chief prepared the directory."""
            from keras_distribute.backend import get_backend

            process_id = engine.process_id
            backend = get_backend()
            variables = self._variables()
            entries = saved_objects.variable_entries(
                variables, backend, process_id, engine.process_count,
                buffers)
            for kind, objects in host_state.by_kind(
                    self._leaf_objects()).items():
                entries.update(kind.entries(objects, process_id))
            mesh = engine.device_mesh
            index_metadata = {
                "save_counter": self.save_counter,
                "backend": backend.name,
                "mesh_shape": list(mesh.shape) if mesh is not None else None,
                "metadata": dict(metadata or {}),
            }
            if owner is not None:
                index_metadata["owner"] = owner
            if process_id == 0:  # the chief writes the index
                index_metadata["object_paths"] = (
                    object_paths.saved_object_paths(
                        self._leaf_objects(),
                        {id(variable): key
                         for key, variable in variables.items()}))
            return entries, index_metadata

        divergence.check_before_writing(engine, self._compared_variables,
                                        path)
        return self._checkpointer.write(engine, path, gather, options,
                                        started, owner)

    def _compared_variables(self) -> List[tuple]:
        """`[(name, variable)]` whose copies must agree in every process:
        the trainable variables and every optimizer variable saved."""
        import keras

        named = []
        leaves = self._leaf_objects()
        for name, variables in self._variables_by_object(leaves).items():
            optimizer = isinstance(leaves[name],
                                   keras.optimizers.Optimizer)
            named += [(f"{key} ({variable.path})", variable)
                      for key, variable in variables.items()
                      if optimizer or variable.trainable]
        return named

    def save(self, file_prefix: str,
             options: Optional[CheckpointOptions] = None,
             metadata: Optional[Dict[str, Any]] = None) -> str:
        """Writes `<file_prefix>-<n>`, numbered by `save_counter`.

        The number is one more than `save_counter` and than every
        `<file_prefix>-<n>` already there: a save never replaces an earlier
        run's checkpoint (`save_counter` takes the number written).

        Args:
            file_prefix: Directory and name stem, e.g. `"/tmp/ckpt/run"`.
            options: A `CheckpointOptions` (e.g. asynchronous writing).
            metadata: JSON-able values stored in the index.

        Returns:
            The path written (with `enable_async`, being written).

        Raises:
            ReplicasDivergedError: as `write`; nothing is written.
        """
        return self._save(file_prefix, options, metadata)

    def _save(self, file_prefix: str, options, metadata) -> str:
        file_prefix = ckpt_paths.checkpoint_path(file_prefix, "file_prefix")
        self.sync()
        if object_store.is_remote(file_prefix):
            directory, stem = object_store.split(file_prefix)
        else:
            directory, stem = os.path.split(os.path.abspath(file_prefix))
        counter = self.save_counter
        self.save_counter = self._next_number(directory, stem)
        try:
            return self.write(f"{file_prefix}-{self.save_counter}", options,
                              metadata)
        except BaseException:
            self.save_counter = counter
            raise

    def _next_number(self, directory: str, stem: str) -> int:
        """The number of the next `<stem>-<number>` save in `directory`:
        after `save_counter` and after every such name already there, as
        the chief sees it (the same in every process)."""
        number = ownership.next_number(directory, stem, self.save_counter)
        engine = self.resolve_engine()
        if engine.process_count > 1:
            number = int(engine.broadcast_text(str(number)))
        return number

    def after_save(self, fn: Callable[[], None]
                   ) -> Optional[concurrent.futures.Future]:
        """Runs `fn` once the save in progress is committed.

        With `CheckpointOptions(enable_async=True)` a save commits in the
        background: `fn` runs then, in that thread, and never if the save
        fails. With no save in progress it runs now.

        Args:
            fn: A function of no arguments (e.g. one that links or trims
                the checkpoints kept).

        Returns:
            The future of the save and then `fn` (it fails if either
            failed; `sync()` raises that once), or `None` when `fn` ran
            now.

        Example:

        >>> path = checkpoint.write(directory, options)
        >>> checkpoint.after_save(lambda: print("committed", path))
        """
        return self._checkpointer.then(fn)

    def sync(self) -> None:
        """Waits for a background save to finish.

        Raises:
            Exception: the one the background save raised, if it failed
                (raised once).
        """
        self._checkpointer.sync()

    # ----------------------------------------------------------------- read
    def read(self, path: str,
             options: Optional[CheckpointOptions] = None, *,
             require_existing_matched: bool = False,
             defer: bool = True) -> LoadStatus:
        """Restores every variable the checkpoint at `path` holds.

        Objects whose variables do not exist yet are restored when they are
        created (see `LoadStatus.assert_consumed`). A restore is all or
        nothing: if any piece fails (a checksum, a truncated file, a shape
        that differs), every variable, iterator and array restored so far is
        put back, so the objects are exactly as before the call.

        Args:
            path: A committed checkpoint directory, or `None` (nothing is
                restored, as with `tf.train.Checkpoint.restore(None)`).
            options: A `CheckpointOptions` (its `verbose`: a line with the
                bytes read and the MB/s).
            require_existing_matched: Raise `CheckpointMismatchError`
                before anything is assigned if a variable that exists now
                has no value in the checkpoint (the check of
                `LoadStatus.assert_existing_objects_matched`, made first).
            defer: `False` restores now the variables that exist, of every
                object, and nothing later (what an object does not hold yet
                is reported by the `LoadStatus`).

        Returns:
            A `LoadStatus` (call `assert_consumed()` to require a full match);
            for `None` an `InitializationOnlyStatus`.

        Raises:
            CheckpointMismatchError: if a variable's shape differs from the
                saved one (the model differs; nothing is restored).
            CheckpointError: if `path` is not a committed checkpoint or a
                file is corrupt (nothing is restored).
        """
        started = time.perf_counter()
        options = options or CheckpointOptions()
        self.sync()
        if path is None:
            return InitializationOnlyStatus()
        path = _local_copy(path)
        index = reading.read_index(path)
        saved, paths = index["variables"], index.get("object_paths", {})
        self._bytes_read = 0
        by_object = self._variables_by_object()
        leaves = self._leaf_objects()
        ready, deferred = {}, []
        for name, variables in by_object.items():
            if not defer or restoring.ready(
                    leaves[name], variables,
                    saved_objects.saved_keys_of(saved, name)):
                ready.update(variables)
            else:
                deferred.append(name)  # not created yet
        ready = object_paths.match(saved, paths, ready, leaves)
        missing = sorted(key for key in ready if key not in saved)
        if require_existing_matched and missing:
            raise CheckpointMismatchError(
                f"The checkpoint {path!r} holds no value for {missing[:10]}: "
                "the objects differ from the ones saved. Nothing was "
                "restored.")
        engine = self.resolve_engine()
        restored = set(ready)
        host_objects = host_state.by_kind(leaves)

        def restore_the_rest():
            # Inside the all-or-nothing restore: a failure here puts the
            # variables back too (and the iterators and arrays restored).
            undo = [kind.snapshot(obj)
                    for kind, objects in host_objects.items()
                    for obj in objects.values()]
            try:
                for kind, objects in host_objects.items():
                    restored.update(kind.restore(
                        path, saved, objects, engine.process_id,
                        engine.process_count, options.trusted))
            except BaseException:
                for put_back in reversed(undo):
                    put_back()
                raise

        self._restore(path, saved, ready, then=restore_the_rest)
        for name in by_object:
            self._deferred.pop(name, None)
        for name in deferred:
            self._deferred[name] = (path, saved, paths, "")
        self._remember_restored(path, saved, paths, "")
        if deferred:
            restoring.defer(self, self.resolve_engine().keras_services)
        deferred_keys = {key for name in self._deferred
                         for key in saved_objects.saved_keys_of(saved, name)}
        progress.report(options.verbose, "restored",
                        path, self._bytes_read, started, engine.process_id,
                        engine.process_count)
        return LoadStatus(
            sorted(set(saved) - restored - deferred_keys),
            sorted(restored - set(saved)), checkpoint=self)

    def _restore(self, path: str, saved: dict, variables: Dict[str, Any],
                 then: Optional[Callable[[], None]] = None) -> None:
        """Assigns `variables` their saved values, all or nothing
        (`restoring.assign_all_or_nothing`, counting the bytes read)."""
        restoring.assign_all_or_nothing(path, saved, variables,
                                        self._count_read, then)

    def _count_read(self, arrays: List[Any]) -> List[Any]:
        self._bytes_read += sum(array.nbytes for array in arrays)
        return arrays

    def _apply_deferred(self) -> None:
        with self._lock:
            if not self._deferred:
                return
            for name, (path, saved, paths, prefix) in list(
                    self._deferred.items()):
                leaves = self._deferred_leaves(prefix)
                if name not in leaves:  # detached (or collected) since
                    del self._deferred[name]
                    continue
                variables = self._variables_by_object(
                    {name: leaves[name]})[name]
                if restoring.ready(leaves[name], variables,
                          saved_objects.saved_keys_of(saved, name)):
                    del self._deferred[name]
                    self._restore(path, saved, object_paths.match(
                        saved, paths, variables, {name: leaves[name]}))
            if not self._deferred:
                restoring.waiting.discard(self)
                restoring.kept_after_drop.discard(self)

    def _deferred_leaves(self, prefix: str) -> Dict[str, Any]:
        """The leaf objects under `prefix`; once this checkpoint was dropped,
        those of its weakly held objects still alive."""
        if self._weak_leaves is None:
            return saved_objects.leaf_objects(self._objects,
                                              ShardedCheckpoint, prefix)
        return {name: obj for name, obj in (
            (name, ref()) for name, ref in self._weak_leaves.items())
            if obj is not None}

    def _remember_restored(self, path: str, saved: dict, paths: dict,
                           prefix: str) -> None:
        """Marks this checkpoint and the checkpoints nested in it as
        restored from `path`: objects attached to them later are restored
        from it too."""
        self._restored_from = (path, saved, paths, prefix)
        for name, obj in list(self._objects.items()):
            # Items added later to its lists and dicts restore too.
            obj = self._objects[name] = attached_containers.attach(
                obj, self, name)
            for inner, nested in attached_containers.nested_checkpoints(
                    obj, f"{prefix}{name}/", ShardedCheckpoint):
                nested._remember_restored(path, saved, paths, inner)

    def _restore_attached(self, container: str, name: str,
                          value: Any) -> None:
        """Restores `value`, attached as `<container><name>` after a read,
        from that read's checkpoint; deferred if not built yet."""
        if self._restored_from is None:
            return  # not restored: nothing to restore it from
        path, saved, paths, prefix = self._restored_from
        for inner, nested in attached_containers.nested_checkpoints(
                value, f"{prefix}{container}{name}/", ShardedCheckpoint):
            nested._remember_restored(path, saved, paths, inner)
        leaves = saved_objects.leaf_objects(
            {name: value}, ShardedCheckpoint, prefix + container)
        by_object = self._variables_by_object(leaves)
        for leaf, variables in by_object.items():
            if restoring.ready(leaves[leaf], variables,
                      saved_objects.saved_keys_of(saved, leaf)):
                self._restore(path, saved, object_paths.match(
                    saved, paths, variables, {leaf: leaves[leaf]}))
            else:
                self._deferred[leaf] = (path, saved, paths, prefix)
                restoring.defer(self, self.resolve_engine().keras_services)

    def restore(self, save_path: str,
                options: Optional[CheckpointOptions] = None) -> LoadStatus:
        """`read`, and take over the checkpoint's `save_counter`.

        Args:
            save_path: A path `save` returned (or `latest_checkpoint`), or
                `None`: nothing is restored (a first run).
            options: A `CheckpointOptions`, as for `read`.

        Returns:
            A `LoadStatus`.
        """
        status = self.read(save_path, options)
        if save_path is None:
            return status
        index = reading.read_index(_local_copy(save_path))
        self.save_counter = int(index.get("save_counter", 0))
        return status


def _local_copy(path: str) -> str:
    """Where to read the committed checkpoint `path`: the directory (or
    where an interrupted commit left it), or for `s3://` / `gs://` a local
    copy downloaded for this process (`remote_reading.download`)."""
    path = ckpt_paths.checkpoint_path(path)
    if object_store.is_remote(path):
        return remote_reading.download(path)
    return reading.locate(os.path.abspath(path))
