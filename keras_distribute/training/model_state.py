"""One model state in every process: the rule for non-trainable variables.

Trainable variables stay equal in every process by construction (every
process applies the same all-reduced gradients). Non-trainable ones do not:
BatchNormalization's moving statistics are updated from each process's own
rows, and a custom layer may count what it saw. DDP answers this by
broadcasting rank 0's buffers; keras_distribute follows the same rule for
every non-trainable variable of a model trained by several processes (its
moving statistics, seed-generator states, `Normalization` statistics,
counters): **they take the chief's (process 0's) values** wherever a user
can look — at the end of every epoch (before the callbacks read or save
them), before every `evaluate` and `predict` (the validation of `fit`
included) and when `fit` returns. The chief's files are thus what every
process holds.

JAX runs one SPMD program over every process, whose state is already one;
this applies to the engines that run a step per process (TensorFlow's
multi-worker strategy, PyTorch). Collective: every process calls it at the
same points. No framework is imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import List

import numpy as np

from keras_distribute.backend.interface import ReplicaEngine

if TYPE_CHECKING:
    from keras import Model


def _needs_agreement(engine: ReplicaEngine) -> bool:
    from keras_distribute.backend import get_backend

    return (engine.process_count > 1
            and get_backend().name != "jax")


def take_chief_values(engine: ReplicaEngine, model: Model) -> None:
    """Gives `model`'s non-trainable variables process 0's values, in
    every process (one all-gather of their bytes; a collective).

    Args:
        engine: The strategy's engine (`process_count`,
            `process_all_gather`).
        model: A built Keras model (or layer).
    """
    if not _needs_agreement(engine) or not getattr(model, "built", False):
        return

    from keras_distribute.backend import get_backend

    variables: List[Any] = list(model.non_trainable_variables)
    if not variables:
        return
    # (TensorFlow's reads a distributed variable, scalars included)
    host_value = get_backend().checkpoint_value
    arrays = [np.array(host_value(v)).reshape(tuple(v.shape))
              for v in variables]
    packed = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    chief = np.asarray(engine.process_all_gather(packed))[0].astype(np.uint8)
    offset = 0
    for variable, array in zip(variables, arrays):
        piece = chief[offset:offset + array.nbytes]
        offset += array.nbytes
        if piece.tobytes() != array.reshape(-1).view(np.uint8).tobytes():
            variable.assign(piece.view(array.dtype).reshape(array.shape))


def with_chief_state(engine: ReplicaEngine, callbacks: Any) -> Any:
    """`fit`'s `callbacks` with one more, first, that gives the model the
    chief's non-trainable values at the end of every epoch, before the
    other callbacks read or save them. Unchanged where not needed or for a
    prepared `CallbackList` (not extended)."""
    if not _needs_agreement(engine) or not isinstance(
            callbacks, (list, tuple, type(None))):
        return callbacks
    import keras

    class ChiefState(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            take_chief_values(engine, self.model)

    return [ChiefState(), *(callbacks or [])]

