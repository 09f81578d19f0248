"""Sharded variable layouts on the torch backend, through DTensor.

With a `layout_map` that shards variables, a torch strategy lays its mesh
over the processes of the job, one process per device. The first mesh axis
is the batch axis: each position on it is one replica, data parallel with
the others (gradients averaged over it, as DDP would). The processes along
the other (model) axes hold one replica between them (tensor parallelism):
a layer with a sharded variable holds all its variables as
`torch.distributed.tensor.DTensor`s on that model sub-mesh — sharded where
the map says, replicated otherwise. Inside such a layer DTensor's own
collectives do the work; its inputs enter as replicated DTensors and its
outputs leave as whole tensors (`full_tensor()`), so the rest of Keras —
losses, metrics, callbacks — only ever sees ordinary tensors. A gradient is
brought back to its variable's placement as it is accumulated; optimizer
slots take their variable's placement. Reading a sharded variable whole
(`get_weights`, `numpy()`) is a collective: every process must do it.

A variable whose layout also shards it over the batch axis (FSDP / ZeRO-3
style) is a DTensor on the whole mesh, 1/N per process, gathered while its
layer runs: `fully_sharded.py`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np
import torch
import torch.distributed as dist
from keras.distribution import DeviceMesh
from keras.distribution import TensorLayout
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor

from keras_distribute.backend import interface
from keras_distribute.backend.torch import peers as torch_peers
from keras_distribute.backend.torch.ddp_training import raised_in_ddp
from keras_distribute.backend.torch.engine import TorchEngine
from keras_distribute.backend.torch.fully_sharded import FullyShardedVariables
from keras_distribute.backend.torch.layer_calls import call_sharded
from keras_distribute.backend.torch.mesh import check_mesh
from keras_distribute.backend.torch.mesh import mesh_ranks
from keras_distribute.backend.torch.mesh import seed_alike_in_each_replica
from keras_distribute.backend.torch.variables import replicating_plain_tensors
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.layouts import axis_names
from keras_distribute.common.layouts import check_layout_fits
from keras_distribute.common.layouts import check_layout_map
from keras_distribute.common.layouts import layout_axes
from keras_distribute.common.layouts import variable_layout
from keras_distribute.common.layouts import warn_unmatched_keys

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap
    from keras.layers import Layer


class ShardedTorchEngine(FullyShardedVariables, TorchEngine):
    """Variables laid out by a LayoutMap over a (batch, model...) mesh.

    The first mesh axis is the batch axis: each of its positions is one
    replica (an input pipeline), data parallel with the others; the
    processes along the other (model) axes hold one replica between them,
    its sharded variables as DTensors on that model sub-mesh. A 1-D mesh is
    all model axis: one replica over every process.
    """

    # Layers' forward passes run on their sharded values.
    contract: Tuple[type, ...] = (interface.ShardedForwardEngine,)

    collective_reads = True  # reading a sharded variable whole is collective
    # A built layer's variables are broadcast before they are cut
    # (`shard_layer`).
    broadcasts_when_built = False

    def __init__(self, device: Any, layout_map: LayoutMap, *,
                 services: KerasServices):
        super().__init__(device, services=services)
        check_layout_map(layout_map)
        check_mesh(layout_map, self.world_size)
        services.install_torch_sharding()
        mesh = layout_map.device_mesh
        self.layout_map = layout_map
        self.device_mesh = mesh
        # DTensors inside the sharded layers only (module docstring), not
        # Keras 3.16's ModelParallel, whose dispatch mode makes every tensor
        # of the step a DTensor (docs/keras_versions.md).
        self.distribution = None
        self.keras_mesh = mesh
        if len(mesh.shape) == 1 and mesh.axis_names[0] in getattr(
                layout_map, "shards_over", ()):
            # kd.layouts.fully_sharded over a 1-D mesh: all batch axis (as
            # on JAX), with a model axis of size 1 after it.
            self.keras_mesh = DeviceMesh(
                (mesh.shape[0], 1), list(mesh.axis_names) + ["kd_model"],
                devices=np.reshape(mesh.devices, (mesh.shape[0], 1)))
        elif len(mesh.shape) == 1:  # all model: a batch axis of size 1 first
            self.keras_mesh = DeviceMesh(
                (1, mesh.shape[0]), ["kd_replica"] + list(mesh.axis_names),
                devices=np.reshape(mesh.devices, (1, mesh.shape[0])))
        shape = tuple(self.keras_mesh.shape)
        names = list(self.keras_mesh.axis_names)
        self.model_axes = names[1:]
        self.batch_axis = names[0]
        ranks = mesh_ranks(self.keras_mesh, device, self.world_size)
        # Keras 3.16 makes the torch mesh of a keras.distribution mesh, and
        # the placements of its layouts, itself: the engine uses Keras' own
        # (`placements`). Keras 3.15's torch backend has no distribution.
        self.torch_mesh = services.keras_torch_mesh(self.keras_mesh)
        self.keras_layouts = self.torch_mesh is not None
        if self.torch_mesh is None:
            self.torch_mesh = TorchDeviceMesh(device.type, ranks,
                                              mesh_dim_names=tuple(names))
        self.model_mesh = self.torch_mesh[tuple(self.model_axes)] if len(
            self.model_axes) > 1 else self.torch_mesh[self.model_axes[0]]
        replica = self.torch_mesh.get_coordinate()[0]
        # One replica per position on the batch axis (data parallel).
        self.num_replicas = shape[0]
        self.local_replica_ids = (replica,)
        self.num_input_pipelines, self.input_pipeline_id = shape[0], replica
        self.replica_group = self.torch_mesh[names[0]].get_group()
        self._keys_checked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        if math.prod(shape[1:]) > 1:
            seed_alike_in_each_replica(replica)

    # ------------------------------------------------------------ variables
    def placements(self, layout: Optional[Any]) -> list:
        """The torch placement on each model-mesh dimension of a layout."""
        axes = list(layout.axes) if layout is not None else []
        if self.keras_layouts:
            # Keras' placements over the whole mesh; the first (batch) axis
            # is always replicated here (`check_mesh`).
            whole = TensorLayout(axes, self.keras_mesh).backend_layout
            return list(whole.placements)[1:]
        placements = []
        for name in self.model_axes:
            dims = [d for d, axis in enumerate(axes)
                    if name in axis_names(axis)]
            placements.append(Shard(dims[0]) if dims else Replicate())
        return placements

    def shard_layer(self, layer: Layer) -> None:
        """Makes the variables of `layer` DTensors when the map shards one.

        Called once a layer is built, before Keras tracks its variables as
        torch parameters.
        """
        mine = [v for v in list(getattr(layer, "_trainable_variables", []))
                + list(getattr(layer, "_non_trainable_variables", []))
                if getattr(v, "_kd_engine", None) is self
                and v._value is not None]
        # (born sharded: made as their shards already, `born_sharded_value`)
        born = [v for v in mine if isinstance(v._value, DTensor)]
        own = [v for v in mine if not isinstance(v._value, DTensor)]
        layouts = [variable_layout(self.layout_map, v.path, v.shape)
                   for v in own]
        if not born and not any(layout is not None and layout_axes(layout)
                                for layout in layouts):
            return
        # Values equal everywhere before they are cut (the sub-meshes of
        # other replicas distribute their own first process's values).
        self.broadcast_new_variables(only=own)
        for variable, layout in zip(own, layouts):
            if layout is not None:
                check_layout_fits(layout, variable.path, variable.shape)
            else:
                layout = TensorLayout([None] * len(variable.shape),
                                      self.device_mesh)
            if self.is_fully_sharded(layout):
                self._to_dtensor(variable, layout,
                                 self.whole_mesh_placements(layout),
                                 self.torch_mesh)
            else:
                self._to_dtensor(variable, layout, self.placements(layout))
        object.__setattr__(layer, "_kd_sharded_engine", self)
        # (what its own call computes with as DTensors; another layer's
        # call reads them whole: `gather_read`)
        object.__setattr__(layer, "_kd_sharded_variables",
                           frozenset(id(v) for v in mine))
        # The variables its forward gathers, found once here rather than
        # at every call (`gathered_variables`).
        object.__setattr__(layer, "_kd_fully_sharded", [
            v for v in mine if self._on_whole_mesh(v._value)])
        if hasattr(layer, "_torch_params"):  # tracked already: track again
            layer._track_variables()

    def born_sharded_value(self, variable: Any, initializer: Any,
                           random_module: Any) -> Optional[Any]:
        """The value of a new `variable` the map shards, made as this
        process's shard only (`born_sharded.local_shard`), or None: Keras
        makes it whole and `shard_layer` cuts it. `random_module` is
        Keras' torch random module (`draw_region`)."""
        from keras_distribute.backend.torch import born_sharded

        shape = tuple(int(d) for d in variable.shape)
        layout = variable_layout(self.layout_map, variable.path, shape)
        if layout is None or not layout_axes(layout):
            return None
        check_layout_fits(layout, variable.path, shape)
        if self.is_fully_sharded(layout):
            placements = self.whole_mesh_placements(layout)
            mesh = self.torch_mesh
        else:
            placements, mesh = self.placements(layout), self.model_mesh
        local = born_sharded.local_shard(variable, initializer, shape,
                                         placements, mesh, random_module)
        if local is None:
            return None
        value = DTensor.from_local(local, mesh, placements, run_check=False,
                                   shape=torch.Size(shape),
                                   stride=_contiguous_strides(shape))
        return self._parameter(variable, value, layout)

    def shard_like(self, variable: Any, reference: Any) -> None:
        """Lays `variable` (an optimizer slot) out as `reference`."""
        value = getattr(reference, "_value", None)
        if isinstance(value, DTensor) and not isinstance(variable._value,
                                                         DTensor):
            self._to_dtensor(variable, getattr(reference, "_layout", None),
                             list(value.placements), value.device_mesh)

    def _to_dtensor(self, variable: Any, layout: Any, placements: list,
                    mesh: Optional[Any] = None):
        local = variable._value.detach()
        # Every process takes its part of the value of the mesh's first
        # process (the same in every process: the values were broadcast
        # from rank 0 first, or are optimizer zeros).
        value = distribute_tensor(local, mesh or self.model_mesh, placements,
                                  src_data_rank=0)
        variable._value = self._parameter(variable, value, layout)

    @staticmethod
    def _parameter(variable: Any, value: Any, layout: Any) -> Any:
        """`variable`'s DTensor `value` as its torch parameter (its
        gradient brought to its placement); `layout` recorded."""
        parameter = torch.nn.Parameter(value,
                                       requires_grad=variable.trainable)
        if variable.trainable:
            parameter.register_post_accumulate_grad_hook(_align_gradient)
        object.__setattr__(variable, "_layout", layout)
        return parameter

    @torch_peers.collective
    def broadcast_new_variables(self, only: Optional[list] = None) -> None:
        """Rank 0's values for new plain variables (DTensors were cut from
        them), or for the variables `only` (before they are cut)."""
        if only is not None:
            with torch.no_grad():
                for variable in only:
                    dist.broadcast(variable._value.data, src=0)
            done = {id(v) for v in only}
            self._created = [ref for ref in self._created
                             if id(ref()) not in done]
            return
        self._created = [ref for ref in self._created if not isinstance(
            getattr(ref(), "_value", None), DTensor)]
        super().broadcast_new_variables()

    def variable_layout(self, variable: Any) -> tuple:
        value = variable._value
        itemsize = np.dtype(variable.dtype).itemsize if (
            variable.dtype != "bfloat16") else 2
        if isinstance(value, DTensor):
            axes = tuple(getattr(variable, "_layout").axes)
            return axes, value.to_local().numel() * itemsize
        return (None,) * len(variable.shape), int(
            np.prod(variable.shape)) * itemsize

    # ------------------------------------------------------------ training
    uses_keras_ddp = False  # DTensor's collectives replace DDP's

    def ddp(self, model: Model) -> Any:
        return model  # DTensor's collectives replace DDP's all-reduce

    @torch_peers.collective
    def sync_gradients(self, variables: Sequence[Any]) -> None:
        """Averages every gradient over the replicas (the batch axis): one
        flat all-reduce of this process's parts, as DDP would."""
        if self.num_replicas == 1:
            return
        grads = [v.value.grad for v in variables if v.value.grad is not None]
        self._average_reduce_scattered(grads)
        local = [g.to_local() if isinstance(g, DTensor) else g
                 for g in grads if not self._on_whole_mesh(g)]
        if not local:
            return
        flat = torch.cat([t.reshape(-1) for t in local])
        flat = self.compress_gradients(flat / self.num_replicas)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.replica_group)
        offset = 0
        with torch.no_grad():
            for tensor in local:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(
                    tensor))
                offset += tensor.numel()

    def sum_gradients(self, grads: Sequence[Any], scale: float) -> list:
        """The replicas' gradients summed, each times its `scale`: a fully
        sharded variable's gradient is that sum already (DTensor
        reduce-scattered it, weighted in `_weigh_replica_gradient`); the
        others are all-reduced as on any torch engine."""
        grads = list(grads)
        super().sum_gradients(
            [g for g in grads if not self._on_whole_mesh(g)], scale)
        return grads

    def average_gradients(self, grads: Sequence[Any]) -> list:
        """The replicas' gradients averaged: a fully sharded variable's
        gradient, DTensor's sum over the replicas, divided in place; the
        others all-reduced (see `DdpTraining.average_gradients`)."""
        self._average_reduce_scattered(grads)
        return self.sum_gradients(grads, 1.0 / self.num_replicas)

    def _average_reduce_scattered(self, grads: Sequence[Any]) -> None:
        """A fully sharded variable's gradient was reduce-scattered over
        the replicas in the backward pass (a sum): averaged in place."""
        with torch.no_grad():
            for grad in grads:
                if self._on_whole_mesh(grad):
                    grad.to_local().div_(self.num_replicas)

    def train_step(self, model: Model, data: Any) -> Any:
        with replicating_plain_tensors():  # plain tensors beside DTensors
            return super().train_step(model, data)

    @contextlib.contextmanager
    def global_metric_states(self, variables: Sequence[Any]):
        """Metric values summed over the replicas (the processes of one
        replica hold the same values)."""
        if self.num_replicas == 1:
            yield
            return
        with super().global_metric_states(variables):
            yield

    def call_trainer(self, method: Callable, model: Model, args: tuple,
                     kwargs: dict) -> Any:
        if model.built and model not in self._keys_checked:
            warn_unmatched_keys(self.layout_map, model)
            self._keys_checked.add(model)
        try:
            return super().call_trainer(method, model, args, kwargs)
        except RuntimeError as error:
            if not raised_in_ddp(error) or not any(
                    isinstance(getattr(v, "_value", None), DTensor)
                    for v in model.variables):
                raise
            first_line = str(error).strip().split("\n")[0]
            raise RuntimeError(
                "torch's DistributedDataParallel cannot wrap a model whose "
                "variables kd shards (the layout map's DTensors). Received: "
                "a DistributedDataParallel made around this model, which "
                f"failed with \"{first_line}\". Under a sharded layout kd "
                "combines the replicas' gradients itself, in Keras' step "
                "and in your own `train_step` alike. Fix: forward through "
                "the model itself (`self(x)`), not a DDP of it; or train "
                "without a `layout_map` to use DDP.") from error

    def sharded_forward(self, forward: Callable, layer: Layer, args: tuple,
                        kwargs: dict) -> Any:
        """Calls a sharded layer: replicated DTensors in, whole tensors out
        (`layer_calls.call_sharded`)."""
        return call_sharded(forward, layer, args, kwargs, self.model_mesh,
                            self.gathered_variables)


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _align_gradient(parameter: Any) -> None:
    """Brings an accumulated gradient to its parameter's placement (e.g. a
    partial sum of a replicated weight is all-reduced)."""
    grad = parameter.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(
            parameter.placements):
        parameter.grad = grad.redistribute(parameter.device_mesh,
                                           parameter.placements)
