"""The TensorFlow backend module: `tf.distribute.MirroredStrategy` underneath.

Variables created in the scope become `tf.distribute` mirrored variables,
Keras 3's TensorFlow trainer runs its steps through the strategy, and `run`,
`reduce`, `gather` and the replica context map onto their `tf.distribute`
counterparts. `run` returns `tf.distribute`'s own per-replica values, so it
works inside and outside `tf.function` alike. This module builds the
engine (`engine.TfEngine`) for each kind of strategy; `devices` finds
the logical devices.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

import tensorflow as tf

from keras_distribute.backend import interface
from keras_distribute.backend.tensorflow import cluster as tf_cluster
from keras_distribute.backend.tensorflow import fit as tf_fit
from keras_distribute.backend.tensorflow.checkpoint import checkpoint_assign  # noqa: F401
from keras_distribute.backend.tensorflow.checkpoint import checkpoint_snapshot  # noqa: F401
from keras_distribute.backend.tensorflow.checkpoint import checkpoint_value  # noqa: F401
from keras_distribute.backend.tensorflow.cluster import (
    bounded_multi_worker_strategy,
)
from keras_distribute.backend.tensorflow.devices import default_devices  # noqa: F401
from keras_distribute.backend.tensorflow.devices import device_name  # noqa: F401
from keras_distribute.backend.tensorflow.devices import resolve_device
from keras_distribute.backend.tensorflow.engine import TfEngine
from keras_distribute.backend.tensorflow.engine import TfTpuEngine
from keras_distribute.backend.tensorflow.fit import apply_gradients  # noqa: F401
from keras_distribute.backend.tensorflow.fit import value_and_gradients  # noqa: F401
from keras_distribute.backend.tensorflow.memory import step_memory  # noqa: F401
from keras_distribute.common.cross_device_ops import communication_timeout_s
from keras_distribute.common.devices import parse_device_name
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.layouts import layout_axes

if TYPE_CHECKING:
    from keras import Variable
    from keras.distribution import LayoutMap

    from keras_distribute.cluster_resolver.base import ClusterResolver

name = "tensorflow"


def is_multi_worker(strategy: Any) -> bool:
    """Whether `strategy` is the tf.distribute engine of a kd multi-worker."""
    return tf_fit.engine_of(strategy) is not None and isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy)


def make_multi_worker_engine(resolver: ClusterResolver,
                             timeout_s: Optional[float],
                             layout_map: LayoutMap | None = None, *,
                             services: KerasServices) -> "TfEngine":
    """A `tf.distribute.MultiWorkerMirroredStrategy` over `resolver`'s job."""
    _refuse_sharded(layout_map)
    timeout_s = communication_timeout_s(timeout_s)
    spec = resolver.cluster_spec()
    addresses = [a for job in ("chief", "worker") for a in spec.get(job, [])]
    if len(set(addresses)) != len(addresses):
        raise ValueError(
            "TensorFlow runs one server per worker, so every worker needs its "
            f"own 'host:port'. Received: {addresses}. Describe the job with "
            "TF_CONFIG or kd.cluster_resolver.SimpleClusterResolver(addresses)"
            " (torchrun, SLURM, submitit, JAX_COORDINATOR_ADDRESS and Ray's"
            " non-TensorFlow trainers give only the coordinator's address;"
            " Ray's TensorflowTrainer and Kubeflow's TFJob set TF_CONFIG).")
    if resolver.num_processes == 1:
        # One worker: tf.distribute's local multi-worker strategy (no
        # server, no coordination service), which any point of a program
        # may create, as plain tf.distribute.MultiWorkerMirroredStrategy().
        local = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=tf.distribute.cluster_resolver
            .SimpleClusterResolver(tf.train.ClusterSpec({})))
        return TfEngine(None, tf_strategy=local, resolver=resolver,
                        services=services)
    from keras_distribute.job import addresses as job_addresses

    tasks = spec.get(resolver.task_type, [])
    own = ""  # a task index outside the cluster: TensorFlow names it
    if 0 <= resolver.task_id < len(tasks):
        own = tasks[resolver.task_id]
        # TensorFlow's server listens on every interface; taken, it said
        # only "Could not start gRPC server"
        job_addresses.refuse_taken_port(
            "0.0.0.0", int(own.rpartition(":")[2]),
            f"TensorFlow's gRPC server of this task ({resolver.task_type} "
            f"{resolver.task_id}, given '{own}')",
            "give this task a free port in TF_CONFIG (or the cluster "
            "resolver); if another task of this job holds it, the two were "
            "given the same task index: give each task its own")
    tf_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type=resolver.task_type,
        task_id=resolver.task_id, rpc_layer="grpc")
    try:
        strategy = bounded_multi_worker_strategy(tf_resolver, timeout_s)
    except tf.errors.UnknownError as error:
        if "Could not start gRPC server" not in str(error):
            raise
        raise OSError(
            errno.EADDRINUSE,
            f"TensorFlow's gRPC server of this task ({resolver.task_type} "
            f"{resolver.task_id}) could not listen on its given address "
            f"'{own}': its port is taken, by another program or by another "
            "task of this job that was given the same task index. Give each "
            "task its own index and a free port in TF_CONFIG (or the "
            "cluster resolver).") from error
    except RuntimeError as error:
        raise RuntimeError(
            "tf.distribute's multi-worker collectives must be set up before "
            "TensorFlow runs anything. Create kd.MultiWorkerMirroredStrategy "
            "at the start of the program, before any tensor is made."
        ) from error
    tf_cluster.check_same_cluster(resolver, timeout_s)
    tf_cluster.watch_peers(resolver.process_id, resolver.num_processes,
                           timeout_s, host=job_addresses.host_of(resolver),
                           store_address=resolver.coordinator_address)
    return TfEngine(None, tf_strategy=strategy, resolver=resolver,
                    services=services)


def make_tpu_engine(tpu_cluster_resolver: Any, assignment: Any,
                    layout_map: LayoutMap | None = None, *,
                    services: KerasServices) -> "TfTpuEngine":
    """`tf.distribute.TPUStrategy` when this host has TPUs.

    Connects to the TPU cluster and initialises its TPU system (the steps of
    TensorFlow's TPU guide), and turns a `kd.DeviceAssignment` into
    `tf.tpu.experimental.DeviceAssignment.build(topology, ...)`; the
    logical-device operations then delegate to TensorFlow's own.
    """
    _refuse_sharded(layout_map)
    if (not tf.config.list_logical_devices("TPU")
            and tpu_cluster_resolver is None):
        raise RuntimeError(
            "kd.TPUStrategy on the 'tensorflow' backend needs TPUs (none "
            "found). On a TPU VM pass tpu_cluster_resolver="
            "tf.distribute.cluster_resolver.TPUClusterResolver(); to "
            "simulate a slice on CPU use the JAX backend with "
            "kd.DeviceAssignment(..., devices=jax.devices()).")
    from keras_distribute.cluster_resolver.tpu import TPUClusterResolver

    if isinstance(tpu_cluster_resolver, TPUClusterResolver):
        tpu_cluster_resolver = tf.distribute.cluster_resolver.\
            TPUClusterResolver(tpu=tpu_cluster_resolver.tpu_name)
    resolver = tpu_cluster_resolver or (
        tf.distribute.cluster_resolver.TPUClusterResolver())
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    tf_assignment = None
    if assignment is not None:
        shape = list(assignment.computation_shape)
        if len(shape) == 1:  # n cores per replica: the last topology axis
            shape = [1, 1, 1, shape[0]]
        tf_assignment = tf.tpu.experimental.DeviceAssignment.build(
            topology, computation_shape=shape,
            num_replicas=assignment.num_replicas)
    strategy = tf.distribute.TPUStrategy(
        resolver, experimental_device_assignment=tf_assignment)
    return TfTpuEngine(strategy, assignment.num_logical_devices
                       if assignment is not None else 1, services=services)


def refuse_unsupported_layouts(layout_map: LayoutMap) -> None:
    """Raises `NotImplementedError` for a layout map that shards variables
    (called before the mesh's devices are resolved)."""
    _refuse_sharded(layout_map)


def _refuse_sharded(layout_map: LayoutMap) -> None:
    if layout_map is None:
        return
    sharded = {
        key: layout.axes for key, layout in layout_map.items()
        if layout_axes(layout)
    }
    for axis in getattr(layout_map, "shards_over", ()):  # fully_sharded
        sharded[f"every variable of at least {layout_map.min_size} "
                f"elements, over {axis!r}"] = (axis,)
    if sharded:
        raise NotImplementedError(
            "Sharded variable layouts are not supported on the "
            "'tensorflow' Keras backend: keras.distribution has no "
            "TensorFlow implementation and tf.distribute.MirroredStrategy "
            "replicates variables. Received sharded layouts for "
            f"{sorted(sharded)}. Use the JAX backend for model "
            "parallelism, or a layout_map whose axes are all None.")


def make_engine(devices: Sequence[Any], layout_map: LayoutMap | None = None, *,
                services: KerasServices) -> "TfEngine":
    """Builds the engine of a strategy over `devices`."""
    _refuse_sharded(layout_map)
    if layout_map is not None:
        devices = [resolve_device(parse_device_name(str(d)))
                   for d in layout_map.device_mesh.devices.flatten()]
    return TfEngine(devices, services=services)


def checkpoint_pieces(variable: Variable, writer: int, process_id: int) -> list:
    """A (replicated) variable whole, in process `writer` only. Every
    process reads it: a sync-on-read variable's read is a collective
    every worker must join."""
    value = checkpoint_value(variable)
    if process_id != writer:
        return []
    return [(interface.whole_region(value.shape), value)]


def mesh_devices(layout_map: LayoutMap) -> list:
    """Every device of the mesh (one process holds all of them)."""
    return interface.mesh_devices_by_name(layout_map, resolve_device)


def host_rng_state() -> None:
    """TensorFlow's own generators live in the graph: none is global state
    kd saves (numpy's and Python's are saved by the caller)."""
    return None


def set_host_rng_state(state: Any) -> None:
    """Nothing to set (see `host_rng_state`)."""


def build_without_values(build: Callable[[], Any]) -> Any:
    """Builds in a graph of its own (`tf.Graph().as_default()`): every
    variable made, the model's and an optimizer's (`compile()` may be part
    of the build), is a node of that graph, never run, so a model of any
    size builds in seconds and holds no memory. The model returned holds
    graph variables: read its variables' shapes, dtypes and paths only.

    Raises:
        ValueError: if a layer's name is not one a TensorFlow graph takes
            (letters, digits and `_.-/>`; eager TensorFlow takes any)."""
    with tf.Graph().as_default():
        try:
            return build()
        except ValueError as error:
            if "is not a valid scope name" not in str(error):
                raise
            raise ValueError(
                "TensorFlow builds the model without values in a graph, "
                "where a layer's name may hold only letters, digits and "
                f"'_.-/>'. TensorFlow said: {error}. Rename the layer, or "
                "pass the model built instead of a function that builds "
                "it.") from None


def refuse_tpu_strategy() -> None:
    """A TPUStrategy can be made here (whether TPUs exist is the engine's
    to say): nothing is refused."""
