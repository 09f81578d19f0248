"""The PyTorch engine (the backend module is `backend/torch/__init__.py`):
one replica per process, `torch.distributed` underneath.

In a launched group (`kd.launch`, `python -m keras_distribute.launch`,
`torchrun`) every process is one replica: gloo on CPU, nccl on GPU (device =
`LOCAL_RANK`). `fit` forwards through a `DistributedDataParallel` held inside
the train step (bucketed all-reduce overlapped with backward); metric states
are all-reduced before they are read; each process trains on its slice of
every global batch. In a plain single process there is one replica.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from keras_distribute.backend.torch.groups import ensure_process_group
from keras_distribute.backend.torch.variables import host_view
from keras_distribute.backend.torch.variables import local_region
from keras_distribute.backend.torch.variables import whole_value
from keras_distribute.common import context
from keras_distribute.common.batches import balanced_bounds
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.values import PerReplica

if TYPE_CHECKING:
    from keras import Model
    from keras.layers import Layer


def _variable_keys(variables: list) -> list:
    """`(path, shape, n)` of each variable: n counts earlier variables of the
    same path and shape (keys that name the same variable in every process
    of one program)."""
    seen: dict = {}
    keys = []
    for variable in variables:
        name = (str(getattr(variable, "path", variable.name)),
                tuple(variable.shape))
        seen[name] = seen.get(name, -1) + 1
        keys.append(name + (seen[name],))
    return keys


class TorchEngine(trainer_call.TrainerCallState):
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

    def replica_copies(self, variable: Any) -> list:
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

    def sync_gradients(self, variables: Sequence[Any]) -> None:
        """Nothing to do: the held DDP all-reduced the gradients."""

    # Keras 3.16 wraps a model in its own DistributedDataParallel; the
    # integration layer hands that one over (`hold_ddp`) instead of a second.
    uses_keras_ddp = True

    def set_gradient_compression(self, name: str) -> None:
        """All-reduces gradients in `name`'s dtype ("fp16" or "bf16")."""
        self.gradient_compression = {"fp16": torch.float16,
                                     "bf16": torch.bfloat16}[name]

    def compress_gradients(self, flat: Any) -> Any:
        """`flat` in the compression dtype (itself when there is none),
        counted as all-reduced bytes."""
        if self.gradient_compression is not None:
            flat = flat.to(self.gradient_compression)
        self.gradient_bytes_reduced += flat.numel() * flat.element_size()
        return flat

    def _register_compression(self, wrapper: Any) -> None:
        # torch's own DDP hooks (cast, divide, all-reduce, cast back), with
        # the bytes counted.
        if self.gradient_compression is None or getattr(
                wrapper, "_kd_compression", False):
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        torch_hook = (default_hooks.fp16_compress_hook
                      if self.gradient_compression == torch.float16
                      else default_hooks.bf16_compress_hook)
        itemsize = torch.empty((), dtype=self.gradient_compression
                               ).element_size()

        def counting_hook(state, bucket):
            self.gradient_bytes_reduced += bucket.buffer().numel() * itemsize
            return torch_hook(state, bucket)

        wrapper.register_comm_hook(None, counting_hook)
        wrapper._kd_compression = True

    def hold_ddp(self, model: Model, wrapper: Any) -> None:
        """Holds `wrapper` (a DDP of `model` made elsewhere) as its DDP."""
        if wrapper is not None:
            self._register_compression(wrapper)
            params = tuple(p for p in model.parameters() if p.requires_grad)
            self._ddp[model] = (wrapper, tuple(map(id, params)))

    def ddp(self, model: Model) -> Any:
        """The DistributedDataParallel that wraps `model`, made once."""
        params = tuple(p for p in model.parameters() if p.requires_grad)
        held = self._ddp.get(model)
        if held is None or held[1] != tuple(map(id, params)):
            self.broadcast_new_variables()
            wrapper = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=None if self.device.type == "cpu" else [
                    self.device.index])
            self._register_compression(wrapper)
            held = (wrapper, tuple(map(id, params)))
            self._ddp[model] = held
        return held[0]

    # ------------------------------------------------------------ training
    @torch.compiler.disable
    def step_begins(self, model: Model) -> Any:
        """Counts a training step (the watchdog reads the count) and returns
        the DDP that wraps `model` (made at its first step).

        Python state, kept out of a step `torch.compile` traces
        (`jit_compile=True`): one graph break where the step begins, where
        a traced counter or DDP lookup would be a guard failing at every
        step (a recompile per step, then eager).
        """
        torch_peers.advance()
        return self.ddp(model)

    @torch.compiler.disable
    def user_step_begins(self) -> None:
        """Counts a step of a user's `train_step`/`test_step` (the watchdog
        reads the count)."""
        torch_peers.advance()

    def wrap_step_function(self, model: Model, function: Callable,
                           is_train: bool) -> Callable:
        """Keras' `train_function`/`test_function` of a model whose step is
        the user's, made global (`user_steps`)."""
        from keras_distribute.backend.torch import user_steps

        return user_steps.wrap_step_function(self, model, function, is_train)

    @torch_peers.collective
    def sum_gradients(self, grads: Sequence[Any], scale: float) -> list:
        """This process's `grads` times `scale`, summed over the replicas
        (in place, as DDP leaves them): one flat all-reduce per dtype; a
        sharded gradient contributes its local part."""
        grads = list(grads)
        if not self.in_group or self.num_replicas == 1:
            return grads
        from torch.distributed.tensor import DTensor

        parts = [g.to_local() if isinstance(g, DTensor) else g
                 for g in grads if g is not None]
        with torch.no_grad():
            for dtype in dict.fromkeys(p.dtype for p in parts):
                group = [p for p in parts if p.dtype == dtype]
                flat = torch.cat([p.reshape(-1) for p in group]) * scale
                dtype_sent = flat.dtype
                flat = self.all_reduce_sum(self.compress_gradients(flat))
                flat = flat.to(dtype_sent)
                offset = 0
                for part in group:
                    part.copy_(flat[offset:offset + part.numel()].view_as(
                        part))
                    offset += part.numel()
        return grads

    @torch_peers.collective
    def weighted_mean_logs(self, logs: dict, share: float) -> dict:
        """`logs` with each scalar value replaced by its mean over the
        processes, each weighted by `share` (its share of the batch)."""
        scalars = [key for key, value in logs.items()
                   if _is_scalar_log(value)]
        if not scalars or not self.in_group or self.num_replicas == 1:
            return logs
        flat = torch.tensor([float(_detached(logs[key])) * share
                             for key in scalars],
                            dtype=torch.float64, device=self.device)
        self.all_reduce_sum(flat)
        return {**logs, **{key: float(value)
                           for key, value in zip(scalars, flat.tolist())}}

    def train_step(self, model: Model, data: Any) -> Any:
        """Keras' torch train step, forwarding through the held DDP."""
        return self.train_steps.train_step(model, data)

    def global_metric_states(self, variables: Sequence[Any]):
        """Metric variables with their all-process values, for a read."""
        return self.train_steps.global_metric_states(variables)

    def restoring_metric_states(self, variables: Sequence[Any]):
        """Around a restore of all-process metric values (a context)."""
        return self.train_steps.restoring_metric_states(variables)

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
            tensor = _to_tensor(leaf)
            return PerReplica([tensor.to(self.device) if on_device else tensor])

        return keras.tree.map_structure(put, structure)

    # ------------------------------------------------------------------ run
    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if not self.in_group:
            return self._run(strategy, fn, args, kwargs)
        torch_peers.advance()
        with torch_peers.naming_a_lost_peer():
            self.broadcast_new_variables()
            return self._run(strategy, fn, args, kwargs)

    def _run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        local = lambda v: v.values[0] if isinstance(v, PerReplica) else v  # noqa: E731
        call_args = keras.tree.map_structure(local, args)
        call_kwargs = keras.tree.map_structure(local, kwargs)
        aggregated = (self._agreed(self._live_aggregated())
                      if self.in_group and self.num_replicas > 1 else [])
        before = [v.value.detach().clone() for v in aggregated]
        from keras_distribute.backend.torch import user_steps

        with strategy.enter_replica(self.local_replica_ids[0],
                                    _TorchCollectives(self)), (
                user_steps.in_run(self)):
            result = fn(*call_args, **call_kwargs)
        if aggregated:
            self._combine_aggregated(aggregated, before)
        return keras.tree.map_structure(
            lambda out: out if out is None else PerReplica([out]), result)

    def _live_aggregated(self) -> list:
        """The "sum" / "mean" variables still alive, in creation order (the
        same on every process: they were made by the same program)."""
        alive = [(ref, ref()) for ref in self._aggregated]
        self._aggregated = [ref for ref, v in alive if v is not None]
        return [v for _, v in alive if v is not None and v._value is not None]

    @torch_peers.collective
    def _agreed(self, variables: list, group: Any = "replicas") -> list:
        """The `variables` that every process holds, in one order everywhere
        (a collective).

        Processes may hold different ones: a metric made by chief-only work
        (a callback, a save), or freed by the garbage collector at another
        time. Combining lists of different lengths aborted gloo ("Received
        data size doesn't match"). A variable is known by its path and shape
        (and which of that name it is); one small all-reduce finds the lists
        equal, else the processes exchange them and keep the common ones.
        `group`: the replicas' group (combining), or `None` for every
        process (broadcasting from process 0).
        """
        group = self.replica_group if group == "replicas" else group
        keys = _variable_keys(variables)
        digest = int.from_bytes(hashlib.blake2b(
            repr(keys).encode(), digest_size=7).digest(), "little")
        probe = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        if int(probe[0]) == digest == -int(probe[1]):
            return variables
        every: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, keys, group=group)
        common = set(every[0]).intersection(*every[1:])
        return [v for key, v in sorted(zip(keys, variables),
                                       key=lambda pair: pair[0])
                if key in common]

    def _combine_aggregated(self, variables: list, before: list) -> None:
        """As tf.distribute's sync-on-read variables read after `run`: a
        "sum" variable (a metric's total and count) holds every process's
        updates, a "mean" one their average — the same on every process.
        One flat all-reduce of the changes (sum) and values (mean)."""
        with torch.no_grad():
            flat = torch.cat([
                (v.value - old if v.aggregation == "sum" else v.value)
                .double().reshape(-1).to(self.device)
                for v, old in zip(variables, before)])
            self.all_reduce_sum(flat)
            offset = 0
            for variable, old in zip(variables, before):
                part = flat[offset:offset + old.numel()].reshape(old.shape)
                offset += old.numel()
                new = (old.double() + part if variable.aggregation == "sum"
                       else part / self.world_size)
                variable.value.copy_(new.to(old.dtype))

    # -------------------------------------------------- cross-replica ops
    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        (value,) = values  # this process's one replica
        tensor = _to_tensor(value).to(self.device)
        if axis is None:
            total = self.all_reduce_sum(tensor.clone())
            return total / self.num_replicas if op is ReduceOp.MEAN else total
        _check_axis(axis, tensor.dim())
        total = self.all_reduce_sum(tensor.sum(dim=axis))
        if op is ReduceOp.SUM:
            return total
        count = torch.tensor(float(tensor.shape[axis]), device=self.device)
        return total / self.all_reduce_sum(count)

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        tensor = _to_tensor(values[0]).to(self.device)
        if tensor.dim() == 0:
            raise ValueError(
                "`gather` needs per-replica values of rank >= 1 to "
                "concatenate. Received scalars. Use `reduce` for scalars, or "
                "give each replica's value a leading dimension.")
        _check_axis(axis, tensor.dim())
        return self.all_gather(tensor, axis)

    @torch_peers.collective
    def all_reduce_sum(self, tensor):
        """Sums `tensor` over the replicas, in place."""
        if self.in_group and self.num_replicas > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM,
                            group=self.replica_group)
        return tensor

    @torch_peers.collective
    def all_gather(self, tensor, axis: int):
        """Concatenates `tensor` of every replica along `axis` (sizes may
        differ), in replica order."""
        if not self.in_group or self.num_replicas == 1:
            return tensor
        group, count = self.replica_group, self.num_replicas
        axis = axis % tensor.dim()
        size = torch.tensor([tensor.shape[axis]], device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(count)]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        pad = ([0, 0] * (tensor.dim() - axis - 1)
               + [0, longest - tensor.shape[axis]])
        padded = torch.nn.functional.pad(tensor, pad)
        parts = [torch.empty_like(padded) for _ in range(count)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p.narrow(axis, 0, int(s.item()))
                          for p, s in zip(parts, sizes)], dim=axis)


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


def on_variable_created(variable: Any) -> None:
    """Called by the Keras hook for every torch Keras variable created."""
    engine = _EngineScope.current()
    if engine is not None:
        object.__setattr__(variable, "_kd_engine", engine)
        engine.record_variable(variable)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _is_scalar_log(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and (
        not value.dtype.is_complex)


def _check_axis(axis: int, rank: int) -> None:
    if not -rank <= axis < rank:
        raise ValueError(
            f"`axis`={axis} is out of range for per-replica values of "
            f"rank {rank}. Use an axis in [{-rank}, {rank}).")


def _to_tensor(value: Any) -> Any:
    """A torch tensor of `value`; a sharded one whole (a collective)."""
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, torch.Tensor):
        return whole_value(value)
    if hasattr(value, "numpy") and not isinstance(value, np.generic):
        value = value.numpy()
    value = np.asarray(value)
    if not value.flags.writeable:  # e.g. tf.data's arrays: torch would warn
        value = value.copy()
    return torch.as_tensor(value)


class _TorchCollectives:
    """Collectives of one process-replica: `torch.distributed` all-reduce."""

    def __init__(self, engine: TorchEngine):
        self._engine = engine

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        from keras_distribute.backend.torch import user_steps

        def reduce(leaf):
            tensor = _to_tensor(leaf).to(self._engine.device).clone()
            if not torch.is_floating_point(tensor) and op is ReduceOp.MEAN:
                tensor = tensor.float()
            total = self._engine.all_reduce_sum(tensor)
            # Global now: an optimizer given it applies it as it is.
            return user_steps.mark_reduced(
                total / self._engine.num_replicas if op is ReduceOp.MEAN
                else total)

        return keras.tree.map_structure(reduce, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        return keras.tree.map_structure(
            lambda leaf: self._engine.all_gather(
                _to_tensor(leaf).to(self._engine.device), axis), value)
