"""Committed checkpoints on disk: find them, read their metadata and
variables (no Keras objects needed)."""

import os
import re
from typing import Any
from typing import Dict
from typing import List
from typing import Optional

import numpy as np

from keras_distribute.checkpoint.storage import format as ckpt_format
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import paths as ckpt_paths
from keras_distribute.checkpoint.storage import reading
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage import remote_reading
from keras_distribute.checkpoint.storage.format import numpy_dtype


def latest_checkpoint(directory: str) -> Optional[str]:
    """The committed checkpoint in `directory` with the highest number.

    Unfinished saves (temporary directories) are ignored.

    Args:
        directory: Where `save` wrote.

    Returns:
        Its path, or `None` when there is none.

    Example:

    ```python
    path = kd.checkpoint.latest_checkpoint("/tmp/ckpt")
    if path is not None:
        checkpoint.restore(path)
    ```
    """
    numbered = checkpoints_in(directory)
    return numbered[-1] if numbered else None


def checkpoints_in(directory: str) -> List[str]:
    """The committed, numbered checkpoints in `directory`, oldest first.

    Args:
        directory: Where `save` (or a `CheckpointManager`) wrote.

    Returns:
        Their paths, by number; unfinished saves are not among them.

    Raises:
        ValueError: for a path with another scheme than `s3://`, `gs://`.
    """
    directory = ckpt_paths.checkpoint_path(directory, "directory")
    if object_store.is_remote(directory):
        return remote_checkpoints.checkpoints_in(directory)
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        # `<name>.old`: a commit died between its renames; it is listed by
        # its own name and read where it lies (`reading.locate`).
        match = re.fullmatch(f"(.*-({ckpt_paths.NUMBER}))" + r"(\.old)?",
                             name)
        if not match:
            continue
        path = os.path.join(directory, match.group(1))
        index = os.path.join(reading.locate(path), ckpt_format.INDEX)
        if os.path.isfile(index):
            found.append((int(match.group(2)), path))
    return [path for _, path in sorted(set(found))]


def _remote_resolve(path: str) -> str:
    """An object-store `path`, or for a prefix of numbered checkpoints its
    latest one."""
    store = object_store.store_for(path)
    if not store.exists(object_store.join(path, ckpt_format.INDEX)):
        latest = latest_checkpoint(path)
        path = latest if latest is not None else path
    return path


def _read_index(path: str) -> dict:
    """The checked index of `path` (or of a directory's latest checkpoint);
    in object storage only the index is read."""
    path = ckpt_paths.checkpoint_path(path)
    if object_store.is_remote(path):
        return remote_checkpoints.read_index(_remote_resolve(path))
    return reading.read_index(_resolve(path))


def _resolve(path: str) -> str:
    """`path`, or for a directory of numbered checkpoints (as
    `tf.train.list_variables` accepts) its latest one."""
    path = ckpt_paths.checkpoint_path(path)
    if object_store.is_remote(path):  # a local copy to read
        return remote_reading.download(_remote_resolve(path))
    if os.path.isfile(os.path.join(path, ckpt_format.INDEX)):
        return path
    latest = latest_checkpoint(path)
    # read_index explains a path that is no checkpoint.
    return reading.locate(latest if latest is not None else path)


def read_metadata(path: str) -> Dict[str, Any]:
    """The `metadata` a checkpoint was written with, and its save counter.

    Args:
        path: A committed checkpoint directory, or a directory of numbered
            checkpoints (its latest one is read).

    Returns:
        A dict: the `metadata` given to `write`/`save`, plus
        `"save_counter"`, `"backend"` and `"mesh_shape"`.

    Raises:
        CheckpointError: if `path` is not a committed checkpoint.
    """
    index = _read_index(path)
    return dict(index.get("metadata", {}),
                save_counter=index.get("save_counter", 0),
                backend=index.get("backend"),
                mesh_shape=index.get("mesh_shape"))


def list_variables(path: str) -> List[tuple]:
    """`(key, shape)` of every variable in a checkpoint, like
    `tf.train.list_variables`.

    Args:
        path: A committed checkpoint directory, or a directory of numbered
            checkpoints (its latest one is read).

    Returns:
        A sorted list of `(key, shape)`.

    Example:

    ```python
    for key, shape in kd.checkpoint.list_variables(path):
        print(key, shape)
    ```
    """
    variables = _read_index(path)["variables"]
    return [(key, tuple(record["shape"]))
            for key, record in sorted(variables.items())]


def load_variable(path: str, key: str) -> np.ndarray:
    """One variable of a checkpoint as a numpy array, like
    `tf.train.load_variable`.

    Args:
        path: A committed checkpoint directory, or a directory of numbered
            checkpoints (its latest one is read).
        key: A key `list_variables` returned, e.g. `"model/0"`.

    Returns:
        The whole variable (assembled from its pieces).

    Raises:
        KeyError: if the checkpoint has no such key.
    """
    return load_checkpoint(path).get_tensor(key)


# How `tf.train.Checkpoint` names a variable it reached through attributes.
TF_VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


class _ByKeyOrName(dict):
    """kd's keys, and values for TensorFlow's names of the same variables
    on lookup (`shape_from_key["net/l1/kernel/.ATTRIBUTES/VARIABLE_VALUE"]`
    in the TF checkpoint guide); iterating lists kd's keys only."""

    def __init__(self, values: Dict[str, Any], names: Dict[str, str]):
        super().__init__(values)
        self._names = names

    def __missing__(self, name: str) -> Any:
        key = self._names.get(name)
        if key is None or key == name:
            raise KeyError(name)
        return self[key]

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default


class CheckpointReader:
    """Reads a committed checkpoint's variables by key, as the reader
    `tf.train.load_checkpoint` returns. Made by `load_checkpoint`.

    A variable answers to kd's key (`"net/0"`) and to TensorFlow's name
    for each attribute path that reaches it
    (`"net/l1/kernel/.ATTRIBUTES/VARIABLE_VALUE"`, what ported programs
    look up; the index records the paths, see `object_paths`); the maps
    and `list_variables` list kd's keys.

    Args:
        path: A committed checkpoint directory.
    """

    def __init__(self, path: str):
        self.path = reading.locate(path)
        index = reading.read_index(self.path)
        self._variables = index["variables"]
        self._keys = {key: key for key in self._variables}
        for key in self._variables:
            self._keys[key + TF_VARIABLE_SUFFIX] = key
        for attribute_path, key in index.get("object_paths", {}).items():
            if key in self._variables:
                self._keys.setdefault(attribute_path + TF_VARIABLE_SUFFIX,
                                      key)

    def get_variable_to_shape_map(self) -> Dict[str, tuple]:
        """`key -> shape` of every variable; TensorFlow's names of them
        look up too."""
        return _ByKeyOrName({key: tuple(record["shape"])
                             for key, record in self._variables.items()},
                            self._keys)

    def get_variable_to_dtype_map(self) -> Dict[str, np.dtype]:
        """`key -> numpy dtype` of every variable (bfloat16 & co. through
        ml_dtypes); TensorFlow's names of them look up too."""
        return _ByKeyOrName({key: numpy_dtype(record["dtype"])
                             for key, record in self._variables.items()},
                            self._keys)

    def has_tensor(self, key: str) -> bool:
        """Whether the checkpoint holds `key` (a key or TensorFlow name)."""
        return key in self._keys

    def get_tensor(self, key: str) -> np.ndarray:
        """The whole variable `key` (a key or TensorFlow name), assembled
        from its pieces (each checked against its checksum).

        Raises:
            KeyError: if the checkpoint has no such key.
        """
        if key not in self._keys:
            raise KeyError(
                f"The checkpoint {self.path!r} has no variable {key!r}. It "
                f"has: {sorted(self._variables)[:10]}... "
                "(get_variable_to_shape_map lists them all, with their "
                "TensorFlow names).")
        return reading.read_whole(self.path, self._variables[self._keys[key]])


def load_checkpoint(path: str) -> CheckpointReader:
    """A reader of a checkpoint's variables, like `tf.train.load_checkpoint`.

    Args:
        path: A committed checkpoint directory, or a directory of numbered
            checkpoints (its latest one is read).

    Returns:
        A `CheckpointReader`.

    Raises:
        CheckpointError: if `path` holds no committed checkpoint.

    Example:

    ```python
    reader = kd.checkpoint.load_checkpoint("./tf_ckpts")
    for key, shape in sorted(reader.get_variable_to_shape_map().items()):
        print(key, shape, reader.get_tensor(key).dtype)
    ```
    """
    return CheckpointReader(_resolve(path))
