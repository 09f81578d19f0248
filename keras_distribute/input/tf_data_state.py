"""A `tf.data` iterator's position as bytes, and back.

tf.data serialises it itself (`SerializeIterator`, the op
`tf.train.Checkpoint` uses). Used by `kd.DistributedIterator` for the
pipeline under it and by the checkpoint for a plain `tf.data` iterator.
Imports TensorFlow only when a `tf.data` iterator is there to save.
"""

from types import MappingProxyType
from typing import Any

import numpy as np

# tf.data's ExternalStatePolicy values (WARN, IGNORE, FAIL).
_POLICY_VALUES = MappingProxyType({"WARN": 0, "IGNORE": 1, "FAIL": 2})


def is_tf_data_iterator(obj: Any) -> bool:
    """Whether `obj` is a `tf.data` iterator (`iter(dataset)`), told without
    importing TensorFlow."""
    return (type(obj).__module__.startswith("tensorflow.")
            and hasattr(obj, "_iterator_resource"))


def save(iterator: Any) -> np.ndarray:
    """The iterator's state as a `uint8` array.

    The dataset's `experimental_external_state_policy` is honoured (as in
    `tf.train.Checkpoint`): with `FAIL`, a pipeline holding state tf.data
    cannot save (e.g. a `py_function`) raises here.
    """
    import tensorflow as tf

    policy = _POLICY_VALUES["WARN"]
    dataset = getattr(iterator, "_dataset", None)
    if dataset is not None:
        chosen = dataset.options().experimental_external_state_policy
        if chosen is not None:
            policy = chosen.value
    state = tf.raw_ops.SerializeIterator(
        resource_handle=iterator._iterator_resource,
        external_state_policy=policy)
    data = tf.io.serialize_tensor(state).numpy()
    return np.frombuffer(data, dtype=np.uint8).copy()


def load(iterator: Any, state: np.ndarray, name: str) -> None:
    """Puts `iterator` where the saved `state` was.

    Raises:
        ValueError: if the state does not fit this iterator's dataset.
    """
    import tensorflow as tf

    try:
        variant = tf.io.parse_tensor(np.asarray(state, np.uint8).tobytes(),
                                     out_type=tf.variant)
        tf.raw_ops.DeserializeIterator(
            resource_handle=iterator._iterator_resource, serialized=variant)
    except (tf.errors.OpError, ValueError) as error:
        raise ValueError(
            f"The checkpoint's iterator {name!r} does not fit the iterator "
            f"given: {error}. Pass an iterator of the same dataset pipeline "
            "as when saving.") from error
