"""The PyTorch engine (the backend module is `backend/torch/__init__.py`):
one replica per process, `torch.distributed` underneath.

In a launched group (`kd.launch`, `python -m keras_distribute.launch`,
`torchrun`) every process is one replica: gloo on CPU, nccl on GPU (device =
`LOCAL_RANK`). `fit` forwards through a `DistributedDataParallel` held inside
the train step (bucketed all-reduce overlapped with backward); metric states
are all-reduced before they are read; each process trains on its slice of
every global batch. In a plain single process there is one replica.

`TorchEngine` holds the engine's state, its variables and the input side;
its DDP training is `ddp_training.DdpTraining` and its `run` and
collectives `process_collectives.ProcessCollectives` (its bases).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import keras
import numpy as np
import torch
import torch.distributed as dist
from keras.distribution import DeviceMesh

from keras_distribute.backend import interface
from keras_distribute.backend import trainer_call
from keras_distribute.backend.torch import peers as torch_peers
from keras_distribute.backend.torch import training as torch_training
from keras_distribute.backend.torch import user_steps
from keras_distribute.backend.torch.ddp_training import DdpTraining
from keras_distribute.backend.torch.groups import ensure_process_group
from keras_distribute.backend.torch.process_collectives import (
    ProcessCollectives,
)
from keras_distribute.backend.torch.process_collectives import to_tensor
from keras_distribute.backend.torch.variables import host_view
from keras_distribute.backend.torch.variables import local_region
from keras_distribute.common import context
from keras_distribute.common.batches import balanced_bounds
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.values import PerReplica

if TYPE_CHECKING:
    from keras import Model
    from keras.layers import Layer


class TorchEngine(DdpTraining, ProcessCollectives,
                  trainer_call.TrainerCallState):
    """The per-strategy torch engine (see `interface.ReplicaEngine`)."""

    # One process per replica, Keras' torch trainer stepping through it.
    contract: Tuple[type, ...] = (interface.TorchDdpEngine,)

    def __init__(self, device: Any, *, services: KerasServices):
        self.keras_services = services
        self.in_group = ensure_process_group()
        self.world_size = dist.get_world_size() if self.in_group else 1
        self.rank = dist.get_rank() if self.in_group else 0
        self.device = device
        self.devices = (device,)
        self.num_replicas = self.world_size
        self.local_replica_ids = (self.rank,)
        self.num_input_pipelines = self.world_size
        self.input_pipeline_id = self.rank
        self.process_count, self.process_id = self.world_size, self.rank
        # The processes a replica-level collective spans (None: all). One
        # replica per process here; a sharding engine narrows it.
        self.replica_group = None
        # Keras 3.16 distributes torch: its `DataParallel` over its device
        # list, current in the scope, makes the one DDP on the mesh's group
        # (the default group: a 1-D mesh over the job). Keras 3.15 has no
        # torch distribution: the engine wraps DDP itself.
        self.distribution = services.keras_torch_data_parallel(
            self.world_size) if self.in_group else None
        self.device_mesh = self.distribution.device_mesh if (
            self.distribution is not None) else DeviceMesh(
                shape=(self.world_size,), axis_names=["batch"],
                devices=[f"{device.type}:{r}"
                         for r in range(self.world_size)])
        # The variables created in scope, not yet broadcast.
        self._created: List[Any] = []
        self._trainer_calls = 0  # `fit` & co. running (call_trainer)
        # Variables aggregated by "sum" / "mean" (metric states, moving
        # statistics): combined over processes after each `run`.
        self._aggregated: List[Any] = []
        self._ddp: "weakref.WeakKeyDictionary[Any, Any]" = (
            weakref.WeakKeyDictionary())
        # `CommunicationOptions(compression=...)`: the dtype gradients are
        # all-reduced in (None: their own), and the bytes handed to those
        # all-reduces so far (what goes on the wire, per process).
        self.gradient_compression = None
        self.gradient_bytes_reduced = 0
        # even_batches, sync_metrics_each_step and step_inputs (`bare_inputs`:
        # its batches are `x` alone, handed to a user's step as Keras hands
        # them, not as `(x,)`): trainer_call.TrainerCallState.
        # Keras' train step through the held DDP, and its metric reads.
        self.train_steps = torch_training.TrainSteps(self)

    # ------------------------------------------------------------ variables
    def scope(self):
        return _EngineScope(self)

    def record_variable(self, variable: Any) -> None:
        if self.in_group:
            self._created.append(weakref.ref(variable))
            if getattr(variable, "aggregation", "none") in ("sum", "mean"):
                self._aggregated.append(weakref.ref(variable))

    # A layer built in the user's own `strategy.scope()` takes process 0's
    # values as soon as it is built, so that a read inside the scope
    # already agrees (in tf.distribute a mirrored variable holds one value
    # from the moment it exists). Through `broadcast_new_variables`, which
    # first agrees on the variables every process made: processes that
    # built other layers, or one that made a variable alone, are never
    # handed a mismatched collective. Layers built during `fit` & co. or
    # in `run` wait for the step's own broadcast.
    broadcasts_when_built = True

    def born_sharded_value(self, variable: Any, initializer: Any,
                           random_module: Any) -> Any:
        """A new variable's value made as this process's shard, or None
        (Keras makes it whole): nothing is sharded here; the sharding
        engine makes large sharded variables so (`ShardedTorchEngine`)."""
        return None

    def layer_built(self, layer: Layer) -> None:
        """Called when a layer made in this engine's scope is built."""
        if (self.in_group and self.broadcasts_when_built
                and not self._trainer_calls
                and context.get_replica_context() is None):
            self.broadcast_new_variables()

    @torch_peers.collective
    def broadcast_new_variables(self) -> None:
        """Makes every variable created so far equal to rank 0's."""
        pending, self._created = self._created, []
        alive = [v for v in (ref() for ref in pending)
                 if v is not None and v._value is not None]
        with torch.no_grad():
            # Only those every process made (chief-only work may make more).
            for variable in self._agreed(alive, group=None):
                dist.broadcast(variable.value.data, src=0)

    def variable_layout(self, variable: Any) -> tuple:
        size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
        return (None,) * len(variable.shape), size

    def owns_variable(self, variable: Any) -> bool:
        return getattr(variable, "_kd_engine", None) is self

    def replica_copies(self, variable: Any,
                       one_per_region: bool = False) -> list:
        """This process's copy: a plain variable whole, a sharded one's
        local piece with its region (processes holding the same piece, e.g.
        the replicas of a model-axis shard, are compared)."""
        from torch.distributed.tensor import DTensor

        value = variable.value if isinstance(variable, keras.Variable) else (
            variable)
        if isinstance(value, DTensor):
            return [(local_region(value), host_view(value.to_local()))]
        return [(interface.whole_region(tuple(value.shape)),
                 host_view(value))]

    def adopt_variables(self, variables: Sequence[Any]) -> None:
        for variable in variables:
            if not self.owns_variable(variable):
                object.__setattr__(variable, "_kd_engine", self)
                self.record_variable(variable)

    def variable_local_results(self, variable: Any) -> Optional[tuple]:
        if (isinstance(variable, keras.Variable)
                and self.owns_variable(variable)):
            return (variable.value,)
        return None

    @torch_peers.collective
    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is true in any process (a collective)."""
        if not self.in_group:
            return bool(flag)
        tensor = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return bool(tensor.item() > 0)

    @torch_peers.collective
    def barrier(self, name: str) -> None:
        if self.in_group:
            dist.barrier()

    @torch_peers.collective
    def broadcast_text(self, text: str) -> str:
        if not self.in_group:
            return text
        box = [text]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def call_trainer(self, method: Callable, model: Model, args: tuple,
                     kwargs: dict) -> Any:
        if not self.in_group:
            return method(model, *args, **kwargs)
        self._trainer_calls += 1
        try:
            with torch_peers.naming_a_lost_peer(), \
                    user_steps.in_trainer_call(), \
                    torch_training.compiled_ddp_mode(self, model):
                return method(model, *args, **kwargs)
        finally:
            self._trainer_calls -= 1

    @property
    def fit_per_process(self) -> bool:
        return self.in_group

    def split_rows(self, batch: int, pipeline: Optional[int] = None):
        """The rows of a global batch an input pipeline (this process's by
        default) takes: balanced slices."""
        return balanced_bounds(
            batch, self.input_pipeline_id if pipeline is None else pipeline,
            self.num_input_pipelines)

    @torch_peers.collective
    def shared_seed(self) -> int:
        """A seed from the global numpy RNG, the same in every process (each
        draws one; rank 0's wins)."""
        seed = [int(np.random.randint(0, 2**31 - 1))]
        dist.broadcast_object_list(seed, src=0)
        return seed[0]

    @torch_peers.collective
    def process_all_gather(self, array: np.ndarray) -> np.ndarray:
        """Every process's `array` (same shape), stacked in process order."""
        array = np.asarray(array)
        if not self.in_group:
            return array[None]
        tensor = torch.as_tensor(array).to(self.device)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts).cpu().numpy()

    def gather_rows(self, array: np.ndarray) -> np.ndarray:
        """Every input pipeline's rows, concatenated in pipeline order."""
        return self.all_gather(torch.as_tensor(array), axis=0).numpy()

    # ------------------------------------------------------- placing values
    def from_native(self, value: Any) -> Any:
        return value

    def distribute_dataset(self, dataset: Any, options: Any) -> Any:
        return None

    def distribute_datasets_from_function(self, dataset_fn, options,
                                          input_context) -> Any:
        return None

    def put_per_replica(self, structures: Sequence[Any],
                        on_device: bool = True) -> Any:
        (structure,) = structures

        def put(leaf):
            if leaf is None:
                return None
            tensor = to_tensor(leaf)
            return PerReplica([tensor.to(self.device) if on_device else tensor])

        return keras.tree.map_structure(put, structure)


class _EngineScope:
    """Records the variables created in scope, for the rank-0 broadcast.

    The engines whose scope is open form a stack per thread, like kd's
    strategy contexts and Keras' own global state."""

    _threads = threading.local()

    @classmethod
    def _active(cls) -> List[TorchEngine]:
        if not hasattr(cls._threads, "engines"):
            cls._threads.engines = []
        engines: List[TorchEngine] = cls._threads.engines
        return engines

    def __init__(self, engine: TorchEngine):
        self._engine = engine

    def __enter__(self):
        _EngineScope._active().append(self._engine)
        # Keras 3.16's torch trainer reads the current distribution.
        distribution = self._engine.distribution
        self._distribution_scope = contextlib.nullcontext() if (
            distribution is None) else distribution.scope()
        self._distribution_scope.__enter__()
        return self

    def __exit__(self, *exc):
        self._distribution_scope.__exit__(*exc)
        _EngineScope._active().pop()
        if self._engine.in_group and not any(exc) and (
            context.get_replica_context() is None
        ):
            self._engine.broadcast_new_variables()
        return False

    @classmethod
    def current(cls) -> Optional[TorchEngine]:
        active = cls._active()
        return active[-1] if active else None


def on_layer_built(layer: Layer) -> None:
    """Called by the Keras hook when a layer is built."""
    engine = _EngineScope.current()
    if engine is not None:
        engine.layer_built(layer)


def born_sharded_value(variable: Any, initializer: Any,
                       random_module: Any) -> Any:
    """Called by the Keras hook before a torch variable is initialised: in
    a sharding engine's scope, its value made as this process's shard
    (`ShardedTorchEngine.born_sharded_value`), else None."""
    engine = _EngineScope.current()
    if engine is None or not engine.in_group:
        return None
    return engine.born_sharded_value(variable, initializer, random_module)


def on_variable_created(variable: Any) -> None:
    """Called by the Keras hook for every torch Keras variable created."""
    engine = _EngineScope.current()
    if engine is not None:
        object.__setattr__(variable, "_kd_engine", engine)
        engine.record_variable(variable)
