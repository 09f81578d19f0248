"""The iterator of a distributed dataset: `iter(dist_dataset)`.

What `tf.distribute.DistributedIterator` offers, on every backend:
`next(iterator)` / `get_next()` for one step's per-replica values,
`get_next_as_optional()` to end a loop without an exception, and — when the
dataset is a `tf.data` pipeline — a position that
`kd.checkpoint.ShardedCheckpoint(iterator=iterator)` saves and restores.
"""

import json
from typing import Any
from typing import Callable
from typing import Dict
from typing import Iterator
from typing import Optional

import numpy as np

from keras_distribute.input import tf_data_state


class OutOfRangeError(Exception):
    """`get_next()` past the end of a distributed dataset (the counterpart
    of `tf.errors.OutOfRangeError`)."""


class OptionalValue:
    """A step's values, or none at the end of the data (the counterpart of
    `tf.experimental.Optional`). Made by `get_next_as_optional()`."""

    _NOTHING = object()

    def __init__(self, value: Any = _NOTHING):
        self._value = value

    def has_value(self) -> bool:
        """Whether there is a value (`False` once the data ran out)."""
        return self._value is not OptionalValue._NOTHING

    def get_value(self) -> Any:
        """The value.

        Raises:
            OutOfRangeError: if there is none (check `has_value()` first).
        """
        if not self.has_value():
            raise OutOfRangeError(
                "This optional holds no value: the distributed dataset ran "
                "out. Check `has_value()` before `get_value()`.")
        return self._value


class DistributedIterator:
    """Iterates a distributed dataset, one step of per-replica values at a
    time. Made by `iter(dist_dataset)`.

    Args:
        strategy: The strategy whose replicas the values are for.
        steps: The per-replica values of each step.
        data_iterator: The `tf.data` iterator `steps` reads, when the
            dataset is a `tf.data` pipeline (its position is what a
            checkpoint saves), else `None`.
        split_state: How the batches are split, as `steps` keeps it (e.g.
            the per-replica batch size a short last batch reuses); saved
            with the position.
        element_spec: A callable returning the per-replica element spec.

    Example:

    ```python
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        strategy.run(step_fn, args=(optional.get_value(),))
    ```
    """

    def __init__(self, strategy: Any, steps: Iterator[Any],
                 data_iterator: Optional[Any], split_state: Dict[str, Any],
                 element_spec: Callable[[], Any]):
        self._strategy = strategy
        self._steps = steps
        self._data_iterator = data_iterator
        self._split_state = split_state
        self._element_spec = element_spec

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        return next(self._steps)

    def get_next(self) -> Any:
        """The next step's per-replica values.

        Raises:
            OutOfRangeError: at the end of the data.
        """
        try:
            return next(self._steps)
        except StopIteration:
            raise OutOfRangeError(
                "End of the distributed dataset: no more elements. Use "
                "`get_next_as_optional()` or a `for` loop to stop without "
                "an exception.") from None

    def get_next_as_optional(self) -> OptionalValue:
        """The next step's values as an `OptionalValue` (empty at the end).

        Returns:
            An `OptionalValue`: `has_value()` is `False` once the data ran
            out, else `get_value()` gives the per-replica values.
        """
        try:
            return OptionalValue(next(self._steps))
        except StopIteration:
            return OptionalValue()

    @property
    def element_spec(self) -> Any:
        """The structure and per-replica shapes of each step's values (see
        `DistributedDataset.element_spec`)."""
        return self._element_spec()

    # --------------------------------------------------------- checkpoints
    def _save_input_state(self) -> np.ndarray:
        """The position (tf.data's own serialisation) and split state as
        bytes: a JSON header line, then tf.data's state."""
        self._check_saveable("iterator")
        header = json.dumps(self._split_state).encode() + b"\n"
        return np.concatenate([
            np.frombuffer(header, dtype=np.uint8),
            tf_data_state.save(self._data_iterator)])

    def _check_saveable(self, name: str) -> None:
        """Raises `ValueError` unless this iterator reads a `tf.data`
        pipeline (the only kind whose position can be saved)."""
        if self._data_iterator is None:
            raise ValueError(
                "Only the position of a distributed tf.data.Dataset can be "
                f"saved. Received: {name}=an iterator over a dataset of "
                "another kind (a list, generator, PyDataset or DataLoader). "
                "Save the step number instead and skip that many steps on "
                "restore.")

    def _restore_input_state(self, state: np.ndarray, name: str) -> None:
        raw = np.asarray(state, np.uint8)
        newline = int(np.argmax(raw == ord("\n")))
        header = raw[:newline].tobytes()
        try:
            split_state = json.loads(header)
        except ValueError:
            split_state = None
        if self._data_iterator is None or not isinstance(split_state, dict):
            raise ValueError(
                f"The checkpoint's {name!r} is not the position of a "
                "distributed tf.data.Dataset, or this iterator is not one. "
                "Pass the iterator of the same distributed pipeline as when "
                "saving.")
        tf_data_state.load(self._data_iterator, raw[newline + 1:], name)
        self._split_state.clear()
        self._split_state.update(split_state)

    def __repr__(self) -> str:
        return "<DistributedIterator>"
