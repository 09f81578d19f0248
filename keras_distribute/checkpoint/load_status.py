"""What a checkpoint restore reports: `LoadStatus` and, for a restore of
`None`, `InitializationOnlyStatus` (the counterparts of tf.train's)."""

from typing import TYPE_CHECKING
from typing import List
from typing import Optional

if TYPE_CHECKING:
    from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint


class LoadStatus:
    """What a `read` / `restore` matched.

    Args:
        unmatched_in_checkpoint: Checkpoint keys no object variable took.
        unmatched_in_objects: Object variables the checkpoint lacked.
        checkpoint: The `ShardedCheckpoint` whose deferred restores (objects
            whose variables do not exist yet) this status reports.
    """

    def __init__(self, unmatched_in_checkpoint: List[str],
                 unmatched_in_objects: List[str],
                 checkpoint: Optional["ShardedCheckpoint"] = None):
        self.unmatched_in_checkpoint = unmatched_in_checkpoint
        self.unmatched_in_objects = unmatched_in_objects
        self._checkpoint = checkpoint

    def _deferred(self) -> List[str]:
        if self._checkpoint is None:
            return []
        self._checkpoint._apply_deferred()
        return sorted(self._checkpoint._deferred)

    def assert_consumed(self) -> "LoadStatus":
        """Raises `AssertionError` unless everything matched both ways."""
        deferred = self._deferred()
        if deferred:
            raise AssertionError(
                f"The variables of {deferred} do not exist yet, so they are "
                "not restored yet; they will be when created (build the "
                "model, call fit, or build the optimizer first).")
        if self.unmatched_in_checkpoint or self.unmatched_in_objects:
            raise AssertionError(
                "The checkpoint and the objects do not match exactly. In the "
                f"checkpoint only: {self.unmatched_in_checkpoint[:10]}; in "
                f"the objects only: {self.unmatched_in_objects[:10]}. Use "
                "expect_partial() if that is intended.")
        return self

    def assert_existing_objects_matched(self) -> "LoadStatus":
        """Raises `AssertionError` if an existing variable was not restored."""
        if self.unmatched_in_objects:
            raise AssertionError(
                "These variables were not in the checkpoint: "
                f"{self.unmatched_in_objects[:10]}.")
        return self

    def expect_partial(self) -> "LoadStatus":
        """Accepts a partial match silently."""
        return self


class InitializationOnlyStatus(LoadStatus):
    """What `read(None)` / `restore(None)` return: nothing was restored
    (as `tf.train.Checkpoint.restore(None)`, e.g. on a first run where
    `manager.latest_checkpoint` is `None`); the variables keep their
    initial values."""

    def __init__(self):
        super().__init__([], [])

    def assert_consumed(self) -> "LoadStatus":
        """Raises `AssertionError`: there was no checkpoint to consume."""
        raise AssertionError(
            "No checkpoint was given (path=None), so nothing was restored. "
            "Pass a checkpoint path, e.g. kd.checkpoint.latest_checkpoint("
            "directory), or skip the assertion on a first run.")

    def assert_existing_objects_matched(self) -> "LoadStatus":
        """Raises `AssertionError`: no variable was restored."""
        return self.assert_consumed()
