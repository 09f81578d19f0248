"""A training step's memory per process on torch: the step itself, run on
fake tensors.

Under torch's `FakeTensorMode` every tensor has its shape, dtype and
storage size but no memory, and every operator runs its real shape logic:
the model's variables and the optimizer's slots are given fake values, a
step as Keras' torch trainer takes it (forward, loss, `backward()`, the
optimizer's in-place update) runs on a fake batch of one replica, and a
dispatch mode counts the bytes of every storage the step makes, less
those it frees, keeping the highest count, and the copies a convolution's
or a max pooling's backward kernel makes inside itself when its arguments'
memory formats differ (`kernel_copy_bytes`). Nothing is allocated; the
variables' own values are put back after.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Dict
from typing import Iterator
from typing import NamedTuple
from typing import Optional

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from keras_distribute.backend.interface import StepMemory
from keras_distribute.backend.torch import user_steps
from keras_distribute.backend.torch.memory_gathering import GatheringLayers
from keras_distribute.backend.torch.storage_counting import LiveStorageBytes
from keras_distribute.common.layouts import axis_names
from keras_distribute.common.layouts import axis_size
from keras_distribute.common.layouts import layout_axes
from keras_distribute.common.layouts import variable_layout

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer


class _ScalarsReadAsOne(TorchDispatchMode):
    """A fake tensor's value read as a Python number (`.item()`: Keras'
    torch SGD passes its learning rate as `alpha=`) reads as 1: a fake
    tensor has no value, and the memory of a step does not depend on it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            if dtype == torch.bool:
                return True
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        return func(*args, **(kwargs or {}))


class _ScalarArraysReadAsOne(TorchFunctionMode):
    """A fake scalar read as a numpy array (Keras' torch Nadam converts its
    momentum product with `convert_to_numpy`) reads as 1, as
    `_ScalarsReadAsOne` reads its value; a larger fake tensor still cannot
    be read."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and (
                isinstance(args[0], FakeTensor) and args[0].numel() == 1):
            name = str(args[0].dtype).replace("torch.", "")
            dtype = np.dtype(name if hasattr(np, name) else "float32")
            return np.ones(tuple(args[0].shape), dtype)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def without_values() -> Iterator[None]:
    """While entered, every tensor made is a fake tensor of a new
    `FakeTensorMode` (a shape, a dtype, no memory), and a fake scalar read
    as a number or a numpy array reads as 1."""
    with (FakeTensorMode(allow_non_fake_inputs=True), _ScalarsReadAsOne(),
          _ScalarArraysReadAsOne()):
        yield


def step_memory(model: Model, optimizer: Optimizer, loss: Callable,
                inputs: Any, targets: Any,
                layout_map: LayoutMap | None) -> Optional[StepMemory]:
    """See `interface.BackendModule.step_memory`: one replica's step on
    fake tensors, as one process of the job runs it.

    A variable sharded over the batch axis (FSDP-style: kd's torch
    engine holds it 1/N per process, `fully_sharded.py`) is held as its
    shard; while its layer computes it is gathered over that axis, what
    the layer's operations save of it is a note gathered again in the
    backward pass, and its gradient is reduce-scattered onto the shard —
    each as new storage of the sizes kd's engine makes. A variable sharded
    over a model axis (tensor parallelism) is held as its shard too, and
    its gradient is made at the shard's size; its layer, which kd's engine
    runs on the shards (DTensor), reads it here as a whole-shaped view
    without memory of its own, so the layer's operations run on whole
    shapes (their outputs whole, as kd's engine gathers them) — except a
    convolution's, which kd's engine gathers whole while it computes, as
    here. The step is one after the first: the last step's gradients are
    alive through the forward pass, as Keras' torch step clears them only
    after it."""
    replicas = 1
    sharded: Dict[int, _Sharding] = {}
    model_axes = False
    if layout_map is not None:
        sharded = _sharded_variables(model, layout_map)
        mesh = layout_map.device_mesh
        replicas = int(mesh.shape[0])
        model_axes = any(int(size) > 1 for size in tuple(mesh.shape)[1:])
    shard_shapes = {key: each.shard for key, each in sharded.items()}
    trainable = list(model.trainable_variables)
    step_optimizer, stand_ins = _optimizer_on_shards(optimizer, trainable,
                                                     shard_shapes)
    variables = list(model.variables)
    values = [variable._value for variable in variables]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def empty(shape: Any, dtype: Any) -> torch.Tensor:
        return torch.empty(tuple(int(s) for s in shape),
                           dtype=getattr(torch, str(dtype)))

    try:
        with fake_mode:
            for variable in variables:
                variable._value = torch.nn.Parameter(
                    empty(shard_shapes.get(id(variable), variable.shape),
                          variable.dtype),
                    requires_grad=variable.trainable)
            for stand_in, variable in zip(stand_ins, trainable):
                stand_in._value = variable._value
            for slot in step_optimizer.variables:
                slot._value = empty(slot.shape, slot.dtype)
            batch = [empty((int(spec.shape[0]) // replicas,)
                           + tuple(spec.shape[1:]) if len(spec.shape) else (),
                           spec.dtype)
                     for spec in tree_flatten((inputs, targets))[0]]
            x, y = _unflatten((inputs, targets), batch)
            resident = ([v._value for v in variables]
                        + [v._value for v in step_optimizer.variables]
                        + batch)
            with (LiveStorageBytes(resident, kernel_copies=True) as live,
                  GatheringLayers(sharded, variables),
                  _ScalarsReadAsOne(), _ScalarArraysReadAsOne()):
                # The last step's gradients: Keras' torch step (and kd's)
                # clears them (`zero_grad`) once the forward pass is done,
                # so every step after the first runs its forward pass
                # beside them (on a model heavy in activations, its peak).
                for variable in trainable:
                    variable._value.grad = torch.empty_like(variable._value)
                y_pred = model(x, training=True)
                for variable in trainable:
                    variable._value.grad = None
                value = loss(y, y_pred)
                for extra in model.losses:
                    value = value + extra
                value.backward()
                grads = [v._value.grad for v in trainable]
                with torch.no_grad(), user_steps.gradients_reduced():
                    step_optimizer.apply(grads, stand_ins)
            resident_bytes = sum(t.untyped_storage().nbytes()
                                 for t in resident)
    finally:
        for variable, value in zip(variables, values):
            variable._value = value
        for stand_in in stand_ins:
            stand_in._value = None
    method = "the step run on torch fake tensors"
    if shard_shapes and not model_axes:
        method += (" (variables sharded over the batch axis held as their "
                   "shards, gathered while their layer computes)")
    elif shard_shapes:
        method += (" (sharded variables held as their shards; a layer "
                   "computes on those cut over a model axis, read whole "
                   "without memory of their own, and on the others "
                   "gathered while it computes, as a convolution's are)")
    return StepMemory(resident_bytes + live.peak, method)


class _Sharding(NamedTuple):
    """How one process holds a sharded variable and its layer reads it."""

    shard: tuple  # the shape the process holds
    computed: tuple  # the shape its layer computes on: gathered over the
    # batch axis, still cut over the model axes (kd's engine's DTensor)
    over_batch: bool  # gathered over the batch axis by a collective


def _sharded_variables(model: Model, layout_map: LayoutMap) -> dict:
    """`{id(variable): _Sharding}` of the variables the map shards (over
    the batch axis, a model axis or both), as one process holds them and
    its layer computes on them (kd's engine gathers a variable over the
    batch axis with a collective while its layer computes, and
    reduce-scatters its gradient; a model axis's shards stay)."""
    mesh = layout_map.device_mesh
    batch_axis = mesh.axis_names[0]
    sharded = {}
    for variable in model.variables:
        shape = tuple(int(s) for s in variable.shape)
        layout = variable_layout(layout_map, variable.path, shape)
        if layout is None:
            continue
        axes = layout_axes(layout)
        if not any(axis_size(mesh, a) > 1 for a in axes):
            continue
        over_batch = batch_axis in axes and axis_size(mesh, batch_axis) > 1
        sharded[id(variable)] = _Sharding(
            shard=tuple(d // axis_size(mesh, axis)
                        for d, axis in zip(shape, layout.axes)),
            computed=tuple(
                d // _model_axes_size(mesh, axis, batch_axis)
                for d, axis in zip(shape, layout.axes)),
            over_batch=over_batch)
    return sharded


def _model_axes_size(mesh: Any, axis: Any, batch_axis: str) -> int:
    """The shards a dimension laid out over `axis` (a mesh axis name, a
    tuple of names or None) is cut into over the mesh's axes other than
    the batch axis."""
    return axis_size(mesh, tuple(name for name in axis_names(axis)
                                 if name != batch_axis))


def _optimizer_on_shards(optimizer: Optimizer, trainable: list,
                         shard_shapes: dict) -> tuple:
    """`(optimizer, stand-ins)`: a fresh optimizer of `optimizer`'s
    configuration built on stand-in variables of the shapes one process
    holds (a shard, or the whole variable), without values."""
    import keras

    fresh = type(optimizer).from_config(optimizer.get_config())
    with without_values():
        stand_ins = [keras.Variable(
            initializer="zeros",
            shape=shard_shapes.get(id(v), tuple(v.shape)), dtype=v.dtype,
            trainable=True, name=v.name) for v in trainable]
        fresh.build(stand_ins)
    return fresh, stand_ins


def _unflatten(structure: Any, leaves: list) -> Any:
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(leaves, tree_flatten(structure)[1])
