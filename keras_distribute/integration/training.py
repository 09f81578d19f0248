"""Keras-private state of a running `fit` that an exact resume must set.

Keras 3.16 shuffles each epoch's samples by the data adapter's own epoch
counter (`np.random.default_rng(epoch)`, stateless TF shuffles seeded by
it), which starts at 0 in every `fit`. A `fit` resumed at epoch k must
shuffle as the uninterrupted run did at epoch k, so the counter is set to
k. The counter is not the epoch itself (Keras' symbolic build draws an
iterator first, so it runs ahead by one), so a backup records its offset
from the epoch and the resume sets `offset + k`. Keras 3.15 draws the order
from the global RNG instead (restored by the backup), and has no counter:
nothing to do there.
"""

import sys
from typing import Any, Optional

_ROW = ("fit's local `epoch_iterator.data_adapter._epoch` (Keras 3.16: the "
        "shuffle seed of each epoch)")


def _running_epoch_iterator(depth: int = 12) -> Optional[Any]:
    """The epoch iterator of the `fit` that is calling back (on the stack)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        iterator = frame.f_locals.get("epoch_iterator")
        if iterator is not None and hasattr(iterator, "data_adapter"):
            return iterator
        frame = frame.f_back
    return None


def _adapter() -> Optional[Any]:
    adapter = getattr(_running_epoch_iterator(), "data_adapter", None)
    if adapter is None or not isinstance(getattr(adapter, "_epoch", None),
                                         int):
        return None
    return adapter


def data_epoch() -> Optional[int]:
    """The running `fit`'s data-adapter epoch counter (`None` where the
    Keras version has none). Call it from a callback."""
    adapter = _adapter()
    return None if adapter is None else adapter._epoch


def set_data_epoch(value: Optional[int]) -> bool:
    """Sets the running `fit`'s data-adapter epoch counter, before the
    epoch's batches are drawn (from `on_epoch_begin`). Returns whether it
    was set."""
    adapter = _adapter()
    if adapter is None or value is None:
        return False
    adapter._epoch = int(value)
    return True
