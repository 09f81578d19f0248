"""JAX with several processes: every process starts from the chief's values.

tf.distribute's `MultiWorkerMirroredStrategy` and kd's torch engine
broadcast the chief's initial values to every worker, so a model built
after the processes' random states diverged (a per-process seed, a random
draw only some processes made) still trains one set of weights. Keras' JAX
backend instead places a new value with `jax.device_put` onto devices of
every process, which requires the value to be equal everywhere and fails
("passed to device_put is not the same on each process") when it is not.
The hook below places process 0's value instead: one broadcast where JAX
made one equality check, so the collective count is unchanged.
"""

import functools
from typing import Any
from typing import Callable

from keras_distribute.integration import patching


def _spans_processes(layout: Any) -> bool:
    return not getattr(layout, "is_fully_addressable", True)


def chief_values(distribute_tensor: Callable) -> Callable:
    """Wraps Keras' JAX `distribute_tensor(tensor, layout)`."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    @functools.wraps(distribute_tensor)
    def wrapper(tensor, layout, *args, **kwargs):
        from keras.distribution import TensorLayout

        sharding = layout.backend_layout if isinstance(
            layout, TensorLayout) else layout
        if (jax.process_count() <= 1 or isinstance(tensor, jax.core.Tracer)
                or not isinstance(sharding, jax.sharding.Sharding)
                or not _spans_processes(sharding)
                or (isinstance(tensor, jax.Array)
                    and _spans_processes(tensor.sharding))):
            # Traced, local, or already a global array: Keras' own path.
            return distribute_tensor(tensor, layout, *args, **kwargs)
        value = np.asarray(multihost_utils.broadcast_one_to_all(
            np.asarray(tensor)))
        return jax.make_array_from_callback(
            value.shape, sharding, lambda index: value[index])

    return patching.wrapping(wrapper, distribute_tensor)
