"""Lists and dicts attached to a restored `ShardedCheckpoint`.

As tf.train.Checkpoint's `ListWrapper` and `_DictWrapper` do, a list or dict
attached to a checkpoint after a restore restores the items added to it
from that restore, as they are added; `nested_checkpoints` finds the
checkpoints nested in an object, with the key prefix each is saved under.
"""

import operator
from typing import Any
from typing import Iterable
from typing import SupportsIndex

from keras_distribute.checkpoint.objects import saved_objects


def nested_checkpoints(obj: Any, prefix: str, checkpoint_class: type):
    """`(prefix, checkpoint)` for the checkpoints in `obj` (itself, or in
    its lists and dicts)."""
    if isinstance(obj, checkpoint_class):
        yield prefix, obj
    elif isinstance(obj, (list, tuple, dict)):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, item in items:
            yield from nested_checkpoints(item, f"{prefix}{key}/",
                                          checkpoint_class)


class AttachedList(list):
    """A list attached to a checkpoint after a restore: items added to it
    are restored as they come (tf.train.Checkpoint's `ListWrapper`)."""

    def __init__(self, items, checkpoint: Any, name: str):
        super().__init__(items)
        self._checkpoint, self._name = checkpoint, name

    def _added(self, index: int, item: object) -> None:
        saved_objects.check_object(str(index), item,
                                   type(self._checkpoint),
                                   f"{self._name}/")
        self._checkpoint._restore_attached(f"{self._name}/", str(index), item)

    def append(self, item: object) -> None:
        super().append(item)
        self._added(len(self) - 1, item)

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    # list's `__iadd__` takes any iterable, as this one does; the types of
    # `list` say it takes a list only.
    def __iadd__(  # type: ignore[misc]
            self, items: Iterable[Any]) -> "AttachedList":
        self.extend(items)
        return self

    def insert(self, index: SupportsIndex, item: object) -> None:
        if operator.index(index) < len(self):
            raise TypeError(
                "A list attached to a restored checkpoint restores items by "
                "position: only append or extend it (an insert would shift "
                f"the saved positions). Received: insert({index}, ...).")
        self.append(item)

    def __setitem__(self, index, item) -> None:
        super().__setitem__(index, item)
        if isinstance(index, int):
            self._added(index % len(self), item)


class AttachedDict(dict):
    """A dict attached to a checkpoint after a restore: entries added to
    it are restored as they come (tf.train.Checkpoint's `_DictWrapper`)."""

    def __init__(self, items, checkpoint: Any, name: str):
        super().__init__(items)
        self._checkpoint, self._name = checkpoint, name

    def __setitem__(self, key: str, item: object) -> None:
        if not isinstance(key, str):
            raise ValueError(
                f"Dict keys of saved objects must be strings. Received: "
                f"{self._name}[{key!r}].")
        saved_objects.check_object(key, item, type(self._checkpoint),
                                   f"{self._name}/")
        super().__setitem__(key, item)
        self._checkpoint._restore_attached(f"{self._name}/", key, item)

    def update(self, *args, **kwargs) -> None:
        for key, item in dict(*args, **kwargs).items():
            self[key] = item

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


def attach(value: Any, checkpoint: Any, name: str) -> Any:
    """`value` as attached to `checkpoint` under `name`: a plain list or
    dict wrapped (`AttachedList`, `AttachedDict`), anything else as is."""
    if type(value) is list:
        return AttachedList(value, checkpoint, name)
    if type(value) is dict:
        return AttachedDict(value, checkpoint, name)
    return value
