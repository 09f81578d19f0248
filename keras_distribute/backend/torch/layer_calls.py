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
    return keras.tree.map_structure(whole_value, outputs)


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
