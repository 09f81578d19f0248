"""Keras-private state of a running `fit` that an exact resume must set.

`kd.callbacks.BackupAndRestore` and `ShardedCheckpoint` resume mid-epoch:
they find the `CallbackList` calling them, set the epoch `fit` starts from
(`model._initial_epoch`, as Keras' own BackupAndRestore does), skip the
train steps already done (by swapping `model.train_function` for a few
calls) and restore other callbacks' progress (`CALLBACK_STATE`, some of it
private attributes of Keras callbacks). Each relies on how Keras' `fit`
runs; all of it is here.

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

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional

import keras

if TYPE_CHECKING:
    from keras import Model

# The attributes that make up a Keras callback's progress (EarlyStopping,
# ReduceLROnPlateau, ModelCheckpoint, ...); restored on resume.
CALLBACK_STATE = ("best", "wait", "stopped_epoch", "best_epoch",
                   "cooldown_counter", "epochs_since_last_save",
                   "_batches_seen_since_last_saving", "_last_batch_seen",
                   "_current_epoch")

_ROW = ("fit's local `epoch_iterator.data_adapter._epoch` (Keras 3.16: the "
        "shuffle seed of each epoch)")


def _running_epoch_iterator(depth: int = 12) -> Optional[Any]:
    """The epoch iterator of the `fit` that is calling back (on the stack)."""
    frame: Optional[types.FrameType] = sys._getframe(2)
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


def set_initial_epoch(model: Model, epoch: Optional[int]) -> None:
    """The epoch the next `fit` starts from (`None`: its `initial_epoch`),
    as Keras' own `BackupAndRestore` sets it."""
    model._initial_epoch = None if epoch is None else int(epoch)


def compiled_metrics_unbuilt(model: Model) -> bool:
    """Whether `model`'s compiled metrics exist but have no variables yet
    (TensorFlow without a strategy makes them when it traces the first
    step); False when the model has none or Keras keeps them elsewhere."""
    compiled = getattr(model, "_compile_metrics", None)
    return compiled is not None and not compiled.built


def build_from_batch(model: Model, batch: Any) -> None:
    """Builds `model` (its compiled metrics included) from one batch, as
    `fit` does before its first step (Keras' `_symbolic_build`: registry
    row `BaseTrainer._symbolic_build`)."""
    model._symbolic_build(data_batch=batch)


def calling_callback_list(callback: Any) -> Optional[Any]:
    """The `CallbackList` dispatching to `callback` (found on the stack)."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList) and any(
                c is callback for c in owner.callbacks):
            return owner
        frame = frame.f_back
    return None


def skip_train_steps(model: Model, count: int, when_done: Callable,
                     on_first_batch: Optional[Callable] = None,
                     callback_list: Optional[Any] = None) -> None:
    """Makes the next `count` train steps consume their batch and do nothing.

    Those batches were trained on before the interruption; the restored
    state already includes them. `on_first_batch(batch)` is called with the
    first batch taken (e.g. to build what needs a batch's shapes). The
    `callback_list` fit dispatches through hands the skipped batches to no
    callback's `on_train_batch_begin` / `on_train_batch_end` (a callback
    that counts batches would count them twice).
    """
    original = model.train_function
    remaining = [count]
    first = [on_first_batch]
    steps_per_call = max(1, int(getattr(model, "steps_per_execution", 1)))
    if callback_list is not None:
        _hide_batches_until(callback_list, lambda: remaining[0] <= 0)

    def skip(*args):
        data = args[-1]
        if hasattr(data, "__next__"):  # an iterator: take the batches
            for _ in range(steps_per_call):
                batch = next(data, _END)
                if batch is _END:
                    break
                if first[0] is not None:
                    first[0], call = None, first[0]
                    call(batch)
        # Only after the batches were taken: the first one may be what
        # draws the epoch's shuffle order from the RNG being restored.
        remaining[0] -= steps_per_call
        if remaining[0] <= 0:
            model.train_function = original
            when_done()
        if keras.backend.backend() == "jax":  # (state, data) -> (logs, state)
            return {}, args[0]
        return {}

    model.train_function = skip


_END = object()


def _hide_batches_until(callback_list: Any,
                        finished: Callable[[], bool]) -> None:
    """`callback_list` dispatches no train batch until `finished()` is true
    at a batch's end (that batch hidden too); then Keras' own methods
    dispatch again (the instance's stand-ins removed)."""
    def on_train_batch_begin(batch: Any, logs: Any = None) -> None:
        return None  # (a batch trained on before the interruption)

    def on_train_batch_end(batch: Any, logs: Any = None) -> None:
        if finished():
            del callback_list.on_train_batch_begin
            del callback_list.on_train_batch_end

    callback_list.on_train_batch_begin = on_train_batch_begin
    callback_list.on_train_batch_end = on_train_batch_end
