"""Keras variables inside `strategy.run` on JAX.

`run` compiles `fn` with `jax.jit(shard_map(...))`. A Keras variable read
inside that trace would be baked into the program as a constant (the next
`run` then serves stale weights), and one assigned there would leak a tracer
(`UnexpectedTracerError` from `metric.update_state`). So `fn` runs inside a
`VariableScope` — a `keras.StatelessScope` whose values are the program's
inputs: the variables `fn` touches are found by a first, abstract trace,
passed in as arguments, and their new values come out as results. After the
call each assigned variable is combined across replicas by its
`aggregation`, as tf.distribute does: `"sum"` (metric totals and counts) adds
every replica's change, `"mean"` averages, and `"none"` /
`"only_first_replica"` (weights, optimizer state: identical on every
replica) take the first replica's value.

The threaded path (per-replica shapes differ) uses the same scope eagerly,
supplying each replica's thread with its device's copy of a replicated
variable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import cast

import jax
import jax.numpy as jnp
import keras

if TYPE_CHECKING:
    from keras import Model
    from keras.optimizers import Optimizer

    from keras_distribute.backend.interface import ReplicaEngine
    from keras_distribute.backend.jax.engine import JaxEngine

# How a variable's per-replica new values are combined after `run`.
_STACKED = ("sum", "mean")


class VariableScope(keras.StatelessScope):
    """A stateless scope that supplies variables' values and records use.

    Args:
        supply: `variable -> value or None` for a variable read that has no
            value in the scope yet (`None`: the variable's own value).
    """

    def __init__(self, supply: Callable[[Any], Any]):
        super().__init__(initialize_variables=False)
        self._supply = supply
        self.read: Dict[int, Any] = {}
        self.written: Dict[int, Any] = {}

    def get_current_value(self, variable):
        value = self.state_mapping.get(id(variable))
        if value is None:
            self.read.setdefault(id(variable), variable)
            value = self._supply(variable)
            if value is not None:
                self.state_mapping[id(variable)] = value
        return value

    def add_update(self, update):
        variable, value = update
        self.read.setdefault(id(variable), variable)
        self.written.setdefault(id(variable), variable)
        self.state_mapping[id(variable)] = value


def aggregation(variable: Any) -> str:
    return getattr(variable, "aggregation", "none") or "none"


def is_stacked(variable: Any) -> bool:
    """Whether each replica's new value is kept (to be combined)."""
    return aggregation(variable) in _STACKED


def check_initialized(variables: List[Any]) -> None:
    uninitialized = [v.path for v in variables
                     if getattr(v, "_value", True) is None]
    if uninitialized:
        raise ValueError(
            "strategy.run on JAX: the function created variables "
            f"({uninitialized[:3]}) — a model, optimizer or metric built "
            "lazily inside `run`. JAX compiles `run` and cannot create state "
            "inside it. Build them before the loop: call the model once on "
            "a batch (or `model.build(input_shape)`), and "
            "`optimizer.build(model.trainable_variables)`.")


def apply_updates(written: List[Any], before: List[Any],
                  updates: List[Any]) -> None:
    """Assigns each written variable its new value, combined across
    replicas by its aggregation (`updates[i]` is stacked `(replicas, ...)`
    for `"sum"` / `"mean"`, else the first replica's value)."""
    for variable, old, new in zip(written, before, updates):
        kind = aggregation(variable)
        if kind == "sum":
            new = _sum_of_changes(old, new)
        elif kind == "mean":
            new = _mean0(new)
        variable.assign(new)


@jax.jit
def _sum_of_changes(old, stacked):
    return old + jnp.sum(stacked - old[None], axis=0).astype(old.dtype)


@jax.jit
def _mean0(stacked):
    return jnp.mean(stacked, axis=0).astype(stacked.dtype)


def stack_replica_values(values: List[Any]) -> Any:
    """The threaded path: per-replica new values, stacked on one device."""
    device = list(values[0].devices())[0] if hasattr(
        values[0], "devices") else None
    return jnp.stack([jax.device_put(v, device) for v in values])


def local_copy(variable: Any, device: Any) -> Optional[Any]:
    """The threaded path: this device's copy of a replicated variable."""
    value = variable._value if hasattr(variable, "_value") else None
    if value is None:
        return None
    if not isinstance(value, jax.Array):
        return jax.device_put(value, device)
    if not value.sharding.is_fully_replicated:
        raise ValueError(
            f"The variable {variable.path!r} is sharded over the mesh; a "
            "per-replica batch of uneven size (a short last batch) runs one "
            "thread per replica and needs replicated variables. Batch the "
            "dataset with drop_remainder=True or pad the last batch.")
    for shard in value.addressable_shards:
        if shard.device == device:
            return shard.data
    return jax.device_put(value, device)


def value_and_gradients(model: Model, compute_loss: Callable, x: Any) -> tuple:
    """`(loss, gradients, y_pred)` of `compute_loss(y_pred, losses)` over the
    model's trainable variables (`jax.value_and_grad` of a stateless call;
    the new non-trainable values, e.g. batch statistics, are assigned)."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_of(values):
        y_pred, new_non_trainable, losses = model.stateless_call(
            values, non_trainable, x, training=True, return_losses=True)
        return compute_loss(y_pred, losses), (y_pred, new_non_trainable)

    (loss, (y_pred, new_non_trainable)), grads = jax.value_and_grad(
        loss_of, has_aux=True)(trainable)
    for variable, value in zip(model.non_trainable_variables,
                               new_non_trainable):
        variable.assign(value)
    return loss, grads, y_pred


def apply_gradients(engine: ReplicaEngine, optimizer: Optimizer,
                    grads: List[Any],
                    variables: List[Any]) -> None:
    """Sums the replicas' gradients, then applies them (inside `run`); in
    `engine`'s compression dtype when it has one."""
    from keras_distribute.common import context

    dtype = engine.gradient_compression
    dtypes = [g.dtype for g in grads]
    if dtype is not None:
        grads = [g.astype(dtype) if jnp.issubdtype(g.dtype, jnp.floating)
                 else g for g in grads]
        # (only a JaxEngine is given a compression dtype)
        cast("JaxEngine", engine).traced_gradient_reductions[:] = [
            (jnp.dtype(g.dtype).name, int(g.size) * g.dtype.itemsize)
            for g in grads]
    grads = context.replica_context_of("apply_gradients").all_reduce(
        "sum", grads)
    optimizer.apply([g.astype(d) for g, d in zip(grads, dtypes)], variables)
