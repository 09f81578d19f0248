"""What a `ShardedCheckpoint` holds, as checkpoint entries: the check of
each object given to it and Keras variables (each process's unique pieces,
with their logical layout). The objects whose state is host values (input
iterators, host arrays) are `host_state`'s kinds.
"""

from typing import Any
from typing import Dict
from typing import List

import numpy as np

from keras_distribute.checkpoint.objects import host_state
from keras_distribute.checkpoint.storage.format import numpy_dtype
from keras_distribute.input.iterator import DistributedIterator


def check_object(name: str, obj: Any, checkpoint_class: type,
                 inside: str = "") -> None:
    """Raises `ValueError` unless `obj` can be saved under `name`.

    Args:
        name: The object's name in the checkpoint.
        obj: The object.
        checkpoint_class: `ShardedCheckpoint`, whose attribute names an
            object cannot take (objects are its attributes).
        inside: For an item of a list or dict, the path of its container
            (`"layers/"`), named in errors.
    """
    import keras

    if "/" in name:
        raise ValueError(
            f"Object names cannot contain '/'. Received: {inside}{name!r}.")
    if isinstance(obj, checkpoint_class):
        return  # nested: its own objects were checked when it took them
    if isinstance(obj, (list, tuple, dict)):
        # As tf.train.Checkpoint tracks lists and dicts of trackables.
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, item in items:
            if isinstance(obj, dict) and not isinstance(key, str):
                raise ValueError(
                    f"Dict keys of saved objects must be strings. Received: "
                    f"{inside}{name}[{key!r}].")
            check_object(str(key), item, checkpoint_class,
                         f"{inside}{name}/")
        return
    name = f"{inside}{name}"
    if type(obj).__name__ == "DistributedIterator" and type(
            obj).__module__.startswith("tensorflow."):
        raise ValueError(
            "tf.distribute's own distributed iterators (what "
            "experimental_distribute_dataset returns on the TensorFlow "
            "backend) cannot be saved; tf.train.Checkpoint refuses them too. "
            f"Received: {name}=a tf.distribute DistributedIterator. Save the "
            "step number instead and skip that many steps on restore, or "
            "save the iterator of the dataset before distribution.")
    if not (isinstance(obj, keras.Variable) or hasattr(obj, "variables")
            or host_state.kind_of(obj) is not None):
        hint = ""
        if hasattr(obj, "shape") and hasattr(obj, "dtype"):
            hint = (" Hold framework tensors and variables (tf.Variable, "
                    "torch.Tensor, jax.Array) in a Keras variable: "
                    f"{name}=keras.Variable(value) (an integer counter: "
                    "keras.Variable(1, trainable=False)).")
        raise ValueError(
            "Expected Keras models, layers, optimizers, metrics, variables "
            f"or tf.data iterators. Received: {name}={type(obj).__name__}."
            + hint)
    if isinstance(obj, DistributedIterator):
        obj._check_saveable(name)
    if hasattr(checkpoint_class, name):
        raise ValueError(
            f"{name!r} is a ShardedCheckpoint method or property; choose "
            f"another name for the object. Received: {name}=...")


def leaf_objects(objects: Dict[str, Any], checkpoint_class: type,
                 prefix: str = "") -> Dict[str, Any]:
    """`objects` with nested checkpoints, lists and dicts flattened:
    `{"l1/model": model, "layers/0": layer, ...}` (the names their
    variables' keys start with)."""
    flat = {}
    for name, obj in objects.items():
        full = f"{prefix}{name}"
        if isinstance(obj, checkpoint_class):
            nested: Any = obj  # a ShardedCheckpoint (its class is given)
            flat.update(leaf_objects(nested._objects, checkpoint_class,
                                     full + "/"))
        elif isinstance(obj, (list, tuple, dict)):
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            flat.update(leaf_objects({str(k): v for k, v in items},
                                     checkpoint_class, full + "/"))
        else:
            flat[full] = obj
    return flat


def saved_keys_of(saved: Dict[str, Any], name: str) -> List[str]:
    """The checkpoint keys of the object saved as `name`."""
    return [key for key in saved
            if key == name or key.startswith(name + "/")]


# Replicated variables of at least this size are spread over the processes
# (each written by one); smaller ones (counters, metric totals, seeds) are
# written by process 0.
SPREAD_BYTES = 1 << 20


def balanced_writers(sizes: Dict[str, int], process_count: int
                     ) -> Dict[str, int]:
    """Which process writes each replicated variable (`key -> process`).

    The same in every process (a pure function of the keys and sizes):
    variables of at least `SPREAD_BYTES`, largest first, each go to the
    process with the fewest bytes so far; the others to process 0.
    """
    load = [0] * process_count
    writers = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        if sizes[key] < SPREAD_BYTES or process_count == 1:
            writers[key] = 0
            continue
        writer = min(range(process_count), key=lambda p: (load[p], p))
        load[writer] += sizes[key]
        writers[key] = writer
    return writers


class HostBuffers:
    """Host memory an asynchronous save copies the values into, kept from
    one save to the next.

    Each piece goes into the buffer the same piece had last time (same
    variable, shape and dtype): once warm, a save allocates nothing and
    touches no fresh pages (on a VM the first touch of new memory costs
    more than the copy). A buffer is reused only by the next save, which
    waits for the one before it (`ShardedCheckpoint.sync`); pieces no
    longer saved are let go.
    """

    def __init__(self) -> None:
        self._buffers: Dict[tuple, np.ndarray] = {}
        self._used: Dict[tuple, np.ndarray] = {}

    def begin(self) -> None:
        """Starts a save: buffers not used by it are dropped at `end`."""
        self._used = {}

    def copy(self, key: str, number: int, array: Any) -> np.ndarray:
        """`array` copied into the buffer of piece `number` of `key`."""
        array = np.asarray(array)
        buffer = self._buffers.get((key, number))
        if buffer is None or buffer.shape != array.shape or (
                buffer.dtype != array.dtype):
            buffer = np.empty_like(array)
        np.copyto(buffer, array)
        self._used[(key, number)] = buffer
        return buffer

    def end(self) -> None:
        """Ends a save: keeps only the buffers it used."""
        self._buffers, self._used = self._used, {}


def variable_entries(variables: Dict[str, Any], backend: Any,
                     process_id: int, process_count: int,
                     buffers: "HostBuffers | None") -> Dict[str, tuple]:
    """The checkpoint entries of Keras variables: each process's unique
    pieces (the backend's `checkpoint_pieces`: a replicated variable
    whole, written by the process `balanced_writers` names). `buffers`:
    where an asynchronous save copies the values (training goes on while
    it writes); `None` writes the values themselves."""
    writers = balanced_writers({
        key: int(np.prod(variable.shape, dtype=np.int64)) * numpy_dtype(
            dtype_name(variable)).itemsize
        for key, variable in variables.items()}, process_count)
    entries = {}
    for key, variable in variables.items():
        pieces = backend.checkpoint_pieces(variable, writers[key],
                                           process_id)
        declared = numpy_dtype(dtype_name(variable))
        if any(np.asarray(array).dtype != declared for _, array in pieces):
            # A backend that holds the variable narrower (JAX without x64:
            # int64 as int32, float64 as float32) or wider: the file holds
            # the declared dtype, so every backend reads what it declares.
            pieces = [(region, np.asarray(array).astype(declared))
                      for region, array in pieces]
        if buffers is not None:
            pieces = [(region, buffers.copy(key, number, array))
                      for number, (region, array) in enumerate(pieces)]
        entries[key] = (tuple(variable.shape), dtype_name(variable),
                        layout_of(variable), pieces, variable.path)
    return entries


def dtype_name(variable: Any) -> str:
    """The numpy name of a variable's dtype (`"bfloat16"` included)."""
    return np.dtype(variable.dtype).name if variable.dtype != "bfloat16" else (
        "bfloat16")


def layout_of(variable: Any) -> list:
    """A variable's logical layout: a mesh axis name or `None` per dim."""
    layout = getattr(variable, "_layout", None)
    axes = getattr(layout, "axes", None)
    return list(axes) if axes is not None else [None] * len(variable.shape)


