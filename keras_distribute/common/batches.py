"""How a global batch divides among a job's input pipelines."""

from typing import Tuple


def balanced_bounds(batch: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rows `[start, stop)` of a `batch`-row batch that `rank` takes.

    Sizes differ by at most one row between processes.

    Args:
        batch: The rows of the global batch.
        rank: The input pipeline (process) asking.
        world_size: How many pipelines share the batch.

    Returns:
        `(start, stop)`.

    Example:

    >>> balanced_bounds(10, 1, 3)
    (4, 7)
    """
    base, extra = divmod(batch, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
