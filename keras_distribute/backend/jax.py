"""The JAX engine: `keras.distribution` layouts, XLA SPMD and `shard_map`.

Variables follow a `keras.distribution.DataParallel` (or `ModelParallel`)
that the strategy's scope makes current; Keras' JAX trainer then compiles
each step as one SPMD program, so gradients are combined by XLA. `run`
compiles `fn` once per replica with `jax.shard_map` over the batch axis;
per-replica inputs of unequal shape (a short last batch) run one thread per
replica instead, with collectives that meet at a barrier.
"""

import contextlib
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

import keras
from keras.distribution import DataParallel
from keras.distribution import DeviceMesh
from keras.distribution import ModelParallel
from keras.distribution import TensorLayout

from keras_distribute import context
from keras_distribute.devices import DeviceSpec
from keras_distribute.reduce_op import ReduceOp
from keras_distribute.values import PerReplica

name = "jax"
_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}
# A replica that never reaches a collective must not hang the others.
_COLLECTIVE_TIMEOUT_S = 300.0
_RUN_CACHE_SIZE = 64


def default_devices() -> list:
    """All local devices of JAX's default platform (GPU/TPU, else CPU)."""
    return list(jax.local_devices())


def device_name(device: Any) -> str:
    """`"cpu:0"`-style name of a `jax.Device`."""
    return f"{device.platform}:{device.id}"


def _available_names(platform: Optional[str] = None) -> list:
    try:
        devices = jax.local_devices(backend=platform) if platform else (
            jax.local_devices())
    except RuntimeError:
        devices = jax.local_devices()
    return [device_name(d) for d in devices]


def resolve_device(device: "DeviceSpec | Any") -> Any:
    """Resolves a `DeviceSpec` (or a `jax.Device`) to a local `jax.Device`."""
    if isinstance(device, jax.Device):
        if device not in jax.local_devices(backend=device.platform):
            raise ValueError(
                f"The device {device} is not local to this process. "
                f"Received: device={device!r}. Local devices: "
                f"{_available_names(device.platform)}."
            )
        return device
    if not isinstance(device, DeviceSpec):
        raise ValueError(
            "Expected a device name (e.g. 'GPU:0', 'cpu:1') or a "
            f"`jax.Device`. Received: device={device!r} of type "
            f"{type(device).__name__}."
        )
    if device.task not in (None, jax.process_index()):
        raise ValueError(
            f"The device {device} of task {device.task} is not local to this "
            f"process (task {jax.process_index()}). MirroredStrategy uses "
            "local devices only; use kd.MultiWorkerMirroredStrategy for "
            "several processes."
        )
    platform = _PLATFORMS.get(device.device_type)
    try:
        candidates = jax.local_devices(backend=platform) if platform else []
    except RuntimeError:
        candidates = []
    if device.index >= len(candidates):
        raise ValueError(
            f"Unknown device {str(device).upper()!r}: this process has "
            f"{len(candidates)} {device.device_type.upper()} device(s). "
            f"Available devices: {_available_names()}. On CPU, simulate "
            "more devices with XLA_FLAGS=--xla_force_host_platform_device_"
            "count=N (set before importing JAX)."
        )
    return candidates[device.index]


class _StrategyLayouts:
    """What a strategy's `keras.distribution` adds to Keras' own.

    A batch that does not divide by the replica count (a short last batch)
    is laid out replicated: every device computes the whole short batch,
    which gives exactly the single-device result with no padding to mask.
    A `layout_map` entry whose rank differs from its variable's is an error.
    """

    _kd_strategy_distribution = True

    def _init_layout_cache(self, batch_shards: int):
        self._batch_shards = batch_shards
        self._data_layouts = {}
        # Several processes: set by the engine for each batch it splits.
        self.batch_given_whole = None

    def get_data_layout(self, data_shape):
        rank = len(data_shape)
        if self.batch_given_whole is not None:
            divisible = rank > 0 and not self.batch_given_whole
        else:
            divisible = rank > 0 and data_shape[0] % self._batch_shards == 0
        key = (rank, divisible)
        if key not in self._data_layouts:
            axes = [None] * rank
            if divisible:
                axes[0] = self.batch_dim_name
            self._data_layouts[key] = TensorLayout(axes, self.device_mesh)
        return self._data_layouts[key]

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        if layout is not None:
            check_layout_fits(layout, variable.path, variable.shape)
        return layout


def _axis_size(mesh, axis) -> int:
    names = axis if isinstance(axis, (tuple, list)) else (axis,)
    size = 1
    for name in names:
        size *= mesh.shape[mesh.axis_names.index(name)]
    return size


def check_layout_fits(layout, path: str, shape) -> None:
    """Raises `ValueError` unless `layout` can lay out a `shape` tensor."""
    if len(layout.axes) != len(shape):
        raise ValueError(
            f"The layout for variable '{path}' has rank "
            f"{len(layout.axes)} but the variable has shape "
            f"{tuple(shape)} (rank {len(shape)}). "
            f"Received: layout axes={tuple(layout.axes)}. Give one "
            "mesh axis name (or None) per variable dimension.")
    mesh = layout.device_mesh
    for dim, (size, axis) in enumerate(zip(shape, layout.axes)):
        if axis is None or mesh is None:
            continue
        parts = _axis_size(mesh, axis)
        if size % parts:
            raise ValueError(
                f"Dimension {dim} of variable '{path}' (shape "
                f"{tuple(shape)}) has size {size}, which does not divide "
                f"into the {parts} devices of mesh axis {axis!r}. Received: "
                f"layout axes={tuple(layout.axes)}. Shard another dimension, "
                "or pick sizes divisible by the axis.")


def check_keys_match(layout_map, model) -> None:
    """Raises `ValueError` for a layout key that matches none of `model`'s
    variables (Keras would silently replicate what it meant to shard)."""
    import re

    paths = [v.path for v in model.weights]
    for key in layout_map:
        if not any(key == p or re.fullmatch(key, p) for p in paths):
            raise ValueError(
                f"The layout_map key {key!r} matches none of the variables of "
                f"model '{model.name}', so nothing would be sharded by it. "
                "Keys are regular expressions matched against the whole "
                f"`variable.path`, e.g. {paths[:3]}. Received: key={key!r}. "
                "Write the full path, or a pattern such as '.*dense.*kernel'.")


def check_layout_map(layout_map) -> None:
    """Raises `ValueError` for a layout naming an axis the mesh lacks."""
    mesh = layout_map.device_mesh
    for key, layout in layout_map.items():
        for axis in layout.axes:
            names = axis if isinstance(axis, (tuple, list)) else (axis,)
            unknown = [n for n in names if n is not None and n not in
                       mesh.axis_names]
            if unknown:
                raise ValueError(
                    f"The layout for {key!r} names mesh axis {unknown[0]!r}, "
                    f"but the mesh has axes {list(mesh.axis_names)}. "
                    f"Received: layout axes={tuple(layout.axes)}. Use the "
                    "mesh's axis names (or None).")


class _StrategyDataParallel(_StrategyLayouts, DataParallel):
    def __init__(self, device_mesh):
        super().__init__(device_mesh=device_mesh)
        self._init_layout_cache(device_mesh.shape[0])


class _StrategyModelParallel(_StrategyLayouts, ModelParallel):
    def __init__(self, layout_map, batch_dim_name):
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name)
        axis = layout_map.device_mesh.axis_names.index(batch_dim_name)
        self._init_layout_cache(layout_map.device_mesh.shape[axis])


def make_multi_worker_engine(resolver: Any, timeout_s: Optional[float],
                             layout_map: Any = None) -> "JaxEngine":
    """Joins the `jax.distributed` job `resolver` describes; all devices."""
    timeout_s = int(timeout_s or 60)
    if not jax.distributed.is_initialized():
        # SIGTERM must still end a process (JAX's preemption service would
        # swallow it); a dead peer is then noticed within the timeout.
        jax.config.update("jax_enable_preemption_service", False)
        try:
            jax.distributed.initialize(
                coordinator_address=resolver.coordinator_address,
                num_processes=resolver.num_processes,
                process_id=resolver.process_id,
                initialization_timeout=timeout_s,
                heartbeat_timeout_seconds=max(timeout_s, 10),
                shutdown_timeout_seconds=max(timeout_s, 10),
            )
        except RuntimeError as error:
            if "before any JAX" in str(error) or "backend" in str(error):
                raise RuntimeError(
                    "jax.distributed must start before JAX runs anything. "
                    "Create kd.MultiWorkerMirroredStrategy at the start of "
                    "the program, before any array is made.") from error
            raise TimeoutError(
                f"Not every worker joined within {timeout_s} s: process "
                f"{resolver.process_id} of {resolver.num_processes} waited "
                f"for the coordinator {resolver.coordinator_address}. Check "
                "that every worker started with the same cluster description."
                f" Cause: {error}") from error
        # As keras.distribution.initialize does: one global seed, so that
        # every process initialises variables to the same values.
        from keras.src.backend.jax import distribution_lib as keras_jax_lib

        keras_jax_lib.initialize_rng()
    elif jax.process_count() != resolver.num_processes:
        raise ValueError(
            f"jax.distributed runs {jax.process_count()} processes but the "
            f"cluster resolver describes {resolver.num_processes}. "
            f"Received: {resolver!r}.")
    return make_engine(list(jax.devices()), layout_map)


def make_tpu_engine(tpu_cluster_resolver: Any, assignment: Any,
                    layout_map: Any = None) -> "JaxEngine":
    """The engine of a TPUStrategy: mesh `(replicas, logical devices)`."""
    from keras.distribution import LayoutMap

    if assignment is not None and assignment.devices is not None:
        devices = [d if isinstance(d, jax.Device) else resolve_device(d)
                   for d in assignment.devices]
    elif jax.default_backend() == "tpu":
        devices = list(jax.devices())
    else:
        raise RuntimeError(
            "kd.TPUStrategy found no TPU (JAX's default backend is "
            f"'{jax.default_backend()}'). Run on a TPU VM, or simulate a "
            "slice by naming devices: kd.TPUStrategy(device_assignment="
            "kd.DeviceAssignment(num_replicas=4, computation_shape=2, "
            "devices=jax.devices())).")
    if assignment is None:
        num_replicas, logical = len(devices), 1
    else:
        num_replicas, logical = (assignment.num_replicas,
                                 assignment.num_logical_devices)
    if layout_map is None:
        mesh = DeviceMesh(
            shape=(num_replicas, logical), axis_names=["batch", "model"],
            devices=np.array([device_name(d) for d in devices]).reshape(
                num_replicas, logical))
        layout_map = LayoutMap(mesh)
    elif tuple(layout_map.device_mesh.shape) != (num_replicas, logical):
        raise ValueError(
            f"The layout_map's mesh has shape {layout_map.device_mesh.shape}"
            f" but the device assignment is {num_replicas} replicas x "
            f"{logical} logical devices. Build the LayoutMap on a "
            f"DeviceMesh of shape ({num_replicas}, {logical}).")
    engine = JaxEngine(devices, layout_map)
    engine.num_logical_devices = logical
    return engine


def make_engine(devices: Sequence[Any], layout_map: Any = None) -> "JaxEngine":
    """Builds the engine of a strategy over `devices`."""
    return JaxEngine(devices, layout_map)


class JaxEngine:
    """The per-strategy JAX engine (see `interface.ReplicaEngine`)."""

    def __init__(self, devices: Sequence[Any], layout_map: Any = None):
        self.devices = tuple(devices)
        if layout_map is None:
            self.device_mesh = DeviceMesh(
                shape=(len(self.devices),),
                axis_names=["batch"],
                devices=[device_name(d) for d in self.devices],
            )
            self.distribution = _StrategyDataParallel(self.device_mesh)
        else:
            check_layout_map(layout_map)
            self.device_mesh = layout_map.device_mesh
            self.distribution = _StrategyModelParallel(
                layout_map, self.device_mesh.axis_names[0]
            )
        self.layout_map = layout_map
        self.batch_axis = self.device_mesh.axis_names[0]
        self.num_replicas = self.device_mesh.shape[0]
        self.rank, self.world_size = jax.process_index(), jax.process_count()
        self.multi_process = self.world_size > 1
        self.num_input_pipelines = self.world_size
        self.input_pipeline_id = self.rank
        if self.multi_process:
            # Each process is handed its own rows (process_data.py).
            self.distribution.auto_shard_dataset = False
        self.mesh = self.device_mesh.backend_mesh
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
        self._run_cache = {}

    # ------------------------------------------------------------ variables
    def scope(self):
        return self.distribution.scope()

    def owns_variable(self, variable: Any) -> bool:
        value = getattr(variable, "_value", None)
        sharding = getattr(value, "sharding", None)
        return isinstance(sharding, NamedSharding) and (
            sharding.mesh.devices.shape == self.mesh.devices.shape
            and set(sharding.device_set) == set(self.mesh.devices.flat)
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

    def call_trainer(self, method: Callable, model: Any, args: tuple,
                     kwargs: dict) -> Any:
        # Keras' JAX trainer detaches variable values during `fit`; if the
        # call dies before re-attaching them, put the last values back so
        # the model stays usable (the next `fit` would otherwise fail).
        if self.layout_map is not None and model.built:
            check_keys_match(self.layout_map, model)
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and hasattr(optimizer, "variables"):
            variables += list(optimizer.variables)
        saved = [(v, v._value) for v in variables]
        try:
            if self.multi_process:
                from keras_distribute import process_data

                with _process_local_predictions(model):
                    return process_data.call_sharded(self, method, model,
                                                     args, kwargs)
            return method(model, *args, **kwargs)
        except BaseException:
            for variable, value in saved:
                if variable._value is None:
                    variable._value = value
            raise

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
            spec = [None] * len(parts)
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
        """This process's rows of a global batch.

        A batch that divides by the replica count is cut into equal
        per-process slices (laid out sharded); any other batch is given
        whole to every process and laid out replicated, which keeps the
        single-device result.
        """
        whole = batch % self.num_replicas != 0
        if rank is None:
            rank = self.rank
            self.distribution.batch_given_whole = whole
        if whole:
            return 0, batch
        per_process = batch // self.world_size
        return rank * per_process, (rank + 1) * per_process

    def shared_seed(self) -> int:
        """A random seed, the same in every process (process 0's)."""
        from jax.experimental import multihost_utils

        seed = np.int32(np.random.default_rng().integers(0, 2**31 - 1))
        return int(multihost_utils.broadcast_one_to_all(seed))

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

    def distribute_datasets_from_function(self, dataset_fn, options) -> Any:
        return None  # built by the neutral layer

    def distribute_dataset(self, dataset: Any, options: Any) -> Any:
        return None  # split by the neutral DistributedDataset

    def put_per_replica(self, structures: Sequence[Any],
                        on_device: bool = True) -> Any:
        def put(*leaves):
            if leaves[0] is None:
                return None
            if not on_device:
                return PerReplica([np.asarray(leaf) for leaf in leaves])
            return PerReplica([
                jax.device_put(_as_array(leaf), device)
                for leaf, device in zip(leaves, self.local_replica_devices)
            ])

        return keras.tree.map_structure(put, *structures)

    def _per_replica_shards(self, array: Any) -> tuple:
        """This process's replicas' parts of a global array, in order."""
        parts = [None] * len(self.local_replica_ids)
        for shard in array.addressable_shards:
            position = self._local_position.get(
                self._replica_of_device.get(shard.device))
            if position is not None and parts[position] is None:
                parts[position] = shard.data
        return tuple(parts)

    def _stack(self, values: Sequence[Any]) -> jax.Array:
        """One global array `(num_replicas, *shape)` from per-replica parts."""
        first = _as_array(values[0])
        shape = (self.num_replicas,) + tuple(np.shape(first))
        sharding = NamedSharding(self.mesh, PartitionSpec(self.batch_axis))
        pieces = []
        for device in sharding.addressable_devices_indices_map(shape):
            position = self._local_position[self._replica_of_device[device]]
            pieces.append(
                jax.device_put(_as_array(values[position])[None], device)
            )
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

    def _replicate(self, value: Any) -> Any:
        if isinstance(value, jax.Array) and value.sharding.device_set != set(
            self.mesh.devices.flat
        ):
            return jax.device_put(value, self._replicated)
        return value

    # ------------------------------------------------------------------ run
    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda x: isinstance(x, PerReplica)
        )
        kinds = tuple(_leaf_kind(leaf) for leaf in leaves)
        local = len(self.local_replica_ids)
        for leaf in leaves:
            if isinstance(leaf, PerReplica) and len(leaf) != local:
                raise ValueError(
                    f"A per-replica argument has {len(leaf)} components but "
                    f"this process runs {local} of the strategy's replicas. "
                    "Make it with this strategy's distributed dataset or "
                    "`experimental_distribute_values_from_function`."
                )
        if all(_even(leaf) for leaf, k in zip(leaves, kinds) if k == "split"):
            return self._run_spmd(strategy, fn, leaves, kinds, treedef)
        if self.multi_process:
            raise ValueError(
                "Per-replica inputs of different shapes (a short last batch) "
                "cannot run across several JAX processes: SPMD needs equal "
                "shapes. Batch the dataset with `drop_remainder=True`, or "
                "pad the last batch.")
        return self._run_threads(strategy, fn, leaves, kinds, treedef)

    def _run_spmd(self, strategy, fn, leaves, kinds, treedef):
        statics = tuple(
            leaf if kind == "static" else None
            for leaf, kind in zip(leaves, kinds)
        )
        compiled = self._compiled_run(strategy, fn, treedef, kinds, statics)
        dynamic = [
            self._stack(leaf.values) if kind == "split" else self._replicate(
                _as_array(leaf))
            for leaf, kind in zip(leaves, kinds) if kind != "static"
        ]
        outputs = compiled(*dynamic)
        return jax.tree_util.tree_map(
            lambda out: PerReplica(
                [part[0] for part in self._per_replica_shards(out)]
            ),
            outputs,
        )

    def _compiled_run(self, strategy, fn, treedef, kinds, statics):
        key = (fn, treedef, kinds, tuple(_static_key(s) for s in statics))
        cached = self._run_cache.get(key)
        if cached is not None:
            return cached[0]
        axis = self.batch_axis
        collectives = _SpmdCollectives(axis)

        def per_replica(*dynamic):
            dynamic = iter(dynamic)
            full = [
                static if kind == "static" else (
                    next(dynamic)[0] if kind == "split" else next(dynamic))
                for kind, static in zip(kinds, statics)
            ]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            ctx = context.ReplicaContext(
                strategy, jax.lax.axis_index(axis), collectives
            )
            with context._enter(strategy, ctx):
                result = fn(*call_args, **call_kwargs)
            return jax.tree_util.tree_map(
                lambda out: jnp.asarray(_unwrap(out))[None], result
            )

        in_specs = tuple(
            PartitionSpec(axis) if kind == "split" else PartitionSpec()
            for kind in kinds if kind != "static"
        )
        compiled = jax.jit(
            jax.shard_map(
                per_replica, mesh=self.mesh, in_specs=in_specs,
                out_specs=PartitionSpec(axis), check_vma=False,
                # Only the replica axis is manual: a model axis stays with
                # XLA, so layouts and logical-device constraints apply.
                axis_names=frozenset({axis}),
            )
        )
        if len(self._run_cache) >= _RUN_CACHE_SIZE:
            self._run_cache.pop(next(iter(self._run_cache)))
        # Keep `statics` alive so their ids in the key stay unique.
        self._run_cache[key] = (compiled, statics)
        return compiled

    def _run_threads(self, strategy, fn, leaves, kinds, treedef):
        n = self.num_replicas
        rendezvous = _Rendezvous(n)
        results, errors = [None] * n, [None] * n

        def replica_main(replica):
            device = self.replica_devices[replica]
            try:
                full = [
                    leaf.values[replica] if kind == "split" else leaf
                    for leaf, kind in zip(leaves, kinds)
                ]
                full = [
                    jax.device_put(_as_array(v), device)
                    if kind != "static" and v is not None else v
                    for v, kind in zip(full, kinds)
                ]
                call_args, call_kwargs = jax.tree_util.tree_unflatten(
                    treedef, full
                )
                ctx = context.ReplicaContext(
                    strategy, replica,
                    _ThreadCollectives(rendezvous, replica, device),
                )
                with jax.default_device(device), self.scope(), (
                        context._enter(strategy, ctx)):
                    results[replica] = fn(*call_args, **call_kwargs)
            except BaseException as error:  # re-raised in the caller
                errors[replica] = error
                rendezvous.abort()

        threads = [
            threading.Thread(target=replica_main, args=(i,), daemon=True)
            for i in range(n)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        real = [e for e in errors if e is not None and not isinstance(
            e, threading.BrokenBarrierError)]
        if real or any(errors):
            raise (real or [e for e in errors if e is not None])[0]
        return keras.tree.map_structure(
            lambda *parts: PerReplica(list(parts)), *results
        )

    # -------------------------------------------------- cross-replica ops
    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        values = [_as_array(v) for v in values]
        if axis is None:
            shapes = {tuple(np.shape(v)) for v in values}
            if len(shapes) > 1:
                raise ValueError(
                    "Cannot reduce per-replica values of different shapes "
                    f"{sorted(shapes)} with axis=None. Pass the batch "
                    "dimension as `axis` (usually `axis=0`)."
                )
            stacked = self._stack(values)
            result = _sum0(stacked) if op is ReduceOp.SUM else _mean0(stacked)
            return self._local(result)
        rank = np.ndim(values[0])
        if not -rank <= axis < rank:
            raise ValueError(
                f"`axis`={axis} is out of range for per-replica values of "
                f"rank {rank}. Use an axis in [{-rank}, {rank})."
            )
        partial_sums = [jnp.sum(v, axis=axis) for v in values]
        total = self._local(_sum0(self._stack(partial_sums)))
        if op is ReduceOp.SUM:
            return total
        counts = [np.float32(np.shape(v)[axis]) for v in values]
        return total / self._local(_sum0(self._stack(counts)))

    def _local(self, replicated: Any) -> Any:
        """A replicated global array as an array this process can read."""
        if self.multi_process:
            return replicated.addressable_data(0)
        return replicated

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        values = [_as_array(v) for v in values]
        rank = np.ndim(values[0])
        if rank == 0:
            raise ValueError(
                "`gather` needs per-replica values of rank >= 1 to "
                "concatenate. Received scalars. Use `reduce` for scalars, or "
                "give each replica's value a leading dimension."
            )
        if not -rank <= axis < rank:
            raise ValueError(
                f"`axis`={axis} is out of range for per-replica values of "
                f"rank {rank}. Use an axis in [{-rank}, {rank})."
            )
        host = self.local_replica_devices[0]
        local = jnp.concatenate(
            [jax.device_put(v, host) for v in values], axis=axis)
        if not self.multi_process:
            return local
        moved = np.moveaxis(np.asarray(local), axis, 0)
        return jnp.asarray(np.moveaxis(self.gather_rows(moved), 0, axis))


def _process_rows(array: Any) -> Any:
    """This process's rows of a global array sharded along axis 0."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return array
    if array.is_fully_replicated:
        return array.addressable_data(0)
    rows = {}
    for shard in array.addressable_shards:
        rows.setdefault(shard.index[0].start or 0, shard.data)
    # The shards live on different devices: meet on the host.
    return np.concatenate([np.asarray(rows[start]) for start in sorted(rows)],
                          axis=0)


@contextlib.contextmanager
def _process_local_predictions(model):
    """Makes Keras' predict function return process-local rows.

    Keras' JAX `predict` turns every batch's output into numpy, which a
    global array spanning several processes refuses; each process takes its
    own rows instead, and `process_data` puts them back together.
    """
    original = model.make_predict_function

    def make_predict_function(force=False):
        original(force)
        inner = model.predict_function
        if not getattr(inner, "_kd_process_rows", False):
            def predict_function(state, iterator):
                outputs, state = inner(state, iterator)
                return jax.tree_util.tree_map(_process_rows, outputs), state

            predict_function._kd_process_rows = True
            model.predict_function = predict_function
        return model.predict_function

    object.__setattr__(model, "make_predict_function", make_predict_function)
    try:
        yield
    finally:
        model.__dict__.pop("make_predict_function", None)


@jax.jit
def _sum0(stacked):
    return jnp.sum(stacked, axis=0)


@jax.jit
def _mean0(stacked):
    return jnp.mean(stacked, axis=0)


def _as_array(value: Any) -> Any:
    if isinstance(value, (jax.Array, np.ndarray)):
        return value
    if isinstance(value, keras.Variable):
        return value.value
    if hasattr(value, "numpy") and not isinstance(value, np.generic):
        return np.asarray(value.numpy())
    return np.asarray(value)


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, keras.Variable) else value


def _leaf_kind(leaf: Any) -> str:
    if isinstance(leaf, PerReplica):
        return "split"
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(leaf, "numpy") and hasattr(leaf, "shape")
        and not isinstance(leaf, keras.Variable)
    ):
        return "replicated"
    return "static"


def _even(leaf: PerReplica) -> bool:
    shapes = {(tuple(np.shape(v)), str(getattr(v, "dtype", type(v))))
              for v in leaf.values}
    return len(shapes) == 1


def _static_key(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return (type(value), value)
    return ("id", id(value))


class _SpmdCollectives:
    """Collectives inside `shard_map`: XLA all-reduce / all-gather."""

    def __init__(self, axis: str):
        self._axis = axis

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        reduce = jax.lax.psum if op is ReduceOp.SUM else jax.lax.pmean
        return jax.tree_util.tree_map(
            lambda v: reduce(jnp.asarray(_unwrap(v)), self._axis), value
        )

    def all_gather(self, value: Any, axis: int) -> Any:
        return jax.tree_util.tree_map(
            lambda v: jax.lax.all_gather(
                jnp.asarray(_unwrap(v)), self._axis, axis=axis, tiled=True
            ),
            value,
        )


class _Rendezvous:
    """Lets replica threads swap values; a failed replica breaks it."""

    def __init__(self, n: int):
        self._barrier = threading.Barrier(n, timeout=_COLLECTIVE_TIMEOUT_S)
        self._slots = [None] * n

    def exchange(self, replica: int, value: Any) -> list:
        self._slots[replica] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before all read
        return values

    def abort(self) -> None:
        self._barrier.abort()


class _ThreadCollectives:
    """Collectives between replica threads (per-replica shapes differ)."""

    def __init__(self, rendezvous: _Rendezvous, replica: int, device: Any):
        self._rendezvous = rendezvous
        self._replica = replica
        self._device = device

    def _local(self, values: list) -> list:
        return [jax.device_put(_as_array(_unwrap(v)), self._device)
                for v in values]

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        everyone = self._rendezvous.exchange(self._replica, value)

        def combine(*parts):
            parts = self._local(list(parts))
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total / len(parts) if op is ReduceOp.MEAN else total

        return keras.tree.map_structure(combine, *everyone)

    def all_gather(self, value: Any, axis: int) -> Any:
        everyone = self._rendezvous.exchange(self._replica, value)
        return keras.tree.map_structure(
            lambda *parts: jnp.concatenate(self._local(list(parts)), axis=axis),
            *everyone,
        )
