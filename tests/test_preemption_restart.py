"""A preempted job exits with 42 and its restart ends where an
uninterrupted run does (#17), through `python -m keras_distribute.launch`.

Rank 1 receives SIGTERM at step 4 of 18; both processes save there, exit
with `PREEMPTION_EXIT_CODE` and the launcher exits with it too (it waits
for the other process's save instead of ending it). Started again, the job
resumes from the backup; its weights equal those of a job never
interrupted, bit for bit. A worker killed outright under
`--max-restarts 1` is restarted with its job, from the last periodic
backup, and ends the same. One in-process agreement test per backend with
5 seeds lives in test_*_multi*.py (worker_training.preemption).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BACKEND
from program_runner import failure_excerpt

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300

SCRIPT = """
import os, signal
import numpy as np
import keras
import keras_distribute as kd

strategy = kd.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 16)).astype("float32")
y = rng.integers(0, 3, size=(96,))
keras.utils.set_random_seed(3)
with strategy.scope():
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dropout(0.2),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
kill_at = int(os.environ.get("KILL_AT", "0"))
crash_at = int(os.environ.get("CRASH_AT", "0"))

class Terminate(keras.callbacks.Callback):
    seen = 0
    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == kill_at and kd.process_index() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if (self.seen == crash_at and kd.process_index() == 1
                and not os.path.exists("crashed")):
            open("crashed", "w").close()   # once: the restart trains on
            os.kill(os.getpid(), signal.SIGKILL)

model.fit(x, y, batch_size=16, epochs=3, shuffle=True, verbose=0,
          callbacks=[Terminate(), kd.callbacks.PreemptionCheckpoint(
              "backup", save_freq=int(os.environ.get("SAVE_FREQ", "0"))
              or None)])
if kd.process_index() == 0:
    np.savez("weights.npz", *model.get_weights())
"""


def _launch(directory: Path, kill_at: int = 0,
            *launcher_args: str, **variables) -> subprocess.CompletedProcess:
    env = dict(os.environ, KERAS_BACKEND=BACKEND, KILL_AT=str(kill_at),
               **variables,
               TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join(filter(None, [
                   str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("KD_RECORD_BAD_INPUTS", None)
    return subprocess.run(
        [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
         *launcher_args, "train.py"], cwd=directory, env=env,
        capture_output=True, text=True,
        timeout=TIMEOUT_S)


def _weights(directory: Path) -> list:
    with np.load(directory / "weights.npz") as saved:
        return [saved[name] for name in saved.files]


@pytest.mark.skipif(os.environ.get("KD_DOCS_BLOCKS", "1") == "0",
                    reason="process start-up heavy: the release stack runs it")
@pytest.mark.skipif(BACKEND != "torch", reason="the launcher's exit codes and "
                    "restarts are backend-independent (checked on all three "
                    "once, here on torch: the fastest to start); every "
                    "backend's agreement, save and resume: test_*_multi*.py")
def test_preempted_job_exits_42_and_its_restart_ends_bit_identical(tmp_path):
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "whole"
    for directory in (interrupted, uninterrupted):
        directory.mkdir()
        (directory / "train.py").write_text(SCRIPT)
    first = _launch(interrupted, kill_at=4)
    assert first.returncode == 42, failure_excerpt(first.stderr)
    assert "exiting with 42 (restart me)" in first.stderr
    assert not (interrupted / "weights.npz").exists()
    assert [p.name for p in (interrupted / "backup").iterdir()
            if p.name[0] != "."] == ["backup-1"]  # one backup
    second = _launch(interrupted, kill_at=0)
    assert second.returncode == 0, failure_excerpt(second.stderr)
    assert not (interrupted / "backup").exists() or not os.listdir(
        interrupted / "backup")  # removed once fit completed
    whole = _launch(uninterrupted, kill_at=0)
    assert whole.returncode == 0, failure_excerpt(whole.stderr)
    for a, b in zip(_weights(interrupted), _weights(uninterrupted)):
        np.testing.assert_array_equal(a, b)
    # A worker killed outright (SIGKILL at step 8, backups every 3 steps):
    # `--max-restarts 1` starts the job again, it resumes from step 6.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "train.py").write_text(SCRIPT)
    elastic = _launch(crashed, 0, "--max-restarts", "1", CRASH_AT="8",
                      SAVE_FREQ="3")
    assert elastic.returncode == 0, failure_excerpt(elastic.stderr)
    assert (crashed / "crashed").exists()
    assert "restarting the job (1 of 1 restarts)" in elastic.stderr
    for a, b in zip(_weights(crashed), _weights(uninterrupted)):
        np.testing.assert_array_equal(a, b)


def test_preemption_checkpoint_argument_errors(tmp_path):
    import keras_distribute as kd

    for bad in ((), ("TERM",), (True,), (10_000,)):
        with pytest.raises(ValueError, match="Expected `signals` to be a "
                           "non-empty sequence of signal numbers"):
            kd.callbacks.PreemptionCheckpoint(str(tmp_path), signals=bad)
    for bad in (0, 256, "42", True):
        with pytest.raises(ValueError, match=r"Expected `exit_code` to be an "
                           r"exit status in \[1, 255\] or None"):
            kd.callbacks.PreemptionCheckpoint(str(tmp_path), exit_code=bad)
    for bad in (0, 1.5, False):
        with pytest.raises(ValueError, match="Expected `check_every` to be a "
                           "positive number of batches"):
            kd.callbacks.PreemptionCheckpoint(str(tmp_path), check_every=bad)
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a "
                       "positive number of batches"):
        kd.callbacks.PreemptionCheckpoint(str(tmp_path), save_freq=-3)
    assert kd.callbacks.PREEMPTION_EXIT_CODE == 42


def test_one_process_signal_stops_saves_and_resumes(tmp_path):
    # The signal in the only process (no collective), SIGUSR1 as the
    # configured signal, a save every 5 batches as well.
    import signal

    import keras
    from conftest import make_mlp

    import keras_distribute as kd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 16)).astype("float32")
    y = rng.integers(0, 3, size=(96,))

    def fit(callbacks):
        keras.utils.set_random_seed(3)
        model = make_mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        model.fit(x, y, batch_size=16, epochs=3, shuffle=True, verbose=0,
                  callbacks=callbacks)
        return model.get_weights()

    class Signal(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and not hasattr(self, "sent"):
                self.sent = True
                os.kill(os.getpid(), signal.SIGUSR1)

    options = dict(signals=(signal.SIGUSR1,), exit_code=None, save_freq=5)
    first = kd.callbacks.PreemptionCheckpoint(str(tmp_path), **options)
    previous = signal.getsignal(signal.SIGUSR1)
    fit([Signal(), first])
    assert first.preempted
    assert signal.getsignal(signal.SIGUSR1) is previous  # handler restored
    second = kd.callbacks.PreemptionCheckpoint(str(tmp_path), **options)
    resumed = fit([second])
    assert not second.preempted
    for a, b in zip(resumed, fit([])):
        np.testing.assert_array_equal(a, b)


def test_preemption_checkpoint_handler_argument_errors(tmp_path):
    import keras

    import keras_distribute as kd

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    handler_class = kd.experimental.PreemptionCheckpointHandler
    with pytest.raises(ValueError, match="needs `checkpoint_dir` when given "
                       "a checkpoint"):
        handler_class(None, checkpoint)
    with pytest.raises(ValueError, match="Expected "
                       "`checkpoint_or_checkpoint_manager` to be a "
                       "kd.checkpoint.ShardedCheckpoint or CheckpointManager"):
        handler_class(None, model, str(tmp_path))
    with pytest.raises(ValueError, match="Expected `termination_config` to "
                       "be a kd.experimental.TerminationConfig"):
        handler_class(None, checkpoint, str(tmp_path),
                      termination_config={"exit_fn": None})
    with pytest.raises(ValueError, match="Expected `exit_fn` to be a "
                       "function or None"):
        kd.experimental.TerminationConfig(exit_fn=42)
