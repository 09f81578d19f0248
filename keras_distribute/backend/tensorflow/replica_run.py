"""The TensorFlow engine's `run` and cross-replica operations, through its
`tf.distribute` strategy: `run` enters kd's replica context inside each
`tf.distribute` replica, `reduce` and `gather` hand per-replica components
to the strategy's own. `ReplicaRun` is a base of `TfEngine` (`engine.py`),
which supplies the attributes it declares.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

import keras
import tensorflow as tf
from tensorflow.python.distribute import values as tf_values

from keras_distribute.common.reduce_op import ReduceOp


class ReplicaRun:
    """`run`, `reduce` and `gather` of `TfEngine` (see the module
    docstring)."""

    tf_strategy: Any
    multi_worker: bool
    local_replica_ids: tuple
    _to_native: Callable[[Any], Any]

    # ------------------------------------------------------------------ run
    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        def replica_fn(*call_args, **call_kwargs):
            tf_context = tf.distribute.get_replica_context()
            with strategy.enter_replica(tf_context.replica_id_in_sync_group,
                                        _TfCollectives(tf_context)):
                try:
                    return fn(*call_args, **call_kwargs)
                except IndexError as error:
                    _raise_if_foreign_variable(error, strategy)
                    raise

        result = self.tf_strategy.run(
            replica_fn, args=self._to_native(args),
            kwargs=self._to_native(kwargs),
        )
        if self.multi_worker and len(self.local_replica_ids) == 1:
            # One device per worker: tf.distribute returns the worker's
            # tensor itself; it is still that replica's own value.
            result = keras.tree.map_structure(
                lambda v: v if v is None or isinstance(
                    v, tf_values.DistributedValues) else tf_values.PerReplica(
                        (v,)), result)
        return result

    # -------------------------------------------------- cross-replica ops
    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        if axis is None:
            shapes = {tuple(to_tensor(v).shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(
                    "Cannot reduce per-replica values of different shapes "
                    f"{sorted(shapes)} with axis=None. Pass the batch "
                    "dimension as `axis` (usually `axis=0`)."
                )
        else:
            _check_axis(axis, len(to_tensor(values[0]).shape))
        per_replica = tf_values.PerReplica(tuple(to_tensor(v) for v in values))
        return self.tf_strategy.reduce(op.value, per_replica, axis=axis)

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        rank = len(to_tensor(values[0]).shape)
        if rank == 0:
            raise ValueError(
                "`gather` needs per-replica values of rank >= 1 to "
                "concatenate. Received scalars. Use `reduce` for scalars, or "
                "give each replica's value a leading dimension."
            )
        _check_axis(axis, rank)
        per_replica = tf_values.PerReplica(tuple(to_tensor(v) for v in values))
        return self.tf_strategy.gather(per_replica, axis=axis)


def _raise_if_foreign_variable(error: IndexError, strategy: Any) -> None:
    """tf.distribute indexes a mirrored variable by replica id: one made
    under a strategy with fewer replicas fails with a bare IndexError."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if frames and frames[-1].filename.replace("\\", "/").endswith(
            "distribute/values.py"):
        raise ValueError(
            "A variable created under another strategy (with fewer replicas) "
            f"was used inside {strategy!r}.run. Received: a mirrored "
            "variable of another strategy. Create the model and its "
            "variables inside this strategy's scope, or run the function "
            "under the strategy that created them.") from error


def _check_axis(axis: int, rank: int) -> None:
    if not -rank <= axis < rank:
        raise ValueError(
            f"`axis`={axis} is out of range for per-replica values of "
            f"rank {rank}. Use an axis in [{-rank}, {rank})."
        )


def to_tensor(value: Any) -> Any:
    if value is None or isinstance(value, tf.Variable):
        return value
    if isinstance(value, keras.Variable):
        return value.value
    return tf.convert_to_tensor(value)


class _TfCollectives:
    """Collectives of a `tf.distribute` replica context."""

    def __init__(self, tf_context):
        self._tf_context = tf_context

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return self._tf_context.all_reduce(
            op.value, keras.tree.map_structure(to_tensor, value))

    def all_gather(self, value: Any, axis: int) -> Any:
        return self._tf_context.all_gather(
            keras.tree.map_structure(to_tensor, value), axis)
