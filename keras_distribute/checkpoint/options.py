"""`CheckpointOptions`: how a save runs."""

import dataclasses
from typing import Optional
from typing import Union

from keras_distribute.checkpoint import progress


@dataclasses.dataclass
class CheckpointOptions:
    """How a save runs (the counterpart of `tf.train.CheckpointOptions`).

    Args:
        enable_async: Write in the background: the call returns once every
            value is copied to host memory; `sync()` (or the next save or
            restore) waits for the write and re-raises its error.
        experimental_enable_async_checkpoint: `tf.train.CheckpointOptions`'
            name for `enable_async`, accepted when porting.
        timeout_seconds: How long the chief waits for the other processes'
            shards before the save fails (the previous checkpoint is kept).
        verbose: A line per save or restore with its bytes, seconds and
            MB/s in each process: `"auto"` (default) when a process moves
            at least 1 GiB, `1` always, `0` never.
        trusted: On restore: the checkpoint comes from a source you trust,
            so an input iterator's state is restored even when it is not
            signed with this host's key (see docs/checkpointing.md: kd
            cannot check tf.data's serialised state, whose deserializer
            does not withstand crafted bytes). Defaults to `False`.

    Example:

    ```python
    options = kd.checkpoint.CheckpointOptions(enable_async=True)
    checkpoint.save("/tmp/ckpt/run", options=options)
    checkpoint.sync()
    ```
    """

    enable_async: bool = False
    experimental_enable_async_checkpoint: Optional[bool] = None
    timeout_seconds: float = 600.0
    verbose: Union[int, str] = "auto"
    trusted: bool = False

    def __post_init__(self):
        if self.experimental_enable_async_checkpoint is not None:
            self.enable_async = bool(self.experimental_enable_async_checkpoint)
        if not self.timeout_seconds > 0:
            raise ValueError(
                "timeout_seconds must be positive. Received: "
                f"timeout_seconds={self.timeout_seconds}.")
        progress.check_verbose(self.verbose)
