"""Horovod-style collectives over the processes of a job, outside `run`.

`kd.allreduce`, `kd.allgather` and `kd.broadcast` combine one value per
process, as `hvd.allreduce` & co. combine one per Horovod worker: metrics
computed by hand, a seed, a flag, a host-side array. They run on the job's
strategy (the latest one spanning several processes) through its engine —
`jax.distributed`, tf.distribute or `torch.distributed` — and return the
value itself in a single process. Every process must call them in the same
order. Inside `strategy.run`, use the replica context's `all_reduce` /
`all_gather` instead.
"""

from types import MappingProxyType
from typing import Any

import numpy as np

from keras_distribute.common import context

_OPS = MappingProxyType({
    "average": np.mean,
    "mean": np.mean,
    "sum": np.sum,
    "min": np.min,
    "max": np.max,
})


def _engine():
    strategy = context.latest_job_strategy()
    if strategy is None and context.has_strategy():
        strategy = context.get_strategy()
    return None if strategy is None else strategy.engine


def _as_array(value: Any):
    """`(numpy array, restore)`: `restore(array)` gives an array back in
    the kind of `value` (a backend tensor stays one)."""
    import keras

    if isinstance(value, (np.ndarray, np.generic, int, float, bool, list,
                          tuple)):
        array, restore = np.asarray(value), np.asarray
    else:
        array = keras.ops.convert_to_numpy(value)
        restore = keras.ops.convert_to_tensor
    if array.dtype == object:
        raise TypeError(
            "Expected a number, a numeric array or a backend tensor. "
            f"Received: a value of type {type(value).__name__} holding "
            "Python objects. Convert it to a numeric array first.")
    return array, restore


def _stack(array: np.ndarray) -> np.ndarray:
    """Every process's `array` (same shape), stacked in process order."""
    engine = _engine()
    if engine is None or engine.process_count == 1:
        return array[None]
    return engine.process_all_gather(array)


def _job_position() -> tuple:
    """`(process count, process id)` of the job's strategy; `(1, 0)`."""
    engine = _engine()
    return (engine.process_count, engine.process_id) if engine else (1, 0)


def process_count() -> int:
    """The number of processes `allreduce` & co. combine (Horovod's
    `hvd.size()` when one process drives one device).

    Returns:
        The process count of the job's strategy; 1 without one.

    Example:

    >>> import keras_distribute as kd
    >>> kd.process_count()
    1
    """
    return _job_position()[0]


def process_index() -> int:
    """This process's index in the job (Horovod's `hvd.rank()`).

    Process 0 is the chief: it alone writes checkpoints and logs files.
    Outside any multi-process job this is 0.

    Returns:
        The process id in the job's strategy.

    Example:

    >>> import keras_distribute as kd
    >>> is_chief = kd.process_index() == 0
    """
    return _job_position()[1]


def allreduce(value: Any, op: str = "average") -> Any:
    """Combines one value per process, as `hvd.allreduce`.

    Args:
        value: A number, numeric array or backend tensor, of the same shape
            in every process.
        op: `"average"` (Horovod's default; `"mean"` too), `"sum"`, `"min"`
            or `"max"`.

    Returns:
        The combined value, the same in every process: a numpy array for a
        number or array, a backend tensor for a tensor. Averages of
        integers are floating point.

    Raises:
        ValueError: for an unknown `op`.
        TypeError: for a value that is not numeric.

    Example:

    ```python
    local_loss = float(my_loss_on_my_rows)
    global_loss = kd.allreduce(local_loss)   # mean over processes
    ```
    """
    if not isinstance(op, str) or op.lower() not in _OPS:
        raise ValueError(
            "Expected `op` to be one of 'average', 'mean', 'sum', 'min', "
            f"'max'. Received: op={op!r}.")
    array, restore = _as_array(value)
    return restore(_OPS[op.lower()](_stack(array), axis=0))


def allgather(value: Any) -> Any:
    """Concatenates every process's rows in process order, as
    `hvd.allgather`. The first dimension may differ between processes.

    Args:
        value: A numeric array or backend tensor of at least one dimension;
            the other dimensions equal in every process.

    Returns:
        The rows of process 0, then 1, ...: a numpy array, or a backend
        tensor for a tensor.

    Raises:
        ValueError: for a scalar.
        TypeError: for a value that is not numeric.

    Example:

    ```python
    every_prediction = kd.allgather(model.predict(my_rows))
    ```
    """
    array, restore = _as_array(value)
    if array.ndim == 0:
        raise ValueError(
            "Expected an array of at least one dimension (rows to "
            "concatenate). Received: a scalar. Use `kd.allreduce` for "
            "scalars.")
    counts = _stack(np.asarray([len(array)]))[:, 0]
    padded = np.zeros((int(counts.max()),) + array.shape[1:], array.dtype)
    padded[:len(array)] = array
    stacked = _stack(padded)
    return restore(np.concatenate(
        [stacked[p][:int(count)] for p, count in enumerate(counts)], axis=0))


def broadcast(value: Any, root_rank: int = 0) -> Any:
    """Process `root_rank`'s value, in every process, as `hvd.broadcast`.

    Args:
        value: A number, numeric array or backend tensor, of the same shape
            and dtype in every process.
        root_rank: The process whose value everyone gets.

    Returns:
        `root_rank`'s value: a numpy array, or a backend tensor for a
        tensor.

    Raises:
        ValueError: for a `root_rank` outside the job.
        TypeError: for a value that is not numeric.

    Example:

    ```python
    seed = kd.broadcast(np.random.randint(2**31))  # the chief's seed
    ```
    """
    count = process_count()
    if isinstance(root_rank, bool) or not isinstance(
            root_rank, (int, np.integer)) or not 0 <= root_rank < count:
        raise ValueError(
            f"Expected `root_rank` to be a process index in [0, {count}). "
            f"Received: root_rank={root_rank!r}.")
    array, restore = _as_array(value)
    return restore(_stack(array)[int(root_rank)])
