"""Export a checkpoint's model as a Keras `.weights.h5` file."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from keras_distribute.backend import interface
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint

if TYPE_CHECKING:
    from keras import Model


def export_weights(checkpoint_path: str, model: Model, filepath: str,
                   object_name: str = "model") -> str:
    """Writes a checkpoint's model as a Keras `.weights.h5` file.

    The checkpoint is restored into `model` (built like the saved one), and
    `model.save_weights(filepath)` writes it; in a multi-process job only
    process 0 writes the file (with a model sharded over the processes,
    every process must call it: reading the weights whole is a collective).
    `model.load_weights(filepath)` reads it back on any backend, without
    keras_distribute.

    Args:
        checkpoint_path: A committed checkpoint directory.
        model: A built Keras model with the saved architecture.
        filepath: The file to write; must end in `.weights.h5`.
        object_name: The name the model was saved under.

    Returns:
        `filepath`.

    Raises:
        ValueError: if `filepath` does not end in `.weights.h5`.
        AssertionError: if a model variable is not in the checkpoint.

    Example:

    ```python
    kd.checkpoint.export_weights(path, model, "/tmp/model.weights.h5")
    ```
    """
    if not str(filepath).endswith(".weights.h5"):
        raise ValueError(
            "Keras weight files end in '.weights.h5'. Received: "
            f"filepath={filepath!r}.")
    checkpoint = ShardedCheckpoint(**{object_name: model})
    checkpoint.read(checkpoint_path).assert_existing_objects_matched()
    if checkpoint._deferred:
        raise ValueError(
            "The model is not built, so its weights cannot be exported. "
            "Build it first (call it on a batch, or model.build(shape)).")
    engine = checkpoint.resolve_engine()
    if engine.process_id == 0:
        model.save_weights(filepath, overwrite=True)
    elif isinstance(engine, interface.ShardedForwardEngine) and (
            engine.collective_reads):
        # Reading sharded weights whole is a collective: join the chief's.
        with tempfile.TemporaryDirectory(prefix="kd-export-") as scratch:
            model.save_weights(os.path.join(scratch, "w.weights.h5"))
    return filepath
