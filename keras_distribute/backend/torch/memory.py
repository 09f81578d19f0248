"""A training step's memory per process on torch: the step itself, run on
fake tensors.

Under torch's `FakeTensorMode` every tensor has its shape, dtype and
storage size but no memory, and every operator runs its real shape logic:
the model's variables and the optimizer's slots are given fake values, a
step as Keras' torch trainer takes it (forward, loss, `backward()`, the
optimizer's in-place update) runs on a fake batch of one replica, and a
dispatch mode counts the bytes of every storage the step makes, less
those it frees, keeping the highest count. Nothing is allocated; the
variables' own values are put back after.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Iterable
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from keras_distribute.backend.interface import StepMemory
from keras_distribute.common.layouts import layout_axes
from keras_distribute.common.layouts import variable_layout

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer


class LiveStorageBytes(TorchDispatchMode):
    """Counts the bytes of the storages made while it is entered (`live`)
    and their highest count (`peak`); storages that existed before
    (`resident` tensors') are not counted."""

    def __init__(self, resident: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted = {id(t.untyped_storage()) for t in resident}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._counted:
                continue
            self._counted.add(key)
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, nbytes)
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._counted.discard(key)


def step_memory(model: Model, optimizer: Optimizer, loss: Callable,
                inputs: Any, targets: Any,
                layout_map: LayoutMap | None) -> Optional[StepMemory]:
    """See `interface.BackendModule.step_memory`: one replica's step on
    fake tensors; None when `layout_map` shards a variable (a process then
    holds parts: the caller traces shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    replicas = 1
    if layout_map is not None:
        replicas = int(layout_map.device_mesh.shape[0])
        for variable in model.variables:
            layout = variable_layout(layout_map, variable.path,
                                     tuple(variable.shape))
            if layout is not None and layout_axes(layout):
                return None
    variables = list(model.variables) + list(optimizer.variables)
    values = [variable._value for variable in variables]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def empty(shape: Any, dtype: Any) -> torch.Tensor:
        return torch.empty(tuple(int(s) for s in shape),
                           dtype=getattr(torch, str(dtype)))

    try:
        with fake_mode:
            for variable in variables:
                variable._value = torch.nn.Parameter(
                    empty(variable.shape, variable.dtype),
                    requires_grad=variable.trainable)
            batch = [empty((int(spec.shape[0]) // replicas,)
                           + tuple(spec.shape[1:]) if len(spec.shape) else (),
                           spec.dtype)
                     for spec in tree_flatten((inputs, targets))[0]]
            x, y = _unflatten((inputs, targets), batch)
            resident = [v._value for v in variables] + batch
            with LiveStorageBytes(resident) as live:
                y_pred = model(x, training=True)
                value = loss(y, y_pred)
                for extra in model.losses:
                    value = value + extra
                value.backward()
                grads = [v.value.grad for v in model.trainable_variables]
                with torch.no_grad():
                    optimizer.apply(grads, model.trainable_variables)
            resident_bytes = sum(t.untyped_storage().nbytes()
                                 for t in resident)
    finally:
        for variable, value in zip(variables, values):
            variable._value = value
    return StepMemory(resident_bytes + live.peak,
                      "the step run on torch fake tensors")


def _unflatten(structure: Any, leaves: list) -> Any:
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(leaves, tree_flatten(structure)[1])
