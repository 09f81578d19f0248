"""Keras variables on the torch backend that may be DTensors.

What the Keras hooks and the checkpoint need from a torch variable whether
it is a plain tensor or sharded over processes (`torch_sharding`): building
and slot hooks, reading and assigning whole values, the pieces a process
writes to a checkpoint and the region it restores, and keeping torch's
`_foreach_*` optimizer ops off lists that mix DTensors and tensors. Imports
nothing of the engine modules at load time.
"""

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import keras

from keras_distribute.checkpoint.reading import whole_region
from keras_distribute.checkpoint.saved_objects import assign_whole


def on_layer_built(layer: Any) -> None:
    """Called by the Keras hook once a layer is built: a sharding engine
    turns its variables into DTensors."""
    own = list(getattr(layer, "_trainable_variables", ())) + list(
        getattr(layer, "_non_trainable_variables", ()))
    engines = {id(e): e for e in (getattr(v, "_kd_engine", None) for v in own)
               if hasattr(e, "shard_layer")}
    for engine in engines.values():
        engine.shard_layer(layer)


def on_slot_created(variable: Any, reference: Any) -> None:
    """Called once an optimizer made `variable` for `reference`: a sharded
    reference gives its slot the same placement."""
    shard_like = getattr(getattr(reference, "_kd_engine", None),
                         "shard_like", None)
    if shard_like is not None:
        shard_like(variable, reference)


def checkpoint_pieces(variable: Any) -> list:
    """`[(region, array)]` this process writes: its unique shard of a
    DTensor; a plain variable whole, from process 0 only."""
    value = variable._value if isinstance(variable, keras.Variable) else None
    if _is_dtensor(value):
        from keras_distribute.backend import torch_sharding

        if not torch_sharding.writes_piece(variable._kd_engine, value):
            return []  # another replica's, or another process's of this one
        local = keras.ops.convert_to_numpy(value.to_local())
        return [(torch_sharding.local_region(value), local)]
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    array = keras.ops.convert_to_numpy(variable.value)
    return [(whole_region(array.shape), array)]


def checkpoint_assign(variable: Any, read_regions: Callable) -> None:
    """Restores a variable, reading only this process's region of it."""
    value = variable._value if isinstance(variable, keras.Variable) else None
    if _is_dtensor(value):
        from keras_distribute.backend import torch_sharding

        (piece,) = read_regions([torch_sharding.local_region(value)])
        torch_sharding.assign_piece(variable, piece)
        return
    assign_whole(variable, read_regions)


def whole_value(value: Any) -> Any:
    """A sharded value as the whole tensor (a collective: every process of
    the mesh must read it); anything else as is."""
    if isinstance(value, (list, tuple)):
        return type(value)(whole_value(v) for v in value)
    return value.full_tensor() if _is_dtensor(value) else value


def assign_sharded(variable: Any, value: Any) -> bool:
    """Assigns a whole `value` to a sharded variable (its part of it, in each
    process); `False` for a plain variable or a DTensor `value`."""
    if not _is_dtensor(variable._value) or _is_dtensor(value):
        return False
    from keras_distribute.backend import torch_sharding

    torch_sharding.assign_whole(variable, value)
    return True


def split_sharded(variables: Sequence[Any], *parallel: Sequence[Any]):
    """`variables` (and lists parallel to them) split into the sharded ones
    and the plain ones: torch's `_foreach_*` ops, which Keras' torch
    optimizers use, refuse lists mixing DTensors and tensors. Yields
    `(variables, *parallel)` per non-empty group, in order."""
    kinds = [_is_dtensor(getattr(v, "_value", v)) for v in variables]
    for kind in (True, False):
        index = [i for i, k in enumerate(kinds) if k is kind]
        if index:
            yield tuple([values[i] for i in index]
                        for values in (variables,) + parallel)


def zero_variables(variables: Sequence[Any]) -> None:
    """Sets every variable (sharded or not) to zeros, in place."""
    with torch.no_grad():
        for variable in variables:
            variable.value.zero_()


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor)
