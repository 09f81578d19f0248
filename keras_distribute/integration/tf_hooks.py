"""The TensorFlow backend's hooks into Keras (installed by `hooks.install`).

1. Keras scales each replica's mean loss by `1 / num_replicas`, wrong when
   a short last batch is split unevenly; the hook on `Loss.__call__` scales
   it by `local_batch / global_batch` instead (and
   `unscale_loss_for_distribution` undoes that for the logged loss). Inside
   a Keras step (`fit`, `evaluate`, ...) under a kd strategy the scaling
   goes to the gradient only: the loss keeps its value, so a user's
   `train_step` that logs `compute_loss(...)` logs the true loss, as on JAX
   and torch (`scale_loss_for_distribution`; Keras' own step's unscaling
   is then the identity). Custom loops in `strategy.run` keep
   tf.distribute's scaled values.
2. `int(v)` / `float(v)` of a scalar variable made in a strategy's scope
   (a tf.distribute `MirroredVariable` inside) read its value, as they do
   outside (`int(ckpt.step)` in the TF checkpoint guide's loop).
3. Multi-worker `fit` (keras#20585): the symbolic build and the scalar
   metric reduction.
4. An optimizer first applied inside a `tf.function` makes its slots under
   `init_scope` (Keras 3.16 does it itself).
5. `CommunicationOptions(compression=...)`: the optimizer's gradient
   all-reduce in a 16-bit type.
6. Optimizer updates inside `keras.ops.cond` (`gradient_accumulation_steps`,
   EMA with `ema_overwrite_frequency`): tf.distribute refuses a `merge_call`
   inside a replica's control flow, so those updates run in cross-replica
   context, on gradients all-reduced before the condition.
7. An optimizer's update waits for its gradients. Keras counts
   `iterations` with an op that needs no data; on a dataset of unknown
   length (e.g. from `distribute_datasets_from_function`) each epoch ends
   with a call whose `get_next` fails, and the count ran in it anyway, on
   some replicas or all (copies one apart: a divergence; or one count too
   many per epoch, which Keras alone on TF counts too). Under a kd strategy
   the whole update depends on the gradients: a step without data changes
   nothing.

Every Keras-private name comes from `registry`.
"""

import functools
import threading

import keras

from keras_distribute.integration import patching
from keras_distribute.integration import registry


def install() -> None:
    """Installs the TensorFlow hooks (`hooks.install` calls it once)."""
    loss_module = registry.resolve("loss_module")

    from keras_distribute.backend.tensorflow import fit as tf_fit

    original_call = loss_module.Loss.__call__
    original_scale = loss_module.scale_loss_for_distribution
    original_unscale = loss_module.unscale_loss_for_distribution
    last_factor = threading.local()  # per replica thread

    @functools.wraps(original_call)
    def __call__(self, y_true, y_pred, sample_weight=None):
        value = original_call(self, y_true, y_pred, sample_weight)
        factor = tf_fit.uneven_batch_loss_factor(self, y_pred)
        last_factor.value = factor
        if factor is None:
            return value
        # Keras 3.16 returns an empty tensor, not 0, for a replica with no
        # rows (its mean then read NaN): the sum is 0 there, the value
        # itself elsewhere.
        scaled = keras.ops.sum(value) * factor
        if tf_fit.steps_log_true_losses():
            return tf_fit.value_of_with_gradient_of(
                keras.ops.sum(value), scaled)
        return scaled

    @functools.wraps(original_scale)
    def scale_loss_for_distribution(value):
        scaled = original_scale(value)
        if not tf_fit.steps_log_true_losses():
            return scaled
        # In a Keras step under a kd strategy the loss keeps its value (what
        # a user's `train_step` logs) and takes the scaled gradient (what
        # the optimizer's sum over replicas needs).
        return tf_fit.value_of_with_gradient_of(value, scaled)

    @functools.wraps(original_unscale)
    def unscale_loss_for_distribution(value):
        if tf_fit.steps_log_true_losses():
            return value  # never scaled (above)
        factor = getattr(last_factor, "value", None)
        if factor is None:
            return original_unscale(value)
        # A replica with an empty slice has loss 0 and factor 0.
        return original_unscale(keras.ops.divide_no_nan(
            value, keras.ops.cast(factor, value.dtype)))

    patching.patch(loss_module.Loss, "__call__", __call__)
    patching.patch(loss_module, "scale_loss_for_distribution",
                   scale_loss_for_distribution)
    patching.patch(loss_module, "unscale_loss_for_distribution",
                   unscale_loss_for_distribution)
    _install_tf_scalar_conversions()
    _install_tf_multi_worker_fixes()
    _install_tf_optimizer_build_fix()
    _install_tf_lazy_build_fix()
    _install_tf_cross_replica_apply()
    _install_tf_gradient_compression()
    _install_tf_update_after_gradients()


def _install_tf_optimizer_build_fix() -> None:
    """The tf.distribute custom-training tutorial's loop: `@tf.function`
    around `strategy.run(step)` whose optimizer is not built yet. Keras
    3.15 makes the slots inside the traced function and the first step
    fails ('You must feed a value for placeholder tensor', keras#23085);
    Keras 3.16 makes them under `tf.init_scope()` (keras#23087). The same
    here, on the versions without it."""
    import tensorflow as tf

    optimizer_class = registry.resolve("TFOptimizer")
    if "add_variable" in optimizer_class.__dict__:
        return  # Keras does it itself
    original = optimizer_class.add_variable

    @functools.wraps(original)
    def add_variable(self, *args, **kwargs):
        with tf.init_scope():
            return original(self, *args, **kwargs)

    patching.patch(optimizer_class, "add_variable", add_variable)


def _install_tf_lazy_build_fix() -> None:
    """The tf.distribute custom-training tutorial's model: a `Sequential`
    with no input shape, built by its first call inside `@tf.function`
    around `strategy.run(step)`. Keras 3 (3.15 and 3.16, and with plain
    tf.distribute too) makes the layers' variables inside the traced
    function: tf.function lifts the mirrored copies' initializers, which read
    the first copy, and the first step fails ('You must feed a value for
    placeholder tensor'). tf.keras 2 built layers under `tf.init_scope()`;
    here a variable a kd strategy makes from an initializer inside a traced
    function is made the same way, eagerly, and the function captures it."""
    import tensorflow as tf

    from keras_distribute.backend.tensorflow import fit as tf_fit

    variable_class = registry.resolve("tf_Variable")
    original = variable_class._initialize_with_initializer

    @functools.wraps(original)
    def _initialize_with_initializer(self, initializer):
        if tf.executing_eagerly() or tf_fit.current_engine() is None:
            return original(self, initializer)
        # Still in the replica's context there (tf.distribute keeps it per
        # thread), so the strategy makes one mirrored variable from the
        # first replica's value, as when a layer builds eagerly in `run`.
        with tf.init_scope():
            return original(self, initializer)

    patching.patch(variable_class, "_initialize_with_initializer",
                   _initialize_with_initializer)


def _install_tf_scalar_conversions() -> None:
    """`int()` / `float()` of a Keras variable holding a tf.distribute
    variable (Keras calls `int(self.value)`, which TF refuses for it)."""
    import tensorflow as tf
    tf_variable = registry.resolve("tf_Variable")

    def conversion(name, convert):
        original = getattr(tf_variable, name)

        @functools.wraps(original)
        def method(self):
            if self.ndim == 0 and isinstance(
                    getattr(self, "_value", None),
                    tf.distribute.DistributedValues):
                return convert(self.numpy())
            return original(self)
        return method

    patching.patch(tf_variable, "__int__", conversion("__int__", int))
    patching.patch(tf_variable, "__float__", conversion("__float__", float))


def _install_tf_multi_worker_fixes() -> None:
    """Keras 3 `fit` under tf.distribute.MultiWorkerMirroredStrategy.

    Upstream (keras#20585) it fails twice: the symbolic build reduces the
    first batch with a cross-worker MEAN (integer labels and unequal shapes
    break it), and `reduce_per_replica` reduces scalar metric results along
    axis 0. Only kd's multi-worker strategies take the fixed paths.
    """
    import tensorflow as tf
    tf_trainer = registry.resolve("tf_trainer")
    tf_trainer_class = registry.resolve("TFTrainer")

    from keras_distribute.backend import tensorflow as tf_backend
    from keras_distribute.backend.tensorflow import fit as tf_fit

    original_build = tf_trainer_class._maybe_symbolic_build

    @functools.wraps(original_build)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras averages the replicas' first batches to get their shapes:
        # that fails when a short batch splits unevenly ([2, 4] vs [0, 4]),
        # on one worker too. Every kd strategy takes one replica's slice.
        # It also reads shapes from the dataset's spec instead of peeking at
        # a batch: an iterator dropped right after one batch can crash
        # TensorFlow (`tf_fit.replica_batch_spec`).
        strategy = self._distribute_strategy
        if iterator is None or tf_fit.engine_of(strategy) is None:
            return original_build(self, iterator, data_batch)
        data_batch = tf_fit.replica_batch_spec(
            getattr(iterator, "_distributed_dataset", None))
        if data_batch is None:  # the spec does not say: peek, as Keras does
            for _, _, batches in iterator:
                # Any one local replica's slice has the shapes and dtypes.
                data_batch = keras.tree.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v,
                    next(batches))
                break
        with strategy.scope():
            try:
                self._symbolic_build(data_batch=data_batch)
            except RuntimeError as error:
                # A model whose own `train_step` does the work and which
                # has no `call` (keras-io's GAN): Keras without a strategy
                # defers its build to the step's first trace; so does kd
                # (the step's variables are then made as in `run`).
                if not _builds_in_its_own_step(self, tf_trainer_class,
                                               error):
                    raise

    original_reduce = tf_trainer.reduce_per_replica

    @functools.wraps(original_reduce)
    def reduce_per_replica(values, strategy, reduction):
        if reduction not in ("auto", "mean") or not tf_backend.is_multi_worker(
                strategy):
            return original_reduce(values, strategy, reduction)

        def reduce(value):
            # Metric results are already global; average scalars across
            # workers with axis=None (axis=0 does not exist for them).
            axis = None if len(getattr(value, "shape", ())) == 0 else 0
            return strategy.reduce("MEAN", value, axis=axis)

        return keras.tree.map_structure(reduce, values)

    patching.patch(tf_trainer_class, "_maybe_symbolic_build",
           _maybe_symbolic_build)
    patching.patch(tf_trainer, "reduce_per_replica", reduce_per_replica)


def _builds_in_its_own_step(model, trainer_class, error) -> bool:
    """Whether `model` could not be built symbolically because its work is
    in an overridden `train_step` (its build then waits for the step)."""
    overridden = type(model).train_step is not trainer_class.train_step
    return overridden and "Unable to automatically build the model" in str(
        error)


def _install_tf_cross_replica_apply() -> None:
    """`SGD(..., gradient_accumulation_steps=k)` (or EMA with an overwrite
    frequency) under a strategy. Keras wraps the update in `ops.cond`; the
    update all-reduces and updates mirrored variables through `merge_call`,
    which tf.distribute refuses inside a replica's `cond` ('merge_call
    called while defining a new graph'; native tf.distribute + Keras 3
    fails the same way). Here the gradients are all-reduced in one
    `merge_call` before the condition and Keras' own update (condition,
    accumulators, clipping, weight decay, EMA) runs in cross-replica
    context, where every variable update applies to all its copies.

    An optimizer that clips (`clipnorm`, `clipvalue`, `global_clipnorm`)
    takes the same path: Keras' TF optimizer clips before its all-reduce,
    so each replica clipped its own part of the gradient (a different
    update from one device's; native tf.distribute + Keras 3 does the
    same), where tf.distribute's Keras 2 optimizers clipped the sum."""
    import tensorflow as tf

    from keras_distribute.backend.tensorflow import fit as tf_fit

    optimizer_class = registry.resolve("TFOptimizer")
    original = optimizer_class._backend_apply_gradients

    def needs_cross_replica(optimizer):
        return bool(optimizer.gradient_accumulation_steps) or bool(
            optimizer.use_ema and optimizer.ema_overwrite_frequency) or any(
                getattr(optimizer, option, None) is not None for option in
                ("clipnorm", "clipvalue", "global_clipnorm"))

    @functools.wraps(original)
    def _backend_apply_gradients(self, grads, trainable_variables):
        replica_context = tf.distribute.get_replica_context()
        if (not needs_cross_replica(self) or replica_context is None
                or not tf.distribute.has_strategy()):
            return original(self, grads, trainable_variables)
        trainable_variables = list(trainable_variables)
        # Cast here, in the replica (where the gradients are tensors).
        grads, restore = tf_fit.compress_for_all_reduce(grads)

        def apply_in_cross_replica(strategy, grads):
            extended = strategy.extended
            reduced = restore(extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM,
                [(g, v.value) for g, v in zip(grads, trainable_variables)]))
            # Keras' TF optimizer asks for a merge_call unless the strategy
            # runs without one; here, already in cross-replica context, its
            # update function must run directly.
            extended._use_merge_call = lambda: False
            try:
                return original(self, reduced, trainable_variables)
            finally:
                del extended._use_merge_call

        replica_context.merge_call(apply_in_cross_replica,
                                   args=(list(grads),))

    patching.patch(optimizer_class, "_backend_apply_gradients",
                   _backend_apply_gradients)


def _install_tf_gradient_compression() -> None:
    """`CommunicationOptions(compression="fp16"|"bf16")`: Keras' TF
    optimizer all-reduces the replicas' gradients (a SUM in replica
    context); they go to it in the 16-bit type and come back in their
    own. Without compression the call is Keras' own."""
    from keras_distribute.backend.tensorflow import fit as tf_fit

    optimizer_class = registry.resolve("TFOptimizer")
    original = optimizer_class._all_reduce_sum_gradients

    @functools.wraps(original)
    def _all_reduce_sum_gradients(self, grads_and_vars):
        engine = tf_fit.current_engine()
        if engine is None or engine.gradient_compression is None:
            return original(self, grads_and_vars)
        pairs = list(grads_and_vars)
        present = [(g, v) for g, v in pairs if g is not None]
        grads, restore = tf_fit.compress_for_all_reduce(
            [g for g, _ in present])
        reduced = iter(restore([g for g, _ in original(
            self, list(zip(grads, [v for _, v in present])))]))
        return [(None if g is None else next(reduced), v) for g, v in pairs]

    patching.patch(optimizer_class, "_all_reduce_sum_gradients",
                   _all_reduce_sum_gradients)


def _install_tf_update_after_gradients() -> None:
    """Inside a graph step of a kd strategy, every op of the optimizer's
    `apply` (its iteration count included) waits for the gradients (see
    the module docstring, 7)."""
    import tensorflow as tf

    from keras_distribute.backend.tensorflow import fit as tf_fit

    optimizer_class = registry.resolve("TFOptimizer")
    original = optimizer_class.apply

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if tf.executing_eagerly() or tf_fit.current_engine() is None:
            return original(self, grads, trainable_variables)
        grads = list(grads)
        tensors = [g.values if isinstance(g, tf.IndexedSlices) else g
                   for g in grads if g is not None]
        with tf.control_dependencies(tensors):
            return original(self, grads, trainable_variables)

    patching.patch(optimizer_class, "apply", apply)
