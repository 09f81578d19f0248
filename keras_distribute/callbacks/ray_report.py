"""`kd.callbacks.RayReport`: Keras `fit` under Ray Train, with Ray's metric
reports, checkpoints and worker restarts.

Ray Train runs a user's `train_loop_per_worker` in N worker processes and
expects it to call `ray.train.report(metrics, checkpoint=...)` in every
worker; a restarted worker group (`FailureConfig(max_failures=...)`) or a
new run (`resume_from_checkpoint=...`) starts again from
`ray.train.get_checkpoint()`. This callback does both for a Keras `fit`:
the state it reports is the whole training state of
`kd.callbacks.BackupAndRestore` (model, optimizer, metric state, RNG, other
callbacks' progress) as one sharded checkpoint, so a resumed run ends with
the same weights as one never interrupted.

This module imports Keras; Ray only inside a Ray Train worker.
"""

import os
import tempfile
from typing import Any
from typing import Optional

from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.callbacks.backup_and_restore import BACKUP_OWNER
from keras_distribute.callbacks.backup_and_restore import BACKUP_STEM
from keras_distribute.callbacks.backup_and_restore import BackupAndRestore
from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint
from keras_distribute.checkpoint.storage import ownership
from keras_distribute.checkpoint.storage.committed import read_metadata
from keras_distribute.cluster_resolver.schedulers import ray_train_context


def _ray_context(owner: str) -> Any:
    context = ray_train_context()
    if context is None:
        raise RuntimeError(
            f"{owner} reports to Ray Train and runs inside a Ray Train "
            "worker. Received: a process that is not one (no "
            "`ray.train.get_context()`). Create it inside the "
            "`train_loop_per_worker` that a Ray trainer (TorchTrainer, "
            "TensorflowTrainer, JaxTrainer) runs, or use "
            "kd.callbacks.BackupAndRestore outside Ray.")
    return context


def _scalar(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class RayReport(BackupAndRestore):
    """Reports `fit`'s metrics and checkpoints to Ray Train; resumes from
    Ray's latest checkpoint.

    Every worker calls `ray.train.report` at the end of each epoch with the
    epoch's logs (global values: the metrics of all replicas, the same in
    every worker) plus `epoch`. When a save is due (`save_freq`), the whole
    training state is first written as one sharded checkpoint (every worker
    writes its shards into `directory`, the chief commits it) and the chief
    hands that directory to Ray, which copies it to the run's storage. At
    the start of `fit`, if Ray has a checkpoint for this run (a restarted
    worker group, or `resume_from_checkpoint=` on the trainer), the training
    state is restored from it and `fit` goes on at the epoch and step it was
    taken at.

    Args:
        directory: Where the workers write a checkpoint before Ray copies it.
            Every worker must see it (one node, or a shared file system).
            Defaults to a directory of the run under the system's temporary
            directory.
        save_freq: `"epoch"`, or save (and report) every that many batches.
        max_to_keep: Checkpoints kept in `directory` (Ray keeps its own
            copies, by its `CheckpointConfig`).

    Raises:
        RuntimeError: outside a Ray Train worker.
        ValueError: for a bad `save_freq` or `max_to_keep`.

    Example:

    ```python
    def train_loop_per_worker(config):
        strategy = kd.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = make_model()
        model.fit(x, y, epochs=5, callbacks=[kd.callbacks.RayReport()])

    ray.train.torch.TorchTrainer(
        train_loop_per_worker,
        scaling_config=ray.train.ScalingConfig(num_workers=2)).fit()
    ```
    """

    def __init__(self, directory: Optional[str] = None,
                 save_freq: Any = "epoch", max_to_keep: int = 2):
        context = _ray_context("kd.callbacks.RayReport")
        if directory is None:
            directory = os.path.join(
                tempfile.gettempdir(), "keras_distribute_ray",
                context.get_experiment_name())
        super().__init__(directory, save_freq=save_freq,
                         delete_checkpoint=True, async_save=False,
                         max_to_keep=max_to_keep)

    # --------------------------------------------------------------- resume
    def _restore_newest_readable(self) -> Optional[str]:
        checkpoint = self._state
        engine = checkpoint.resolve_engine()
        # Ray's checkpoint is the one to resume from: what an earlier attempt
        # left here was either reported (Ray has it) or never committed.
        if engine.process_id == 0:
            self._remove_own_backups()
            ownership.make_directory(self.directory, BACKUP_OWNER)
        engine.barrier("keras_distribute.RayReport.staging")
        self._manager = CheckpointManager(
            checkpoint, self.directory, max_to_keep=self.max_to_keep,
            checkpoint_name=BACKUP_STEM, owner=BACKUP_OWNER)
        import ray.train

        reported = ray.train.get_checkpoint()
        if reported is None:
            return None
        path = self._local_path(reported, engine)
        objects = checkpoint.objects_by_name()
        objects.pop("metrics")
        objects.pop("callback_arrays")
        ShardedCheckpoint(**objects).read(path).assert_existing_objects_matched()
        self._resume = read_metadata(path)
        return path

    def _local_path(self, reported: Any, engine: ReplicaEngine) -> str:
        """The directory of Ray's checkpoint on this node: its own path on a
        local file system, else a copy the chief downloads."""
        import pyarrow.fs

        if isinstance(reported.filesystem, pyarrow.fs.LocalFileSystem):
            return reported.path
        path = os.path.join(self.directory, "from-ray")
        if engine.process_id == 0:
            # An earlier attempt's download (a backup of ours) is replaced.
            ownership.remove_owned(path, BACKUP_OWNER)
            reported.to_directory(path)
        engine.barrier("keras_distribute.RayReport.download")
        return path

    # --------------------------------------------------------------- report
    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            super().on_epoch_end(epoch, logs)  # saves, then reports
        else:
            self._report(epoch + 1, 0, logs, path=None)

    def _save(self, epoch: int, step: int, logs) -> None:
        path = self._backups.save(options=self._options(),
                                  metadata=self._metadata(epoch, step, logs))
        self._report(epoch, step, logs, path)

    def _report(self, epoch: int, step: int, logs, path: Optional[str]):
        import ray.train

        metrics = {name: _scalar(value)
                   for name, value in (logs or {}).items()}
        metrics.update(epoch=epoch, step=step)
        checkpoint = None
        if path is not None and self._state.resolve_engine().process_id == 0:
            checkpoint = ray.train.Checkpoint.from_directory(path)
        ray.train.report(metrics, checkpoint=checkpoint,
                         delete_local_checkpoint_after_upload=False)
