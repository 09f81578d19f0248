"""The estimated step's gathering (`memory.step_memory`): each sharded
variable read as kd's torch engine gives it to the layer computing with it,
on fake tensors, counting what a gathering makes and holds."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import torch

from keras_distribute.backend.torch.layer_calls import convolutions
from keras_distribute.backend.torch.storage_counting import (
    gloo_stages_collectives,
)


def _staging(like: torch.Tensor, shape: tuple, staged: bool) -> None:
    """A collective's staging buffer of `shape`, made and freed at once
    (it counts towards the peak while the collective runs)."""
    if staged:
        like.new_empty(shape)


class _Gathered(torch.autograd.Function):
    """A shard gathered whole (new storage, as DTensor's all-gather makes);
    in backward the whole gradient reduce-scattered onto the shard (new
    storage of the shard's size). `staged`: each collective also holds a
    staging buffer of the whole while it runs (gloo)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, shape: tuple,
                staged: bool) -> torch.Tensor:
        ctx.shard_shape, ctx.staged = tuple(shard.shape), staged
        whole = shard.new_empty(shape)
        _staging(shard, shape, staged)
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        shard = grad.new_empty(ctx.shard_shape)
        _staging(grad, tuple(grad.shape), ctx.staged)
        return shard, None, None


class _ReadOnShards(torch.autograd.Function):
    """A variable cut over a model axis, as the layer kd's engine runs on
    its shards (DTensor) reads it: a whole-shaped view without memory of
    its own — of the batch-axis gathering of the shard (new storage, of
    the shape the layer computes on) where the variable is also sharded
    over the batch axis, else of nothing. In backward the whole gradient
    goes back onto the shard (new storage of the shard's size)."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, computed: tuple,
                shape: tuple, staged: bool) -> torch.Tensor:
        ctx.shard_shape, ctx.computed, ctx.staged = (
            tuple(shard.shape), computed, staged)
        if computed != tuple(shard.shape):  # gathered over the batch axis
            held = shard.new_empty(computed)
            _staging(shard, computed, staged)
        else:
            held = shard.new_empty((1,) * len(shape))
        return held.as_strided(shape, (0,) * len(shape))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        shard = grad.new_empty(ctx.shard_shape)
        if ctx.computed != ctx.shard_shape:
            _staging(grad, ctx.computed, ctx.staged)
        return shard, None, None, None


class GatheringLayers:
    """While entered, every Keras layer with variables in `sharded` reads
    them as kd's torch engine gives them to it (global torch module
    hooks): gathered over the batch axis, a model axis's shards read
    whole without memory of their own (`_ReadOnShards`) — a convolution's
    gathered whole —, and what its operations save of a gathered value
    for backward is a note that the backward pass gathers again (new
    storage), as kd's engine does
    (`fully_sharded.FullyShardedVariables.gathered_variables`); each
    gathering over the batch axis on gloo holds a collective's staging
    buffer while it runs (`gloo_stages_collectives`)."""

    def __init__(self, sharded: dict, variables: list) -> None:
        self._sharded = {id(v): (v, sharded[id(v)]) for v in variables
                         if id(v) in sharded}
        self._staging = gloo_stages_collectives()
        self._swapped: list = []
        self._gathered: dict = {}
        self._handles: list = []
        # Each module call running now: what another layer's call read of
        # a sharded variable (gathered whole for the rest of the call, as
        # kd's engine does: `FullyShardedVariables.gather_read`) and its
        # notes (`_pack`).
        self._calls: list = []
        self._reads = _NonOwnerReads(self)
        self._gathering = False  # (its own operations are not reads)
        self._whole_reads: dict = {}  # id(variable): its whole read now

    def __enter__(self) -> "GatheringLayers":
        if self._sharded:
            self._shards = {id(v._value): v for v, _ in
                            self._sharded.values()}
            hooks = torch.nn.modules.module
            self._handles = [
                hooks.register_module_forward_pre_hook(self._before),
                hooks.register_module_forward_hook(self._after)]
            self._reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handles:
            self._reads.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        while self._calls:  # a layer that raised: its hooks too
            self._end_call()
        while self._swapped:
            swapped, notes = self._swapped.pop()
            notes.__exit__(None, None, None)
            for variable, shard, _ in swapped:
                variable._value = shard
        self._gathered.clear()

    def read_whole(self, tensor: Any) -> Any:
        """`tensor`, or where it is a sharded variable's shard read by a
        module call that is not its layer's (a block computing with a
        sublayer's kernel), the variable gathered whole until that call
        ends."""
        variable = self._shards.get(id(tensor)) if (
            self._calls and not self._gathering) else None
        if variable is None:
            return tensor
        if variable._value is not tensor:  # (read already: `x.dtype`)
            return self._whole_reads.get(id(variable), tensor)
        sharding = self._sharded[id(variable)][1]
        staged = sharding.over_batch and self._staging
        shape = tuple(int(s) for s in variable.shape)
        self._gathering = True
        try:
            read = _Gathered.apply(tensor, shape, staged)
        finally:
            self._gathering = False
        variable._value = read
        self._whole_reads[id(variable)] = read
        if variable.trainable:
            self._gathered[id(read.untyped_storage())] = staged
        self._calls[-1][0].append((variable, tensor, read))
        return read

    def _end_call(self) -> None:
        reads, notes = self._calls.pop()
        notes.__exit__(None, None, None)
        for variable, shard, read in reads:
            variable._value = shard
            self._whole_reads.pop(id(variable), None)
            self._gathered.pop(id(read.untyped_storage()), None)

    def _own(self, layer: Any) -> list:
        own = list(layer.__dict__.get("_trainable_variables", ())) + list(
            layer.__dict__.get("_non_trainable_variables", ()))
        return [v for v in own if id(v) in self._sharded]

    def _before(self, layer: Any, args: Any) -> None:
        notes = torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                         self._unpack)
        notes.__enter__()
        self._calls.append(([], notes))
        own = self._own(layer)
        if not own:
            return
        self._gathering = True
        try:
            self._gather_own(own, isinstance(layer, convolutions()))
        finally:
            self._gathering = False

    def _gather_own(self, own: list, convolving: bool) -> None:
        swapped = []
        for variable in own:
            shard = variable._value
            sharding = self._sharded[id(variable)][1]
            shape = tuple(int(s) for s in variable.shape)
            staged = sharding.over_batch and self._staging
            if convolving or sharding.computed == shape:
                read = _Gathered.apply(shard, shape, staged)
                held = read
            else:
                read = _ReadOnShards.apply(shard, sharding.computed, shape,
                                           staged)
                held = read if sharding.over_batch else None
            variable._value = read
            if held is not None and variable.trainable:
                self._gathered[id(held.untyped_storage())] = staged
            swapped.append((variable, shard, held))
        notes = torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                         self._unpack)
        notes.__enter__()
        self._swapped.append((swapped, notes))

    def _after(self, layer: Any, args: Any, output: Any) -> None:
        if self._own(layer) and self._swapped:
            self._end_own_call()
        if self._calls:
            self._end_call()

    def _end_own_call(self) -> None:
        swapped, notes = self._swapped.pop()
        notes.__exit__(None, None, None)
        for variable, shard, held in swapped:
            variable._value = shard
            if held is not None:
                self._gathered.pop(id(held.untyped_storage()), None)

    def _pack(self, saved: torch.Tensor) -> Any:
        try:
            storage = saved.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass without
            return saved
        if id(storage) in self._gathered:
            return _Note(tuple(saved.size()), tuple(saved.stride()),
                         saved.storage_offset(), saved.dtype,
                         storage.nbytes(), self._gathered[id(storage)])
        return saved

    @staticmethod
    def _unpack(packed: Any) -> Any:
        if isinstance(packed, _Note):  # gathered again: new storage
            count = packed.nbytes // packed.dtype.itemsize
            whole = torch.empty(count, dtype=packed.dtype)
            _staging(whole, (count,), packed.staged)
            return whole.as_strided(packed.size, packed.stride,
                                    packed.offset)
        return packed


class _NonOwnerReads(torch.overrides.TorchFunctionMode):
    """While an estimated step runs: a sharded variable's shard given to an
    operation by a module call that is not its layer's is gathered whole
    first (`GatheringLayers.read_whole`)."""

    def __init__(self, layers: GatheringLayers) -> None:
        super().__init__()
        self._layers = layers

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = self._layers.read_whole
        args = tuple(read(a) if isinstance(a, torch.Tensor) else a
                     for a in args)
        return func(*args, **kwargs)


class _Note(NamedTuple):
    """A saved gathered value's geometry (`GatheringLayers._pack`)."""

    size: tuple
    stride: tuple
    offset: int
    dtype: Any
    nbytes: int
    staged: bool  # its gathering holds a collective's staging buffer
