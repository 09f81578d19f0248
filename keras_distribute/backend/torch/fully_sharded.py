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
from typing import Callable
from typing import List
from typing import Optional

import torch
from keras.distribution import TensorLayout
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_distribute.backend.torch.layer_calls import LayerCall
from keras_distribute.backend.torch.layer_calls import running_calls
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
        its model sub-mesh view, gathered over the batch axis by DTensor;
        so does another layer's fully sharded variable its call reads
        itself (keras-hub's Gemma 4 block computes with
        `self.ffw_linear.kernel`), from its first read to the end of the
        call (`gather_read`).

        The view's gradient is declared a partial sum over the replicas
        (`to_local(grad_placements=...)`), so DTensor's backward
        reduce-scatters it onto the variable's shards. A non-trainable
        variable the layer assigned (a moving statistic) is written back
        to its shard afterwards.
        """
        call = LayerCall(layer, self)
        calls = running_calls()
        calls.append(call)
        regathered = _gathered_now()
        try:
            for variable in layer.__dict__.get("_kd_fully_sharded", ()):
                self._gather_into(call, variable, regathered)
            # (a layer that read another's variables: their gathered
            # values are saved as notes too)
            with _saving_gathered_as_notes(bool(call.keys) or (
                    layer.__dict__.get("_kd_reads_sharded") is self)):
                yield
        finally:
            calls.pop()
            self.end_call(call)

    def end_call(self, call: LayerCall) -> None:
        """Puts back what was gathered for a layer call that ends: a
        non-trainable variable the call assigned (a moving statistic) is
        written back to its shard."""
        regathered = _gathered_now()
        for key in call.keys:
            regathered.pop(key, None)
        for variable, parameter, read in call.swapped:
            if variable._value is not read or not variable.trainable:
                self._write_back(variable._value, parameter)
            variable._value = parameter

    def gather_read(self, variable: Any, symbolic: bool) -> Optional[Any]:
        """Called as a fully sharded `variable` is read: inside a layer's
        call that did not gather it (a layer computing with a sublayer's
        kernel itself, as keras-hub's Gemma 4 block does), it reads whole,
        as a plain tensor, for the rest of that call; its gradient is
        reduce-scattered onto its shards as a layer's own. That layer's
        later calls save it for backward as a note (`calling_forward`).
        In a `symbolic` call (on no real tensor), only the latter; outside
        every layer call (an optimizer's update, `get_weights`), nothing.
        While Keras saves a layer (`layer_calls.reading_whole`), each read
        gives the whole value, as a plain tensor, for that read only:
        returned (nothing is kept gathered). Returns: that value, or None.
        """
        calls = running_calls()
        value = variable._value
        if not calls or not isinstance(value, DTensor):
            return None
        call = calls[-1]
        if call.whole:  # a layer Keras saves
            if symbolic:
                return None
            with torch.no_grad():
                return value.full_tensor()
        if id(variable) in call.layer.__dict__.get("_kd_sharded_variables",
                                                   ()):
            return None  # its own layer's call: as it computes with it
        if call.layer.__dict__.get("_kd_reads_sharded") is not self:
            object.__setattr__(call.layer, "_kd_reads_sharded", self)
        if symbolic or call.engine not in (None, self):
            return None
        call.engine = self
        if self._on_whole_mesh(value):
            self._gather_into(call, variable, _gathered_now(), whole=True)
            return None
        # sharded over a model axis only: read whole, its gradient the
        # same on each process of the model sub-mesh (one batch)
        replicated = [Replicate()] * value.device_mesh.ndim
        read = value.redistribute(value.device_mesh, replicated).to_local(
            grad_placements=replicated)
        variable._value = read
        call.swapped.append((variable, value, read))
        return None

    def calling_forward(self, forward: Callable, layer: Layer, args: tuple,
                        kwargs: dict) -> Any:
        """Calls a layer that holds no sharded variable but computes with
        another layer's (`gather_read`): what it reads is gathered for the
        call and saved for backward as a note."""
        with self.gathered_variables(layer):
            return forward(layer, *args, **kwargs)

    def _gather_into(self, call: LayerCall, variable: Any,
                     regathered: dict, whole: bool = False) -> None:
        """`variable` reads gathered over the batch axis until `call` ends:
        as its model sub-mesh view (a DTensor, in its layer's call), or
        `whole` (a plain tensor, in another layer's call). Nothing to do
        where a layer calling this one gathered it."""
        parameter = variable._value
        if not self._on_whole_mesh(parameter):
            return
        placements = list(parameter.placements)
        if whole:
            placements = [Replicate()] * len(placements)
        gathered = parameter.redistribute(
            self.torch_mesh, [Replicate()] + placements[1:])
        local = gathered.to_local(
            grad_placements=[Partial()] + placements[1:])
        if local.requires_grad:
            local.register_hook(self._weigh_replica_gradient)
        if local.requires_grad and local.numel() and tuple(
                local.shape) == tuple(self.gather_again_shape(parameter)):
            key = _storage_key(local)
            regathered[key] = (self, parameter, local)
            call.keys.append(key)
        read = local if whole else DTensor.from_local(
            local, self.model_mesh, placements[1:], run_check=False)
        variable._value = read
        call.swapped.append((variable, parameter, read))

    @staticmethod
    def gather_again_shape(parameter: Any) -> tuple:
        """The shape `gather_again` gives of `parameter`: whole over the
        batch axis, its shard over each model axis."""
        shape = list(parameter.shape)
        mesh = parameter.device_mesh
        for axis, placement in enumerate(parameter.placements):
            if axis and isinstance(placement, Shard):
                size = mesh.size(axis)
                dim = placement.dim
                shape[dim] = -(-shape[dim] // size)  # (even shards only)
        return tuple(shape)

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
        sharded `parameter`: an assignment made while it was gathered (as
        its model sub-mesh view, or whole)."""
        with torch.no_grad():
            mesh = parameter.device_mesh
            placements = [Replicate()] + list(parameter.placements)[1:]
            if isinstance(value, DTensor):
                value = value.to_local()
            elif tuple(value.shape) == tuple(parameter.shape):
                placements = [Replicate()] * len(placements)
            whole = DTensor.from_local(value.detach(), mesh, placements,
                                       run_check=False)
            shard = whole.redistribute(mesh, list(parameter.placements))
            parameter.to_local().copy_(shard.to_local())


def on_read(variable: Any, symbolic: bool) -> Optional[Any]:
    """Called as a variable's value is read (`symbolic`: in a call on no
    real tensor): a fully sharded one read by a layer's call other than
    its own is gathered for that call, and one read while Keras saves its
    layer reads whole (`FullyShardedVariables.gather_read`); any other,
    nothing. Returns the value to read in place of the variable's own for
    this read, `variable._value` where that changed, else None."""
    stored = variable._value
    if not isinstance(stored, DTensor):
        return None
    engine = variable.__dict__.get("_kd_engine")
    if not isinstance(engine, FullyShardedVariables):
        return None
    read = engine.gather_read(variable, symbolic)
    if read is None and variable._value is not stored:
        return variable._value
    return read


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
