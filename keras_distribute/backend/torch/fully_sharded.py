"""Fully sharded variables (FSDP / ZeRO-3 style) of a sharded torch engine.

A variable whose layout also shards it over the batch axis (keras-hub's
`get_layout_map`, `kd.layouts.fully_sharded`) is a DTensor on the whole
mesh, so each process holds its 1/N of it along the batch axis, and so do
its gradient and its optimizer slots. When its layer runs, DTensor gathers
it over the batch axis (`redistribute` to `Replicate`) into the model
sub-mesh view the layer computes with; that view's gradient enters
DTensor's backward as a partial sum over the replicas, which DTensor
reduce-scatters back onto the shards.

The gathered values live only while their layer computes, as FSDP2's
`reshard_after_forward`: what the layer's operations save for the backward
pass of a gathered value is not the value but a note of where it came from
(`torch.autograd.graph.saved_tensors_hooks`), and the backward pass gathers
it again from the shards when it needs it. So at the end of the forward
pass a process holds its shards and the activations, not every layer's
gathered variables.

`FullyShardedVariables` is the part of `ShardedTorchEngine`
(`sharding.py`) that does this; it reads the engine's meshes and axes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING
from typing import Any
from typing import List
from typing import Optional

import torch
from keras.distribution import TensorLayout
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_distribute.common.layouts import axis_names
from keras_distribute.common.layouts import layout_axes

if TYPE_CHECKING:
    from keras.layers import Layer


class FullyShardedVariables:
    """The fully sharded variables of a sharded torch engine: which layouts
    make them, and their gathering while their layer runs."""

    # The engine's (ShardedTorchEngine.__init__).
    num_replicas: int
    batch_axis: str
    model_axes: List[str]
    keras_layouts: bool
    keras_mesh: Any
    torch_mesh: Any
    model_mesh: Any

    def is_fully_sharded(self, layout: Optional[Any]) -> bool:
        """Whether `layout` shards over the batch axis too (FSDP-style):
        its variable is then a DTensor on the whole mesh."""
        return (layout is not None and self.num_replicas > 1
                and self.batch_axis in layout_axes(layout))

    def whole_mesh_placements(self, layout: Any) -> list:
        """The torch placement on each dimension of the whole mesh (the
        batch axis first) of a layout."""
        axes = list(layout.axes)
        if self.keras_layouts:
            return list(TensorLayout(axes, self.keras_mesh).backend_layout
                        .placements)
        placements = []
        for name in [self.batch_axis] + list(self.model_axes):
            dims = [d for d, axis in enumerate(axes)
                    if name in axis_names(axis)]
            placements.append(Shard(dims[0]) if dims else Replicate())
        return placements

    def _on_whole_mesh(self, value: Any) -> bool:
        return (isinstance(value, DTensor)
                and value.device_mesh.ndim == self.torch_mesh.ndim
                and self.num_replicas > 1)

    @contextlib.contextmanager
    def gathered_variables(self, layer: Layer):
        """While a layer runs: each of its fully sharded variables reads as
        its model sub-mesh view, gathered over the batch axis by DTensor.

        The view's gradient is declared a partial sum over the replicas
        (`to_local(grad_placements=...)`), so DTensor's backward
        reduce-scatters it onto the variable's shards. A non-trainable
        variable the layer assigned (a moving statistic) is written back
        to its shard afterwards.
        """
        own = layer.__dict__.get("_kd_fully_sharded", ())
        if not own:  # model-axis sharding only: nothing to gather
            yield
            return
        swapped = []
        regathered = _gathered_now()
        keys = []
        try:
            for variable in own:
                parameter = variable._value
                placements = list(parameter.placements)
                gathered = parameter.redistribute(
                    self.torch_mesh, [Replicate()] + placements[1:])
                local = gathered.to_local(
                    grad_placements=[Partial()] + placements[1:])
                if local.requires_grad:
                    local.register_hook(self._weigh_replica_gradient)
                if local.requires_grad and local.numel():
                    key = _storage_key(local)
                    regathered[key] = (self, parameter, local)
                    keys.append(key)
                view = DTensor.from_local(local, self.model_mesh,
                                          placements[1:], run_check=False)
                variable._value = view
                swapped.append((variable, parameter, view))
            with _saving_gathered_as_notes(bool(keys)):
                yield
        finally:
            for key in keys:
                regathered.pop(key, None)
            for variable, parameter, view in swapped:
                if variable._value is not view or not variable.trainable:
                    self._write_back(variable._value, parameter)
                variable._value = parameter

    def gather_again(self, parameter: Any) -> torch.Tensor:
        """The model sub-mesh local value of a fully sharded `parameter`,
        gathered over the batch axis again (in the backward pass: a
        collective every process makes at the same point)."""
        placements = list(parameter.placements)
        with torch.no_grad():
            return parameter.detach().redistribute(
                self.torch_mesh, [Replicate()] + placements[1:]).to_local()

    def _weigh_replica_gradient(self, grad: Any) -> Any:
        """This process's part of a fully sharded variable's gradient,
        before DTensor sums it over the replicas: inside a user's step
        (`user_steps`), weighted by the process's share of the global
        batch, so the sum is the global batch's gradient as for the other
        variables (`sum_gradients`); in Keras' own step, as it is (averaged
        in `sync_gradients`, as DDP does)."""
        from keras_distribute.backend.torch import user_steps

        session = user_steps.current_session()
        if session is None or session.engine is not self:
            return grad
        return grad * session.share()

    def _write_back(self, value: Any, parameter: Any) -> None:
        """Copies this process's shard of a (gathered) `value` into the
        whole-mesh `parameter`: an assignment made while it was gathered."""
        with torch.no_grad():
            if isinstance(value, DTensor):
                value = value.to_local()
            whole = DTensor.from_local(
                value.detach(), self.torch_mesh,
                [Replicate()] + list(parameter.placements)[1:],
                run_check=False)
            shard = whole.redistribute(self.torch_mesh,
                                       list(parameter.placements))
            parameter.to_local().copy_(shard.to_local())


# The gathered values of the layers computing now (nested layers each add
# theirs), by their storage: what the saved-tensor hooks replace by notes.
_GATHERED = threading.local()


def _gathered_now() -> dict:
    gathered = getattr(_GATHERED, "by_storage", None)
    if gathered is None:
        gathered = _GATHERED.by_storage = {}
    return gathered


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _GatheredNote:
    """What the autograd graph keeps for a saved tensor that is (a view of)
    a gathered value: the shards to gather it from and its geometry."""

    __slots__ = ("engine", "parameter", "size", "stride", "offset",
                 "dtensor")

    def __init__(self, engine: Any, parameter: Any, local: torch.Tensor,
                 saved: torch.Tensor, dtensor: Optional[DTensor]) -> None:
        self.engine = engine
        self.parameter = parameter
        self.size = tuple(saved.size())
        self.stride = tuple(saved.stride())
        self.offset = saved.storage_offset() - local.storage_offset()
        # (mesh, placements, global shape, global stride) of a DTensor
        self.dtensor = None if dtensor is None else (
            dtensor.device_mesh, tuple(dtensor.placements),
            tuple(dtensor.shape), tuple(dtensor.stride()))

    def unpack(self) -> torch.Tensor:
        local = self.engine.gather_again(self.parameter)
        view = local.as_strided(self.size, self.stride,
                                local.storage_offset() + self.offset)
        if self.dtensor is None:
            return view
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(view, mesh, list(placements),
                                  run_check=False, shape=shape,
                                  stride=stride)


def _pack(saved: Any) -> Any:
    """Saves a note in place of a gathered value (or a view of one)."""
    local = saved._local_tensor if isinstance(saved, DTensor) else saved
    if (not isinstance(local, torch.Tensor) or local.device.type == "meta"
            or isinstance(local, DTensor)):
        return saved
    try:
        key = _storage_key(local)
    except (RuntimeError, NotImplementedError):  # no storage (a subclass)
        return saved
    entry = _gathered_now().get(key)
    if entry is None:
        return saved
    engine, parameter, gathered = entry
    if local.dtype != gathered.dtype:
        return saved
    return _GatheredNote(engine, parameter, gathered, local,
                         saved if isinstance(saved, DTensor) else None)


def _unpack(packed: Any) -> Any:
    if isinstance(packed, _GatheredNote):
        return packed.unpack()
    return packed


@contextlib.contextmanager
def _saving_gathered_as_notes(active: bool):
    """While a layer with gathered trainable variables computes: the
    tensors its operations save for backward that are those variables'
    gathered values are kept as notes (`_GatheredNote`) and gathered again
    when the backward pass reads them. Not under torch.compile (its graph
    keeps what it keeps)."""
    if not active or torch.compiler.is_compiling():
        yield
        return
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield
