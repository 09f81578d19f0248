"""The TensorFlow backend's side of the sharded checkpoint: a variable's
value as host memory to save, and a restored value assigned without a copy.
"""


from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import values as tf_values

from keras_distribute.backend.interface import whole_region

if TYPE_CHECKING:
    from keras import Variable


def checkpoint_value(variable: Variable) -> np.ndarray:
    """A variable's value on the host, for the sharded checkpoint.

    Metric variables under tf.distribute are sync-on-read: reading one in
    cross-replica context aggregates its replicas' parts.
    """
    value = getattr(variable, "_value", None)
    if isinstance(value, tf_values.DistributedValues):
        value = value.read_value()
    else:
        value = tf.convert_to_tensor(variable.value)
    # A read-only view of the tensor's memory on the host (`.numpy()` and
    # Keras' `convert_to_numpy` copy it); an asynchronous save copies it.
    if value.shape.rank == 0:
        # (a bfloat16 scalar's __array__ gives an ml_dtypes scalar, which
        # np.asarray refuses: "__array__ method not producing an array")
        return np.array(value.numpy())
    return np.asarray(value)


def checkpoint_snapshot(variable: Variable):
    """`put_back()` for a variable's current value. Each replica's component
    is held as it is (a sync-on-read metric variable's parts differ), as a
    tensor: TensorFlow copies a buffer before an assignment would write
    into one that is still read (copy-on-write), so this copies nothing
    unless the restore assigns. (One read op per copy: with 5,000
    variables, `tf.identity` of a read doubled the cost.)"""
    value = getattr(variable, "_value", None)
    with tf.init_scope():
        if isinstance(value, tf_values.DistributedValues):
            components = list(value.values)
            held = [tf.convert_to_tensor(component)
                    for component in components]

            def put_back():
                with tf.init_scope():
                    for component, old in zip(components, held):
                        component.assign(old)
            return put_back
        old = (value.value() if isinstance(value, tf.Variable)
               else tf.identity(variable.value))

    def put_back_whole():
        with tf.init_scope():
            variable.assign(old)
    return put_back_whole


def checkpoint_assign(variable: Variable, read_regions) -> None:
    """Assigns a variable's restored value, now.

    A deferred restore can fire inside a `tf.function` trace: without a
    strategy, `train_on_batch` builds the optimizer in its first traced
    step. An assignment there would be an op of the step (run later, or
    pruned), so it is lifted out of the trace and runs eagerly, once.
    """
    with tf.init_scope():
        (array,) = read_regions([whole_region(variable.shape)])
        value = _zero_copy_tensor(array)
        held = getattr(variable, "_value", None)
        if (isinstance(held, tf.Variable) and isinstance(value, tf.Tensor)
                and value.dtype == held.dtype
                and value.shape == held.shape):
            # what Keras' `assign` ends in, without reading the value back
            # (a third of the time of restoring many small variables)
            held.assign(value, read_value=False)
        else:
            variable.assign(value)


def _zero_copy_tensor(array: Any) -> Any:
    """A tensor over `array`'s own memory (DLPack), or `array` as it is.

    The checkpoint reads into fresh 64-byte aligned memory; handed over as
    numpy, `assign` first copied it into a tensor (65 ms per 128 MiB, then
    the copy into each replica). TensorFlow may keep the given buffer as the
    variable's value and copies it before the first update that would write
    into it (copy-on-write; tested), so the memory is never shared with
    anything that changes it: the reader hands out each buffer once."""
    if (not isinstance(array, np.ndarray) or array.ndim == 0
            or not array.flags.c_contiguous or array.ctypes.data % 64
            or array.dtype.kind not in "fiuc"):
        return array
    try:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    except Exception:  # a dtype DLPack does not carry: the numpy path
        return array
