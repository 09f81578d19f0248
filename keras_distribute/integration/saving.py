"""Keras saving in a multi-process job: chief-only saves run no collective.

Two things break when only some processes save (the chief, as every
multi-worker tutorial and Keras' own `ModelCheckpoint` / `BackupAndRestore`
under `chief_only_writes` do), or when every process saves to one path:

1. Keras' saving walks an object's attributes, skipping those of a fresh
   reference object it builds for the purpose (`Optimizer(1.0)` among
   them). Built in the saving thread, under the strategy, that optimizer's
   variables are distributed: a broadcast (TensorFlow) or a cross-process
   equality check (JAX) that only the saving process joins. The other
   processes are in their next step's collective: TF fails with
   "Collective instance ... expected type 0 ... got type 1", JAX with
   "passed to device_put is not the same on each process". The reference
   objects are now built once per process in a thread of their own, where
   no strategy or distribution is current (and cached: Keras 3.15 reads
   its cache under another name than it writes it).
2. `model.save(path)` in every process wrote the same file concurrently (a
   reader got a corrupt zip or an HDF5 lock error): each process writes a
   file of its own next to `path` and renames it into place.
"""

import functools
import os
import threading
from typing import Any
from typing import Callable
from typing import Dict

from keras_distribute.common.context import model_strategy
from keras_distribute.integration import patching

_skipsets: Dict[str, Any] = {}
_skipsets_lock = threading.Lock()


def outside_every_strategy(get_attr_skipset: Callable) -> Callable:
    """Wraps Keras' `get_attr_skipset(obj_type)` (see 1. above)."""

    @functools.wraps(get_attr_skipset)
    def wrapper(obj_type, *args, **kwargs):
        with _skipsets_lock:
            if obj_type in _skipsets:
                return _skipsets[obj_type]
        outcome = {}

        def build() -> None:
            try:
                outcome["value"] = get_attr_skipset(obj_type, *args, **kwargs)
            except BaseException as error:  # raised again in the caller
                outcome["error"] = error

        # A fresh thread: TF's strategy stack, Keras' global state (its
        # distribution) and kd's context are all per thread.
        thread = threading.Thread(target=build, name="kd-saving-skipset")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        with _skipsets_lock:
            return _skipsets.setdefault(obj_type, outcome["value"])

    return patching.wrapping(wrapper, get_attr_skipset)


def atomic_save(original: Callable) -> Callable:
    """Wraps `Model.save` / `Model.save_weights` (see 2. above).

    No collective: a save that only the chief makes cannot hang.
    """

    @functools.wraps(original)
    def method(self, filepath, *args, **kwargs):
        strategy = model_strategy(self)
        engine = None if strategy is None else strategy.engine
        if engine is None or engine.process_count <= 1 or not isinstance(
                filepath, (str, os.PathLike)) or "://" in str(filepath) or (
                kwargs.get("overwrite") is False and os.path.exists(
                    filepath)):  # Keras' own refusal / prompt applies
            return original(self, filepath, *args, **kwargs)
        filepath = os.fspath(filepath)
        directory, name = os.path.split(os.path.abspath(filepath))
        writing = os.path.join(directory, f".kd-{os.getpid()}-{name}")
        try:
            result = original(self, writing, *args, **kwargs)
            os.replace(writing, filepath)
        finally:
            if os.path.exists(writing):
                os.remove(writing)
        return result

    return patching.wrapping(method, original)
