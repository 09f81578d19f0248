"""The default strategy: one replica, everything runs in place.

It is what `kd.get_strategy()` returns outside every scope, so code written
for a strategy also runs without one, as with `tf.distribute`.
"""

import contextlib
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

import numpy as np

from keras_distribute.common import context
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.reduce_op import check_reduce_axis
from keras_distribute.common.values import PerReplica
from keras_distribute.strategies.strategy import Strategy


class _IdentityCollectives:
    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return value

    def all_gather(self, value: Any, axis: int) -> Any:
        return value


class InPlaceEngine:
    """Engine of the default strategy: one replica, no devices to manage,
    every collective of one process (`interface.ReplicaEngine`)."""

    contract: tuple = ()  # no optional capability
    devices = ()
    num_replicas = 1
    local_replica_ids = (0,)
    num_input_pipelines, input_pipeline_id = 1, 0
    process_count, process_id = 1, 0
    device_mesh = None
    distribution = None
    fit_per_process = False  # one process: nothing to split

    def __init__(self, services: KerasServices) -> None:
        self.keras_services = services
        self.gradient_compression = None

    def scope(self):
        return contextlib.nullcontext()

    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        from keras import ops

        (value,) = values
        if axis is None:
            return value
        return ops.sum(value, axis) if op is ReduceOp.SUM else ops.mean(
            value, axis)

    def from_native(self, value: Any) -> Any:
        return value

    def distribute_datasets_from_function(self, dataset_fn, options,
                                          input_context) -> Any:
        return None  # built by the neutral layer

    def distribute_dataset(self, dataset: Any, options: Any) -> Any:
        return dataset

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        return values[0]

    def put_per_replica(self, structures: Sequence[Any],
                        on_device: bool = True) -> Any:
        return structures[0]

    def variable_local_results(self, variable: Any):
        return None

    def replica_copies(self, variable: Any,
                       one_per_region: bool = False) -> list:
        return []  # one copy: nothing to compare

    def variable_layout(self, variable: Any) -> tuple:
        size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
        return (None,) * len(variable.shape), size

    def owns_variable(self, variable: Any) -> bool:
        return True

    def adopt_variables(self, variables) -> None:
        pass

    def barrier(self, name: str) -> None:
        pass

    def broadcast_text(self, text: str) -> str:
        return text

    def process_all_gather(self, array: Any) -> Any:
        return np.asarray(array)[None]

    def set_gradient_compression(self, name: str) -> None:
        raise ValueError(
            "The default strategy (outside every strategy's scope) "
            "all-reduces nothing, so it compresses nothing. Received: "
            f"compression={name!r}. Pass kd.CommunicationOptions to the "
            "strategy whose scope the model is made in.")

    def call_trainer(self, method, model, args, kwargs):
        return method(model, *args, **kwargs)


class DefaultStrategy(Strategy):
    """The strategy in effect outside every `scope()`: one replica."""

    # No Keras hooks: the default strategy changes nothing.
    _installs_keras_hooks = False

    def __init__(self):
        from keras_distribute import integration

        super().__init__(InPlaceEngine(integration.services()))
        self._replica_context = context.ReplicaContext(
            self, 0, _IdentityCollectives()
        )

    @contextlib.contextmanager
    def scope(self):
        yield self

    def run(self, fn: Callable, args: tuple = (),
            kwargs: Optional[dict] = None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value: Any, axis: Optional[int] = None):
        op = ReduceOp.from_value(reduce_op)
        check_reduce_axis(axis)
        import keras

        return keras.tree.map_structure(
            lambda v: self._engine.reduce(
                op, [v.values[0] if isinstance(v, PerReplica) else v], axis),
            value,
        )

    def experimental_distribute_dataset(self, dataset, options=None):
        return dataset

    def _default_replica_context(self):
        return self._replica_context

    def __repr__(self) -> str:
        return "<DefaultStrategy num_replicas_in_sync=1>"


context._register_default_strategy_factory(DefaultStrategy)
