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
multi-worker strategy, PyTorch). The replicas of one TensorFlow process
(MirroredStrategy over several devices) hold a copy each, updated from
their own slices: at the same points every copy takes the first's (the
value `get_weights` and the saved files hold), so `predict` answers alike
whichever replica computed a row, whatever the batch size.

Only what differs moves: each process all-gathers a fingerprint per
variable (8 bytes; a frozen backbone's weights never move), then the
bytes of the variables that differ from the chief's. Collective: every
process calls it at the same points. No framework is imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import List

import numpy as np

from keras_distribute.backend.interface import ReplicaEngine

if TYPE_CHECKING:
    from keras import Model


def _across_processes(engine: ReplicaEngine) -> bool:
    from keras_distribute.backend import get_backend

    return (engine.process_count > 1
            and get_backend().name != "jax")


def _across_local_replicas(engine: ReplicaEngine) -> bool:
    from keras_distribute.backend import get_backend

    return (get_backend().name == "tensorflow"
            and engine.num_replicas > engine.process_count)


def _needs_agreement(engine: ReplicaEngine) -> bool:
    return _across_processes(engine) or _across_local_replicas(engine)


def take_chief_values(engine: ReplicaEngine, model: Model) -> None:
    """Gives `model`'s non-trainable variables process 0's values (its
    first replica's), in every process and every replica (a collective:
    one all-gather of a fingerprint per variable, one of the bytes of
    those that differ).

    Args:
        engine: The strategy's engine (`process_count`,
            `process_all_gather`, `replica_copies`).
        model: A built Keras model (or layer).
    """
    if not _needs_agreement(engine) or not getattr(model, "built", False):
        return

    from keras_distribute.backend import get_backend

    variables: List[Any] = list(model.non_trainable_variables)
    if not variables:
        return
    # (TensorFlow's reads a distributed variable's first copy)
    host_value = get_backend().checkpoint_value
    arrays = [np.array(host_value(v)).reshape(tuple(v.shape))
              for v in variables]
    from keras_distribute.training.divergence import copy_digests
    from keras_distribute.training.divergence import fingerprint

    if _across_local_replicas(engine):
        for variable, array in zip(variables, arrays):
            if copy_digests(engine, variable)[1]:  # this process's differ
                variable.assign(array)  # every copy: the first's value
    if not _across_processes(engine):
        return

    mine = np.array([fingerprint(a) for a in arrays], np.int64)
    table = np.asarray(engine.process_all_gather(mine))
    differ = [i for i in range(len(arrays))
              if (table[:, i] != table[0, i]).any()]
    if not differ:
        return
    packed = np.concatenate(
        [arrays[i].reshape(-1).view(np.uint8) for i in differ])
    chief = np.asarray(engine.process_all_gather(packed))[0].astype(np.uint8)
    offset = 0
    for index in differ:
        array = arrays[index]
        piece = chief[offset:offset + array.nbytes]
        offset += array.nbytes
        if piece.tobytes() != array.reshape(-1).view(np.uint8).tobytes():
            variables[index].assign(
                piece.view(array.dtype).reshape(array.shape))


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

