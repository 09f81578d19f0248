"""Keras callbacks in multi-process runs: only the chief writes files.

Every process runs the same `fit` with the same callbacks. Left alone, a
`ModelCheckpoint` or `CSVLogger` in N processes writes the same file N times
at once. Inside `chief_only_writes`, the non-chief processes keep their
callbacks' logic (logs are global, so `EarlyStopping` stops every process at
the same epoch) but send their writes to a scratch directory or skip them;
the callbacks are restored when `fit` returns.
"""

import contextlib
import os
import tempfile
from typing import Any
from typing import Iterator
from typing import List
from typing import Sequence


def _no_write(*args, **kwargs) -> None:
    return None


def _redirect(callback: Any, scratch: str, saved: list,
              collective_reads: bool) -> None:
    import keras

    def swap(name: str, value: Any) -> None:
        saved.append((callback, name, callback.__dict__.get(name, _MISSING)))
        setattr(callback, name, value)

    def no_save(*paths: str) -> None:
        """The chief's save writes the file. With collective reads (a model
        sharded over the processes) it reads every process's part, so the
        others save too — as the chief does, into scratch (`paths`, the
        callback's attributes naming files, point there meanwhile)."""
        if not collective_reads:
            swap("_save_model", _no_write)
            return
        save = callback._save_model

        def scratch_save(*args, **kwargs):
            real = {name: getattr(callback, name) for name in paths}
            for name, path in real.items():
                setattr(callback, name, os.path.join(
                    scratch, os.path.basename(str(path))))
            try:
                return save(*args, **kwargs)
            finally:
                for name, path in real.items():
                    setattr(callback, name, path)

        swap("_save_model", scratch_save)

    if isinstance(callback, keras.callbacks.BackupAndRestore):
        swap("delete_checkpoint", False)      # the chief deletes it at the end
        no_save("backup_dir", "_weights_path", "_training_metadata_path",
                "_prev_weights_path", "_prev_training_metadata_path")
    elif isinstance(callback, keras.callbacks.ModelCheckpoint):
        no_save("filepath")
    elif isinstance(callback, keras.callbacks.CSVLogger):
        swap("filename", os.path.join(scratch, "log.csv"))
    elif isinstance(callback, keras.callbacks.TensorBoard):
        swap("log_dir", os.path.join(scratch, "tensorboard"))


_MISSING = object()


@contextlib.contextmanager
def chief_only_writes(callbacks: Sequence[Any], is_chief: bool,
                      collective_reads: bool = False) -> Iterator[None]:
    """Redirects the file writes of non-chief processes' callbacks.

    Args:
        callbacks: The callbacks passed to `fit` (a list, or `None`).
        is_chief: Whether this process is the chief (process 0).
        collective_reads: Whether reading the weights is a collective (a
            model sharded over the processes): non-chief processes then
            save too, into the scratch directory, so that the chief's read
            completes.

    Yields:
        Nothing; on exit the callbacks are as they were.
    """
    if is_chief or not callbacks or not isinstance(callbacks, (list, tuple)):
        yield
        return
    saved: List[Any] = []
    with tempfile.TemporaryDirectory(prefix="kd-worker-") as scratch:
        try:
            for callback in callbacks:
                _redirect(callback, scratch, saved, collective_reads)
            yield
        finally:
            for callback, name, value in reversed(saved):
                if value is _MISSING:
                    delattr(callback, name)
                else:
                    setattr(callback, name, value)
