"""`ShardedCheckpoint`: save and restore Keras state, reshardable, portable."""

import os
import re
from typing import Any, Dict, List, Optional

import numpy as np

from keras_distribute.checkpoint import format as ckpt_format
from keras_distribute.checkpoint.format import CheckpointError


class LoadStatus:
    """What a `read` / `restore` matched.

    Args:
        unmatched_in_checkpoint: Checkpoint keys no object variable took.
        unmatched_in_objects: Object variables the checkpoint lacked.
    """

    def __init__(self, unmatched_in_checkpoint: List[str],
                 unmatched_in_objects: List[str]):
        self.unmatched_in_checkpoint = unmatched_in_checkpoint
        self.unmatched_in_objects = unmatched_in_objects

    def assert_consumed(self) -> "LoadStatus":
        """Raises `AssertionError` unless everything matched both ways."""
        if self.unmatched_in_checkpoint or self.unmatched_in_objects:
            raise AssertionError(
                "The checkpoint and the objects do not match exactly. In the "
                f"checkpoint only: {self.unmatched_in_checkpoint[:10]}; in "
                f"the objects only: {self.unmatched_in_objects[:10]}. Use "
                "expect_partial() if that is intended.")
        return self

    def assert_existing_objects_matched(self) -> "LoadStatus":
        """Raises `AssertionError` if an object variable was not restored."""
        if self.unmatched_in_objects:
            raise AssertionError(
                "These variables were not in the checkpoint: "
                f"{self.unmatched_in_objects[:10]}.")
        return self

    def expect_partial(self) -> "LoadStatus":
        """Accepts a partial match silently."""
        return self


class ShardedCheckpoint:
    """Saves Keras models, optimizers, metrics and variables, sharded.

    Each variable is written as its unique pieces (a replicated variable
    once, a sharded one shard by shard) with its **logical** layout, so a
    checkpoint written on 8 devices restores onto 1, 2 or 4, onto another
    mesh, or onto another Keras backend, bit for bit. Restore reads only the
    slices each device needs. Writes are atomic (temporary directory, then a
    rename); every piece carries a sha256 checked on read.

    Args:
        root: An optional object saved under the name `"root"`.
        **objects: Named Keras models, layers, optimizers, metrics or
            variables, e.g. `model=model, optimizer=optimizer`.

    Raises:
        ValueError: for an object that holds no Keras variables.

    Example:

    ```python
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    path = checkpoint.save("/tmp/ckpt/run")      # /tmp/ckpt/run-1
    checkpoint.restore(path).assert_consumed()
    ```
    """

    def __init__(self, root: Any = None, **objects: Any):
        import keras

        if root is not None:
            objects = {"root": root, **objects}
        for name, obj in objects.items():
            if not isinstance(obj, keras.Variable) and not hasattr(
                    obj, "variables"):
                raise ValueError(
                    f"Expected Keras models, layers, optimizers, metrics or "
                    f"variables. Received: {name}={type(obj).__name__}.")
        self._objects = objects
        self.save_counter = 0

    def _variables(self) -> Dict[str, Any]:
        """`key -> variable`. Keys follow the object structure, as
        `tf.train.Checkpoint`'s do: the object's name and the variable's
        position in it (`"model/3"`), not Keras' auto-numbered names
        (`dense_3`, `adam_1`), which differ between two builds of one model.
        """
        import keras

        found, seen = {}, set()
        for name, obj in self._objects.items():
            if isinstance(obj, keras.Variable):
                found[name] = obj
                continue
            for position, variable in enumerate(obj.variables):
                if id(variable) not in seen:
                    seen.add(id(variable))
                    found[f"{name}/{position}"] = variable
        return found

    def write(self, path: str) -> str:
        """Writes a checkpoint at `path` (replacing one there, atomically).

        Args:
            path: The checkpoint directory.

        Returns:
            `path`.
        """
        from keras_distribute.backend import get_backend
        from keras_distribute import context

        engine = context.get_strategy()._engine
        if getattr(engine, "num_input_pipelines", 1) > 1 or int(
                os.environ.get("WORLD_SIZE", "1")) > 1:
            raise NotImplementedError(
                "ShardedCheckpoint does not write from several processes yet "
                "(each would write the same path). For now, save from the "
                "chief only: `if strategy.cluster_resolver.is_chief: "
                "model.save_weights(...)`.")
        backend = get_backend()
        pieces_of = getattr(backend, "checkpoint_pieces", _whole_value)
        entries = {}
        for key, variable in self._variables().items():
            entries[key] = (tuple(variable.shape), _dtype_name(variable),
                             _layout(variable), pieces_of(variable),
                             variable.path)
        mesh = getattr(context.get_strategy(), "device_mesh", None)
        ckpt_format.write(path, entries, {
            "save_counter": self.save_counter,
            "backend": backend.name,
            "mesh_shape": list(mesh.shape) if mesh is not None else None,
        })
        return path

    def read(self, path: str) -> LoadStatus:
        """Restores every variable the checkpoint at `path` holds.

        Args:
            path: A committed checkpoint directory.

        Returns:
            A `LoadStatus` (call `assert_consumed()` to require a full match).

        Raises:
            CheckpointError: if `path` is not a committed checkpoint, a file
                is corrupt, or a variable's shape differs from the saved one.
        """
        from keras_distribute.backend import get_backend

        index = ckpt_format.read_index(path)
        saved = index["variables"]
        assign = getattr(get_backend(), "checkpoint_assign", _assign_whole)
        variables = self._variables()
        for key, variable in variables.items():
            record = saved.get(key)
            if record is None:
                continue
            if tuple(record["shape"]) != tuple(variable.shape):
                raise CheckpointError(
                    f"The checkpoint's {key!r} ({record.get('path')}) has "
                    f"shape {tuple(record['shape'])} but the variable "
                    f"{variable.path!r} has {tuple(variable.shape)}. Build the "
                    "model as it was when saved.")
            assign(variable, lambda regions, record=record: (
                ckpt_format.read_regions(path, record, regions)))
        return LoadStatus(
            sorted(set(saved) - set(variables)),
            sorted(set(variables) - set(saved)))

    def save(self, file_prefix: str) -> str:
        """Writes `<file_prefix>-<n>`, numbered by `save_counter`.

        Args:
            file_prefix: Directory and name stem, e.g. `"/tmp/ckpt/run"`.

        Returns:
            The path written.
        """
        self.save_counter += 1
        try:
            return self.write(f"{file_prefix}-{self.save_counter}")
        except BaseException:
            self.save_counter -= 1
            raise

    def restore(self, save_path: str) -> LoadStatus:
        """`read`, and take over the checkpoint's `save_counter`.

        Args:
            save_path: A path `save` returned (or `latest_checkpoint`).

        Returns:
            A `LoadStatus`.
        """
        status = self.read(save_path)
        self.save_counter = int(ckpt_format.read_index(save_path).get(
            "save_counter", 0))
        return status

    def sync(self) -> None:
        """Waits for pending saves (saves are synchronous for now)."""


def latest_checkpoint(directory: str) -> Optional[str]:
    """The committed checkpoint in `directory` with the highest number.

    Unfinished saves (temporary directories) are ignored.

    Args:
        directory: Where `save` wrote.

    Returns:
        Its path, or `None` when there is none.
    """
    if not os.path.isdir(directory):
        return None
    best, best_number = None, -1
    for name in os.listdir(directory):
        match = re.fullmatch(r".*-(\d+)", name)
        path = os.path.join(directory, name)
        if match and os.path.isfile(os.path.join(path, ckpt_format.INDEX)):
            if int(match.group(1)) > best_number:
                best, best_number = path, int(match.group(1))
    return best


def _dtype_name(variable: Any) -> str:
    return np.dtype(variable.dtype).name if variable.dtype != "bfloat16" else (
        "bfloat16")


def _layout(variable: Any) -> list:
    layout = getattr(variable, "_layout", None)
    axes = getattr(layout, "axes", None)
    return list(axes) if axes is not None else [None] * len(variable.shape)


def _whole_value(variable: Any) -> list:
    import keras

    value = keras.ops.convert_to_numpy(variable.value)
    return [(tuple((0, n) for n in value.shape), value)]


def _assign_whole(variable: Any, read_regions) -> None:
    (value,) = read_regions([tuple((0, n) for n in variable.shape)])
    variable.assign(value)
