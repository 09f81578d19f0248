"""Steps a user writes, distributed on torch processes.

Keras' own train step forwards through the DDP the engine holds
(`training.TrainSteps.train_step`). A model that overrides `train_step` or
`test_step` (keras-io's "Customizing what happens in fit()" for torch, a
GAN with two optimizers) replaces it, while each process still trains on
its share of every global batch: without more, each process would apply
its own gradients and report its own metrics. Here, as tf.distribute's
optimizers and sync-on-read metrics do:

- around each step of a model whose step is the user's, a `StepSession`
  knows the process's rows of the global batch;
- gradients handed to a Keras optimizer (`apply`, `apply_gradients`, each
  of several optimizers, every call) in that step are replaced by the
  global batch's: the processes' gradients of their local mean losses,
  each weighted by its share of the global batch, summed (one flat
  all-reduce per call; the same mean DDP makes, also for a short last
  batch split unevenly);
- inside `strategy.run` (a custom loop), gradients not yet all-reduced
  are summed over the replicas (the loss there is scaled by the global
  batch, as in tf.distribute); those the replica context's `all_reduce`
  returned are applied as they are;
- the step's logs are global: the model's metric results when the step
  returns one log per metric (the rule Keras applies at an epoch's end),
  else each scalar log as the rows-weighted mean over the processes;
- in a loop of the user's own outside `fit` and `strategy.run` (keras-io's
  "Writing a training loop from scratch in PyTorch", each process on its
  own batches), a Keras optimizer made under a strategy of several
  processes applies the processes' gradients averaged (DDP's rule: each
  process's loss is the mean over its batch); gradients already equal in
  every process (all-reduced by the user) average to themselves.

Keras' own step (DDP reduced its gradients) opens no session: its
optimizer call goes straight through (also when `torch.compile` traces it),
as every optimizer call inside `fit` & co. not in a user's step does.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Sequence

import torch

from keras_distribute.backend.torch.trees import flat_leaves

if TYPE_CHECKING:
    from keras import Model
    from keras.optimizers import Optimizer

    from keras_distribute.backend.torch.engine import TorchEngine

_state = threading.local()
# Sessions and `run` calls open in any thread: the one check an optimizer's
# `apply` makes in every other case (a module global, so that a step
# `torch.compile` traces keeps it as a guard, with no graph break).
_open = 0
# `fit`, `evaluate` & co. running in this process (a module global, as
# `_open`): an optimizer call there outside a session is Keras' own step's.
_trainer_calls = 0


def current_session() -> Optional["StepSession"]:
    """The step session open in this thread (None outside a user's step)."""
    return getattr(_state, "session", None)


def _reduced_depth() -> int:
    return getattr(_state, "reduced", 0)


@contextlib.contextmanager
def gradients_reduced() -> Iterator[None]:
    """Gradients applied in this block are already global (DDP reduced
    them, or the caller all-reduced them)."""
    _state.reduced = _reduced_depth() + 1
    try:
        yield
    finally:
        _state.reduced -= 1


@contextlib.contextmanager
def in_run(engine: TorchEngine) -> Iterator[None]:
    """Marks this thread as inside `engine`'s `run` (a replica's call)."""
    global _open
    previous = getattr(_state, "run_engine", None)
    _state.run_engine = engine
    _open += 1
    try:
        yield
    finally:
        _open -= 1
        _state.run_engine = previous


@contextlib.contextmanager
def in_trainer_call() -> Iterator[None]:
    """Marks a `fit`/`evaluate`/`predict`/`*_on_batch` call running."""
    global _trainer_calls
    _trainer_calls += 1
    try:
        yield
    finally:
        _trainer_calls -= 1


def mark_reduced(tensor: Any) -> Any:
    """Marks `tensor` as all-reduced over the replicas (an optimizer given
    it inside `strategy.run` applies it as it is); returns it."""
    if isinstance(tensor, torch.Tensor):
        tensor._kd_all_reduced = True
    return tensor


def _is_reduced(tensor: Any) -> bool:
    return tensor is None or bool(getattr(tensor, "_kd_all_reduced", False))


def _rows(batch: Any) -> int:
    leaves = [leaf for leaf in flat_leaves(batch)
              if leaf is not None and getattr(leaf, "shape", None)]
    return int(leaves[0].shape[0]) if leaves else 0


class StepSession:
    """One step of a user's `train_step`/`test_step` in this process.

    Args:
        engine: The torch engine of the model's strategy.
        model: The Keras model stepping.
        rows: This process's rows of the global batch.
        even: Whether every process is known to hold the same number of
            rows (`fit` over arrays that split evenly): no all-reduce is
            needed to weigh the processes.
    """

    def __init__(self, engine: TorchEngine, model: Model, rows: int,
                 even: bool):
        self.engine = engine
        self.model = model
        self.rows = rows
        self._even = even
        self._share: Optional[float] = None

    def share(self) -> float:
        """This process's share of the global batch (a collective unless
        the batches split evenly)."""
        if self._share is None:
            if self._even:
                self._share = 1.0 / self.engine.num_replicas
            else:
                total = float(self.engine.all_reduce_sum(torch.tensor(
                    float(self.rows), dtype=torch.float64,
                    device=self.engine.device)).item())
                self._share = self.rows / total if total else 0.0
        return self._share

    def global_gradients(self, grads: Sequence[Any]) -> List[Any]:
        """The global batch's gradients from this process's (of its local
        mean loss): weighted by each process's share, summed."""
        return self.engine.sum_gradients(grads, self.share())

    def global_logs(self, logs: Any) -> Any:
        """The step's logs, global (see the module docstring)."""
        if not isinstance(logs, dict) or not logs:
            return logs
        flat = _flattened(logs)
        results = self.model.get_metrics_result()  # global (integration)
        if isinstance(results, dict) and set(results) == set(flat):
            return results
        return self.engine.weighted_mean_logs(flat, self.share())


def _flattened(logs: dict) -> dict:
    """Nested dicts of logs (`{"compile_metrics": {"mae": ...}}`) merged
    into one, as Keras' `pythonify_logs` shows them."""
    flat: dict = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            flat.update(_flattened(value))
        else:
            flat[key] = value
    return flat


def apply_with_global_gradients(apply: Callable, optimizer: Optimizer,
                                grads: Any, variables: Any) -> Any:
    """Calls an optimizer's `apply` with the global batch's gradients where
    kd knows them to be local (inside a user's step, inside `strategy.run`
    on gradients not yet all-reduced, or in a loop of the user's own in a
    job of several processes: see the module docstring)."""
    if not _open and _trainer_calls:  # Keras' own step: DDP reduced them
        return apply(optimizer, grads, variables)
    if grads is None or _reduced_depth():
        return apply(optimizer, grads, variables)
    if not _open:
        if variables is not None:
            variables = list(variables)  # (read twice: a generator once)
        engine = _engine_of(optimizer, variables)
        if engine is None or not engine.in_group or engine.num_replicas == 1:
            return apply(optimizer, grads, variables)
        averaged = engine.average_gradients(list(grads))
        with gradients_reduced():
            return apply(optimizer, averaged, variables)
    grads = list(grads)
    session = current_session()
    if session is not None:
        global_grads = session.global_gradients(grads)
    else:
        engine = getattr(_state, "run_engine", None)
        if engine is None or engine.num_replicas == 1 or all(
                map(_is_reduced, grads)):
            return apply(optimizer, grads, variables)
        global_grads = engine.sum_gradients(grads, 1.0)
    with gradients_reduced():  # a wrapping optimizer's inner `apply`
        return apply(optimizer, global_grads, variables)


def _engine_of(optimizer: Optimizer, variables: Optional[List[Any]]
               ) -> Optional["TorchEngine"]:
    """The torch engine whose scope made `optimizer` (its step counter) or
    the variables it updates; None outside every strategy."""
    candidates = [getattr(optimizer, "iterations", None)]
    if variables:
        candidates.append(variables[0])
    for candidate in candidates:
        engine = getattr(candidate, "__dict__", {}).get("_kd_engine")
        if engine is not None:
            return engine
    return None


def wrap_step_function(engine: TorchEngine, model: Model,
                       function: Callable,
                       is_train: bool) -> Callable:
    """`function` (Keras' `train_function`/`test_function`) run as one
    `StepSession` per call."""

    def step(data):
        batch = data[0] if isinstance(data, (list, tuple)) and len(
            data) == 1 else data
        source = engine.step_inputs
        if source is not None and source.bare_inputs and isinstance(
                batch, (list, tuple)) and len(batch) == 1:
            # `x` alone, as Keras hands it without kd's per-process data.
            batch = batch[0]
            data = [batch]
        session = StepSession(engine, model, _rows(batch),
                              even=is_train and engine.even_batches)
        global _open
        engine.user_step_begins()
        previous = current_session()
        _state.session = session
        _open += 1
        try:
            logs = function(data)
        finally:
            _open -= 1
            _state.session = previous
        if is_train and not engine.sync_metrics_each_step:
            # Flat, as Keras shows them: at the epoch's end Keras takes
            # the metrics' (global) results where the keys are theirs; a
            # nested `compile_metrics` log never matched (each process's
            # own results were logged).
            return _flattened(logs) if isinstance(logs, dict) else logs
        return session.global_logs(logs)

    step._kd_user_step = True  # type: ignore[attr-defined]
    return step
