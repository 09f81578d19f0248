"""What `kd.callbacks` saves and restores besides the variables.

The host RNG states, other callbacks' progress, skipping the train steps
already done, linking a committed checkpoint elsewhere. Imports Keras: only
`keras_distribute.callbacks` loads it.
"""

import os
import random
import shutil
import sys
from typing import Any, Callable, Dict, List, Optional

import keras
import numpy as np

from keras_distribute.checkpoint import format as ckpt_format

# The attributes that make up a Keras callback's progress (EarlyStopping,
# ReduceLROnPlateau, ModelCheckpoint, ...); restored on resume.
CALLBACK_STATE = ("best", "wait", "stopped_epoch", "best_epoch",
                   "cooldown_counter", "epochs_since_last_save",
                   "_batches_seen_since_last_saving", "_last_batch_seen",
                   "_current_epoch")


class MetricVariables:
    """A model's metric state for `ShardedCheckpoint`, read when saved (on
    TensorFlow, compiled metrics make their variables in the first step)."""

    def __init__(self, model: Any):
        self._model = model

    @property
    def variables(self) -> List[Any]:
        return list(self._model.metrics_variables)


def keyed_callbacks(callbacks: List[Any]):
    """`(key, callback)` pairs; the key (`"<position>:<class>"`) names a
    callback's state in a backup."""
    for position, callback in enumerate(callbacks):
        yield f"{position}:{type(callback).__name__}", callback


# The other callbacks' state that is arrays, not scalars: kept in the
# checkpoint itself (EarlyStopping(restore_best_weights=True)).
CALLBACK_ARRAYS = ("best_weights",)


class CallbackArrays:
    """The other callbacks' array state (`CALLBACK_ARRAYS`) of a kd training
    callback, as host arrays a `ShardedCheckpoint` saves and restores.

    Args:
        owner: The kd callback; its `_others` are the callbacks whose state
            is kept (read when saved).
    """

    def __init__(self, owner: Any):
        self._owner = owner

    def _host_arrays(self) -> Dict[str, np.ndarray]:
        arrays = {}
        for prefix, callback in keyed_callbacks(self._owner._others):
            for name in CALLBACK_ARRAYS:
                value = callback.__dict__.get(name)
                if isinstance(value, list) and all(
                        isinstance(a, np.ndarray) for a in value):
                    for i, array in enumerate(value):
                        arrays[f"{prefix}/{name}/{i}"] = array
        return arrays

    def _restore_host_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
        for prefix, callback in keyed_callbacks(self._owner._others):
            for name in CALLBACK_ARRAYS:
                start = f"{prefix}/{name}/"
                found = {int(key[len(start):]): array
                         for key, array in arrays.items()
                         if key.startswith(start)}
                if found:
                    setattr(callback, name,
                            [found[i] for i in range(len(found))])


def json_scalar(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return NOT_SCALAR


NOT_SCALAR = object()


def capture_rng() -> Dict[str, Any]:
    """The host RNG states that decide data order (numpy, random, torch)."""
    from keras_distribute.backend import get_backend

    kind, keys, position, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"numpy": [kind, keys.tolist(), position, has_gauss, gauss],
             "python": [version, list(internal), gauss_next]}
    host_state = getattr(get_backend(), "host_rng_state", None)
    if host_state is not None:
        state["backend"] = host_state()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    from keras_distribute.backend import get_backend

    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, np.uint32), position,
                         has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    set_host_state = getattr(get_backend(), "set_host_rng_state", None)
    if "backend" in state and set_host_state is not None:
        set_host_state(state["backend"])


def calling_callback_list(callback: Any) -> Optional[Any]:
    """The `CallbackList` dispatching to `callback` (found on the stack)."""
    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList) and any(
                c is callback for c in owner.callbacks):
            return owner
        frame = frame.f_back
    return None


def skip_train_steps(model: Any, count: int, when_done: Callable,
                     on_first_batch: Optional[Callable] = None) -> None:
    """Makes the next `count` train steps consume their batch and do nothing.

    Those batches were trained on before the interruption; the restored
    state already includes them. `on_first_batch(batch)` is called with the
    first batch taken (e.g. to build what needs a batch's shapes).
    """
    original = model.train_function
    remaining = [count]
    first = [on_first_batch]
    steps_per_call = max(1, int(getattr(model, "steps_per_execution", 1)))

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


def link_checkpoint(source: str, target: str) -> None:
    """Puts a copy of a committed checkpoint at `target` (hard links when
    the file system allows), atomically."""
    ckpt_format.refuse_foreign(target)
    temporary = ckpt_format.make_temporary(target)
    try:
        for name in os.listdir(source):
            try:
                os.link(os.path.join(source, name),
                        os.path.join(temporary, name))
            except OSError:
                shutil.copy2(os.path.join(source, name),
                             os.path.join(temporary, name))
        os.remove(os.path.join(temporary, ckpt_format.TEMPORARY_MARKER))
        ckpt_format._commit(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
