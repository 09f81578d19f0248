"""Input iterators in a checkpoint: a `tf.data` iterator's position, or a
distributed dataset's iterator over a `tf.data` pipeline.

`tf.train.Checkpoint(iterator=iterator)` (the TF "Training checkpoints"
guide) saves where a `tf.data` iterator is, so a resumed loop reads the
next batch, not the first. `ShardedCheckpoint` does the same on every
Keras backend (`tf.data` feeds JAX and PyTorch too): the iterator's state is
serialised by tf.data itself (`SerializeIterator`, the op
`tf.train.Checkpoint` uses) and stored as a byte array, one per process —
each process reads its own input — under `<name>/process-<id>`.
"""

from typing import Any
from typing import Dict

import numpy as np

from keras_distribute.backend.interface import whole_region
from keras_distribute.checkpoint.storage import reading
from keras_distribute.checkpoint.storage import signing
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.input import tf_data_state
from keras_distribute.input.iterator import DistributedIterator

_PROCESS_KEY = "{name}/process-{process_id:05d}"
# Each state's signature (`signing`): kd restores only states it can prove
# it wrote, since tf.data's deserializer does not withstand crafted bytes.
_SIGNATURE_KEY = "{name}/signature-{process_id:05d}"


def is_data_iterator(obj: Any) -> bool:
    """Whether `obj` is an input iterator a checkpoint can hold: a `tf.data`
    iterator (`iter(dataset)`) or a `kd.DistributedIterator`.

    Tested without importing TensorFlow: a process that never imported it
    holds no `tf.data` iterator.
    """
    return (tf_data_state.is_tf_data_iterator(obj)
            or isinstance(obj, DistributedIterator))


def save(iterator: Any) -> np.ndarray:
    """The state of an input iterator (`is_data_iterator`) as bytes."""
    if tf_data_state.is_tf_data_iterator(iterator):
        return tf_data_state.save(iterator)
    return iterator._save_input_state()


def load(iterator: Any, state: np.ndarray, name: str) -> None:
    """Puts an input iterator where `save` found it.

    Raises:
        CheckpointError: if the state does not fit the iterator.
    """
    try:
        if tf_data_state.is_tf_data_iterator(iterator):
            tf_data_state.load(iterator, state, name)
        else:
            iterator._restore_input_state(state, name)
    except ValueError as error:
        raise CheckpointError(str(error)) from error


def snapshot(iterator: Any):
    """`put_back()`: puts `iterator` where it is now (a restore that fails
    after restoring it leaves it as it was)."""
    state = save(iterator)
    return lambda: load(iterator, state, "(its own state)")


def state_key(name: str, process_id: int) -> str:
    """The checkpoint key of process `process_id`'s iterator `name`."""
    return _PROCESS_KEY.format(name=name, process_id=process_id)


def saved_processes(saved: Dict[str, Any], name: str) -> int:
    """How many processes saved an iterator `name` (0: none)."""
    prefix = name + "/process-"
    return sum(1 for key in saved if key.startswith(prefix))


def entries(iterators: Dict[str, Any], process_id: int) -> Dict[str, tuple]:
    """The checkpoint entries of this process's input iterators (its own
    key each: every process reads its own input), each with its
    signature."""
    found = {}
    for name, iterator in iterators.items():
        state = save(iterator)  # a fresh copy
        signature = np.frombuffer(signing.sign(state.tobytes()), np.uint8)
        for key, array, what in (
                (state_key(name, process_id), state, "input iterator"),
                (_SIGNATURE_KEY.format(name=name, process_id=process_id),
                 signature.copy(), "its signature")):
            found[key] = (array.shape, "uint8", [None],
                          [(whole_region(array.shape), array)],
                          f"{name} ({what})")
    return found


def _verified_state(path: str, saved: Dict[str, Any], name: str,
                    process_id: int, trusted: bool) -> np.ndarray:
    """This process's saved state of iterator `name`, once its signature
    proved kd wrote it with this key (or the caller trusts the checkpoint).

    Raises:
        CheckpointError: for a state without a valid signature.
    """
    state = reading.read_whole(path, saved[state_key(name, process_id)])
    if trusted:
        return state
    signature_key = _SIGNATURE_KEY.format(name=name, process_id=process_id)
    signature = (reading.read_whole(path, saved[signature_key]).tobytes()
                 if signature_key in saved else None)
    if not signing.verify(np.asarray(state, np.uint8).tobytes(), signature):
        raise CheckpointError(
            f"Not restoring the input iterator {name!r} from {path!r}: its "
            f"state is {'unsigned' if signature is None else 'not signed'}"
            f"{'' if signature is None else ' with this key'}. "
            "tf.data's deserializer does not withstand crafted bytes (they "
            "can crash the process), so keras_distribute restores an "
            "iterator's state only from checkpoints it wrote with this "
            f"host's key ({signing.key_path()}, or "
            f"${signing.KEY_VARIABLE}). If you trust this checkpoint, read "
            "it with options=kd.checkpoint.CheckpointOptions(trusted=True); "
            f"for hosts that share checkpoints, set ${signing.KEY_VARIABLE} "
            "to the same key on each.")
    return state


def restore_all(path: str, saved: Dict[str, Any], iterators: Dict[str, Any],
                process_id: int, process_count: int,
                trusted: bool = False) -> set:
    """Restores this process's iterators; returns the keys consumed (a
    process takes its own state; the others' are theirs).

    Args:
        trusted: Restore a state even without a valid signature (the
            caller trusts the checkpoint's source).

    Raises:
        CheckpointError: if the checkpoint was saved by another number of
            processes, a state is not signed with this key (and not
            `trusted`), or a state does not fit its iterator.
    """
    consumed = set()
    for name, iterator in iterators.items():
        key = state_key(name, process_id)
        saved_count = saved_processes(saved, name)
        if saved_count == 0:
            consumed.add(key)  # not in the checkpoint: reported as missing
            continue
        if saved_count != process_count:
            raise CheckpointError(
                f"The checkpoint holds the input iterator {name!r} of "
                f"{saved_count} processes, but this run has "
                f"{process_count}: each process resumes its own input. "
                "Restore with the same number of processes, or leave "
                "the iterator out of the ShardedCheckpoint and call "
                "expect_partial().")
        load(iterator, _verified_state(path, saved, name, process_id,
                                       trusted), name)
        consumed |= {k for k in saved if k.startswith(
            (name + "/process-", name + "/signature-"))}
    return consumed
