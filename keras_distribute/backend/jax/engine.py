"""The JAX engine (the backend module is `backend/jax/__init__.py`):
`keras.distribution` layouts, XLA SPMD and `shard_map`.

Variables follow a `keras.distribution.DataParallel` (or `ModelParallel`)
that the strategy's scope makes current; Keras' JAX trainer then compiles
each step as one SPMD program, so gradients are combined by XLA (or, with
`CommunicationOptions(compression=...)`, per replica: `jax_compression`).
`run` compiles `fn` once per replica with `jax.shard_map` over the batch
axis (`jax_spmd_run`); per-replica inputs of unequal shape (a short last
batch) run one thread per replica instead, with collectives that meet at a
barrier. Per-replica values and `reduce` / `gather` are `replica_values`
(a base of `spmd_run.SpmdRun`, itself a base of `JaxEngine`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from keras.distribution import DeviceMesh

from keras_distribute.backend import interface
from keras_distribute.backend import trainer_call
from keras_distribute.backend.jax import compression as jax_compression
from keras_distribute.backend.jax.devices import device_name
from keras_distribute.backend.jax.layouts import StrategyDataParallel
from keras_distribute.backend.jax.layouts import StrategyModelParallel
from keras_distribute.backend.jax.predict import process_local_predictions
from keras_distribute.backend.jax.spmd_run import SpmdRun
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.layouts import check_layout_map
from keras_distribute.common.layouts import warn_unmatched_keys

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap


def make_engine(devices: Sequence[Any], layout_map: LayoutMap | None = None, *,
                services: KerasServices) -> "JaxEngine":
    """Builds the engine of a strategy over `devices`."""
    return JaxEngine(devices, layout_map, services=services)


class JaxEngine(SpmdRun, trainer_call.TrainerCallState):
    """The per-strategy JAX engine (see `interface.ReplicaEngine`)."""

    # Its `fit` runs per process in a multi-process job; `constrain` lays
    # tensors out over the model axes (a TPU engine adds `TpuEngine`).
    contract: Tuple[type, ...] = (interface.ProcessDataEngine,
                                  interface.LayoutEngine)
    num_logical_devices = 1  # per replica; a TPU engine's may be more

    def __init__(self, devices: Sequence[Any],
                 layout_map: LayoutMap | None = None, *,
                 services: KerasServices):
        self.keras_services = services
        self.devices = tuple(devices)
        if layout_map is None:
            self.device_mesh = DeviceMesh(
                shape=(len(self.devices),),
                axis_names=["batch"],
                devices=[device_name(d) for d in self.devices],
            )
            self.distribution = StrategyDataParallel(self.device_mesh)
        else:
            check_layout_map(layout_map)
            self.device_mesh = layout_map.device_mesh
            self.distribution = StrategyModelParallel(
                layout_map, self.device_mesh.axis_names[0]
            )
        self.layout_map = layout_map
        self.batch_axis = self.device_mesh.axis_names[0]
        self.num_replicas = self.device_mesh.shape[0]
        self.rank, self.world_size = jax.process_index(), jax.process_count()
        self.multi_process = self.world_size > 1
        self.num_input_pipelines = self.world_size
        self.input_pipeline_id = self.rank
        self.process_count, self.process_id = self.world_size, self.rank
        if self.multi_process:
            # Each process is handed its own rows (input/process_data.py).
            self.distribution.auto_shard_dataset = False
        self.mesh = self.device_mesh.backend_mesh
        self._device_set = frozenset(self.mesh.devices.flat)
        # The models whose keys matched, and those warned about.
        self._keys_checked: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._eager_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._replica_of_device = {}
        batch_index = self.device_mesh.axis_names.index(self.batch_axis)
        for coords, device in np.ndenumerate(self.mesh.devices):
            self._replica_of_device[device] = coords[batch_index]
        # The device each replica's per-replica values live on: the first
        # device of its row along the batch axis (the mesh's first axis).
        self.replica_devices = tuple(
            self.mesh.devices[(i,) + (0,) * (self.mesh.devices.ndim - 1)]
            for i in range(self.num_replicas)
        )
        # The replicas this process runs; per-replica values hold these only.
        self.local_replica_ids = tuple(
            i for i, d in enumerate(self.replica_devices)
            if d.process_index == self.rank)
        self._local_position = {
            replica: position
            for position, replica in enumerate(self.local_replica_ids)}
        self.local_replica_devices = tuple(
            self.replica_devices[i] for i in self.local_replica_ids)
        self._run_cache: Dict[Any, Any] = {}
        # `CommunicationOptions(compression=...)`: the dtype gradients are
        # all-reduced in (None: their own), and what the last traced
        # training step handed to that all-reduce (`(dtype, bytes)`).
        self.gradient_compression = None
        self.traced_gradient_reductions: List[Any] = []

    def set_gradient_compression(self, name: str) -> None:
        """All-reduces the gradients of `fit` and of `kd.train_step` in
        `name`'s 16-bit dtype (backend/jax/compression.py)."""
        if self.layout_map is not None:
            raise ValueError(
                "Gradient compression on JAX is for data-parallel "
                "strategies: with a `layout_map` XLA reduces the gradients "
                "of sharded variables inside the compiled step, in their own "
                f"dtype. Received: compression={name!r} with a layout_map. "
                "Pass `kd.CommunicationOptions(compression=None)`, or drop "
                "the layout_map.")
        self.gradient_compression = jax_compression.DTYPES[name]

    # ------------------------------------------------------------ variables
    def scope(self):
        return self.distribution.scope()

    def owns_variable(self, variable: Any) -> bool:
        value = getattr(variable, "_value", None)
        sharding = getattr(value, "sharding", None)
        return isinstance(sharding, NamedSharding) and (
            sharding.mesh.devices.shape == self.mesh.devices.shape
            and sharding.device_set == self._device_set
        )

    def variable_layout(self, variable: Any) -> tuple:
        value = variable.value
        spec = getattr(value.sharding, "spec", None)
        axes = tuple(spec) + (None,) * (len(variable.shape) - len(spec)) if (
            spec is not None) else (None,) * len(variable.shape)
        shard = value.addressable_shards[0].data
        return axes, int(shard.size * shard.dtype.itemsize)

    def adopt_variables(self, variables: Sequence[Any]) -> None:
        for variable in variables:
            if variable._value is None or self.owns_variable(variable):
                continue
            variable._layout = None
            variable._layout = self.distribution.get_variable_layout(variable)
            variable._direct_assign(variable._value)

    def variable_local_results(self, variable: Any) -> Optional[tuple]:
        if not isinstance(variable, keras.Variable) or not self.owns_variable(
            variable
        ):
            return None
        return self._per_replica_shards(variable.value)

    def replica_copies(self, variable: Any,
                       one_per_region: bool = False) -> list:
        """Every shard this process's devices hold, with its region (a
        replicated variable: one whole copy per device)."""
        value = variable.value if isinstance(variable, keras.Variable) else (
            variable)
        if not isinstance(value, jax.Array):
            return [(interface.whole_region(np.shape(value)),
                     np.asarray(value))]
        shape = value.shape
        copies, seen = [], set()
        for shard in value.addressable_shards:
            region = tuple(
                (0 if part.start is None else int(part.start),
                 int(size) if part.stop is None else int(part.stop))
                for part, size in zip(shard.index, shape))
            if one_per_region and region in seen:
                continue  # (not read to the host)
            seen.add(region)
            copies.append((region, np.asarray(shard.data)))
        return copies

    def barrier(self, name: str) -> None:
        if self.multi_process:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(name)

    def broadcast_text(self, text: str) -> str:
        if not self.multi_process:
            return text
        from jax.experimental import multihost_utils

        from keras_distribute.backend.interface import broadcast_text_by

        return broadcast_text_by(multihost_utils.broadcast_one_to_all, text)

    def call_trainer(self, method: Callable, model: Model, args: tuple,
                     kwargs: dict) -> Any:
        # Keras' JAX trainer detaches variable values during `fit`; if the
        # call dies before re-attaching them, put the last values back so
        # the model stays usable (the next `fit` would otherwise fail).
        if self.layout_map is not None and model.built and (
                model not in self._keys_checked):
            warn_unmatched_keys(self.layout_map, model)
            self._keys_checked.add(model)
        self._warn_eager_cpu_collectives(model)
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and hasattr(optimizer, "variables"):
            variables += list(optimizer.variables)
        saved = [(v, v._value) for v in variables]
        compressing = contextlib.nullcontext()
        if self.gradient_compression is not None and getattr(
                method, "__name__", "") in ("fit", "train_on_batch"):
            compressing = jax_compression.compressing(
                model, self, self.gradient_compression)
        try:
            with compressing:
                return self._call_trainer(method, model, args, kwargs)
        except BaseException:
            for variable, value in saved:
                if variable._value is None:
                    variable._value = value
            raise

    def _warn_eager_cpu_collectives(self, model: Model) -> None:
        """Warns once per model compiled with `jit_compile=False` over
        several CPU devices: Keras then runs every operation as its own
        program over the devices, and XLA's CPU collectives can abort the
        process with a rendezvous timeout (exit 134, "Expected 8 threads to
        join the rendezvous") — with `keras.distribution.DataParallel` too
        (a keras-hub BertMaskedLM, 8 simulated devices; #30)."""
        if getattr(model, "jit_compile", True) is not False or len(
                self._device_set) < 2 or model in self._eager_warned:
            return
        if any(device.platform != "cpu" for device in self._device_set):
            return
        self._eager_warned.add(model)
        warnings.warn(
            f"{model.name!r} is compiled with jit_compile=False and the "
            f"strategy spans {len(self._device_set)} CPU devices: Keras then "
            "runs each operation as its own program over them, and XLA's "
            "CPU collectives can deadlock and abort the process ('Expected "
            f"{len(self._device_set)} threads to join the rendezvous', exit "
            "134), with keras.distribution.DataParallel as well. Compile "
            "with jit_compile=True (Keras' default on JAX), or run the "
            "eager program on one device to debug it.", stacklevel=4)

    @property
    def fit_per_process(self) -> bool:
        return self.multi_process

    def _call_trainer(self, method: Callable, model: Model, args: tuple,
                      kwargs: dict) -> Any:
        if self.multi_process:
            from keras_distribute.job import peer_board

            with process_local_predictions(model), peer_board.busy():
                return method(model, *args, **kwargs)
        return method(model, *args, **kwargs)

    def constrain(self, tensor: Any, parts: Sequence[int],
                  in_replica: bool) -> Any:
        """Lays `tensor` out over each replica's logical devices."""
        cut = [dim for dim, count in enumerate(parts) if count > 1]
        if in_replica:
            # Inside `run`: the replica axis is manual, the model axis not.
            if len(cut) > 1:
                raise ValueError(
                    "Inside `strategy.run` a tensor can be split along one "
                    "dimension only on JAX. Received: partition_dimensions="
                    f"{list(parts)}. Split one dimension, or call it in a "
                    "fit/evaluate step.")
            spec: List[Any] = [None] * len(parts)
            for dim in cut:
                spec[dim] = "model"
            return jax.lax.with_sharding_constraint(
                tensor, PartitionSpec(*spec))
        # A global step (fit, jit): dimension 0 is also the replica axis.
        names = [f"model_{i}" for i in range(len(cut))]
        rows = self.mesh.devices.shape[0]
        counts = tuple(parts[d] for d in cut)
        rest = self.mesh.devices.size // (rows * int(np.prod(counts)))
        mesh = jax.sharding.Mesh(
            self.mesh.devices.reshape((rows,) + counts + (rest,)),
            (self.batch_axis, *names, "model_rest"))
        spec = [None] * len(parts)
        for dim, name in zip(cut, names):
            spec[dim] = name
        spec[0] = self.batch_axis if spec[0] is None else (
            self.batch_axis, spec[0])
        return jax.lax.with_sharding_constraint(
            tensor, NamedSharding(mesh, PartitionSpec(*spec)))

    # ---------------------------------------------------- several processes
    def split_rows(self, batch: int, rank: Optional[int] = None):
        """A process's rows of a global batch (this process's by default).

        A batch that divides by the replica count is cut into equal
        per-process slices (laid out sharded); any other batch is given
        whole to every process and laid out replicated, which keeps the
        single-device result.
        """
        if batch % self.num_replicas != 0:
            return 0, batch
        rank = self.rank if rank is None else rank
        per_process = batch // self.world_size
        return rank * per_process, (rank + 1) * per_process

    def rows_to_feed(self, batch: int):
        """`split_rows(batch)`, and the batch laid out to match (whole:
        replicated; split: sharded over the batch axis)."""
        self.distribution.batch_given_whole = batch % self.num_replicas != 0
        return self.split_rows(batch)

    def shared_seed(self) -> int:
        """A seed from the global numpy RNG, the same in every process (each
        draws one; process 0's wins)."""
        from jax.experimental import multihost_utils

        seed = np.int32(np.random.randint(0, 2**31 - 1))
        return int(multihost_utils.broadcast_one_to_all(seed))

    def any_process(self, flag: bool) -> bool:
        """Whether `flag` is true in any process (a collective)."""
        if not self.multi_process:
            return bool(flag)
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.array([int(bool(flag))]))
        return bool(np.any(flags))

    def process_all_gather(self, array: np.ndarray) -> np.ndarray:
        """Every process's `array` (same shape), stacked in process order."""
        if not self.multi_process:
            return np.asarray(array)[None]
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(
            np.asarray(array)[None], tiled=True))

    def gather_rows(self, array: np.ndarray) -> np.ndarray:
        """Every process's rows (counts may differ), in process order."""
        from jax.experimental import multihost_utils

        counts = multihost_utils.process_allgather(
            np.array([array.shape[0]]))
        longest = int(np.max(counts))
        padded = np.zeros((longest,) + array.shape[1:], array.dtype)
        padded[:array.shape[0]] = array
        everyone = multihost_utils.process_allgather(padded)
        return np.concatenate([everyone[p][:int(counts[p][0])]
                               for p in range(self.world_size)], axis=0)

    # ------------------------------------------------------- placing values
    def from_native(self, value: Any) -> Any:
        return value

    def distribute_datasets_from_function(self, dataset_fn, options,
                                          input_context) -> Any:
        return None  # built by the neutral layer

    def distribute_dataset(self, dataset: Any, options: Any) -> Any:
        return None  # split by the neutral DistributedDataset


class JaxTpuEngine(JaxEngine):
    """The engine of a `kd.TPUStrategy` on JAX: a `JaxEngine` over a mesh
    `(replicas, logical devices)` whose replicas each span
    `num_logical_devices` devices (see `jobs.make_tpu_engine`)."""

    contract: Tuple[type, ...] = JaxEngine.contract + (interface.TpuEngine,)

    def __init__(self, devices: Sequence[Any], layout_map: LayoutMap,
                 num_logical_devices: int, *, services: KerasServices):
        super().__init__(devices, layout_map, services=services)
        self.num_logical_devices = num_logical_devices
