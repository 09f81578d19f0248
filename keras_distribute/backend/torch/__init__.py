"""The PyTorch backend module (see `interface.BackendModule`).

What the neutral layer calls on torch, gathered from the modules that
implement it: the engine of one process per device (`engine`) and
that device (`devices`), its
sharded variant over a device mesh (`sharding`), `run`'s training
helpers (`training`) and the checkpoint's view of a variable, plain
tensor or DTensor (`variables`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from keras_distribute.backend import interface
from keras_distribute.backend.torch.devices import default_devices
from keras_distribute.backend.torch.devices import device_name  # noqa: F401
from keras_distribute.backend.torch.devices import host_rng_state  # noqa: F401
from keras_distribute.backend.torch.devices import resolve_device  # noqa: F401
from keras_distribute.backend.torch.devices import set_host_rng_state  # noqa: F401
from keras_distribute.backend.torch.engine import TorchEngine
from keras_distribute.backend.torch.engine import born_sharded_value  # noqa: F401
from keras_distribute.backend.torch.engine import on_layer_built  # noqa: F401
from keras_distribute.backend.torch.engine import on_variable_created  # noqa: F401
from keras_distribute.backend.torch.groups import ensure_process_group
from keras_distribute.backend.torch.groups import join_process_group
from keras_distribute.backend.torch.memory import step_memory  # noqa: F401
from keras_distribute.backend.torch.sharding import ShardedTorchEngine
from keras_distribute.backend.torch.training import value_and_gradients  # noqa: F401
from keras_distribute.backend.torch.variables import checkpoint_assign  # noqa: F401
from keras_distribute.backend.torch.variables import checkpoint_pieces  # noqa: F401
from keras_distribute.backend.torch.variables import checkpoint_snapshot  # noqa: F401
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.layouts import sharded_axes

if TYPE_CHECKING:
    from keras import Variable
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer

    from keras_distribute.backend.interface import ReplicaEngine
    from keras_distribute.cluster_resolver.base import ClusterResolver

name = "torch"


def build_without_values(build: Callable[[], Any]) -> Any:
    """Builds under torch's `FakeTensorMode`: every tensor the build makes,
    each variable's value (the model's and an optimizer's: `compile()` may
    be part of the build), has a shape and a dtype but no memory, so a
    model of any size builds in seconds. A value read as a number (a
    random initializer's seed) reads as 1. The model returned holds fake
    tensors: read its variables' shapes, dtypes and paths only."""
    from keras_distribute.backend.torch.memory import without_values

    with without_values():
        return build()


def apply_gradients(engine: ReplicaEngine, optimizer: Optimizer,
                    grads: Sequence[Any],
                    variables: Sequence[Any]) -> None:
    """Sums the processes' gradients, then applies them (in `engine`'s
    compression dtype, counted, when it is a torch engine)."""
    from keras_distribute.common import context

    # The default strategy's in-place engine has no compression (and no
    # other process): its all-reduce is the identity.
    compress = (engine.compress_gradients if isinstance(engine, TorchEngine)
                else lambda g: g)
    dtypes = [g.dtype for g in grads]
    grads = context.replica_context_of("apply_gradients").all_reduce(
        "sum", [compress(g) for g in grads])
    grads = [g.to(dtype) for g, dtype in zip(grads, dtypes)]
    with torch.no_grad():
        optimizer.apply(grads, variables)


def make_engine(devices: Sequence[Any], layout_map: LayoutMap | None = None, *,
                services: KerasServices) -> "TorchEngine":
    """Builds the engine of a strategy over this process's device.

    A `layout_map` that shards variables gives a `ShardedTorchEngine`: one
    replica over every process, variables as DTensors (`sharding`).
    """
    if len(devices) != 1:
        raise ValueError(
            "On the torch backend each process drives exactly one device. "
            f"Received {len(devices)} devices. Run one process per device.")
    if layout_map is not None and sharded_axes(layout_map):
        ensure_process_group()
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        mesh_size = int(np.prod(layout_map.device_mesh.shape))
        if not (world_size == 1 and mesh_size == 1):
            return ShardedTorchEngine(devices[0], layout_map,
                                      services=services)
    return TorchEngine(devices[0], services=services)


def mesh_devices(layout_map: LayoutMap) -> list:
    """The devices of a strategy built on `layout_map`: this process's own
    (each process is one device of the mesh; `make_engine` checks the
    process count against the mesh)."""
    return default_devices()


def make_multi_worker_engine(resolver: ClusterResolver,
                             timeout_s: Optional[float],
                             layout_map: LayoutMap | None = None, *,
                             services: KerasServices) -> TorchEngine:
    """Joins (or checks) the group `resolver` describes; one replica each."""
    join_process_group(resolver, timeout_s)
    return make_engine(default_devices(), layout_map, services=services)


def checkpoint_value(variable: Variable) -> Any:
    """A replicated variable's value on the host."""
    return interface.host_value(variable)


def refuse_unsupported_layouts(layout_map: LayoutMap) -> None:
    """torch shards what `ShardedTorchEngine` supports and says so when it
    is made: nothing is refused this early."""


def refuse_tpu_strategy() -> None:
    """Raises `NotImplementedError`: TPUs are not available on torch."""
    raise NotImplementedError(
        f"TPUs are not available on the '{name}' Keras backend. Use the JAX "
        "backend (or TensorFlow on a TPU VM).")


def make_tpu_engine(tpu_cluster_resolver: Any, assignment: Any,
                    layout_map: LayoutMap | None = None, *,
                    services: KerasServices) -> Any:
    """Raises `NotImplementedError` (see `refuse_tpu_strategy`)."""
    refuse_tpu_strategy()
