"""The kinds of saved object whose state is host values, not variables: one
interface (`HostStateKind`) for what a `ShardedCheckpoint` writes, restores
and puts back for each.

- `InputIterators`: a `tf.data` iterator or a `kd.DistributedIterator`
  (each process's position, signed: `iterator_state`);
- `HostArrays`: a `HostArrayHolder`, e.g. the other callbacks' array state a
  training backup keeps (`EarlyStopping.best_weights`), the same in every
  process (process 0 writes it).

Anything else a checkpoint saves holds Keras variables (`.variables`).
"""

import abc
from typing import Any
from typing import Callable
from typing import Dict
from typing import Optional
from typing import Set
from typing import cast

import numpy as np

from keras_distribute.backend.interface import whole_region
from keras_distribute.checkpoint.objects import iterator_state
from keras_distribute.checkpoint.storage import reading


class HostArrayHolder(abc.ABC):
    """An object a checkpoint saves as named host arrays.

    Example:

    ```python
    class Arrays(HostArrayHolder):
        def __init__(self):
            self.arrays = {"table": np.zeros(3)}

        def host_arrays(self):
            return self.arrays

        def restore_host_arrays(self, arrays):
            self.arrays = dict(arrays)
    ```
    """

    @abc.abstractmethod
    def host_arrays(self) -> Dict[str, np.ndarray]:
        """`{key: array}`, the same values in every process."""

    @abc.abstractmethod
    def restore_host_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
        """Takes the arrays `host_arrays` returned (saved or snapshot)."""


class HostStateKind(abc.ABC):
    """How a checkpoint writes, restores and puts back one kind of object
    whose state is host values."""

    @abc.abstractmethod
    def holds(self, obj: object) -> bool:
        """Whether `obj` is of this kind."""

    @abc.abstractmethod
    def entries(self, objects: Dict[str, Any],
                process_id: int) -> Dict[str, tuple]:
        """This process's checkpoint entries of `objects` (by name)."""

    @abc.abstractmethod
    def restore(self, path: str, saved: Dict[str, Any],
                objects: Dict[str, Any], process_id: int,
                process_count: int, trusted: bool) -> Set[str]:
        """Restores `objects` from the checkpoint at `path` (its index's
        `saved` variables); returns the keys consumed.

        Raises:
            CheckpointError: for a saved state that does not fit.
        """

    @abc.abstractmethod
    def snapshot(self, obj: object) -> Callable[[], None]:
        """`put_back()`: gives `obj` its current state again (a restore
        that fails later leaves it as it was)."""


class InputIterators(HostStateKind):
    """Input iterators: each process's position, signed (`iterator_state`)."""

    def holds(self, obj: object) -> bool:
        return iterator_state.is_data_iterator(obj)

    def entries(self, objects: Dict[str, Any],
                process_id: int) -> Dict[str, tuple]:
        return iterator_state.entries(objects, process_id)

    def restore(self, path: str, saved: Dict[str, Any],
                objects: Dict[str, Any], process_id: int,
                process_count: int, trusted: bool) -> Set[str]:
        return iterator_state.restore_all(path, saved, objects, process_id,
                                          process_count, trusted=trusted)

    def snapshot(self, obj: object) -> Callable[[], None]:
        return iterator_state.snapshot(obj)


class HostArrays(HostStateKind):
    """`HostArrayHolder`s: arrays the same in every process."""

    def holds(self, obj: object) -> bool:
        return isinstance(obj, HostArrayHolder)

    def entries(self, objects: Dict[str, Any],
                process_id: int) -> Dict[str, tuple]:
        found = {}
        for name, holder in objects.items():
            for key, array in holder.host_arrays().items():
                array = np.array(array, copy=True)
                pieces = ([(whole_region(array.shape), array)]
                          if process_id == 0 else [])
                found[f"{name}/{key}"] = (
                    array.shape, array.dtype.name, [None] * array.ndim,
                    pieces, f"{name}/{key} (host array)")
        return found

    def restore(self, path: str, saved: Dict[str, Any],
                objects: Dict[str, Any], process_id: int,
                process_count: int, trusted: bool) -> Set[str]:
        consumed: Set[str] = set()
        for name, holder in objects.items():
            keys = [key for key in saved if key.startswith(name + "/")]
            holder.restore_host_arrays({
                key[len(name) + 1:]: reading.read_whole(path, saved[key])
                for key in keys})
            consumed |= set(keys)
        return consumed

    def snapshot(self, obj: object) -> Callable[[], None]:
        holder = cast(HostArrayHolder, obj)
        arrays = {key: np.array(array, copy=True)
                  for key, array in holder.host_arrays().items()}
        return lambda: holder.restore_host_arrays(arrays)


# Every kind, in the order their state is written and restored.
KINDS = (InputIterators(), HostArrays())


def kind_of(obj: object) -> Optional[HostStateKind]:
    """The kind of host state `obj` is, or `None` (it holds variables)."""
    for kind in KINDS:
        if kind.holds(obj):
            return kind
    return None


def by_kind(leaves: Dict[str, Any]
            ) -> Dict[HostStateKind, Dict[str, Any]]:
    """`leaves` (name -> object) of each kind of host state."""
    found: Dict[HostStateKind, Dict[str, Any]] = {kind: {} for kind in KINDS}
    for name, obj in leaves.items():
        kind = kind_of(obj)
        if kind is not None:
            found[kind][name] = obj
    return found
