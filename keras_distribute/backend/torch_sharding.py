"""Sharded variable layouts on the torch backend, through DTensor.

With a `layout_map` that shards variables, a torch strategy runs one model
replica over all the processes of the job, one process per logical device of
the mesh (tensor parallelism). A layer with a sharded variable holds all its
variables as `torch.distributed.tensor.DTensor`s on a torch `DeviceMesh` of
the same shape and axis names as the Keras one: sharded where the map says,
replicated otherwise. Inside such a layer DTensor's own collectives do the
work; its inputs enter as replicated DTensors and its outputs leave as whole
tensors (`full_tensor()`), so the rest of Keras — losses, metrics, callbacks —
only ever sees ordinary tensors. A gradient is brought back to its
variable's placement as it is accumulated; optimizer slots take their
variable's placement. Reading a sharded variable whole (`get_weights`,
`numpy()`) is a collective: every process must do it.

Data × model parallelism (a batch axis of size > 1 next to a sharded axis)
is not supported here yet: it raises, pointing to the JAX backend.
"""

import contextlib
import math
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication

import keras
from keras.distribution import TensorLayout

from keras_distribute import context
from keras_distribute.backend.torch import TorchEngine
from keras_distribute.layouts import check_keys_match
from keras_distribute.layouts import check_layout_fits
from keras_distribute.layouts import check_layout_map
from keras_distribute.reduce_op import ReduceOp
from keras_distribute.values import PerReplica


def check_mesh(layout_map: Any, world_size: int) -> None:
    """Raises unless the mesh fits a torch job of `world_size` processes."""
    mesh = layout_map.device_mesh
    size = math.prod(mesh.shape)
    if len(mesh.shape) > 1 and mesh.shape[0] != 1:
        raise NotImplementedError(
            "Sharded layouts on the torch backend run one model replica over "
            "every process (tensor parallelism): the mesh's first (batch) "
            f"axis must have size 1. Received: mesh shape "
            f"{tuple(mesh.shape)}, axes {list(mesh.axis_names)}. Use "
            f"DeviceMesh((1, {size}), ['batch', 'model'], ...), or the JAX "
            "backend for data x model parallelism.")
    if size != world_size:
        raise ValueError(
            f"On the torch backend each process is one device of the mesh, "
            f"so a mesh of shape {tuple(mesh.shape)} ({size} devices) needs "
            f"{size} processes. Received: {world_size} process(es). Launch "
            f"{size} processes (kd.launch(fn, num_processes={size}), "
            "torchrun), or build the mesh for the processes you have.")


class ShardedTorchEngine(TorchEngine):
    """One replica over every process, variables laid out by a LayoutMap."""

    collective_reads = True  # reading a sharded variable whole is collective

    def __init__(self, device: Any, layout_map: Any):
        super().__init__(device)
        check_layout_map(layout_map)
        check_mesh(layout_map, self.world_size)
        mesh = layout_map.device_mesh
        self.layout_map = layout_map
        self.device_mesh = mesh
        self.torch_mesh = init_device_mesh(
            device.type, tuple(mesh.shape),
            mesh_dim_names=tuple(mesh.axis_names))
        # One replica: every process sees every batch whole.
        self.num_replicas = 1
        self.local_replica_ids = (0,)
        self.num_input_pipelines, self.input_pipeline_id = 1, 0
        self.process_id, self.process_count = self.rank, self.world_size
        self._keys_checked = weakref.WeakSet()

    # ------------------------------------------------------------ variables
    def placements(self, layout: Optional[Any]) -> list:
        """The torch placement on each mesh dimension of a Keras layout."""
        axes = list(layout.axes) if layout is not None else []
        placements = []
        for name in self.device_mesh.axis_names:
            dims = [d for d, axis in enumerate(axes) if axis == name or (
                isinstance(axis, (tuple, list)) and name in axis)]
            placements.append(Shard(dims[0]) if dims else Replicate())
        return placements

    def shard_layer(self, layer: Any) -> None:
        """Makes the variables of `layer` DTensors when the map shards one.

        Called once a layer is built, before Keras tracks its variables as
        torch parameters.
        """
        own = [v for v in list(getattr(layer, "_trainable_variables", []))
               + list(getattr(layer, "_non_trainable_variables", []))
               if getattr(v, "_kd_engine", None) is self
               and v._value is not None and not isinstance(v._value, DTensor)]
        layouts = [self.layout_map[v.path] for v in own]
        if not any(layout is not None and any(a is not None for a in layout.axes)
                   for layout in layouts):
            return
        for variable, layout in zip(own, layouts):
            if layout is not None:
                check_layout_fits(layout, variable.path, variable.shape)
            else:
                layout = TensorLayout([None] * len(variable.shape),
                                      self.device_mesh)
            self._to_dtensor(variable, layout, self.placements(layout))
        object.__setattr__(layer, "_kd_sharded_engine", self)
        if "_torch_params" in layer.__dict__ or hasattr(layer, "_torch_params"):
            layer._track_variables()

    def shard_like(self, variable: Any, reference: Any) -> None:
        """Lays `variable` (an optimizer slot) out as `reference`."""
        value = getattr(reference, "_value", None)
        if isinstance(value, DTensor) and not isinstance(variable._value,
                                                         DTensor):
            self._to_dtensor(variable, getattr(reference, "_layout", None),
                             list(value.placements))

    def _to_dtensor(self, variable: Any, layout: Any, placements: list):
        local = variable._value.detach()
        value = distribute_tensor(local, self.torch_mesh, placements,
                                  src_data_rank=0)
        parameter = torch.nn.Parameter(value,
                                       requires_grad=variable.trainable)
        if variable.trainable:
            parameter.register_post_accumulate_grad_hook(_align_gradient)
        variable._value = parameter
        object.__setattr__(variable, "_layout", layout)

    def broadcast_new_variables(self) -> None:
        """Rank 0's values for new plain variables (DTensors came from it)."""
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
    def ddp(self, model: Any) -> Any:
        return model  # DTensor's collectives replace DDP's all-reduce

    def train_step(self, model: Any, data: Any) -> Any:
        from keras_distribute.backend import torch_training

        with implicit_replication():  # plain scalars next to DTensor slots
            return torch_training.train_step(self, model, data)

    @contextlib.contextmanager
    def global_metric_states(self, variables: Sequence[Any]):
        yield  # one replica: every process holds the same metric values

    def call_trainer(self, method: Callable, model: Any, args: tuple,
                     kwargs: dict) -> Any:
        if model.built and model not in self._keys_checked:
            check_keys_match(self.layout_map, model)
            self._keys_checked.add(model)
        return super().call_trainer(method, model, args, kwargs)

    def split_rows(self, batch: int, rank: Optional[int] = None):
        return 0, batch  # every process takes every batch whole

    def sharded_forward(self, forward: Callable, layer: Any, args: tuple,
                        kwargs: dict) -> Any:
        """Calls a sharded layer: replicated DTensors in, whole tensors out."""
        def enter(leaf):
            if isinstance(leaf, torch.Tensor) and not isinstance(
                    leaf, DTensor) and leaf.device.type != "meta":
                return DTensor.from_local(
                    leaf, self.torch_mesh,
                    [Replicate()] * self.torch_mesh.ndim, run_check=False)
            return leaf

        if not any(isinstance(leaf, torch.Tensor) and leaf.device.type !=
                   "meta" for leaf in keras.tree.flatten((args, kwargs))):
            return forward(layer, *args, **kwargs)  # symbolic call
        args, kwargs = keras.tree.map_structure(enter, (args, kwargs))
        with implicit_replication():
            outputs = forward(layer, *args, **kwargs)
        return keras.tree.map_structure(whole, outputs)

    # ------------------------------------------------------ one replica
    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.broadcast_new_variables()
        local = lambda v: v.values[0] if isinstance(v, PerReplica) else v  # noqa: E731
        ctx = context.ReplicaContext(strategy, 0, _OneReplica())
        with context._enter(strategy, ctx):
            result = fn(*keras.tree.map_structure(local, args),
                        **keras.tree.map_structure(local, kwargs))
        return keras.tree.map_structure(
            lambda out: out if out is None else PerReplica([out]), result)

    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        from keras_distribute.backend.torch import _check_axis
        from keras_distribute.backend.torch import _to_tensor

        (value,) = values
        tensor = whole(_to_tensor(value))
        if axis is None:
            return tensor
        _check_axis(axis, tensor.dim())
        return tensor.sum(dim=axis) if op is ReduceOp.SUM else (
            tensor.float().mean(dim=axis))

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        from keras_distribute.backend.torch import _to_tensor

        return whole(_to_tensor(values[0]))


class _OneReplica:
    """The collectives of a single replica: nothing to combine."""

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        return keras.tree.map_structure(whole, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        return keras.tree.map_structure(whole, value)


def whole(value: Any) -> Any:
    """A DTensor as the whole tensor (a collective); anything else as is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _align_gradient(parameter: Any) -> None:
    """Brings an accumulated gradient to its parameter's placement (e.g. a
    partial sum of a replicated weight is all-reduced)."""
    grad = parameter.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(
            parameter.placements):
        parameter.grad = grad.redistribute(parameter.device_mesh,
                                           parameter.placements)


def local_region(value: Any) -> tuple:
    """`((start, stop), ...)` of the global tensor this process holds."""
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape))


def owns_unique_piece(value: Any) -> bool:
    """Whether this process writes its piece (first along replicated dims)."""
    coordinate = value.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coordinate, value.placements)
               if not isinstance(p, Shard))


def assign_whole(variable: Any, array: Any) -> None:
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
        local.copy_(torch.as_tensor(np.asarray(piece)) if not isinstance(
            piece, torch.Tensor) else piece.to(local.dtype))
