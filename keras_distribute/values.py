"""Values that live on several replicas at once."""

import abc
from typing import Any, Sequence


class DistributedValues(metaclass=abc.ABCMeta):
    """Base class for values that have one component per replica.

    A backend may register its framework's own per-replica type as a
    virtual subclass (TensorFlow does). Use `strategy.experimental_local_results(value)` to get the components
    as a tuple, in replica order.
    """

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple:
        """The per-replica components, in replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        items = ",\n".join(
            f"  {i}: {value!r}" for i, value in enumerate(self._values)
        )
        return f"{type(self).__name__}:{{\n{items}\n}}"


class PerReplica(DistributedValues):
    """A value that can differ from replica to replica.

    Returned by `strategy.run`, yielded by distributed datasets and made by
    `strategy.experimental_distribute_values_from_function`.
    """
