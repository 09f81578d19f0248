"""Loss scaling for custom training loops under a strategy."""

from typing import Any
from typing import Optional

from keras_distribute.common import context


def compute_average_loss(per_example_loss: Any,
                         global_batch_size: Optional[int] = None,
                         sample_weight: Any = None) -> Any:
    """Sums per-example losses and divides by the **global** batch size.

    Inside `strategy.run`, each replica sees only its slice of the batch.
    Dividing its summed loss by the global batch size makes the gradients
    that the replicas then add up (`all_reduce("sum", grads)`) equal to the
    gradient of the mean loss over the whole global batch.

    Args:
        per_example_loss: Per-example losses, rank >= 1.
        global_batch_size: The global batch size. Defaults to the replica's
            batch size times `num_replicas_in_sync` (wrong for a short last
            batch: pass it explicitly there).
        sample_weight: Optional weights, broadcastable to `per_example_loss`.

    Returns:
        A scalar: `sum(per_example_loss * sample_weight) / global_batch_size`,
        or `0` when `global_batch_size` is `0`.

    Raises:
        ValueError: if `per_example_loss` is a scalar, or `global_batch_size`
            is negative or not an integer.
        RuntimeError: if called in cross-replica context without
            `global_batch_size`.

    Example:

    ```python
    def step_fn(x, y):
        per_example = keras.losses.mean_squared_error(y, model(x))
        return kd.compute_average_loss(per_example, global_batch_size=64)
    ```
    """
    from keras import ops

    per_example_loss = ops.convert_to_tensor(per_example_loss)
    dtype = per_example_loss.dtype
    if len(per_example_loss.shape) == 0:
        raise ValueError(
            "Expected `per_example_loss` to have rank >= 1 (one loss per "
            "example). Received a scalar. Use a loss with "
            "`reduction=None` so that it returns one value per example."
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * ops.cast(sample_weight, dtype)
    if global_batch_size is None:
        if context.in_cross_replica_context():
            raise RuntimeError(
                "`compute_average_loss` was called in cross-replica context "
                "without `global_batch_size`. Call it inside `strategy.run` "
                "or pass `global_batch_size`."
            )
        num_replicas = context.get_strategy().num_replicas_in_sync
        # The dynamic size: unknown statically inside a traced function
        # over a distributed dataset (None * n failed).
        global_batch_size = ops.shape(per_example_loss)[0] * num_replicas
    elif isinstance(global_batch_size, bool) or not isinstance(
        global_batch_size, int
    ) and not hasattr(global_batch_size, "dtype"):
        raise ValueError(
            "Expected `global_batch_size` to be an integer. Received: "
            f"global_batch_size={global_batch_size!r}."
        )
    if isinstance(global_batch_size, int) and global_batch_size < 0:
        raise ValueError(
            "Expected `global_batch_size` to be non-negative. Received: "
            f"global_batch_size={global_batch_size}."
        )
    total = ops.sum(per_example_loss)
    return ops.divide_no_nan(total, ops.cast(global_batch_size, dtype))


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divides a summed regularization loss by the number of replicas.

    Each replica adds the full regularization loss to its share of the
    data loss; after the replicas' gradients are summed, dividing by the
    replica count counts it exactly once.

    Args:
        regularization_loss: A regularization loss (summed if not scalar).

    Returns:
        `sum(regularization_loss) / num_replicas_in_sync`.

    Raises:
        RuntimeError: if called in cross-replica context.

    Example:

    ```python
    loss += kd.scale_regularization_loss(ops.sum(model.losses))
    ```
    """
    from keras import ops

    if context.in_cross_replica_context():
        raise RuntimeError(
            "`scale_regularization_loss` was called in cross-replica context; "
            "call it inside `strategy.run`."
        )
    num_replicas = context.get_strategy().num_replicas_in_sync
    return ops.sum(regularization_loss) / num_replicas
