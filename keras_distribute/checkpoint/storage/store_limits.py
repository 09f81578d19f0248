"""How long kd waits for an object store: one deadline per operation, every
try and retry included, and the error raised when it passes. Framework-free;
imports nothing of kd but the error type."""

import os

from keras_distribute.checkpoint.storage.format import CheckpointStorageError

# One operation's time bound (every try and retry together), in seconds.
TIMEOUT_VARIABLE = "KERAS_DISTRIBUTE_STORE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0
# A transfer's bound grows by a second per MiB (a floor of 1 MiB/s).
_TRANSFER_FLOOR_BYTES_PER_S = 1 << 20


def operation_timeout_s() -> float:
    """The bound on one store operation's total time, from
    `KERAS_DISTRIBUTE_STORE_TIMEOUT_S` (seconds; default 120).

    Returns:
        The bound in seconds.

    Raises:
        ValueError: if the variable is set to anything but a positive
            number of seconds.

    Example:

    >>> os.environ["KERAS_DISTRIBUTE_STORE_TIMEOUT_S"] = "30"
    >>> operation_timeout_s()
    30.0
    """
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"{TIMEOUT_VARIABLE} must be a positive number of seconds (the "
            "bound on one object-store operation, retries included), but it "
            f"is {text[:100]!r}. Set it to e.g. 120, or unset it for the "
            f"default ({DEFAULT_TIMEOUT_S:.0f} s).")
    return value


def budget_s(timeout_s: float, transfer_bytes: int) -> float:
    """One operation's deadline: `timeout_s`, plus a second per MiB the
    operation moves (`transfer_bytes`)."""
    return timeout_s + transfer_bytes / _TRANSFER_FLOOR_BYTES_PER_S


def unanswered(scheme: str, what: str, tries: int, budget: float,
               error: BaseException) -> CheckpointStorageError:
    """The error for an operation (`what`) the store did not answer in
    `tries` tries within `budget` seconds; `error` was the last."""
    last = f"{type(error).__name__}: {error}".rstrip(": ")
    if isinstance(error, TimeoutError) and not str(error):
        last = "no answer before the deadline"
    return CheckpointStorageError(
        f"{what} failed ({tries} tries within {budget:.0f} s, the bound "
        f"{TIMEOUT_VARIABLE} sets; the last error: {last}). The "
        f"{scheme}:// store did not answer: check the network and the "
        "endpoint, then try again (what it holds was not changed: a "
        "checkpoint saved before is intact).")
