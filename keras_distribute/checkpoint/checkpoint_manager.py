"""`CheckpointManager`: numbered saves in a directory, the latest N or the
best N kept (`retention`)."""

import os
import types
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional

from keras_distribute.checkpoint import retention
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint
from keras_distribute.checkpoint.storage import lease
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import ownership
from keras_distribute.checkpoint.storage import paths as ckpt_paths
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage import remote_lease
from keras_distribute.checkpoint.storage import remote_writing
from keras_distribute.checkpoint.storage import writing as ckpt_writing
from keras_distribute.checkpoint.storage.committed import checkpoints_in
from keras_distribute.checkpoint.storage.committed import read_metadata
from keras_distribute.checkpoint.storage.format import CheckpointError


class CheckpointManager:
    """Keeps the last (or the best) `max_to_keep` checkpoints of a
    `ShardedCheckpoint`.

    The counterpart of `tf.train.CheckpointManager`. Saves go to
    `<directory>/<checkpoint_name>-<number>`; once a save is committed the
    oldest ones beyond `max_to_keep` are deleted (by the chief), except
    that with `keep_every_n_steps` one checkpoint every that many steps is
    kept for good. A failed save deletes nothing. Saves left unfinished by
    an earlier, interrupted run are removed when the manager is created.

    With `best_metric`, the `max_to_keep` kept are the best by that entry
    of each save's `metadata` (lower is better with `best_mode="min"`,
    higher with `"max"`; a NaN is never kept), not the latest: a save that
    would not be among them is not written (`save` returns `None`), and
    when a better one is committed the worst is deleted. Checkpoints
    already in the directory without that entry are not managed.

    Ownership: every checkpoint it writes records `owner` in its index, and
    it deletes only checkpoints recorded with its `owner` (another
    writer's, e.g. `ShardedCheckpoint.save`'s or another manager's in the
    same directory, stay). A new checkpoint is numbered after the highest
    `<checkpoint_name>-<number>` already in the directory, so a manager
    that did not restore first never replaces an earlier run's checkpoint.

    One directory, one job: the manager takes the directory's lease (a file
    naming the job, its host and process; see
    `keras_distribute.checkpoint.storage.lease`),
    shared by every manager and checkpoint callback of the same job and held
    until `close()` (or until the manager is collected or the process
    ends). A manager made on a directory that another live job saves into
    raises `DirectoryInUseError` in every process, before it touches
    anything there; a lease left by a job that died is taken over.

    Args:
        checkpoint: The `ShardedCheckpoint` to save and restore.
        directory: Where the checkpoints go (created if needed).
        max_to_keep: How many recent checkpoints to keep; `None` keeps all.
        keep_every_n_steps: Also keep, for good, a checkpoint whose number is
            at least this many steps after the last one kept that way.
        checkpoint_name: The name stem of the checkpoint directories.
        step_counter: A scalar step variable (or anything `int()` reads),
            for `checkpoint_interval`.
        checkpoint_interval: Save only if at least this many steps of
            `step_counter` passed since the last save (`save` returns
            `None` otherwise), as `tf.train.CheckpointManager`.
        init_fn: Called by `restore_or_initialize` when there is no
            checkpoint to restore.
        owner: The name recorded in each checkpoint it writes; it deletes
            only checkpoints recorded with this owner. Defaults to
            `"CheckpointManager/<checkpoint_name>"`.
        best_metric: Keep the best checkpoints by this `metadata` entry
            (e.g. `"val_loss"`) instead of the latest.
        best_mode: `"min"` (lower `best_metric` is better) or `"max"`.

    Raises:
        ValueError: for a non-positive `max_to_keep`, `keep_every_n_steps`
            or `checkpoint_interval`, a `checkpoint_interval` without a
            `step_counter`, a bad `best_metric` or `best_mode`, or
            `keep_every_n_steps` with `best_metric` (it keeps by age).
        DirectoryInUseError: another live job saves into `directory`.
        PermissionError: `directory` cannot be written by this process
            (its lease cannot be made there), in every process of the job.
        FileNotFoundError, OSError: the directory's lease could not be
            made for another reason (a bucket that does not exist), in
            every process of the job.

    Example:

    ```python
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    manager = kd.checkpoint.CheckpointManager(checkpoint, "/tmp/ckpt",
                                              max_to_keep=3)
    manager.restore_or_initialize()
    for step in range(100):
        ...
        if step % 10 == 0:
            manager.save(checkpoint_number=step)
    ```
    """

    def __init__(self, checkpoint: ShardedCheckpoint, directory: str,
                 max_to_keep: Optional[int] = 5,
                 keep_every_n_steps: Optional[int] = None,
                 checkpoint_name: str = "ckpt",
                 step_counter: Any = None,
                 checkpoint_interval: Optional[int] = None,
                 init_fn: Optional[Callable[[], Any]] = None,
                 owner: Optional[str] = None,
                 best_metric: Optional[str] = None,
                 best_mode: str = "min"):
        if not isinstance(checkpoint, ShardedCheckpoint):
            raise ValueError(
                "Expected a kd.checkpoint.ShardedCheckpoint. Received: "
                f"checkpoint={type(checkpoint).__name__}.")
        for name, value in (("max_to_keep", max_to_keep),
                            ("keep_every_n_steps", keep_every_n_steps),
                            ("checkpoint_interval", checkpoint_interval)):
            if value is not None and (not isinstance(value, int)
                                      or value < 1):
                raise ValueError(
                    f"{name} must be a positive integer or None. Received: "
                    f"{name}={value!r}.")
        if not checkpoint_name or "/" in checkpoint_name:
            raise ValueError(
                "checkpoint_name must be a plain, non-empty name. Received: "
                f"checkpoint_name={checkpoint_name!r}.")
        if owner is not None and (not isinstance(owner, str) or not owner):
            raise ValueError(
                "owner must be a non-empty string (a name recorded in each "
                f"checkpoint). Received: owner={owner!r}.")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError(
                "checkpoint_interval counts steps of step_counter: pass "
                "step_counter= (e.g. the optimizer's iterations). Received: "
                f"checkpoint_interval={checkpoint_interval}, "
                "step_counter=None.")
        if best_metric is not None and (not isinstance(best_metric, str)
                                        or not best_metric):
            raise ValueError(
                "best_metric must name a metadata entry each save records "
                f"(e.g. 'val_loss'). Received: best_metric={best_metric!r}.")
        if best_mode not in ("min", "max"):
            raise ValueError(
                "best_mode must be 'min' (a lower best_metric is better) or "
                f"'max'. Received: best_mode={best_mode!r}.")
        if best_metric is not None and keep_every_n_steps is not None:
            raise ValueError(
                "keep_every_n_steps keeps checkpoints by age, best_metric by "
                "a metric: pass one of them. Received: keep_every_n_steps="
                f"{keep_every_n_steps}, best_metric={best_metric!r}.")
        self._retention: retention.Retention = (
            retention.KeepLatest(max_to_keep) if best_metric is None else
            retention.KeepBest(max_to_keep, best_metric, best_mode))
        self.best_metric = best_metric
        self.checkpoint = checkpoint
        self.step_counter = step_counter
        self.checkpoint_interval = checkpoint_interval
        self.init_fn = init_fn
        self._last_saved_step: Optional[int] = None
        # (path, tracking before it, its future) of a background save.
        self._in_flight: Optional[tuple] = None
        self.directory = ckpt_paths.checkpoint_path(directory, "directory")
        self._remote = object_store.is_remote(self.directory)
        if not self._remote:
            self.directory = os.path.abspath(self.directory)
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.checkpoint_name = checkpoint_name
        self.owner = owner or f"CheckpointManager/{checkpoint_name}"
        self._is_chief = checkpoint.resolve_engine().process_id == 0
        self._lease: Optional[Any] = None
        self._closed = False
        self._take_lease()
        if self._is_chief and self._remote:
            remote_checkpoints.clean_unfinished(self.directory, self.owner)
        elif self._is_chief:
            ckpt_writing.clean_unfinished(self.directory)
        existing = [p for p in checkpoints_in(self.directory)
                    if os.path.basename(p).rsplit("-", 1)[0]
                    == checkpoint_name]
        # The metric value of each managed checkpoint (with best_metric).
        self._values: Dict[str, float] = {}
        if best_metric is not None:
            self._values = self._recorded_values(existing)
            existing = [p for p in existing if p in self._values]
        self._checkpoints: List[str] = self._retention.kept(existing,
                                                            self._values)
        older = [p for p in existing if p not in self._checkpoints]
        self._last_kept_for_good = (
            _number(older[-1]) if older else None)

    def _recorded_values(self, paths: List[str]) -> Dict[str, float]:
        """The `best_metric` recorded in each of `paths` that has one."""
        values = {}
        for path in paths:
            try:
                value = self._retention.value_of(read_metadata(path))
            except (CheckpointError, ValueError):
                continue  # unreadable, or saved without the metric
            if value is not None:
                values[path] = value
        return values

    def _take_lease(self) -> None:
        """Takes the directory's lease for this job (process 0 takes it,
        every process learns the verdict), before anything is touched."""
        engine = self.checkpoint.resolve_engine()
        refusal = ""
        try:
            if self._is_chief and self._remote:
                key = remote_lease.take(self.directory)
                self._lease = remote_lease.ReleaseWhenCollected(self, key)
            elif self._is_chief:
                os.makedirs(self.directory, exist_ok=True)
                path = lease.take(self.directory)
                self._lease = lease.release_when_collected(self, path)
        except lease.DirectoryInUseError as error:
            refusal = f"{_IN_USE}:{error}"
        except OSError as error:  # (every process raises it: below)
            refusal = f"{_refused_as(error).__name__}:{self._refused(error)}"
        if engine.process_count > 1:
            refusal = engine.broadcast_text(refusal)
        if refusal:
            kind, _, message = refusal.partition(":")
            if kind == _IN_USE:
                raise lease.DirectoryInUseError(message)
            raise _REFUSALS[kind](message)

    def _refused(self, error: OSError) -> str:
        if isinstance(error, PermissionError):
            return (f"The checkpoint directory {self.directory!r} cannot be "
                    f"written by this process ({type(error).__name__}: "
                    f"{error.strerror or error}): its lease "
                    f"({lease.LEASE}) could not be made there. Nothing was "
                    "written. Give the job a directory it can write (check "
                    "its owner, permissions and whether its file system is "
                    "read-only, or the store's credentials and policy).")
        return (f"The checkpoint directory {self.directory!r} could not be "
                f"used: its lease ({lease.LEASE}) could not be made there "
                f"({type(error).__name__}: {error}). Nothing was written.")

    def close(self) -> None:
        """Waits for a background save, then lets go of the directory's
        lease (another job may then save there). A later `save` takes it
        again. Call it in every process of the job, as `save`.

        Example:

        ```python
        with kd.checkpoint.CheckpointManager(checkpoint, "/tmp/ckpt") as m:
            m.save()
        ```
        """
        try:
            self.sync()
        finally:
            self._closed = True
            if self._lease is not None:
                taken = self._lease.detach()  # None: released already
                self._lease = None
                if taken is not None:
                    lease.release(taken[2][0])

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def checkpoints(self) -> List[str]:
        """The managed checkpoints, oldest first (a background save that
        failed is not among them)."""
        self._settle()
        return list(self._checkpoints)

    @property
    def latest_checkpoint(self) -> Optional[str]:
        """The newest managed checkpoint, or `None`."""
        self._settle()
        return self._checkpoints[-1] if self._checkpoints else None

    @property
    def best_checkpoint(self) -> Optional[str]:
        """With `best_metric`, the managed checkpoint with the best value
        (of equal ones, the oldest); `None` without `best_metric` or
        checkpoints."""
        self._settle()
        if not isinstance(self._retention, retention.KeepBest):
            return None
        ranked = self._retention.ranked(self._checkpoints, self._values)
        return ranked[0] if ranked else None

    @property
    def best_value(self) -> Optional[float]:
        """The `best_metric` value of `best_checkpoint` (or `None`)."""
        best = self.best_checkpoint
        return None if best is None else self._values[best]

    def would_keep(self, metadata: Optional[Dict[str, Any]] = None) -> bool:
        """Whether a save with this `metadata` would be among the ones
        kept (always, without `best_metric`).

        Raises:
            ValueError: with `best_metric`, if `metadata` lacks it.

        Example:

        >>> if manager.would_keep({"val_loss": 0.3}):
        ...     manager.save(metadata={"val_loss": 0.3})
        """
        self._settle()
        return self._retention.would_keep(
            self._retention.value_of(metadata), self._checkpoints,
            self._values)

    def _settle(self) -> None:
        """Forgets a background save that failed (its error is still raised
        by the next `save` / `sync`); the ones it would have replaced stay."""
        if self._in_flight is None or not self._in_flight[2].done():
            return
        path, kept_before, future = self._in_flight
        self._in_flight = None
        if future.exception() is not None and path in self._checkpoints:
            self._checkpoints, self._last_kept_for_good = kept_before

    def forget(self, path: str) -> None:
        """Stops managing `path` (e.g. a backup found unreadable); the
        files stay where they are."""
        self._settle()
        if path in self._checkpoints:
            self._checkpoints.remove(path)
            self._values.pop(path, None)

    def save(self, checkpoint_number: Optional[int] = None,
             options: Optional[CheckpointOptions] = None,
             metadata: Optional[Dict[str, Any]] = None,
             check_interval: bool = True) -> Optional[str]:
        """Saves a new checkpoint and deletes the ones no longer kept.

        Args:
            checkpoint_number: The number in the name (e.g. the step; an
                integer or a scalar variable); by default the checkpoint's
                `save_counter` after the save.
            options: A `CheckpointOptions` (e.g. asynchronous writing; old
                checkpoints are then deleted once the new one is committed).
            metadata: JSON-able values stored in the index.
            check_interval: With `checkpoint_interval`, skip the save when
                too few steps passed; `False` saves regardless.

        Returns:
            The path of the new checkpoint, or `None` when the interval
            skipped it (or, with `best_metric`, it would not be kept).

        Raises:
            ValueError: if `checkpoint_number` is not after the latest one
                (or after a `<checkpoint_name>-<n>` already in the
                directory), `metadata` is not JSON-able, or (with
                `best_metric`) it lacks that entry.
        """
        value = self._retention.value_of(metadata)
        if checkpoint_number is not None:
            checkpoint_number = int(checkpoint_number)
        step = None
        if self.checkpoint_interval is not None:
            step = int(self.step_counter)
            if check_interval and self._last_saved_step is not None and (
                    step < self._last_saved_step + self.checkpoint_interval):
                return None
        self._settle()
        self.checkpoint.sync()  # re-raises a failed background save
        if self._closed:  # in every process alike: close() is collective
            self._take_lease()
            self._closed = False
        if not self._agreed_to_keep(value):
            return None
        path = self._new_path(checkpoint_number,
                              self.checkpoint.save_counter)
        number = _number(path)
        kept_before = (list(self._checkpoints), self._last_kept_for_good)
        counter = self.checkpoint.save_counter
        to_delete = self._track(path, value)
        self.checkpoint.save_counter = (
            number if checkpoint_number is None else counter + 1)
        try:
            # Old checkpoints go only once the new one is committed (in the
            # background with an asynchronous save); never after a failure.
            written = self.checkpoint.write(path, options, metadata,
                                            owner=self.owner)
            pending = self.checkpoint.after_save(self._deleter(to_delete))
            self._last_saved_step = step
            if pending is not None:  # in the background
                self._in_flight = (path, kept_before, pending)
            return written
        except BaseException:
            self.checkpoint.save_counter = counter
            self._checkpoints, self._last_kept_for_good = kept_before
            raise

    def save_link(self, source: str,
                  checkpoint_number: Optional[int] = None,
                  metadata: Optional[Dict[str, Any]] = None
                  ) -> Optional[str]:
        """Keeps a checkpoint this manager's `ShardedCheckpoint` saved
        elsewhere (e.g. by another manager) as one of this manager's,
        without writing it again.

        Once `source` is committed (after a background save, in its
        thread), its files are hard-linked (copied where the file system
        cannot link) to `<directory>/<checkpoint_name>-<number>`, with an
        index of its own recording this manager's `owner`; then the ones
        no longer kept are deleted. If the save of `source` fails, nothing
        is linked or deleted. Call it in every process, as `save`.

        Args:
            source: The path a save of the same checkpoint returned.
            checkpoint_number: The number in the name; by default the next
                free one.
            metadata: The metadata `source` was saved with (with
                `best_metric`, its value ranks the copy).

        Returns:
            The path of the copy, or `None` when, with `best_metric`, it
            would not be kept.

        Raises:
            ValueError: as `save`.

        Example:

        ```python
        latest = kd.checkpoint.CheckpointManager(checkpoint, "/tmp/run")
        best = kd.checkpoint.CheckpointManager(
            checkpoint, "/tmp/run/best", best_metric="val_loss")
        saved = latest.save(metadata={"val_loss": 0.25})
        best.save_link(saved, metadata={"val_loss": 0.25})
        ```
        """
        value = self._retention.value_of(metadata)
        if checkpoint_number is not None:
            checkpoint_number = int(checkpoint_number)
        self._settle()
        if self._closed:
            self._take_lease()
            self._closed = False
        if not self._agreed_to_keep(value):
            return None
        # (a link still to be made is not in the directory yet)
        path = self._new_path(checkpoint_number, max(
            [_number(p) for p in self._checkpoints], default=0))
        kept_before = (list(self._checkpoints), self._last_kept_for_good)
        to_delete = self._track(path, value)
        delete = self._deleter(to_delete)
        source = ckpt_paths.checkpoint_path(source, "source")
        if object_store.is_remote(source) != self._remote:
            self._checkpoints, self._last_kept_for_good = kept_before
            raise ValueError(
                "save_link keeps a checkpoint in the store it was saved to: "
                f"source={source!r} and directory={self.directory!r} must be "
                "both local or both in object storage. Save into this "
                "manager's directory instead (manager.save()).")
        if not self._remote:
            source = os.path.abspath(source)

        def link_then_delete() -> None:
            if self._is_chief and self._remote:
                remote_writing.copy_committed(source, path, self.owner)
            elif self._is_chief:
                ckpt_writing.link_committed(source, path, owner=self.owner)
            delete()

        try:
            pending = self.checkpoint.after_save(link_then_delete)
        except BaseException:
            self._checkpoints, self._last_kept_for_good = kept_before
            raise
        if pending is not None:
            self._in_flight = (path, kept_before, pending)
        return path

    def _agreed_to_keep(self, value: Optional[float]) -> bool:
        """Whether a save with `value` is kept, as the chief decides."""
        if self.best_metric is None:
            return True
        keep = self._retention.would_keep(value, self._checkpoints,
                                          self._values)
        engine = self.checkpoint.resolve_engine()
        if engine.process_count > 1:
            keep = engine.broadcast_text("keep" if keep else "") == "keep"
        return keep

    def _new_path(self, checkpoint_number: Optional[int],
                  counter: int) -> str:
        """`<directory>/<checkpoint_name>-<number>` of the next save: after
        `counter` and every such name in the directory, as the chief sees
        it."""
        free = ownership.next_number(self.directory, self.checkpoint_name,
                                     counter)
        engine = self.checkpoint.resolve_engine()
        if engine.process_count > 1:
            free = int(engine.broadcast_text(str(free)))
        if checkpoint_number is not None and checkpoint_number < free:
            raise ValueError(
                f"checkpoint_number must grow: it must be after the latest "
                f"checkpoint ({self.latest_checkpoint!r}) and every "
                f"'{self.checkpoint_name}-<n>' already in {self.directory!r} "
                f"(the next free number is {free}); a save never replaces "
                f"one. Received: checkpoint_number={checkpoint_number}.")
        number = free if checkpoint_number is None else checkpoint_number
        return os.path.join(self.directory,
                            f"{self.checkpoint_name}-{number}")

    def _track(self, path: str, value: Optional[float]) -> List[str]:
        """Adds `path`; returns the checkpoints that fall out of the list."""
        self._checkpoints.append(path)
        if value is not None:
            self._values[path] = value
        kept = self._retention.kept(self._checkpoints, self._values)
        dropped = [p for p in self._checkpoints if p not in kept]
        self._checkpoints = kept
        to_delete = []
        for old in dropped:
            n = _number(old)
            if self.keep_every_n_steps is not None and (
                    self._last_kept_for_good is None
                    or n - self._last_kept_for_good >= self.keep_every_n_steps):
                self._last_kept_for_good = n
                continue
            to_delete.append(old)
        return to_delete

    def _deleter(self, paths: List[str]):
        def delete():
            if self._is_chief:
                for path in paths:  # only what this manager's owner wrote
                    ownership.remove_owned(path, self.owner)
        return delete

    def sync(self) -> None:
        """Waits for a background save (see `ShardedCheckpoint.sync`)."""
        self.checkpoint.sync()

    def restore_or_initialize(self) -> Optional[str]:
        """Restores the latest checkpoint, if there is one; else calls
        `init_fn` (if given).

        Returns:
            The path restored, or `None` when the directory held none (the
            objects keep their initial values, or what `init_fn` set).
        """
        latest = self.latest_checkpoint
        if latest is None:
            if self.init_fn is not None:
                self.init_fn()
            return None
        self.checkpoint.restore(latest)
        if self.step_counter is not None:
            self._last_saved_step = int(self.step_counter)
        return latest


# The kinds of refusal process 0 broadcasts (`_take_lease`): the lease of
# another job, or the error the directory gave, raised as its own type.
_IN_USE = "in_use"
_REFUSALS = types.MappingProxyType({kind.__name__: kind for kind in (
    PermissionError, FileNotFoundError, OSError)})


def _refused_as(error: OSError) -> type:
    return next(kind for kind in _REFUSALS.values()
                if isinstance(error, kind))


def _number(path: str) -> int:
    return int(os.path.basename(path).rsplit("-", 1)[1])
