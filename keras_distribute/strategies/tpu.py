"""`TPUStrategy`: replicas of several logical devices each, on TPU cores.

On JAX the strategy is a `DeviceMesh` with a replica axis (`"batch"`) and a
logical-device axis (`"model"`); variables follow `layout_map` (model
parallelism) and the logical-device operations become sharding constraints.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from typing import Any
from typing import Optional
from typing import Sequence
from typing import cast

from keras_distribute.backend import get_backend
from keras_distribute.backend import interface
from keras_distribute.common import context
from keras_distribute.strategies.strategy import Strategy

if TYPE_CHECKING:
    from keras.distribution import LayoutMap


class DeviceAssignment:
    """How many replicas, each of how many logical devices (TPU cores).

    Args:
        num_replicas: The number of model replicas (data parallelism).
        computation_shape: Logical devices per replica: an int or a list
            whose product is taken (a TPU topology shape such as
            `[1, 1, 1, 2]`). Defaults to `1`.
        devices: Explicit devices, replica-major (`num_replicas *
            prod(computation_shape)` of them). Defaults to the TPU cores.
            Give CPU devices to simulate a TPU slice in tests.

    Raises:
        ValueError: on non-positive sizes or a device count that does not
            match.

    Example:

    ```python
    assignment = kd.DeviceAssignment(num_replicas=4, computation_shape=2,
                                     devices=jax.devices())   # 8 devices
    strategy = kd.TPUStrategy(device_assignment=assignment)
    ```
    """

    def __init__(self, num_replicas: int, computation_shape: Any = 1,
                 devices: Optional[Sequence[Any]] = None):
        shape = list(computation_shape) if isinstance(
            computation_shape, (list, tuple)) else [computation_shape]
        if not all(isinstance(s, int) and s >= 1 for s in shape) or not (
                isinstance(num_replicas, int) and num_replicas >= 1):
            raise ValueError(
                "Expected a positive int `num_replicas` and positive ints in "
                f"`computation_shape`. Received: num_replicas={num_replicas!r}"
                f", computation_shape={computation_shape!r}.")
        self.num_replicas = num_replicas
        self.computation_shape = shape
        self.num_logical_devices = math.prod(shape)
        self.devices = list(devices) if devices is not None else None
        needed = num_replicas * self.num_logical_devices
        if self.devices is not None and len(self.devices) != needed:
            raise ValueError(
                f"{num_replicas} replicas of {self.num_logical_devices} "
                f"logical devices need {needed} devices. Received "
                f"{len(self.devices)} devices. Pass exactly {needed}, or "
                "change num_replicas / computation_shape.")

    @classmethod
    def build(cls, topology: Any = None, computation_shape: Any = 1,
              num_replicas: int = 1, devices: Optional[Sequence[Any]] = None
              ) -> "DeviceAssignment":
        """`tf.tpu.experimental.DeviceAssignment.build`-style constructor.

        Args:
            topology: Ignored (JAX knows the slice's topology).
            computation_shape: Logical devices per replica.
            num_replicas: Number of replicas.
            devices: Explicit devices, as in the constructor.

        Returns:
            A `DeviceAssignment`.
        """
        return cls(num_replicas, computation_shape, devices)

    def __repr__(self) -> str:
        return (f"<DeviceAssignment num_replicas={self.num_replicas}, "
                f"computation_shape={self.computation_shape}>")


class TPUStrategy(Strategy):
    """Synchronous training on TPU cores, with model parallelism per replica.

    Each replica spans `device_assignment.num_logical_devices` cores: the
    strategy's mesh is `(num_replicas, logical devices)` with axes
    `("batch", "model")`. Variables are replicated unless `layout_map`
    shards them over `"model"`; `fit`, `evaluate`, `predict`, `run` and
    `reduce` work as on the other strategies.

    Args:
        tpu_cluster_resolver: Accepted for `tf.distribute` compatibility; on
            a multi-host TPU pod JAX finds its peers itself.
        device_assignment: A `kd.DeviceAssignment`. Defaults to one replica
            per TPU core.
        layout_map: Optional `keras.distribution.LayoutMap` over a mesh with
            axes `("batch", "model")` of the same devices.

    Raises:
        RuntimeError: without TPUs, unless the device assignment names
            devices explicitly (how tests simulate a slice on CPU).
        NotImplementedError: on the torch backend.

    Example:

    ```python
    strategy = kd.TPUStrategy()
    with strategy.scope():
        model = make_model()
    model.fit(dataset, epochs=3)
    ```
    """

    def __init__(self, tpu_cluster_resolver: Any = None,
                 device_assignment: Optional[DeviceAssignment] = None,
                 layout_map: LayoutMap | None = None):
        backend = get_backend()
        backend.refuse_tpu_strategy()
        if device_assignment is not None and not isinstance(
                device_assignment, DeviceAssignment):
            raise ValueError(
                "Expected `device_assignment` to be a kd.DeviceAssignment. "
                f"Received: {type(device_assignment).__name__}.")
        self._assignment = device_assignment
        from keras_distribute import integration

        super().__init__(backend.make_tpu_engine(
            tpu_cluster_resolver, device_assignment, layout_map,
            services=integration.services()))

    @property
    def _tpu_engine(self) -> interface.TpuEngine:
        # `make_tpu_engine` declares it (its `contract`); the base class
        # types its engine as the plain `ReplicaEngine`.
        return cast(interface.TpuEngine, self._engine)

    @property
    def num_logical_devices(self) -> int:
        """Logical devices (cores) per replica."""
        return self._tpu_engine.num_logical_devices

    def experimental_split_to_logical_devices(self, tensor: Any,
                                              partition_dimensions: Sequence[
                                                  int]) -> Any:
        """Splits `tensor` across each replica's logical devices.

        Args:
            tensor: A tensor, inside a `fit`/`run` step or a jitted function.
            partition_dimensions: How many parts each dimension is cut into;
                the product must equal the logical devices per replica.

        Returns:
            `tensor`, laid out accordingly (values unchanged).

        Raises:
            ValueError: on a wrong length, a product that does not match, or
                a dimension not divisible by its parts.

        Example:

        ```python
        # 8 logical devices: images (B, H, W, C) cut 2 x 4 over H and W.
        x = strategy.experimental_split_to_logical_devices(x, [1, 2, 4, 1])
        ```
        """
        parts = list(partition_dimensions)
        shape = tuple(tensor.shape)
        if len(parts) != len(shape):
            raise ValueError(
                f"`partition_dimensions` needs one entry per dimension of "
                f"the tensor (rank {len(shape)}). Received: "
                f"partition_dimensions={parts} for shape {shape}.")
        if math.prod(parts) != self.num_logical_devices:
            raise ValueError(
                f"The product of `partition_dimensions` must equal the "
                f"{self.num_logical_devices} logical devices per replica. "
                f"Received: partition_dimensions={parts} (product "
                f"{math.prod(parts)}).")
        for dim, (size, count) in enumerate(zip(shape, parts)):
            if size is not None and size % count:
                raise ValueError(
                    f"Dimension {dim} of the tensor (size {size}) does not "
                    f"divide into {count} parts. Received: "
                    f"partition_dimensions={parts} for shape {shape}.")
        return self._constrain(tensor, parts)

    def _constrain(self, tensor: Any, parts: Sequence[int]) -> Any:
        import keras

        if isinstance(tensor, keras.KerasTensor):
            return tensor  # symbolic: only real tensors have a layout
        return self._tpu_engine.constrain(tensor, parts, self._in_replica())

    def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
        """Replicates `tensor` on every logical device of its replica.

        Args:
            tensor: A tensor inside a step.

        Returns:
            `tensor`, replicated across the replica's logical devices.
        """
        return self._constrain(tensor, [1] * len(tensor.shape))

    def experimental_assign_to_logical_device(self, tensor: Any,
                                              logical_device_id: int) -> Any:
        """Places `tensor` on one logical device of its replica.

        On TensorFlow this is TPUStrategy's own placement. XLA's SPMD
        partitioner on JAX has no single-device placement inside a program,
        so there the tensor is kept replicated across the replica's logical
        devices (identical values; the id is validated).

        Args:
            tensor: A tensor inside a step.
            logical_device_id: The logical device, in
                `[0, num_logical_devices)`.

        Returns:
            `tensor`.

        Raises:
            ValueError: if `logical_device_id` is out of range.
        """
        if not isinstance(logical_device_id, int) or not (
                0 <= logical_device_id < self.num_logical_devices):
            raise ValueError(
                f"`logical_device_id` must be in [0, "
                f"{self.num_logical_devices}). Received: "
                f"logical_device_id={logical_device_id!r}.")
        if isinstance(self._engine, interface.LogicalDeviceEngine):
            return self._engine.assign_to_logical_device(tensor,
                                                         logical_device_id)
        return self.experimental_replicate_to_logical_devices(tensor)

    def _in_replica(self) -> bool:
        return context.get_replica_context() is not None and (
            context.has_strategy())
