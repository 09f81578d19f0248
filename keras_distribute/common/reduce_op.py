"""`ReduceOp`: how values from several replicas are combined."""

import enum
from typing import Any


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    `SUM` adds the values of all replicas; `MEAN` divides that sum by the
    number of values. Every API that takes a `ReduceOp` also accepts the
    strings `"sum"` and `"mean"` in any case, as `tf.distribute` does.

    Example:

    >>> ReduceOp.from_value("Sum") is ReduceOp.SUM
    True
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_value(value: "ReduceOp | str") -> "ReduceOp":
        """Returns the `ReduceOp` that `value` names.

        Args:
            value: A `ReduceOp`, or one of the strings `"sum"` / `"mean"` in
                any case.

        Returns:
            The matching `ReduceOp`.

        Raises:
            ValueError: if `value` names no reduce operation.
        """
        if isinstance(value, ReduceOp):
            return value
        # tf.distribute.ReduceOp values convert too, by their name.
        name = getattr(value, "name", value)
        if isinstance(name, str) and name.upper() in ("SUM", "MEAN"):
            return ReduceOp[name.upper()]
        raise ValueError(
            "Expected a reduce operation: `kd.ReduceOp.SUM`, "
            "`kd.ReduceOp.MEAN`, or the strings 'sum' / 'mean'. "
            f"Received: reduce_op={value!r}."
        )


def check_reduce_axis(axis: Any) -> None:
    """Raises `TypeError` unless `axis` (of `Strategy.reduce`) is `None` or
    an integer."""
    if axis is not None and (not isinstance(axis, int) or isinstance(
            axis, bool)):
        raise TypeError(
            "`axis` must be None (combine the replicas element-wise) or "
            "an integer dimension of each replica's value (reduce it "
            f"too, e.g. 0 for the batch). Received: axis={axis!r}.")
