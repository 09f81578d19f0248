"""The narrow interface every backend module implements.

The neutral layer (strategies, values, contexts, input, Keras hooks) talks
to a framework only through these protocols. A backend module
(`backend/jax/__init__.py`, ...) exports the functions of `BackendModule`, and
`make_engine` returns an object following `ReplicaEngine` for one strategy.
An engine that can do more declares it in its `contract` (a tuple of the
protocols it follows): `ProcessDataEngine` (its `fit` runs per process on
that process's rows), `TorchDdpEngine` (Keras' torch trainer steps through
it), `ShardedForwardEngine` (layers' forward passes run sharded) and
`LayoutEngine` (tensors can be laid out over the model axes inside a step).
`tests/test_engine_contract.py` checks that every engine follows what it
declares and that the neutral layer reads nothing from an engine that no
protocol declares.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import ContextManager
from typing import Optional
from typing import Protocol
from typing import Sequence
from typing import runtime_checkable

from keras_distribute.common.devices import DeviceSpec
from keras_distribute.common.devices import parse_device_name
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.reduce_op import ReduceOp

if TYPE_CHECKING:
    from keras import Model
    from keras import Variable
    from keras.distribution import LayoutMap
    from keras.layers import Layer
    from keras.optimizers import Optimizer

    from keras_distribute.cluster_resolver.base import ClusterResolver


@runtime_checkable
class ReplicaEngine(Protocol):
    """The per-strategy engine: devices, layouts, collectives."""

    devices: tuple
    num_replicas: int  # replicas in sync, over every process
    local_replica_ids: tuple  # the replicas this process runs
    num_input_pipelines: int  # one per process (or per replica group)
    input_pipeline_id: int
    process_count: int  # processes of the job (checkpoint writers)
    process_id: int  # this process; 0 is the chief
    device_mesh: Any  # keras.distribution.DeviceMesh
    distribution: Any  # keras.distribution.Distribution or None
    # `CommunicationOptions(compression=...)` as the engine holds it (None:
    # gradients are all-reduced in their own dtype).
    gradient_compression: Any
    # `fit` runs in each process on that process's rows of every global
    # batch (`input/process_data.py`): torch in a group, JAX over several
    # processes. Otherwise the framework's own distribution feeds it.
    fit_per_process: bool
    # What the engine (and the input pipeline and checkpoint that run on
    # it) need from the Keras integration: handed in by `make_*engine`.
    keras_services: KerasServices

    def scope(self) -> ContextManager[None]:
        """Makes variables created inside follow the strategy's layout."""

    def run(self, strategy: Any, fn: Callable, args: tuple,
            kwargs: dict) -> Any:
        """Runs `fn` once per replica, each call inside
        `strategy.enter_replica(replica_id, collectives)` (the strategy
        makes and enters its replica context); returns `PerReplica` leaves."""

    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        """Combines one leaf's per-replica components across replicas."""

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        """Concatenates one leaf's per-replica components along `axis`."""

    def put_per_replica(self, structures: Sequence[Any],
                        on_device: bool = True) -> Any:
        """Places structure `i` on replica `i`; returns `PerReplica` leaves."""

    def from_native(self, value: Any) -> Any:
        """Turns the framework's own distributed values into `PerReplica`."""

    def distribute_dataset(self, dataset: Any, options: Any) -> Any:
        """The framework's own distributed dataset, or `None` to split here."""

    def distribute_datasets_from_function(self, dataset_fn: Callable,
                                          options: Any,
                                          input_context: Any) -> Any:
        """The framework's own per-pipeline datasets, or `None` (the neutral
        layer builds them). `dataset_fn` may be called to see what it makes:
        it runs once per pipeline however often it is called."""

    def variable_local_results(self, variable: Any) -> Optional[tuple]:
        """The per-replica copies of a strategy variable, else `None`."""

    def variable_layout(self, variable: Any) -> tuple:
        """`(axes per dimension, bytes per device)` of a variable."""

    def replica_copies(self, variable: Any,
                       one_per_region: bool = False) -> list:
        """`[(region, host array)]`: every copy of `variable` this process
        holds, each with the global region it covers (`whole_region(shape)`
        for a whole copy); with `one_per_region`, only the first of the
        copies of each region (none other is read to the host). Copies of
        one region must be equal everywhere (the divergence check compares
        them, `training/divergence.py`)."""

    def owns_variable(self, variable: Any) -> bool:
        """Whether `variable` was created under this engine's layout."""

    def adopt_variables(self, variables: Sequence[Any]) -> None:
        """Lays out stray variables (e.g. of an optimizer built elsewhere)."""

    def barrier(self, name: str) -> None:
        """Returns once every process of the job called it (no-op alone)."""

    def broadcast_text(self, text: str) -> str:
        """Process 0's `text`, in every process (a collective; alone:
        `text`)."""

    def process_all_gather(self, array: Any) -> Any:
        """Every process's `array` (same shape in each), stacked along a new
        first axis in process order (a collective; alone: `array[None]`)."""

    def set_gradient_compression(self, name: str) -> None:
        """All-reduces the gradients of `fit` (and of `kd.train_step`) in
        `name`'s dtype (`"fp16"` or `"bf16"`), their own dtype again after."""

    def call_trainer(self, method: Callable, model: Model, args: tuple,
                     kwargs: dict) -> Any:
        """Calls a Keras `fit`/`evaluate`/... method under the engine.

        `method` comes with the neutral layer's rules already around it
        (`process_data.with_process_rules`: each process's rows, one model
        state in every process): the engine adds only its own framework's
        part (contexts, compression, a step function), and calls no layer
        above it."""


@runtime_checkable
class ProcessDataEngine(ReplicaEngine, Protocol):
    """An engine whose `fit` runs in each process on that process's rows
    (`input/process_data.py`): torch, and JAX over several processes."""

    # The settings of the trainer call in progress (`trainer_call`), read by
    # the engine's own steps; see `trainer_call.TrainerCallState`.
    even_batches: bool
    sync_metrics_each_step: bool
    step_inputs: Any

    def trainer_call(self, *, even_batches: Any = ...,
                     step_inputs: Any = ...,
                     sync_metrics_each_step: Any = ...
                     ) -> ContextManager[None]:
        """Holds the given settings for the trainer call inside the `with`
        (the others unchanged) and puts back the previous ones after."""

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is true in any process (a collective; alone:
        `flag`)."""

    def split_rows(self, batch: int, pipeline: Optional[int] = None) -> tuple:
        """`(start, stop)`: the rows of a global batch of `batch` rows that
        input pipeline `pipeline` (default: this process's) feeds. A query:
        it changes nothing."""

    def rows_to_feed(self, batch: int) -> tuple:
        """`split_rows(batch)` of the global batch this process feeds next;
        the engine lays that batch out to match (JAX: a batch given whole
        to every process is laid out replicated)."""

    def shared_seed(self) -> int:
        """A seed every process agrees on (from kd's own generator, never
        the user's random streams)."""

    def gather_rows(self, array: Any) -> Any:
        """Every process's rows of `array`, concatenated in process order
        (rows may differ in number between processes)."""


@runtime_checkable
class TorchDdpEngine(ProcessDataEngine, Protocol):
    """An engine Keras' torch trainer steps through
    (`integration/torch_hooks.py`)."""

    uses_keras_ddp: bool  # the model's step goes through Keras' own DDP
    in_group: bool  # a torch.distributed process group is running

    def restoring_metric_states(self, variables: Sequence[Any]
                                ) -> ContextManager[None]:
        """Inside: assigning the metric variables sets the job's totals
        (a resumed backup's metric state), not this process's share."""

    def hold_ddp(self, model: Model, wrapper: Any) -> None:
        """Keeps Keras' DDP wrapper of `model` for its training steps."""

    def train_step(self, model: Model, data: Any) -> Any:
        """One training step of `model` on this process's `data`."""

    def wrap_step_function(self, model: Model, function: Callable,
                           is_train: bool) -> Callable:
        """Keras' `train_function` (or `test_function`) of a model whose
        step is the user's, as steps whose optimizer calls get the global
        batch's gradients and whose logs are global."""

    def global_metric_states(self,
                             variables: Sequence[Any]) -> ContextManager[None]:
        """Inside: the metric variables hold every process's totals."""

    def broadcast_new_variables(self) -> None:
        """Gives variables created since the last call process 0's values."""


@runtime_checkable
class ShardedForwardEngine(TorchDdpEngine, Protocol):
    """A torch engine whose layers' variables are sharded over model axes."""

    collective_reads: bool  # reading a sharded variable whole is collective

    def sharded_forward(self, forward: Callable, layer: Layer, args: tuple,
                        kwargs: dict) -> Any:
        """`forward(layer, *args, **kwargs)` on the layer's sharded values."""

    def calling_forward(self, forward: Callable, layer: Layer, args: tuple,
                        kwargs: dict) -> Any:
        """`forward(layer, *args, **kwargs)` of a layer that holds no
        sharded variable but computes with another layer's: what it reads
        gathered for the call."""


@runtime_checkable
class LayoutEngine(ReplicaEngine, Protocol):
    """An engine that can lay a tensor out over the model axes inside a
    step (`TPUStrategy.experimental_split_to_logical_devices`)."""

    def constrain(self, tensor: Any, parts: Sequence[int],
                  in_replica: bool) -> Any:
        """`tensor` split into `parts` along its dimensions."""


@runtime_checkable
class LogicalDeviceEngine(LayoutEngine, Protocol):
    """An engine that can place a tensor on one logical device of each
    replica (`TPUStrategy.experimental_assign_to_logical_device`)."""

    def assign_to_logical_device(self, tensor: Any,
                                 logical_device_id: int) -> Any:
        """`tensor` on logical device `logical_device_id` of the replica."""


@runtime_checkable
class TpuEngine(LayoutEngine, Protocol):
    """The engine of a `kd.TPUStrategy` (`make_tpu_engine`)."""

    num_logical_devices: int  # the devices (cores) one replica spans


class BackendModule(Protocol):
    """The free functions of a backend module."""

    def value_and_gradients(self, model: Model, compute_loss: Callable,
                            x: Any) -> tuple:
        """`(loss, gradients, y_pred)` on this replica: `compute_loss(y_pred,
        model_losses)` and its gradients over `model.trainable_variables`
        (in `kd.train_step`, inside `run`)."""

    def apply_gradients(self, engine: ReplicaEngine, optimizer: Optimizer,
                        grads: Any, variables: Any) -> None:
        """Combines the replicas' gradients (sum) and applies them once,
        as `engine` (the running strategy's) all-reduces them."""

    name: str

    def default_devices(self) -> list:
        """All local accelerators, else all local CPU devices."""

    def resolve_device(self, device: "DeviceSpec | Any") -> Any:
        """A parsed name, or a framework device object, to a device."""

    def device_name(self, device: Any) -> str:
        """The Keras-style name (`"cpu:0"`) of a device."""

    def make_engine(self, devices: Sequence[Any],
                    layout_map: LayoutMap | None = None, *,
                    services: KerasServices) -> ReplicaEngine:
        """Builds the engine for a strategy over `devices`; the engine keeps
        `services` (the Keras integration's) as `keras_services`."""

    def make_multi_worker_engine(self, resolver: ClusterResolver,
                                 timeout_s: Optional[float],
                                 layout_map: LayoutMap | None = None, *,
                                 services: KerasServices) -> ReplicaEngine:
        """Builds the engine of a `kd.MultiWorkerMirroredStrategy` over the
        job `resolver` describes (joining it; one worker: this process)."""

    def refuse_tpu_strategy(self) -> None:
        """Raises `NotImplementedError` on a backend that has no
        `kd.TPUStrategy` (before its arguments are checked); else does
        nothing."""

    def make_tpu_engine(self, tpu_cluster_resolver: Any, assignment: Any,
                        layout_map: LayoutMap | None = None, *,
                        services: KerasServices) -> ReplicaEngine:
        """Builds the engine of a `kd.TPUStrategy`."""

    def refuse_unsupported_layouts(self, layout_map: LayoutMap) -> None:
        """Raises when this backend cannot shard variables as `layout_map`
        says (before its devices are looked up); else does nothing."""

    def mesh_devices(self, layout_map: LayoutMap) -> list:
        """The devices of a strategy built on `layout_map`'s mesh
        (`mesh_devices_by_name` unless one process is one device)."""

    def checkpoint_pieces(self, variable: Variable, writer: int,
                          process_id: int) -> list:
        """`[(region, host array)]`: the unique pieces of `variable` this
        process writes (`process_id` in the job): a replicated variable
        whole in process `writer` only, each shard once."""

    def checkpoint_value(self, variable: Variable) -> Any:
        """A replicated variable's whole value on the host (a collective
        for TensorFlow's sync-on-read variables: every process calls it)."""

    def checkpoint_assign(self, variable: Variable,
                          read_regions: Callable) -> None:
        """Restores `variable` from `read_regions(regions, into=None) ->
        [arrays]`, reading only what this process holds."""

    def checkpoint_snapshot(self, variable: Variable) -> Callable[[], None]:
        """`put_back()` for `variable`'s current value (a failed restore
        puts every variable back)."""

    def host_rng_state(self) -> Any:
        """The backend's own global host RNG state, JSON-serialisable
        (`None` when it keeps none besides numpy's and Python's)."""

    def set_host_rng_state(self, state: Any) -> None:
        """Sets what `host_rng_state` returned (ignores `None`)."""

    def build_without_values(self, build: Callable[[], Any]) -> Any:
        """Calls `build()` (which makes a Keras model) so that its
        variables get shapes and dtypes but hold no memory; returns what it
        returned (only shapes, dtypes and paths may be read from it)."""

    def step_memory(self, model: Model, optimizer: Optimizer, loss: Callable,
                    inputs: Any, targets: Any,
                    layout_map: LayoutMap | None) -> Optional[StepMemory]:
        """The peak bytes per device of one training step of `model`
        (forward, loss, backward, `optimizer` applied; `optimizer` is built
        on the model's trainable variables), for the global batch whose
        `inputs` and `targets` are trees of `keras.KerasTensor`s, laid out
        as `layout_map` says (None: one device), from the framework's own
        accounting and without the memory itself; None where the framework
        cannot account for it here (the caller then traces shapes)."""


class StepMemory:
    """What `BackendModule.step_memory` measured: `peak` bytes on the most
    loaded device at the peak of a step (variables, optimizer slots, the
    batch, gradients, activations and workspace) and `method`, how."""

    def __init__(self, peak: int, method: str) -> None:
        self.peak, self.method = int(peak), method


def broadcast_text_by(broadcast_array: Callable[[Any], Any],
                      text: str) -> str:
    """`ReplicaEngine.broadcast_text` for an engine whose broadcast takes
    arrays of the same shape in every process: process 0's length first,
    then its bytes (`broadcast_array(int32 array) -> process 0's array`)."""
    import numpy as np

    data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    size = int(np.asarray(broadcast_array(
        np.array([data.size], np.int32)))[0])
    payload = data if data.size == size else np.zeros(size, np.int32)
    received: bytes = np.asarray(broadcast_array(payload)).astype(
        np.uint8).tobytes()
    return received.decode()


# The checkpoint's view of a variable, which engines implement
# (`checkpoint_pieces` / `checkpoint_assign`): a region is the global slice
# `((start, stop), ...)` of each dimension a piece covers.
def whole_region(shape: Sequence[int]) -> tuple:
    """The region covering a whole array of `shape`."""
    return tuple((0, int(n)) for n in shape)


def assign_whole(variable: Variable, read_regions: Callable) -> None:
    """Restores a replicated variable from its whole saved region
    (`read_regions([region]) -> [array]`)."""
    (value,) = read_regions([whole_region(variable.shape)])
    variable.assign(value)


def snapshot_whole(variable: Variable) -> Callable[[], None]:
    """A way back to a variable's current value: returns `put_back()`,
    which assigns it again (a host copy is held until then). A restore
    takes one per variable before assigning it, so that a failed restore
    leaves every variable as it was."""
    import keras
    import numpy as np

    value = np.array(keras.ops.convert_to_numpy(variable.value), copy=True)
    return lambda: variable.assign(value)


def host_value(variable: Any) -> Any:
    """`BackendModule.checkpoint_value` of a backend whose variables read
    the same in every process: Keras' host copy of the value."""
    import keras

    return keras.ops.convert_to_numpy(variable.value)


def mesh_devices_by_name(layout_map: LayoutMap,
                         resolve_device: Callable[[Any], Any]) -> list:
    """`BackendModule.mesh_devices` of a backend where one process holds
    the mesh: each of the mesh's devices, resolved by name (or as the
    framework's device object it already is)."""
    return [resolve_device(parse_device_name(str(device)) if not hasattr(
        device, "platform") else device)
        for device in layout_map.device_mesh.devices.flatten()]
