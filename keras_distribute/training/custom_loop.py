"""`kd.train_step`: the training step of a custom loop, once, for every
backend.

The tf.distribute tutorials write the step with `tf.GradientTape`, which
exists on TensorFlow only; JAX needs `jax.value_and_grad` over a stateless
call and torch `loss.backward()`. `train_step` is that step for all three,
so a ported loop needs one rewrite, not three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

from keras_distribute.training.losses import compute_average_loss
from keras_distribute.training.losses import scale_regularization_loss

if TYPE_CHECKING:
    from keras import Model
    from keras.optimizers import Optimizer


def train_step(model: Model, optimizer: Optimizer, loss_fn: Callable, x: Any,
               y: Any, sample_weight: Any = None,
               global_batch_size: Optional[int] = None,
               metrics: Sequence[Any] = ()) -> Any:
    """One training step of a custom loop, on every backend.

    Call it inside `strategy.run` (or without a strategy). It computes this
    replica's per-example losses, averages them over the **global** batch
    (`kd.compute_average_loss`, plus the model's regularization losses
    divided by the replica count), takes the gradients with the backend's
    own machinery, combines them over the replicas and applies them once,
    then updates `metrics` with `(y, y_pred)`.

    Args:
        model: A Keras model created in the strategy's scope.
        optimizer: A Keras optimizer created in the scope. On JAX build it
            before the loop (`optimizer.build(model.trainable_variables)`).
        loss_fn: Returns one loss per example, e.g.
            `keras.losses.SparseCategoricalCrossentropy(reduction=None)`.
        x: This replica's inputs.
        y: This replica's targets.
        sample_weight: Optional per-example weights.
        global_batch_size: The global batch size. Defaults to this
            replica's batch times the replica count (pass it for a short
            last batch).
        metrics: Metrics created in the scope, updated with `(y, y_pred)`;
            read outside `run` they hold the global values.

    Returns:
        This replica's share of the loss (`strategy.reduce("sum", ...)` of
        the per-replica values is the global mean loss).

    Raises:
        ValueError: if `loss_fn` returns a scalar (use `reduction=None`).

    Example:

    ```python
    def step(inputs):
        x, y = inputs
        return kd.train_step(model, optimizer, loss_fn, x, y,
                             global_batch_size=GLOBAL_BATCH_SIZE,
                             metrics=[train_accuracy])

    for batch in strategy.experimental_distribute_dataset(dataset):
        loss = strategy.reduce("sum", strategy.run(step, args=(batch,)),
                               axis=None)
    ```
    """
    from keras_distribute.backend import get_backend
    from keras_distribute.common import context

    def compute_loss(y_pred: Any, model_losses: Sequence[Any]) -> Any:
        import keras

        loss = compute_average_loss(loss_fn(y, y_pred),
                                    global_batch_size=global_batch_size,
                                    sample_weight=sample_weight)
        if model_losses:
            loss = loss + scale_regularization_loss(
                keras.ops.sum(keras.ops.stack(
                    [keras.ops.sum(term) for term in model_losses])))
        return loss

    backend = get_backend()
    loss, grads, y_pred = backend.value_and_gradients(model, compute_loss, x)
    backend.apply_gradients(context.get_strategy().engine, optimizer, grads,
                            model.trainable_variables)
    for metric in metrics:
        metric.update_state(y, y_pred)
    return loss

