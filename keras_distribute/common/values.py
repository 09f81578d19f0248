"""Values that live on several replicas at once."""

import abc
from typing import Any
from typing import Sequence


class DistributedValues(metaclass=abc.ABCMeta):
    """Base class for values that have one component per replica.

    A backend may register its framework's own per-replica type as a
    virtual subclass (TensorFlow does). Use
    `strategy.experimental_local_results(value)` to get the components as a
    tuple, in replica order.
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


def to_numpy(value: Any) -> Any:
    """Numpy values of anything a strategy returns, on every backend.

    A `PerReplica` (what `run` returns) becomes a tuple of numpy arrays, one
    per replica of this process (as `experimental_local_results`, then
    `.numpy()` on each); a backend tensor or a Keras variable becomes a
    numpy array; nested structures are mapped. JAX arrays have no
    `.numpy()`, torch tensors need `.detach().cpu()`: this is the one
    spelling that works everywhere.

    Args:
        value: A per-replica value, tensor, variable, number, or a nested
            structure of them.

    Returns:
        The same structure with numpy arrays (tuples for per-replica values).

    Example:

    ```python
    per_replica = strategy.run(step, args=(batch,))
    losses = kd.numpy(per_replica)       # (array(0.7), array(0.69), ...)
    ```
    """
    import keras

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, DistributedValues):
            return tuple(convert(v) for v in leaf.values)
        if isinstance(leaf, keras.Variable):
            leaf = leaf.value
        if leaf is None or isinstance(leaf, (str, bytes)):
            return leaf
        if hasattr(leaf, "detach"):  # torch: no autograd, on the host
            leaf = leaf.detach().cpu()
        return keras.ops.convert_to_numpy(leaf)

    return keras.tree.map_structure(
        convert, value, none_is_leaf=True) if not isinstance(
            value, DistributedValues) else convert(value)
