"""kd's errors for a job that lost one of its processes (framework-free)."""

from typing import Optional


class WorkerLostError(RuntimeError):
    """A collective failed because another process of the job froze, left
    or stopped progressing; `rank` names it (`None` when it could not be
    told apart).

    The engine's own error (gloo's "Timed out waiting ... for recv", a
    closed connection) is the `__cause__`. Launchers (`kd.launch`,
    `python -m keras_distribute.launch`) blame `rank`, not the process
    that raised.

    Example:

    >>> try:
    ...     model.fit(x, y)  # doctest: +SKIP
    ... except kd.WorkerLostError as error:
    ...     print("lost process", error.rank)  # doctest: +SKIP
    """

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


class ReplicasDivergedError(RuntimeError):
    """The copies of a variable that every replica must hold alike differ.

    Raised by the divergence check (at each epoch end of a distributed
    `fit`, and by `strategy.check_replicas_agree(model)`); `variable` names
    the first variable found to differ.

    Example:

    >>> try:
    ...     model.fit(x, y)  # doctest: +SKIP
    ... except kd.ReplicasDivergedError as error:
    ...     print("diverged:", error.variable)  # doctest: +SKIP
    """

    def __init__(self, message: str, variable: Optional[str] = None):
        super().__init__(message)
        self.variable = variable
