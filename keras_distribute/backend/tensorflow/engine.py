"""The TensorFlow engine: one `tf.distribute` strategy per kd strategy.

`TfEngine` drives a `tf.distribute.MirroredStrategy` (or the multi-worker or
TPU strategy the backend module made) for `run`, `reduce`, `gather`, the
scope and the input pipeline; the backend module
(`backend/tensorflow/__init__.py`) builds it. Its `run`, `reduce` and
`gather` are `replica_run.ReplicaRun` (a base of `TfEngine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import keras
import numpy as np
import tensorflow as tf
from keras.distribution import DeviceMesh
from tensorflow.python.distribute import values as tf_values

from keras_distribute.backend import interface
from keras_distribute.backend.tensorflow import cluster as tf_cluster
from keras_distribute.backend.tensorflow import fit as tf_fit
from keras_distribute.backend.tensorflow.devices import device_name
from keras_distribute.backend.tensorflow.replica_run import ReplicaRun
from keras_distribute.backend.tensorflow.replica_run import to_tensor
from keras_distribute.common.devices import parse_device_name
from keras_distribute.common.input_context import InputContext
from keras_distribute.common.keras_services import KerasServices
from keras_distribute.common.values import PerReplica
from keras_distribute.job import peer_board

if TYPE_CHECKING:
    from keras import Model

    from keras_distribute.cluster_resolver.base import ClusterResolver

# `isinstance(value, kd.PerReplica)` holds for tf.distribute's own values.
PerReplica.register(tf_values.PerReplica)
_strategies_created = 0
_KEY_BASE_STRIDE = 1_000_000


def _tf_options(options) -> Optional[tf.distribute.InputOptions]:
    if options is None:
        return None
    mode = getattr(tf.distribute.InputReplicationMode,
                   options.experimental_replication_mode.value)
    return tf.distribute.InputOptions(
        experimental_fetch_to_device=options.experimental_fetch_to_device,
        experimental_replication_mode=mode,
        experimental_place_dataset_on_device=(
            options.experimental_place_dataset_on_device),
        experimental_per_replica_buffer_size=(
            options.experimental_per_replica_buffer_size),
    )


def _new_mirrored_strategy(devices: Sequence[Any]):
    # Every strategy in a process needs its own collective group keys,
    # else a second strategy over another device count aborts its
    # collectives ("joining a group with size 2, but that group has size
    # 4"). TensorFlow's own test combinations move the key base the same
    # way; it is restored so that plain tf.distribute strategies created
    # later keep the keys they would have had.
    global _strategies_created
    _strategies_created += 1
    cls = tf.distribute.MirroredStrategy
    saved_base = cls._collective_key_base
    cls._collective_key_base = _KEY_BASE_STRIDE * _strategies_created
    try:
        return cls(devices=[d.name for d in devices])
    finally:
        cls._collective_key_base = saved_base


class TfEngine(ReplicaRun):
    """The per-strategy TensorFlow engine (see `interface.ReplicaEngine`)."""

    # `constrain` lays tensors out (a TPU engine adds `TpuEngine`).
    contract: Tuple[type, ...] = (interface.LogicalDeviceEngine,)
    # tf.distribute feeds each worker's replicas itself.
    fit_per_process = False
    num_logical_devices = 1  # per replica; a TPU engine's may be more

    def __init__(self, devices: Optional[Sequence[Any]], *,
                 services: KerasServices, tf_strategy: Any = None,
                 resolver: ClusterResolver | None = None):
        self.keras_services = services
        if tf_strategy is None:
            if devices is None:
                raise ValueError(
                    "A TfEngine is made over `devices` or an existing "
                    "`tf_strategy`. Received neither: pass one of them.")
            self.tf_strategy = _new_mirrored_strategy(devices)
        else:
            self.tf_strategy = tf_strategy
        tf_fit.register_engine(self.tf_strategy, self)
        # Inside a `fit` whose every training batch splits evenly (the
        # replicas then skip the uneven-batch all-reduce).
        self.even_fit = False
        self.trainer_calls = 0  # `fit` & co. running (call_trainer)
        # `CommunicationOptions(compression=...)`: the dtype gradients are
        # all-reduced in (None: their own), and the `(dtype, bytes)` of the
        # gradients the last traced step handed to the all-reduce.
        self.gradient_compression = None
        self.traced_gradient_reductions: List[Any] = []
        self.multi_worker = resolver is not None
        self._resolver = resolver  # names a lost worker (tf_cluster)
        self.is_chief = resolver.is_chief if resolver is not None else True
        worker_devices = self.tf_strategy.extended.worker_devices
        self.devices = tuple(devices) if devices is not None else tuple(
            tf.config.LogicalDevice(name=d, device_type=parse_device_name(
                d).device_type.upper()) for d in worker_devices)
        self.num_replicas = self.tf_strategy.num_replicas_in_sync
        first = (resolver.process_id * len(worker_devices)
                 if resolver is not None else 0)
        self.local_replica_ids = tuple(
            range(first, first + len(worker_devices)))
        self.num_input_pipelines = (
            resolver.num_processes if resolver is not None else 1)
        self.input_pipeline_id = resolver.process_id if resolver else 0
        self.process_count = self.num_input_pipelines
        self.process_id = self.input_pipeline_id
        self.device_mesh = DeviceMesh(
            shape=(self.num_replicas,), axis_names=["batch"],
            devices=[f"cpu:{i}" for i in range(self.num_replicas)]
            if resolver is not None else
            [device_name(d) for d in self.devices],
        )
        # keras.distribution has no TensorFlow implementation.
        self.distribution = None

    def scope(self):
        return self.tf_strategy.scope()

    # ------------------------------------------------------------ variables
    def variable_layout(self, variable: Any) -> tuple:
        size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
        return (None,) * len(variable.shape), size

    def owns_variable(self, variable: Any) -> bool:
        value = getattr(variable, "_value", variable)
        return isinstance(value, tf_values.DistributedValues) and (
            self.tf_strategy.extended.variable_created_in_scope(value))

    def adopt_variables(self, variables: Sequence[Any]) -> None:
        # tf.distribute cannot turn a plain variable into a mirrored one.
        strays = [v.path for v in variables if not self.owns_variable(v)]
        if strays:
            raise ValueError(
                "Some variables used by this model were created outside the "
                "strategy's scope, which tf.distribute cannot mirror "
                f"afterwards. Received: {len(strays)} such variable(s), e.g. "
                f"{strays[:3]}. Create the optimizer (and build the model) "
                "inside the scope:\n\n"
                "    with strategy.scope():\n"
                "        model = ...\n"
                "        model.compile(optimizer=keras.optimizers.SGD(0.1))\n"
            )

    def variable_local_results(self, variable: Any) -> Optional[tuple]:
        value = getattr(variable, "_value", None)
        if isinstance(variable, keras.Variable) and isinstance(
            value, tf_values.DistributedValues
        ):
            return tuple(self.tf_strategy.experimental_local_results(value))
        return None

    def replica_copies(self, variable: Any,
                       one_per_region: bool = False) -> list:
        """Each local replica's copy of a mirrored variable (one for a plain
        one): whole copies."""
        region = interface.whole_region(tuple(variable.shape))
        copies = self.variable_local_results(variable) or (variable.value,)
        if one_per_region:
            copies = copies[:1]
        # One read op per copy, viewed in place: `.numpy()` added an
        # identity op and a host copy (a third of the divergence check).
        return [(region, np.asarray(copy.value() if isinstance(
            copy, tf.Variable) else copy)) for copy in copies]

    def constrain(self, tensor: Any, parts: Sequence[int],
                  in_replica: bool) -> Any:
        """TPUStrategy's own split (or replicate) to logical devices."""
        if all(count == 1 for count in parts):
            return self.tf_strategy.experimental_replicate_to_logical_devices(
                tensor)
        return self.tf_strategy.experimental_split_to_logical_devices(
            tensor, list(parts))

    def assign_to_logical_device(self, tensor: Any,
                                 logical_device_id: int) -> Any:
        """TPUStrategy's own placement on one logical device."""
        return self.tf_strategy.experimental_assign_to_logical_device(
            tensor, logical_device_id)

    def set_gradient_compression(self, name: str) -> None:
        """The optimizer all-reduces gradients in `name`'s dtype ("fp16"
        or "bf16"; see `tf_fit.compress_for_all_reduce`)."""
        self.gradient_compression = {
            "fp16": tf.float16, "bf16": tf.bfloat16}[name]

    def barrier(self, name: str) -> None:
        if self.multi_worker:  # a one-element all-reduce over every worker
            self.tf_strategy.run(lambda: tf.distribute.get_replica_context(
            ).all_reduce("SUM", tf.constant(1.0)))

    def broadcast_text(self, text: str) -> str:
        if not self.multi_worker:
            return text
        from keras_distribute.backend.interface import broadcast_text_by

        # A sum in which only the chief's first replica contributes.
        return broadcast_text_by(self._sum_from_chief, text)

    def process_all_gather(self, array: np.ndarray) -> np.ndarray:
        """Every worker's `array` (same shape), stacked in worker order: a
        sum in which each worker's first replica fills its own row."""
        array = np.asarray(array)
        if not self.multi_worker:
            return array[None]
        workers = self.process_count
        per_worker = self.num_replicas // workers
        kind = array.dtype
        summable = array.astype(np.float64 if kind.kind == "f" else np.int64)

        def contribute():
            context_ = tf.distribute.get_replica_context()
            replica = context_.replica_id_in_sync_group
            rows = tf.one_hot(replica // per_worker, workers,
                              dtype=summable.dtype)
            own = tf.reshape(rows, [workers] + [1] * summable.ndim) * (
                tf.constant(summable)[None])
            return context_.all_reduce("SUM", tf.where(
                tf.equal(replica % per_worker, 0), own, tf.zeros_like(own)))

        result = self.tf_strategy.run(contribute)
        stacked = self.tf_strategy.experimental_local_results(result)[0]
        return stacked.numpy().astype(kind)

    def _sum_from_chief(self, array: np.ndarray) -> np.ndarray:
        def contribute():  # replica 0 (on the chief) alone adds its part
            context_ = tf.distribute.get_replica_context()
            own = tf.constant(array)
            return context_.all_reduce("SUM", tf.where(
                tf.equal(context_.replica_id_in_sync_group, 0), own,
                tf.zeros_like(own)))

        result = self.tf_strategy.run(contribute)
        return self.tf_strategy.experimental_local_results(result)[0].numpy()

    def call_trainer(self, method: Callable, model: Model, args: tuple,
                     kwargs: dict) -> Any:
        if method.__name__ == "predict_on_batch":
            # Keras' TF `predict_on_batch` feeds the whole batch to every
            # replica and concatenates N copies; `predict` splits it.
            (x,) = args or (kwargs["x"],)
            size = keras.tree.flatten(x)[0].shape[0]
            return model.predict(x, batch_size=size, verbose=0)
        if method.__name__ == "fit":
            tf_fit.warn_if_replicas_get_empty_batches(model, args, kwargs,
                                                self.num_replicas)
        even = method.__name__ == "fit" and tf_fit.batches_split_evenly(
            args, kwargs, self.num_replicas)
        if even:
            self.even_fit = True
        self.trainer_calls += 1
        try:
            with peer_board.busy(), \
                    tf_cluster.naming_a_lost_worker(self._resolver):
                return method(model, *args, **kwargs)
        except tf.errors.OpError as error:
            if method.__name__ == "fit":
                tf_fit.note_empty_batches(error, model, self.num_replicas)
            raise
        finally:
            self.trainer_calls -= 1
            self.even_fit = False

    # ------------------------------------------------------- placing values
    def from_native(self, value: Any) -> Any:
        def convert(leaf):
            if isinstance(leaf, tf_values.DistributedValues):
                return PerReplica(
                    self.tf_strategy.experimental_local_results(leaf))
            return leaf

        return keras.tree.map_structure(convert, value)

    def _to_native(self, value: Any) -> Any:
        def convert(leaf):
            if isinstance(leaf, PerReplica) and not isinstance(
                leaf, tf_values.DistributedValues
            ):
                return tf_values.PerReplica(tuple(leaf.values))
            return leaf

        return keras.tree.map_structure(convert, value)

    def put_per_replica(self, structures: Sequence[Any],
                        on_device: bool = True) -> Any:
        return self.tf_strategy.experimental_distribute_values_from_function(
            lambda ctx: keras.tree.map_structure(
                to_tensor, structures[ctx.replica_id_in_sync_group])
        )

    def distribute_dataset(self, dataset: Any, options: Any) -> Any:
        if isinstance(dataset, tf.data.Dataset):
            return self.tf_strategy.experimental_distribute_dataset(
                dataset, _tf_options(options))
        return None

    def distribute_datasets_from_function(self, dataset_fn: Callable,
                                          options: Any,
                                          input_context: Any) -> Any:
        if not isinstance(dataset_fn(input_context), tf.data.Dataset):
            return None  # arrays, a list of batches: kd's own pipeline

        def tf_dataset_fn(tf_context):
            return dataset_fn(InputContext(
                num_input_pipelines=tf_context.num_input_pipelines,
                input_pipeline_id=tf_context.input_pipeline_id,
                num_replicas_in_sync=tf_context.num_replicas_in_sync,
            ))

        return self.tf_strategy.distribute_datasets_from_function(
            tf_dataset_fn, _tf_options(options))


class TfTpuEngine(TfEngine):
    """The engine of a `kd.TPUStrategy` on TensorFlow: a `TfEngine` over a
    `tf.distribute.TPUStrategy` whose replicas each span
    `num_logical_devices` cores (see `make_tpu_engine`)."""

    contract: Tuple[type, ...] = TfEngine.contract + (interface.TpuEngine,)

    def __init__(self, tf_strategy: Any, num_logical_devices: int, *,
                 services: KerasServices):
        super().__init__(None, tf_strategy=tf_strategy, services=services)
        self.num_logical_devices = num_logical_devices
