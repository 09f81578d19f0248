"""The settings of the trainer call in progress, held by a
`ProcessDataEngine` (`interface.ProcessDataEngine.trainer_call`): the one
implementation JAX's and torch's engines inherit."""

import contextlib
from typing import Any
from typing import Iterator
from typing import Optional

_UNCHANGED: Any = ...


class TrainerCallState:
    """What the neutral layer tells a `ProcessDataEngine` about the trainer
    call in progress, held by the engine (the defaults, written once, are
    those outside every call), and the rows of each batch it feeds.

    `input/process_data.py` sets them for a `fit`, `evaluate` or
    `train_on_batch` through `trainer_call`, never by writing the engine's
    fields; a call inside another (`fit`'s validation `evaluate`) changes
    only what it gives and puts the outer call's settings back after.

    - `even_batches`: every batch of the call splits evenly over the
      replicas (the replicas then skip the uneven-batch reweighting).
    - `sync_metrics_each_step`: per-batch logs have a reader, so each
      train step makes the metrics global (else only the epoch-end results
      are).
    - `step_inputs`: the per-process dataset Keras iterates (
      `input/process_data.py`'s ArrayShards or SourceShards; None outside).
    """

    even_batches: bool = False
    sync_metrics_each_step: bool = True
    step_inputs: Any = None

    def split_rows(self, batch: int, pipeline: Optional[int] = None
                   ) -> tuple:
        """Each engine's own split (`ProcessDataEngine.split_rows`)."""
        raise NotImplementedError

    def rows_to_feed(self, batch: int) -> tuple:
        """This process's rows of the global batch it feeds next; an engine
        that lays a batch out by how it was split records it here."""
        return self.split_rows(batch)

    @contextlib.contextmanager
    def trainer_call(self, *, even_batches: Any = _UNCHANGED,
                     step_inputs: Any = _UNCHANGED,
                     sync_metrics_each_step: Any = _UNCHANGED
                     ) -> Iterator[None]:
        previous = (self.even_batches, self.step_inputs,
                    self.sync_metrics_each_step)
        if even_batches is not _UNCHANGED:
            self.even_batches = bool(even_batches)
        if step_inputs is not _UNCHANGED:
            self.step_inputs = step_inputs
        if sync_metrics_each_step is not _UNCHANGED:
            self.sync_metrics_each_step = bool(sync_metrics_each_step)
        try:
            yield
        finally:
            (self.even_batches, self.step_inputs,
             self.sync_metrics_each_step) = previous
