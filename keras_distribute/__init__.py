"""keras_distribute: the tf.distribute programming model for Keras 3.

`MirroredStrategy`, `strategy.scope()`, `run` / `reduce`, distributed
datasets and replica contexts, on the JAX, TensorFlow and PyTorch backends,
built on `keras.distribution`.

Example:

```python
import keras_distribute as kd

strategy = kd.MirroredStrategy()
with strategy.scope():
    model = make_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=256, epochs=3)   # 256 = global batch size
```
"""

from keras_distribute import checkpoint
from keras_distribute import cluster_resolver
from keras_distribute import integration  # noqa: F401 (registers its hooks)
from keras_distribute import layouts
from keras_distribute.cluster_resolver.tpu import (
    experimental_connect_to_cluster,
)
from keras_distribute.cluster_resolver.tpu import initialize_tpu_system
from keras_distribute.common.context import ReplicaContext
from keras_distribute.common.context import ValueContext
from keras_distribute.common.context import get_replica_context
from keras_distribute.common.context import get_strategy
from keras_distribute.common.context import has_strategy
from keras_distribute.common.context import in_cross_replica_context
from keras_distribute.common.cross_device_ops import CommunicationImplementation
from keras_distribute.common.cross_device_ops import CommunicationOptions
from keras_distribute.common.cross_device_ops import CrossDeviceOps
from keras_distribute.common.cross_device_ops import HierarchicalCopyAllReduce
from keras_distribute.common.cross_device_ops import NcclAllReduce
from keras_distribute.common.cross_device_ops import ReductionToOneDevice
from keras_distribute.common.errors import ReplicasDivergedError
from keras_distribute.common.errors import WorkerLostError
from keras_distribute.common.input_context import InputContext
from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.simulate import simulate_cpu_devices
from keras_distribute.common.values import DistributedValues
from keras_distribute.common.values import PerReplica
from keras_distribute.common.values import to_numpy as numpy
from keras_distribute.input.datasets import AutoShardPolicy
from keras_distribute.input.datasets import DistributedDataset
from keras_distribute.input.datasets import InputOptions
from keras_distribute.input.datasets import InputReplicationMode
from keras_distribute.input.iterator import DistributedIterator
from keras_distribute.input.iterator import OptionalValue
from keras_distribute.input.iterator import OutOfRangeError
from keras_distribute.launch.launcher import LaunchError
from keras_distribute.launch.launcher import launch
from keras_distribute.launch.launcher import notebook_launcher
from keras_distribute.strategies import default as _default_strategy  # noqa: F401
from keras_distribute.strategies.extended import StrategyExtended
from keras_distribute.strategies.mirrored import MirroredStrategy
from keras_distribute.strategies.mirrored import OneDeviceStrategy
from keras_distribute.strategies.multi_worker import MultiWorkerMirroredStrategy
from keras_distribute.strategies.strategy import Strategy
from keras_distribute.strategies.tpu import DeviceAssignment
from keras_distribute.strategies.tpu import TPUStrategy
from keras_distribute.training.collectives import allgather
from keras_distribute.training.collectives import allreduce
from keras_distribute.training.collectives import broadcast
from keras_distribute.training.collectives import process_count
from keras_distribute.training.collectives import process_index
from keras_distribute.training.custom_loop import train_step
from keras_distribute.training.divergence import set_divergence_check
from keras_distribute.training.losses import compute_average_loss
from keras_distribute.training.losses import scale_regularization_loss

__version__ = "0.1.0"


def __getattr__(name):
    # `kd.callbacks` subclasses Keras callbacks, so it imports Keras (and
    # the backend framework): loaded on first use, not with the package.
    if name in ("callbacks", "experimental"):
        import importlib

        return importlib.import_module(f"keras_distribute.{name}")
    raise AttributeError(f"module 'keras_distribute' has no attribute {name!r}")


__all__ = (
    "AutoShardPolicy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DeviceAssignment",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "LaunchError",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "OptionalValue",
    "OutOfRangeError",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "ReplicasDivergedError",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "ValueContext",
    "WorkerLostError",
    "allgather",
    "allreduce",
    "broadcast",
    "callbacks",
    "checkpoint",
    "cluster_resolver",
    "layouts",
    "compute_average_loss",
    "experimental",
    "experimental_connect_to_cluster",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_tpu_system",
    "launch",
    "notebook_launcher",
    "numpy",
    "process_count",
    "process_index",
    "scale_regularization_loss",
    "set_divergence_check",
    "simulate_cpu_devices",
    "train_step",
)
