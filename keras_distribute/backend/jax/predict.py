"""JAX `predict` in a job of several processes: process-local rows."""

import contextlib
import weakref
from typing import Any
from typing import Callable
from typing import Dict

import jax
import numpy as np


def process_rows(array: Any) -> Any:
    """This process's rows of a global array sharded along axis 0."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return array
    if array.is_fully_replicated:
        return array.addressable_data(0)
    rows: Dict[Any, Any] = {}
    for shard in array.addressable_shards:
        rows.setdefault(shard.index[0].start or 0, shard.data)
    # The shards live on different devices: meet on the host.
    return np.concatenate([np.asarray(rows[start]) for start in sorted(rows)],
                          axis=0)


# The predict functions `process_local_predictions` made (not wrapped again).
_PROCESS_ROWS_FUNCTIONS: "weakref.WeakSet[Callable]" = weakref.WeakSet()


@contextlib.contextmanager
def process_local_predictions(model):
    """Makes Keras' predict function return process-local rows.

    Keras' JAX `predict` turns every batch's output into numpy, which a
    global array spanning several processes refuses; each process takes its
    own rows instead, and `process_data` puts them back together.
    """
    original = model.make_predict_function

    def make_predict_function(force=False):
        original(force)
        inner = model.predict_function
        if inner not in _PROCESS_ROWS_FUNCTIONS:
            def predict_function(state, iterator):
                outputs, state = inner(state, iterator)
                return jax.tree_util.tree_map(process_rows, outputs), state

            _PROCESS_ROWS_FUNCTIONS.add(predict_function)
            model.predict_function = predict_function
        return model.predict_function

    object.__setattr__(model, "make_predict_function", make_predict_function)
    try:
        yield
    finally:
        model.__dict__.pop("make_predict_function", None)


