"""What `kd.callbacks` saves and restores besides the variables.

The host RNG states and the other callbacks' array state (what reaches
into a running Keras `fit` lives in `integration/training.py`). Only
`keras_distribute.callbacks` loads it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING
from typing import Any
from typing import Dict
from typing import List

import numpy as np

from keras_distribute.checkpoint.objects.host_state import HostArrayHolder

if TYPE_CHECKING:
    from keras import Model


class MetricVariables:
    """A model's metric state for `ShardedCheckpoint`, read when saved (on
    TensorFlow, compiled metrics make their variables in the first step)."""

    def __init__(self, model: Model):
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


class CallbackArrays(HostArrayHolder):
    """The other callbacks' array state (`CALLBACK_ARRAYS`) of a kd training
    callback, as host arrays a `ShardedCheckpoint` saves and restores.

    Args:
        owner: The kd callback; its `_others` are the callbacks whose state
            is kept (read when saved).
    """

    def __init__(self, owner: Any):
        self._owner = owner

    def host_arrays(self) -> Dict[str, np.ndarray]:
        arrays = {}
        for prefix, callback in keyed_callbacks(self._owner._others):
            for name in CALLBACK_ARRAYS:
                value = callback.__dict__.get(name)
                if isinstance(value, list) and all(
                        isinstance(a, np.ndarray) for a in value):
                    for i, array in enumerate(value):
                        arrays[f"{prefix}/{name}/{i}"] = array
        return arrays

    def restore_host_arrays(self, arrays: Dict[str, np.ndarray]) -> None:
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
    backend_state = get_backend().host_rng_state()
    if backend_state is not None:
        state["backend"] = backend_state
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    from keras_distribute.backend import get_backend

    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, np.uint32), position,
                         has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "backend" in state:
        get_backend().set_host_rng_state(state["backend"])

