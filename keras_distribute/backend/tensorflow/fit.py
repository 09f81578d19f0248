"""What `fit` under tf.distribute needs beyond Keras: uneven batches.

Keras scales each replica's mean loss by `1 / num_replicas`, exact only when
every replica holds as many examples. `uneven_batch_loss_factor` gives the
correction (`local / global` weighting) that `integration.hooks` applies; it is
skipped, with its per-step all-reduce, when every batch of a `fit` on arrays
splits evenly. A last batch smaller than the replica count leaves replicas
empty, which unsynchronized BatchNormalization turns into NaN: kd warns.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.distribute import values as tf_values

if TYPE_CHECKING:
    from keras import Model
    from keras.optimizers import Optimizer

    from keras_distribute.backend.interface import ReplicaEngine
    from keras_distribute.backend.tensorflow.engine import TfEngine

# The attribute of a tf.distribute strategy kd made that refers (weakly: the
# engine holds its strategy) to its kd engine, where the state of the
# strategy's `fit` and gradient compression lives (`TfEngine`). No
# module-level table: the link goes with the strategy object.
_ENGINE_ATTRIBUTE = "_keras_distribute_engine"


def register_engine(tf_strategy: Any, engine: TfEngine) -> None:
    """Records `engine` as the kd engine of `tf_strategy`."""
    setattr(tf_strategy, _ENGINE_ATTRIBUTE, weakref.ref(engine))


def engine_of(tf_strategy: Any) -> Any:
    """The kd engine of a tf.distribute strategy, or `None` for one kd did
    not make (e.g. the user's own `tf.distribute.MirroredStrategy`)."""
    reference = getattr(tf_strategy, _ENGINE_ATTRIBUTE, None)
    return reference() if isinstance(reference, weakref.ref) else None


def current_engine() -> Any:
    """The kd engine of the current tf.distribute strategy, or `None`."""
    if not tf.distribute.has_strategy():
        return None
    return engine_of(tf.distribute.get_strategy())


def steps_log_true_losses() -> bool:
    """Whether a loss computed now keeps its value and carries the
    per-replica scaling in its gradient only: inside a Keras trainer call
    (`fit`, `evaluate`, ...) of a kd strategy with several replicas, in a
    replica's context."""
    engine = current_engine()
    return engine is not None and engine.trainer_calls > 0 and (
        tf.distribute.get_replica_context() is not None
        and tf.distribute.get_strategy().num_replicas_in_sync > 1)


def value_of_with_gradient_of(value: Any, scaled: Any) -> Any:
    """A tensor whose value is `value`'s and whose gradient is `scaled`'s."""
    return scaled + tf.stop_gradient(value - scaled)


def uneven_batch_loss_factor(loss: Any, y_pred: Any) -> Any:
    """How much to rescale a replica's loss so that uneven batches weigh right.

    Keras scales each replica's mean loss by `1 / num_replicas`, which is
    exact only when every replica holds as many examples. The right scale is
    `local_batch / global_batch`; this returns the ratio of the two scales
    (`num_replicas * local / global`), or `None` outside a replica step of a
    kd strategy or for a loss that is not averaged over the batch.
    """
    if getattr(loss, "reduction", None) != "sum_over_batch_size":
        return None
    engine = current_engine()
    if engine is None or engine.even_fit:
        return None
    tf_context = tf.distribute.get_replica_context()
    num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if tf_context is None or num_replicas == 1:
        return None
    first = keras.tree.flatten(y_pred)[0]
    local = tf.cast(tf.shape(first)[0], "float32")
    total = tf_context.all_reduce("SUM", local)
    return tf.math.divide_no_nan(num_replicas * local, total)


def fit_sizes(args: tuple, kwargs: dict):
    """`(num_samples, batch_size)` of `fit` on arrays, else `None`."""
    x = args[0] if args else kwargs.get("x")
    leaves = keras.tree.flatten(x) if x is not None else []
    if not leaves or not all(hasattr(leaf, "shape") and not isinstance(
            leaf, tf.data.Dataset) for leaf in leaves):
        return None
    if kwargs.get("steps_per_epoch") is not None or len(args) > 3:
        return None
    num_samples = leaves[0].shape[0]
    batch_size = (args[2] if len(args) > 2 else kwargs.get("batch_size")) or 32
    split = kwargs.get("validation_split") or 0.0
    if split and kwargs.get("validation_data") is None:
        num_samples = int(num_samples * (1.0 - split))
    return num_samples, batch_size


def warn_if_replicas_get_empty_batches(model, args, kwargs,
                                        num_replicas: int) -> None:
    sizes = fit_sizes(args, kwargs)
    if sizes is None:
        return
    last = sizes[0] % sizes[1]
    if not 0 < last < num_replicas:
        return
    unsynced = [layer.name for layer in model._flatten_layers()
                if isinstance(layer, keras.layers.BatchNormalization)
                and not layer.synchronized]
    if unsynced:
        warnings.warn(
            f"The last batch of each epoch has {last} example(s) for "
            f"{num_replicas} replicas, so some replicas get an empty batch, "
            "on which BatchNormalization(synchronized=False) computes NaN "
            f"statistics (layers: {unsynced}). Use "
            "BatchNormalization(synchronized=True), which also matches the "
            "single-device statistics, or a batch size that leaves at least "
            f"{num_replicas} examples in the last batch.", stacklevel=4)
    if has_own_train_step(model):
        warnings.warn(
            f"The last batch of each epoch has {last} example(s) for "
            f"{num_replicas} replicas, so some replicas run "
            f"{type(model).__name__}'s own train_step on an empty batch. "
            + _EMPTY_BATCH_ADVICE.format(replicas=num_replicas),
            stacklevel=4)


# What a step of the user's own may do on an empty batch, and the ways out.
_EMPTY_BATCH_ADVICE = (
    "Keras' own step handles an empty batch; a step of your own may not: "
    "TensorFlow's oneDNN convolutions return a wrong shape for one (a GAN's "
    "step then fails with e.g. 'ConcatOp : Dimension 3 in both shapes must "
    "be equal: shape[0] = [0,8,8,8] vs. shape[1] = [0,8,8,1]'), and plain "
    "tf.distribute fails on such a step too. Use a batch size that leaves "
    "at least {replicas} examples in the last batch, drop it (tf.data: "
    "`.batch(size, drop_remainder=True)`), or set TF_ENABLE_ONEDNN_OPTS=0 "
    "before TensorFlow is imported.")


def has_own_train_step(model) -> bool:
    """Whether `model`'s class (or one between it and Keras') defines its
    own `train_step`."""
    step = getattr(type(model), "train_step", None)
    return step is not None and not str(
        getattr(step, "__module__", "")).startswith("keras.")


def note_empty_batches(error: BaseException, model, num_replicas: int
                       ) -> None:
    """Adds to a TensorFlow error raised by `fit` of a model with its own
    `train_step` on several replicas a note: an empty batch on some
    replicas may be why (the error keeps its type and message)."""
    if (num_replicas < 2 or not has_own_train_step(model)
            or not isinstance(error, tf.errors.OpError)
            or not hasattr(error, "add_note")):
        return
    error.add_note(
        f"keras_distribute: if the global batch of this step had fewer "
        f"examples than the {num_replicas} replicas (the short last batch "
        "of an epoch), some replicas ran "
        f"{type(model).__name__}'s own train_step on an empty batch. "
        + _EMPTY_BATCH_ADVICE.format(replicas=num_replicas))


def batches_split_evenly(args: tuple, kwargs: dict, num_replicas: int) -> bool:
    """Whether every training batch of `fit(x=arrays, ...)` splits evenly.

    Conservative: `False` for datasets, generators and `steps_per_epoch`.
    """
    sizes = fit_sizes(args, kwargs)
    if sizes is None:
        return False
    num_samples, batch_size = sizes
    return (batch_size % num_replicas == 0
            and (num_samples % batch_size) % num_replicas == 0)


def replica_batch_spec(distributed_dataset: Any) -> Any:
    """One replica's batch of a distributed dataset, as `keras.KerasTensor`s.

    Read from the dataset's `element_spec`: no iterator is made. Keras' TF
    trainer peeks at the first batch to build the model symbolically, then
    drops that iterator while its prefetch threads still run, and
    TensorFlow's `MultiDeviceIterator` can then crash the process (its
    background thread reads through the context of the per-device iterator
    being destroyed: a segmentation fault, about once in a few hundred
    epochs with validation on a loaded 2-core machine). The symbolic build
    needs only shapes and dtypes.

    Args:
        distributed_dataset: a `tf.distribute.DistributedDataset`.

    Returns:
        The batch's structure with a `keras.KerasTensor` per tensor, or
        `None` where the spec does not give every shape and dtype (an
        unknown rank, a leaf that is not a tensor's spec).

    Example:

    >>> spec = replica_batch_spec(strategy.experimental_distribute_dataset(
    ...     tf.data.Dataset.from_tensor_slices((x, y)).batch(8)))
    >>> spec[0].shape
    (None, 64)
    """
    spec = getattr(distributed_dataset, "element_spec", None)
    if spec is None:
        return None
    tensor_specs = (tf.TensorSpec, tf.SparseTensorSpec, tf.RaggedTensorSpec)
    unknown = []

    def to_keras_tensor(leaf):
        if isinstance(leaf, tf_values.PerReplicaSpec):
            leaf = leaf._component_specs[0]  # every replica's has the rank
        if not isinstance(leaf, tensor_specs) or leaf.shape.rank is None:
            unknown.append(leaf)
            return None
        return keras.KerasTensor(tuple(leaf.shape.as_list()),
                                 dtype=keras.backend.standardize_dtype(
                                     leaf.dtype))

    batch = keras.tree.map_structure(to_keras_tensor, spec)
    return None if unknown else batch


def value_and_gradients(model: Model, compute_loss, x: Any) -> tuple:
    """`(loss, gradients, y_pred)` by a `tf.GradientTape`."""
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = compute_loss(y_pred, model.losses)
    return loss, tape.gradient(loss, model.trainable_variables), y_pred


def apply_gradients(engine: ReplicaEngine, optimizer: Optimizer, grads: Any,
                    variables: Any) -> None:
    """In a tf.distribute replica context the optimizer sums the replicas'
    gradients itself (what the tutorials rely on); its all-reduce applies
    the strategy's compression (`compress_for_all_reduce`), so `engine` is
    not read here."""
    optimizer.apply_gradients(zip(grads, variables))


def compress_for_all_reduce(grads: Any) -> tuple:
    """`(grads in the compression dtype, restore)` for the current strategy.

    Dense floating gradients are cast to the strategy's compression dtype
    (`CommunicationOptions(compression=...)`; unchanged without one);
    `restore(reduced)` casts the all-reduced values back. What one traced
    step reduces is recorded in the engine's `traced_gradient_reductions`.
    """
    grads = list(grads)
    engine = current_engine()
    dtype = engine.gradient_compression if engine is not None else None
    if dtype is None:
        return grads, lambda reduced: reduced
    dtypes = [g.dtype for g in grads]

    def compress(g):
        if isinstance(g, tf.Tensor) and g.dtype.is_floating:
            return tf.cast(g, dtype)
        return g

    compressed = [compress(g) for g in grads]
    engine.traced_gradient_reductions[:] = [
        (g.dtype.name, g.shape.num_elements() * g.dtype.size)
        for g in compressed if isinstance(g, tf.Tensor)]

    def restore(reduced):
        return [r if r is None or r.dtype == d else tf.cast(r, d)
                for r, d in zip(reduced, dtypes)]

    return compressed, restore
