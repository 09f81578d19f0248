"""tf.distribute's `PreemptionCheckpointHandler` and `TerminationConfig`
(`kd.experimental.*`), for custom training loops, on every backend.

`PreemptionSignals` — record a termination signal, then agree over the
processes at a step boundary whether any process got one — is shared with
`kd.callbacks.PreemptionCheckpoint` (the `fit` form).
"""

import contextlib
import signal
import sys
import threading
import warnings
from typing import Any
from typing import Callable
from typing import Dict
from typing import Optional
from typing import Sequence

import numpy as np

from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint
from keras_distribute.checkpoint.storage.committed import read_metadata
from keras_distribute.job.exit_codes import PREEMPTION_EXIT_CODE


def _checked_signals(signals: Sequence[int]) -> tuple:
    signals = tuple(signals)
    valid = signal.valid_signals()
    if signals and all(isinstance(s, int) and not isinstance(s, bool)
                       and s in valid for s in signals):
        return signals
    raise ValueError(
        "Expected `signals` to be a non-empty sequence of signal numbers "
        f"(e.g. signal.SIGTERM). Received: signals={signals!r}.")


class PreemptionSignals:
    """Records the preemption signals this process receives (while
    installed) and tells whether any process of the job received one.

    Args:
        signals: The signal numbers that mean "preempted".
        watcher_fn: Optionally, a function polled at each agreement point;
            `True` counts as a signal (a platform's own notice).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,),
                 watcher_fn: Optional[Callable[[], bool]] = None):
        self.signals = _checked_signals(signals)
        self.watcher_fn = watcher_fn
        self.received: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    def _record(self, signum, frame) -> None:
        self.received = signum

    def install(self) -> None:
        """Catches the signals (the main thread only can; elsewhere warns)."""
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "Preemption handling runs outside the main thread, where "
                "Python cannot receive signals; a preemption signal will not "
                "be caught in this process.", stacklevel=3)
            return
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._record)

    def uninstall(self) -> None:
        """Puts the handlers that were there back."""
        while self._previous:
            signum, handler = self._previous.popitem()
            signal.signal(signum, handler)

    def anyone(self, engine: ReplicaEngine) -> bool:
        """Whether any process of `engine`'s job was signalled (a
        collective: every process calls it at the same step)."""
        if self.received is None and self.watcher_fn is not None and (
                self.watcher_fn()):
            self.received = self.signals[0]
        flag = np.array([0 if self.received is None else 1], np.int32)
        if engine.process_count > 1:
            flag = engine.process_all_gather(flag)
        return bool(np.any(flag))

    def name(self) -> str:
        return signal.Signals(self.received or self.signals[0]).name


class TerminationConfig:
    """How `PreemptionCheckpointHandler` learns of a preemption and what it
    does after saving, as `tf.distribute.experimental.TerminationConfig`.

    Args:
        termination_watcher_fn: A function returning `True` once the
            platform announced a preemption (polled at each `run`), in
            addition to SIGTERM.
        exit_fn: Called after the save; defaults to exiting with
            `PREEMPTION_EXIT_CODE` (42: restart me).
        grace_period: Seconds the platform gives between its notice and the
            end (kept for compatibility; the save starts at the next step).
        save_fn: Called instead of the checkpoint manager's save.

    Example:

    ```python
    config = kd.experimental.TerminationConfig(exit_fn=lambda: None)
    ```
    """

    def __init__(self, termination_watcher_fn: Optional[Callable] = None,
                 exit_fn: Optional[Callable] = None,
                 grace_period: Optional[float] = None,
                 save_fn: Optional[Callable] = None):
        for name, value in (("termination_watcher_fn", termination_watcher_fn),
                            ("exit_fn", exit_fn), ("save_fn", save_fn)):
            if value is not None and not callable(value):
                raise ValueError(
                    f"Expected `{name}` to be a function or None. Received: "
                    f"{name}={value!r}.")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = grace_period
        self.save_fn = save_fn


class PreemptionCheckpointHandler:
    """Saves a checkpoint at one step on every worker when one is
    preempted, as `tf.distribute.experimental.PreemptionCheckpointHandler`.

    Created, it restores the latest checkpoint (and `total_run_calls`, the
    number of `run` calls done) if there is one, and catches SIGTERM. Each
    `run(step_fn, ...)` runs one training step, then the workers agree
    whether any was signalled; if so, every worker saves the checkpoint
    there (numbered by `total_run_calls`), waits until it is committed,
    and calls the `exit_fn` (by default exits with 42, "restart me").
    Restarted, the loop goes on from `total_run_calls`.

    Args:
        cluster_resolver: The job's cluster resolver (e.g.
            `strategy.cluster_resolver`); accepted for compatibility, the
            workers are those of the checkpoint's strategy.
        checkpoint_or_checkpoint_manager: A `kd.checkpoint.ShardedCheckpoint`
            (a manager keeping one checkpoint in `checkpoint_dir` is made)
            or a `kd.checkpoint.CheckpointManager`.
        checkpoint_dir: Where the checkpoints go, with a checkpoint.
        termination_config: A `kd.experimental.TerminationConfig`.

    Raises:
        ValueError: for a checkpoint without `checkpoint_dir`, or anything
            that is neither a checkpoint nor a manager.

    Example:

    ```python
    handler = kd.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, checkpoint, "/shared/ckpt")
    for epoch in range(handler.total_run_calls // STEPS, EPOCHS):
        for step in range(handler.total_run_calls % STEPS, STEPS):
            loss = handler.run(distributed_train_step, next(iterator))
    ```
    """

    def __init__(self, cluster_resolver: Any,
                 checkpoint_or_checkpoint_manager: Any,
                 checkpoint_dir: Optional[str] = None,
                 termination_config: Optional[TerminationConfig] = None):
        target = checkpoint_or_checkpoint_manager
        if isinstance(target, CheckpointManager):
            self._manager = target
        elif isinstance(target, ShardedCheckpoint):
            if not checkpoint_dir:
                raise ValueError(
                    "PreemptionCheckpointHandler needs `checkpoint_dir` when "
                    "given a checkpoint (it keeps its saves there). Received: "
                    f"checkpoint_dir={checkpoint_dir!r}.")
            self._manager = CheckpointManager(target, checkpoint_dir,
                                              max_to_keep=1)
        else:
            raise ValueError(
                "Expected `checkpoint_or_checkpoint_manager` to be a "
                "kd.checkpoint.ShardedCheckpoint or CheckpointManager. "
                f"Received: {type(target).__name__}.")
        if termination_config is None:
            termination_config = TerminationConfig()
        if not isinstance(termination_config, TerminationConfig):
            raise ValueError(
                "Expected `termination_config` to be a "
                "kd.experimental.TerminationConfig. Received: "
                f"{type(termination_config).__name__}.")
        self._cluster_resolver = cluster_resolver
        self._config = termination_config
        self._signals = PreemptionSignals(
            watcher_fn=termination_config.termination_watcher_fn)
        self._total_run_calls = 0
        latest = self._manager.restore_or_initialize()
        if latest is not None:
            self._total_run_calls = int(read_metadata(latest).get(
                "total_run_calls", 0))
        self._signals.install()

    @property
    def total_run_calls(self) -> int:
        """How many `run` calls were made, over every restart."""
        return self._total_run_calls

    def run(self, distributed_train_function: Callable, *args: Any,
            **kwargs: Any) -> Any:
        """Runs one training step, then saves and exits if any worker was
        preempted.

        Args:
            distributed_train_function: One step (e.g. a function calling
                `strategy.run`); every worker calls `run` as often.
            *args: Its positional arguments.
            **kwargs: Its keyword arguments.

        Returns:
            What `distributed_train_function` returned.
        """
        result = distributed_train_function(*args, **kwargs)
        self._total_run_calls += 1
        self.save_checkpoint_if_preempted()
        return result

    def save_checkpoint_if_preempted(
            self, options: Optional[CheckpointOptions] = None,
            metadata: Optional[Dict[str, Any]] = None) -> None:
        """Saves and exits if any worker was preempted (a collective: call
        it at the same point on every worker). Arguments are those of
        `CheckpointManager.save`: `options`, `metadata`."""
        engine = self._manager.checkpoint.resolve_engine()
        if not self._signals.anyone(engine):
            return
        if self._config.save_fn is not None:
            self._config.save_fn()
        else:
            metadata = dict(metadata or {},
                            total_run_calls=self._total_run_calls)
            self._manager.save(self._total_run_calls, options=options,
                               metadata=metadata, check_interval=False)
            self._manager.sync()
        engine.barrier("keras_distribute.PreemptionCheckpointHandler.saved")
        self._signals.uninstall()
        if self._config.exit_fn is not None:
            self._config.exit_fn()
            self._signals.received = None
            self._signals.install()
            return
        print(f"PreemptionCheckpointHandler: saved after run call "
              f"{self._total_run_calls} on {self._signals.name()}; exiting "
              f"with {PREEMPTION_EXIT_CODE} (restart me).", file=sys.stderr)
        sys.exit(PREEMPTION_EXIT_CODE)

    @contextlib.contextmanager
    def watch_preemption_scope(self):
        """A scope whose preemption signals are caught (the handler catches
        them from its creation; kept for compatibility)."""
        self._signals.install()
        yield
