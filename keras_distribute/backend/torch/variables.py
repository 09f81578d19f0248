"""Keras variables on the torch backend that may be DTensors.

What the Keras hooks and the checkpoint need from a torch variable whether
it is a plain tensor or a DTensor sharded over processes: building
and slot hooks, reading and assigning whole values, the pieces a process
writes to a checkpoint and the region it restores, and keeping torch's
`_foreach_*` optimizer ops off lists that mix DTensors and tensors. Imports
nothing of the engine modules at load time.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Dict
from typing import Iterator
from typing import Sequence

import keras
import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import (
    compute_local_shape_and_global_offset,
)

from keras_distribute.backend.interface import assign_whole
from keras_distribute.backend.interface import snapshot_whole
from keras_distribute.backend.interface import whole_region

if TYPE_CHECKING:
    from keras.layers import Layer

    from keras_distribute.backend.torch.sharding import ShardedTorchEngine


def on_layer_built(layer: Layer) -> None:
    """Called by the Keras hook once a layer is built: a sharding engine
    turns its variables into DTensors."""
    own = list(getattr(layer, "_trainable_variables", ())) + list(
        getattr(layer, "_non_trainable_variables", ()))
    engines: Dict[int, Any] = {
        id(e): e for e in (getattr(v, "_kd_engine", None) for v in own)
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


def checkpoint_pieces(variable: Any, writer: int, process_id: int) -> list:
    """`[(region, array)]` this process (`process_id`) writes: its unique
    shard of a DTensor; a plain (replicated) variable whole, in process
    `writer` only."""
    value: Any = (variable._value if isinstance(variable, keras.Variable)
                  else None)
    if _is_dtensor(value):
        if not writes_piece(variable._kd_engine, value):
            return []  # another replica's, or another process's of this one
        return [(local_region(value), host_view(value.to_local()))]
    if process_id != writer:
        return []
    array = host_view(variable.value)
    return [(whole_region(array.shape), array)]


def host_view(tensor: Any) -> np.ndarray:
    """A tensor's values as a numpy array: a view of its memory when it is
    on the CPU (a synchronous save writes from it; an asynchronous one
    copies it first), else a copy to the host (Keras' `convert_to_numpy`
    always copies)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return keras.ops.convert_to_numpy(tensor)
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _restored_by_swap(value: Any) -> bool:
    """Whether a restore reads a variable's value into new memory and
    swaps it in (a plain, contiguous CPU tensor): its old memory is never
    written, so holding it is the snapshot."""
    return isinstance(value, torch.Tensor) and not _is_dtensor(value) and (
        value.device.type == "cpu" and value.is_contiguous())


def checkpoint_snapshot(variable: Any) -> Callable[[], None]:
    """`put_back()` for a variable's current value (this process's part of
    a sharded one): a plain CPU variable's memory itself, which the
    restore replaces rather than writes (no copy); otherwise a copy."""
    value: Any = (variable._value if isinstance(variable, keras.Variable)
                  else None)
    if _is_dtensor(value):
        local = value.to_local().detach().clone()
        return lambda: assign_piece(variable, local)
    if _restored_by_swap(value):
        held = value.data  # (the same memory: `checkpoint_assign` swaps)

        def put_back_memory():
            variable._value.data = held
        return put_back_memory
    if isinstance(value, torch.Tensor):
        old = value.detach().clone()

        def put_back():
            with torch.no_grad():
                variable._value.copy_(old)
        return put_back
    return snapshot_whole(variable)


def checkpoint_assign(variable: Any, read_regions: Callable) -> None:
    """Restores a variable, reading only this process's region of it; a
    plain CPU variable into new memory, swapped in once read whole and
    verified (its tensor object stays: a `torch.optim` optimizer or a
    module that holds it sees the new values; the old memory, untouched,
    is what `checkpoint_snapshot` holds)."""
    value: Any = (variable._value if isinstance(variable, keras.Variable)
                  else None)
    if _is_dtensor(value):
        (piece,) = read_regions([local_region(value)])
        assign_piece(variable, piece)
        return
    if _restored_by_swap(value):
        fresh = torch.empty_like(value, memory_format=torch.contiguous_format)
        read_regions([whole_region(value.shape)], into=[host_view(fresh)])
        value.data = fresh
        return
    assign_whole(variable, read_regions)


def whole_value(value: Any) -> Any:
    """A sharded value as the whole tensor (a collective: every process of
    the mesh must read it); anything else as is."""
    if isinstance(value, (list, tuple)):
        return type(value)(whole_value(v) for v in value)
    return value.full_tensor() if _is_dtensor(value) else value


def assign_sharded(variable: Any, value: Any) -> bool:
    """Assigns `value` where the variable or the value is a DTensor; `False`
    (Keras assigns) when neither is.

    - a plain `value` to a sharded variable: this process's part of it;
    - a DTensor `value` to a plain variable: its whole tensor (e.g.
      Adafactor's factored slots, plain, updated from a sharded gradient);
    - a DTensor `value` to a sharded variable: laid out as the variable,
      over the variable's mesh (through the whole tensor when the value is
      on another mesh: a fully sharded variable's update computed from
      variables on the model sub-mesh). Keras 3.16's torch variable
      redistributes it to its own Keras layout's mesh instead, which
      torch refuses across meshes (EMA, Ftrl, Muon, Lamb under FSDP).

    A DTensor value's whole tensor is a collective, made in the same order
    in every process (an optimizer's update is).
    """
    target = variable._value
    if not _is_dtensor(target):
        if not _is_dtensor(value):
            return False
        with torch.no_grad():
            target.copy_(value.full_tensor())
        return True
    if not _is_dtensor(value):
        assign_whole_sharded(variable, value)
    elif value.device_mesh == target.device_mesh:
        with torch.no_grad():
            local = value.redistribute(target.device_mesh,
                                       target.placements).to_local()
            target.to_local().copy_(local.to(target.dtype))
    else:
        assign_whole_sharded(variable, value.full_tensor())
    return True


def split_sharded(variables: Sequence[Any], *parallel: Sequence[Any]):
    """`variables` (and lists parallel to them) split into the sharded ones
    and the plain ones: torch's `_foreach_*` ops, which Keras' torch
    optimizers use, refuse lists mixing DTensors and tensors. Yields
    `(variables, *parallel)` per non-empty group, in order."""
    def kind(variable):  # DTensors grouped by their mesh (no cross-mesh op)
        value = getattr(variable, "_value", variable)
        return (value.device_mesh.ndim,) if _is_dtensor(value) else ()

    kinds = [kind(v) for v in variables]
    for group in sorted(set(kinds), reverse=True):
        index = [i for i, k in enumerate(kinds) if k == group]
        yield tuple([values[i] for i in index]
                    for values in (variables,) + parallel)


_replicating = threading.local()


@contextlib.contextmanager
def replicating_plain_tensors() -> Iterator[None]:
    """torch's `implicit_replication` (a plain tensor next to a DTensor is
    taken as replicated), nestable: torch's switches it off when any inner
    use ends, so a sharded layer's call inside the train step left the
    optimizer's update without it (Adafactor's factored slots, plain
    tensors, then failed beside DTensor gradients)."""
    depth = getattr(_replicating, "depth", 0)
    if depth:
        _replicating.depth = depth + 1
        try:
            yield
        finally:
            _replicating.depth = depth
        return
    from torch.distributed.tensor.experimental import implicit_replication

    _replicating.depth = 1
    try:
        with implicit_replication():
            yield
    finally:
        _replicating.depth = 0


def clip_by_global_norm(values: Sequence[Any], clip_norm: float,
                        keras_clip: Callable) -> list:
    """Keras' `clip_by_global_norm` (`keras_clip`) where some `values`
    (gradients) are DTensors, possibly on different meshes (a fully
    sharded variable's on the whole mesh, the others' on the model
    sub-mesh), which Keras' one `stack` of the squared norms refuses:
    each squared norm is made whole first (a DTensor's is summed over its
    shards, a collective every process makes in the same order), so every
    process scales by the same global norm, the one of the whole tensors.
    """
    if not any(_is_dtensor(v) for v in values if v is not None):
        return keras_clip(values, clip_norm)
    with torch.no_grad():
        squares = []
        for value in values:
            if value is None:
                continue
            square = torch.sum(torch.square(value))
            squares.append((square.full_tensor() if _is_dtensor(square)
                            else square).to(torch.float32))
        norm = torch.sqrt(torch.sum(torch.stack(squares)))
        # As Keras: a no-op for a finite norm under the clip, NaN for a
        # non-finite one.
        scale = clip_norm * torch.clamp(1.0 / norm, max=1.0 / clip_norm)
        scale = scale + (norm - norm)
    with replicating_plain_tensors():  # a plain scale times each DTensor
        return [None if value is None else value * scale.to(value.dtype)
                for value in values]


def zero_variables(variables: Sequence[Any]) -> None:
    """Sets every variable (sharded or not) to zeros, in place."""
    with torch.no_grad():
        for variable in variables:
            variable.value.zero_()


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, DTensor)


def local_region(value: Any) -> tuple:
    """`((start, stop), ...)` of the global tensor this process holds."""
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape))


def writes_piece(engine: ShardedTorchEngine, value: Any) -> bool:
    """Whether this process writes its piece of `value` to a checkpoint:
    first along the mesh dimensions that replicate it (every piece once),
    and in replica 0 only unless the value is sharded over the replicas too
    (a DTensor on the whole mesh, batch axis included)."""
    coordinate = value.device_mesh.get_coordinate()
    whole_mesh = value.device_mesh.ndim == engine.torch_mesh.ndim
    return (whole_mesh or engine.input_pipeline_id == 0) and all(
        c == 0 for c, p in zip(coordinate, value.placements)
        if not isinstance(p, Shard))


def assign_whole_sharded(variable: Any, array: Any) -> None:
    """Copies this process's part of a whole value into a sharded variable."""
    value = variable._value
    region = local_region(value)
    whole_value = torch.as_tensor(np.asarray(array)) if not isinstance(
        array, torch.Tensor) else array
    for dim, (start, stop) in enumerate(region):
        whole_value = whole_value.narrow(dim, start, stop - start)
    assign_piece(variable, whole_value)


def assign_piece(variable: Any, piece: Any) -> None:
    """Copies `piece` (this process's region) into a sharded variable."""
    local = variable._value.to_local()
    with torch.no_grad():
        local.copy_(host_tensor(np.asarray(piece)) if not isinstance(
            piece, torch.Tensor) else piece.to(local.dtype))


def host_tensor(array: np.ndarray) -> Any:
    """A numpy array as a CPU tensor sharing its memory; bfloat16 (numpy's
    `ml_dtypes.bfloat16`, which torch does not take) through its bits."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(
            np.int16)).view(torch.bfloat16)
    return torch.as_tensor(array)
