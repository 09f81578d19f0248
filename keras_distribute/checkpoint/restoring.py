"""Restoring variables: all or nothing, now or once they are created.

`assign_all_or_nothing` checks every shape, holds each variable's value and
puts every one back on any failure; `ready` says whether an object's
variables exist yet; the deferred restores (objects restored when Keras
builds them, as `tf.train.Checkpoint` does) are tracked here and applied by
the hooks the integration layer installs.
"""

import weakref
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional

from keras_distribute.checkpoint.storage import reading
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import CheckpointMismatchError
from keras_distribute.common.keras_services import KerasServices


def assign_all_or_nothing(
        path: str, saved: dict, variables: Dict[str, Any],
        count_read: Callable[[List[Any]], List[Any]],
        then: Optional[Callable[[], None]] = None) -> None:
    """Assigns `variables` their values saved at `path`, all or nothing.

    Every shape is checked before anything is assigned; each variable's
    value is held (the backend's `checkpoint_snapshot`) before it is
    assigned, and on any failure — a corrupt piece, a truncated file,
    an error of `then()` (run last, inside the same all-or-nothing) —
    every variable assigned so far is put back, so the objects are
    exactly as before and the error says so.

    Args:
        path: The committed checkpoint directory.
        saved: Its index's variables (`key -> record`).
        variables: `key -> variable` to assign; keys the checkpoint lacks
            are skipped.
        count_read: Called with the arrays each read returns (and returns
            them): the progress line's byte count.
        then: Run after the assignments, inside the same all-or-nothing.

    Raises:
        CheckpointMismatchError: if a variable's shape differs from the
            saved one (nothing is assigned).
        CheckpointError: if a piece cannot be read or verified.

    Example:

    ```python
    saved = reading.read_index(path)["variables"]
    assign_all_or_nothing(path, saved, {"model/0": kernel}, lambda a: a)
    ```
    """
    from keras_distribute.backend import get_backend

    planned = []
    for key, variable in variables.items():
        record = saved.get(key)
        if record is None:
            continue
        if tuple(record["shape"]) != tuple(variable.shape):
            raise CheckpointMismatchError(
                f"The checkpoint's {key!r} ({record.get('path')}) has "
                f"shape {tuple(record['shape'])} but the variable "
                f"{variable.path!r} has {tuple(variable.shape)}: the "
                "model differs from the one saved. Nothing was "
                "restored. Build the model as it was when saved.")
        planned.append((variable, record))
    backend = get_backend()
    assign, snapshot = backend.checkpoint_assign, backend.checkpoint_snapshot
    undo = []
    try:
        with reading.OpenShards(path) as shards:
            for variable, record in planned:
                undo.append(snapshot(variable))
                assign(variable, lambda regions, into=None, record=record: (
                    count_read(reading.read_regions(
                        path, record, regions, into, shards))))
        if then is not None:
            then()
    except BaseException as error:
        for put_back in reversed(undo):
            put_back()
        if isinstance(error, CheckpointError):
            raise type(error)(
                f"{error} Nothing was restored from {path!r}: every "
                "object holds the values it had before.") from None
        raise


def ready(obj: Any, variables: Dict[str, Any], wanted: List[str]) -> bool:
    """Whether `obj`'s variables exist, so a restore can be applied now.

    An object holding fewer variables than the checkpoint saved for it is
    waited for while it is not built (a subclassed model before its first
    call, an optimizer before its first step). A built one is restored now,
    key by key, and what it lacks is reported by the `LoadStatus` (as
    `tf.train.Checkpoint` restores a model with fewer layers partially).
    """
    import keras

    if isinstance(obj, keras.Variable) or len(variables) >= len(wanted):
        return True
    # An optimizer is `built` while it still makes its slots: count those.
    return (isinstance(obj, keras.layers.Layer) and bool(variables)
            and obj.built)


# Checkpoints with restores waiting for their variables to be created
# (each has `_apply_deferred()`).
waiting: "weakref.WeakSet[Any]" = weakref.WeakSet()


# Checkpoints collected with restores still deferred, kept (strongly) until
# those restores apply or the objects they wait for are gone: a restore
# written as one expression (`ShardedCheckpoint(...).restore(path)`) before
# the optimizer is built must still reach it, as tf.train.Checkpoint's does.
kept_after_drop: "set[Any]" = set()


def keep_after_drop(checkpoint: Any) -> None:
    """Keeps `checkpoint`, being collected with deferred restores, alive on
    weak references to the objects it waits for (`_wait_weakly`): nothing
    else of it (a model it restored already) is held."""
    checkpoint._wait_weakly(lambda: kept_after_drop.discard(checkpoint))
    kept_after_drop.add(checkpoint)
    waiting.add(checkpoint)


def defer(checkpoint: Any, services: KerasServices) -> None:
    """Marks `checkpoint` as waiting for variables to be created; the hooks
    that apply its restores then are installed (once) through `services`
    (its engine's `keras_services`)."""
    waiting.add(checkpoint)
    services.install_deferred_restores()


def apply_deferred_restores() -> None:
    """Restores every deferred object whose variables now exist.

    Called by the Keras hooks after a layer or optimizer is built and before
    `fit` & co. start; a user rarely needs it.
    """
    for checkpoint in list(waiting):
        checkpoint._apply_deferred()
