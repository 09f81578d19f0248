"""`StrategyExtended`: the less common strategy operations
(`strategy.extended`), as `tf.distribute.StrategyExtended`."""


from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    from keras_distribute.strategies.strategy import Strategy


class StrategyExtended:
    """Less common strategy operations, as `tf.distribute.StrategyExtended`.

    Args:
        strategy: The strategy these operations belong to.
    """

    def __init__(self, strategy: Strategy):
        self._strategy = strategy

    def variable_created_in_scope(self, variable: Any) -> bool:
        """Whether `variable` was created in the strategy's scope.

        Args:
            variable: A Keras variable.

        Returns:
            `True` if the strategy laid the variable out.
        """
        return self._strategy.engine.owns_variable(variable)

    @property
    def worker_devices(self) -> tuple:
        """The Keras-style names of this worker's replica devices."""
        from keras_distribute.backend import get_backend

        return tuple(
            get_backend().device_name(d) for d in self._strategy.engine.devices
        )

    parameter_devices = worker_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process is the one that writes checkpoints and
        other files (the chief, process 0), as in tf.distribute. A
        `kd.checkpoint.ShardedCheckpoint` save is still called by every
        process (each writes its own pieces)."""
        return self._strategy.engine.process_id == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries (TensorBoard): the chief."""
        return self._strategy.engine.process_id == 0

    @property
    def experimental_should_init(self) -> bool:
        """Whether this process initialises variables: every process does
        (values are then made equal across processes)."""
        return True

    should_init = experimental_should_init
