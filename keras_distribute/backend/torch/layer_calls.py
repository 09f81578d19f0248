"""A sharded layer's call on torch: replicated DTensors in, whole tensors out.

A layer holding a variable the map shards over a model axis computes on
DTensors: its tensor inputs enter as replicated DTensors on the model
sub-mesh, its variables sharded over the batch axis are gathered while it
computes (`FullyShardedVariables.gathered_variables`), a Keras convolution
computes on its kernel gathered whole (`_replicated_while_convolving`), and
its outputs leave as whole tensors, so the rest of Keras only ever sees
ordinary tensors.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable

import keras
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

from keras_distribute.backend.torch.trees import flat_leaves
from keras_distribute.backend.torch.variables import replicating_plain_tensors
from keras_distribute.backend.torch.variables import whole_value

if TYPE_CHECKING:
    from keras.layers import Layer
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh


class LayerCall:
    """One layer's call running now on this thread: the engine that
    gathered variables for it (None for a layer that holds no sharded
    variable and read none yet), `(variable, shards, value read)` to put
    back when it ends, the storages of the gathered values
    (`FullyShardedVariables.gathered_variables`, `gather_read`), and
    whether it is Keras saving the layer (each read whole, kept by none).
    """

    __slots__ = ("layer", "engine", "swapped", "keys", "whole")

    def __init__(self, layer: Any, engine: Any = None,
                 whole: bool = False) -> None:
        self.layer = layer
        self.engine = engine
        self.swapped: list = []
        self.keys: list = []
        self.whole = whole  # every sharded variable read whole


# The layer calls running now on each thread, innermost last: a fully
# sharded variable read by a call that is not its layer's is gathered for
# the innermost one.
_running = threading.local()


def running_calls() -> list:
    """The `LayerCall`s running now on this thread, innermost last."""
    calls = getattr(_running, "calls", None)
    if calls is None:
        calls = _running.calls = []
    return calls


def call_plain(forward: Callable, layer: Layer, args: tuple,
               kwargs: dict) -> Any:
    """Calls a layer that holds no sharded variable. Where its call reads a
    fully sharded variable itself (`FullyShardedVariables.gather_read`),
    the engine puts the variable back when the call ends."""
    calls = running_calls()
    call = LayerCall(layer)
    calls.append(call)
    try:
        return forward(layer, *args, **kwargs)
    finally:
        calls.pop()
        if call.engine is not None:
            call.engine.end_call(call)


@contextlib.contextmanager
def reading_whole(layer: Any):
    """While Keras saves `layer`'s variables: each read of a sharded
    variable gives its whole value, as a plain tensor (a collective), for
    that read — LoRA's kernel merged with its adapters, which the map may
    lay out on another mesh (`FullyShardedVariables.gather_read`)."""
    calls = running_calls()
    calls.append(LayerCall(layer, whole=True))
    try:
        yield
    finally:
        calls.pop()


def call_sharded(forward: Callable, layer: Layer, args: tuple, kwargs: dict,
                 model_mesh: TorchDeviceMesh,
                 gathered_variables: Callable) -> Any:
    """Calls `forward(layer, *args, **kwargs)` on DTensors over
    `model_mesh` (a symbolic call, on no real tensor, as it is), inside
    `gathered_variables(layer)`; returns its outputs whole."""
    def enter(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and not isinstance(
                leaf, DTensor) and leaf.device.type != "meta":
            return DTensor.from_local(
                leaf, model_mesh, [Replicate()] * model_mesh.ndim,
                run_check=False)
        return leaf

    if not any(isinstance(leaf, torch.Tensor) and leaf.device.type !=
               "meta" for leaf in flat_leaves((args, kwargs))):
        return forward(layer, *args, **kwargs)  # symbolic call
    args, kwargs = keras.tree.map_structure(enter, (args, kwargs))
    with replicating_plain_tensors(), gathered_variables(
            layer), _replicated_while_convolving(layer):
        outputs = forward(layer, *args, **kwargs)
    return keras.tree.map_structure(_whole_output, outputs)


def _whole_output(value: Any) -> Any:
    """A sharded layer's output as a whole tensor the caller may modify in
    place (keras-hub's MoE block multiplies its shared expert's output
    with `*=`): a DTensor's whole tensor is a view autograd forbids that
    of, so in a step that records gradients it is copied."""
    whole = whole_value(value)
    if whole is not value and whole.requires_grad:
        whole = whole.clone()
    return whole


@contextlib.contextmanager
def _replicated_while_convolving(layer: Layer):
    """While a Keras convolution runs, its trainable variables sharded over
    a model axis read replicated (gathered by DTensor; their gradients go
    back to the shards): DTensor's convolution does not compute on a
    kernel cut by channels (torch 2.13: its local shapes disagree), so
    such a layer keeps only its memory sharded, at rest, and computes
    whole."""
    if not isinstance(layer, convolutions()):
        yield
        return
    swapped = []
    try:
        for variable in layer.__dict__.get("_trainable_variables", ()):
            value = variable._value
            if isinstance(value, DTensor) and any(
                    isinstance(p, Shard) for p in value.placements):
                swapped.append((variable, value))
                variable._value = value.redistribute(
                    value.device_mesh,
                    [Replicate()] * value.device_mesh.ndim)
        yield
    finally:
        for variable, value in reversed(swapped):
            variable._value = value


@functools.lru_cache(maxsize=None)
def convolutions() -> tuple:
    """Keras' convolution layers (their subclasses are convolutions too),
    which kd's engine runs on their kernels gathered whole
    (`_replicated_while_convolving`)."""
    layers = keras.layers
    return tuple(getattr(layers, name) for name in (
        "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
        "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D",
        "SeparableConv1D", "SeparableConv2D") if hasattr(layers, name))
