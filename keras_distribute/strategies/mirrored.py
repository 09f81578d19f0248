"""`MirroredStrategy`: synchronous data parallelism over one host's devices."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING
from typing import Any
from typing import Dict
from typing import Optional
from typing import Sequence

from keras_distribute.backend import get_backend
from keras_distribute.common.cross_device_ops import CrossDeviceOps
from keras_distribute.common.devices import parse_device_name
from keras_distribute.strategies.strategy import Strategy

if TYPE_CHECKING:
    from keras.distribution import LayoutMap


def _resolve_devices(backend, devices: Sequence[Any]) -> list:
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise ValueError(
            "Expected `devices` to be a list of device names (e.g. "
            "['GPU:0', 'GPU:1']) or device objects. Received: "
            f"devices={devices!r}. Wrap a single device in a list."
        )
    devices = list(devices)
    if not devices:
        raise ValueError(
            "Expected at least one device. Received: devices=[]. Pass "
            "`devices=None` to use all local devices."
        )
    resolved = [
        backend.resolve_device(
            parse_device_name(d) if isinstance(d, str) else d
        )
        for d in devices
    ]
    seen: Dict[Any, Any] = {}
    for given, device in zip(devices, resolved):
        if device in seen:
            raise ValueError(
                f"The device {backend.device_name(device)!r} is listed twice "
                f"(as {seen[device]!r} and {given!r}). Received: "
                f"devices={devices!r}. List each device once."
            )
        seen[device] = given
    return resolved


class MirroredStrategy(Strategy):
    """Synchronous training on all devices of one machine.

    Each variable created in `scope()` is replicated on every device (or
    laid out by `layout_map`); each training step splits the **global**
    batch across the replicas and combines their gradients, so N replicas
    on a batch of B make the same update as one device on B.

    On JAX this drives `keras.distribution.DataParallel` (or `ModelParallel`
    with a `layout_map`), compiled by XLA as one SPMD program. On torch each
    process is one replica; with a `layout_map` that shards variables, each
    position on the mesh's batch axis is a replica held by the processes
    along its model axes, its variables as DTensors.

    Args:
        devices: The devices to use: names such as `"GPU:0"`, `"/gpu:1"`,
            `"cpu:0"`, `"/job:localhost/replica:0/task:0/device:CPU:0"`, or
            backend device objects. Defaults to all local GPUs/TPUs, else
            all local CPU devices.
        cross_device_ops: `kd.NcclAllReduce()`,
            `kd.HierarchicalCopyAllReduce()` or `kd.ReductionToOneDevice()`
            (or tf.distribute's), accepted for `tf.distribute` compatibility
            and kept as `strategy.cross_device_ops`; the backend's engine
            chooses the all-reduce algorithm. Defaults to `None`.
        layout_map: Optional `keras.distribution.LayoutMap` that shards
            variables over a model axis (model parallelism). Its mesh's first
            axis is the replica (batch) axis.
        communication_options: Optional `kd.CommunicationOptions`; its
            `compression` ("fp16"/"bf16") halves the bytes of the gradient
            all-reduce (every backend; on JAX not with a `layout_map`).

    Raises:
        TypeError: for a `cross_device_ops` that is none of those.
        ValueError: for an unknown, duplicate or malformed device,
            `communication_options` that is not a `kd.CommunicationOptions`
            or asks for compression with a `layout_map` (JAX),
            `devices` that disagree with `layout_map`'s mesh, or (torch) a
            mesh whose size is not the number of processes.
        NotImplementedError: on a backend not supported yet; sharded
            layouts on TensorFlow; (torch) a variable sharded over the batch
            axis.

    Example:

    ```python
    import keras_distribute as kd
    strategy = kd.MirroredStrategy()
    print(strategy.num_replicas_in_sync)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64, epochs=3)
    ```
    """

    def __init__(self, devices: Optional[Sequence[Any]] = None,
                 cross_device_ops: Any = None, *,
                 layout_map: LayoutMap | None = None,
                 communication_options: Any = None):
        backend = get_backend()
        if layout_map is not None:
            # A backend that cannot shard says so before its devices are
            # looked up (TF: "CPU:1" of a mesh would be unknown first).
            backend.refuse_unsupported_layouts(layout_map)
            mesh_devices = _mesh_devices(backend, layout_map)
            if devices is not None and set(
                _resolve_devices(backend, devices)
            ) != set(mesh_devices):
                raise ValueError(
                    "`devices` and the devices of `layout_map.device_mesh` "
                    f"differ. Received: devices={list(devices)!r}, mesh "
                    f"devices={[backend.device_name(d) for d in mesh_devices]}."
                    " Pass only `layout_map`, or build its mesh on `devices`."
                )
            resolved = mesh_devices
        elif devices is None:
            resolved = backend.default_devices()
        else:
            resolved = _resolve_devices(backend, devices)
        if cross_device_ops is not None and not isinstance(
                cross_device_ops, CrossDeviceOps) and not type(
                cross_device_ops).__module__.startswith("tensorflow"):
            raise TypeError(
                "Expected `cross_device_ops` to be None or one of "
                "kd.NcclAllReduce(), kd.HierarchicalCopyAllReduce(), "
                "kd.ReductionToOneDevice(). Received: "
                f"cross_device_ops={cross_device_ops!r}.")
        from keras_distribute import integration

        super().__init__(backend.make_engine(
            resolved, layout_map=layout_map,
            services=integration.services()))
        self._set_communication_options(communication_options)
        if self._engine.process_count == 1:
            _warn_if_in_a_job()
        # The engine chooses the all-reduce; kept for inspection only.
        self.cross_device_ops = cross_device_ops


def _warn_if_in_a_job() -> None:
    """Warns when the environment describes a job of several processes that
    this one-process strategy leaves out (each process would train alone)."""
    from keras_distribute.cluster_resolver import resolvers as cluster_resolver

    found = []
    for resolver in cluster_resolver.DETECTED_IN_ORDER:
        if not resolver.detect():
            continue
        if resolver is not cluster_resolver.RayTrainClusterResolver:
            try:  # (Ray's is a collective to make; it detects 2+ workers)
                if resolver().num_processes < 2:
                    continue
            except ValueError:  # malformed: the multi-worker strategy says
                continue
        found.append(resolver.__name__)
    if found:
        warnings.warn(
            f"kd.MirroredStrategy uses this process's devices only, but the "
            f"environment describes a job of several processes "
            f"({found[0]}): every process would train its own model. Use "
            "kd.MultiWorkerMirroredStrategy() to train one model over the "
            "job.", stacklevel=3)


def _mesh_devices(backend, layout_map) -> list:
    mesh = getattr(layout_map, "device_mesh", None)
    if mesh is None:
        raise ValueError(
            "Expected `layout_map` to be a `keras.distribution.LayoutMap` "
            f"built on a `DeviceMesh`. Received: layout_map={layout_map!r}."
        )
    return backend.mesh_devices(layout_map)


class OneDeviceStrategy(MirroredStrategy):
    """Everything on one device, as `tf.distribute.OneDeviceStrategy`: one
    replica, so `run`, `reduce` and distributed datasets work unchanged on
    a single GPU, TPU core or the CPU (code written for a strategy, run
    without distribution).

    Args:
        device: The device, e.g. `"GPU:0"` or `"cpu:0"`.

    Raises:
        ValueError: for an unknown or malformed device.

    Example:

    ```python
    strategy = kd.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ```
    """

    def __init__(self, device: Any):
        if isinstance(device, (list, tuple)):
            raise ValueError(
                "OneDeviceStrategy takes one device. Received: "
                f"device={device!r}. Use kd.MirroredStrategy(devices) for "
                "several.")
        super().__init__(devices=[device])
