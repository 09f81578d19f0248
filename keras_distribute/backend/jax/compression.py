"""Compressed gradient all-reduce on JAX (`CommunicationOptions(compression=)`).

Under XLA SPMD the gradient all-reduce is one the partitioner inserts, in
the gradients' own dtype. To all-reduce in 16 bits, the training step of a
model a strategy owns computes its loss and gradients in a `jax.shard_map`
over the batch axis instead: each replica differentiates the loss of its
own slice of the batch, and the trainable variables enter through
`_compressed_gradient`, an identity whose gradient is the replicas'
`psum` of the 16-bit cast of theirs (each already divided by the replica
count: the loss is the replicas' `pmean`, as DDP's `fp16_compress_hook`
divides before it sums). Everything after the gradients (the optimizer,
the metrics over the global `y_pred`) is Keras' own step, unchanged.

What the replicas computed of the model's other state comes back combined
by the variable's aggregation, as after `strategy.run`: `"sum"` (metric
totals) adds every replica's change, other floating state (batch
statistics) is averaged, and the rest takes the first replica's value.

Only Keras' own step is rewritten: a model that overrides `train_step`,
`compute_loss_and_updates` or `compute_loss`, or a loss whose reduction
is not a mean over the batch, trains uncompressed, with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Any
from typing import Optional

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec

if TYPE_CHECKING:
    from keras import Model

    from keras_distribute.backend.jax.engine import JaxEngine

# `CommunicationOptions(compression=...)` names -> the dtype on the wire.
DTYPES = MappingProxyType({"fp16": jnp.float16, "bf16": jnp.bfloat16})
# Loss reductions whose per-replica means average to the global one (the
# replicas hold equal slices of the batch).
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
_KERAS_OWN = ("train_step", "compute_loss_and_updates", "compute_loss")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _compressed_gradient(value, axis, dtype):
    return jax.lax.pcast(value, axis, to="varying")


def _compressed_gradient_fwd(value, axis, dtype):
    return _compressed_gradient(value, axis, dtype), None


def _compressed_gradient_bwd(axis, dtype, _, gradient):
    if not jnp.issubdtype(gradient.dtype, jnp.floating):
        return (jax.lax.psum(gradient, axis),)
    reduced = jax.lax.psum(gradient.astype(dtype), axis)
    return (reduced.astype(gradient.dtype),)


_compressed_gradient.defvjp(_compressed_gradient_fwd,
                            _compressed_gradient_bwd)


def uncompressible_reason(model: Model) -> Optional[str]:
    """Why `model`'s step cannot be compressed, or None when it can."""
    for name in _KERAS_OWN:
        if getattr(type(model), name, None) is not getattr(
                keras.Model, name, None):
            return (f"it overrides `{name}` (compression rewrites Keras' "
                    "own training step only)")
    for loss in keras.tree.flatten(getattr(model, "loss", None)):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if isinstance(loss, keras.losses.Loss) and (
                reduction not in _MEAN_REDUCTIONS):
            return (f"its loss {loss.name!r} has reduction={reduction!r} "
                    "(the replicas' losses combine by their mean only for "
                    f"the reductions {list(_MEAN_REDUCTIONS)})")
    return None


@contextlib.contextmanager
def compressing(model: Model, engine: JaxEngine, dtype: Any):
    """While it is open, `model`'s training steps all-reduce their
    gradients in `dtype` over `engine`'s batch axis (see the module)."""
    reason = uncompressible_reason(model)
    if reason is not None:
        _warn_once(model, reason)
        yield
        return
    original = type(model).compute_loss_and_updates.__get__(model)
    step = functools.partial(_compressed_step, model, original, engine,
                             dtype)
    object.__setattr__(model, "compute_loss_and_updates", step)
    try:
        yield
    finally:
        model.__dict__.pop("compute_loss_and_updates", None)


def _warn_once(model: Model, reason: str) -> None:
    if not model.__dict__.get("_kd_compression_warned"):
        warnings.warn(
            f"Gradient compression is not applied to {model.name!r} on JAX: "
            f"{reason}. It trains uncompressed.", stacklevel=2)
        object.__setattr__(model, "_kd_compression_warned", True)


def _batch_is_split(engine: JaxEngine, x: Any) -> bool:
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(x)
              if getattr(leaf, "ndim", 0) > 0]
    if not leaves:
        return False
    layout = engine.distribution.get_data_layout(leaves[0].shape)
    return layout.axes[0] == engine.batch_axis


def _compressed_step(model, original, engine, dtype, trainable_variables,
                     non_trainable_variables, metrics_variables, x, y,
                     sample_weight, training=False, optimizer_variables=None):
    arguments = (trainable_variables, non_trainable_variables,
                 metrics_variables, x, y, sample_weight)
    if not training or not _batch_is_split(engine, x):
        # Evaluation, or a short batch laid out whole on every device: no
        # gradient all-reduce to compress.
        return original(*arguments, training=training,
                        optimizer_variables=optimizer_variables)
    axis = engine.batch_axis
    # The paths of the state updated from each replica's data.
    batch_statistics: list = []
    per_replica = functools.partial(_per_replica_step, model, original, axis,
                                    dtype, batch_statistics)
    split = PartitionSpec(axis)
    whole = PartitionSpec()

    def batch_specs(tree):
        return jax.tree_util.tree_map(
            lambda leaf: split if getattr(leaf, "ndim", 0) > 0 else whole,
            tree)

    program = jax.shard_map(
        per_replica, mesh=engine.mesh,
        in_specs=(whole, whole, whole, batch_specs(x), batch_specs(y),
                  batch_specs(sample_weight), whole),
        # Every output of the model is batched: split, as its inputs.
        out_specs=(whole, (whole, split, whole, whole)))
    result = program(*arguments, optimizer_variables)
    if batch_statistics:
        # Per replica these would be statistics of its slice, where JAX's
        # one SPMD program computes them over the global batch: keep that.
        _warn_once(model, f"it updates {batch_statistics[0]!r} from each "
                   "batch (batch statistics: a compressed step would compute "
                   "them per replica, where JAX computes them over the "
                   "global batch)")
        return original(*arguments, training=True,
                        optimizer_variables=optimizer_variables)
    engine.traced_gradient_reductions[:] = [
        (jnp.dtype(dtype).name, int(v.size) * jnp.dtype(dtype).itemsize)
        for v in trainable_variables]
    return result


def _per_replica_step(model, original, axis, dtype, batch_statistics,
                      trainable, non_trainable, metrics, x, y, sample_weight,
                      optimizer_variables):
    """Keras' loss and updates on one replica's slice, inside `shard_map`:
    the trainable variables enter through `_compressed_gradient`, the loss
    leaves as the replicas' mean, other state combined (`_combined`)."""
    trainable = [_compressed_gradient(v, axis, dtype) for v in trainable]
    loss, (unscaled, y_pred, new_non_trainable, new_metrics) = original(
        trainable, non_trainable, metrics, x, y, sample_weight,
        training=True, optimizer_variables=optimizer_variables)
    batch_statistics.extend(
        v.path for v, new in zip(model.non_trainable_variables,
                                 new_non_trainable)
        if axis in _varying_axes(new))
    combine = functools.partial(_combined, axis)
    return jax.lax.pmean(loss, axis), (
        jax.lax.pmean(unscaled, axis),
        y_pred,
        [combine(v, old, new) for v, old, new in zip(
            model.non_trainable_variables, non_trainable, new_non_trainable)],
        [combine(v, old, new) for v, old, new in zip(
            model.metrics_variables, metrics, new_metrics)],
    )


def _combined(axis: str, variable: Any, old: Any, new: Any) -> Any:
    """One value of what the replicas computed for `variable`."""
    aggregation = getattr(variable, "aggregation", "none") or "none"
    varying = axis in _varying_axes(new)
    if aggregation == "sum":
        # Every replica's change counts, also one that is the same on all
        # (a count of examples: each replica counted its own slice).
        change = new - jax.lax.pcast(old, axis, to="varying") if varying else (
            jax.lax.pcast(new - old, axis, to="varying"))
        return (old + jax.lax.psum(change, axis)).astype(new.dtype)
    if not varying:
        return new  # the same on every replica
    if jnp.issubdtype(new.dtype, jnp.floating):
        return jax.lax.pmean(new, axis)
    first = jax.lax.axis_index(axis) == 0
    return jax.lax.psum(jnp.where(first, new, jnp.zeros_like(new)), axis)


def _varying_axes(value: Any) -> frozenset:
    """The manual mesh axes along which `value` differs between replicas
    (`vma`; JAX 0.10 names it `manual_axis_type.varying`)."""
    aval = jax.typeof(value)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    return frozenset(aval.manual_axis_type.varying)
