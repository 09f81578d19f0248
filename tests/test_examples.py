"""Every example runs (briefly) under the active backend, and has --help."""

import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
from conftest import BACKEND
from program_runner import run_program

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 300

RUNS = [
    ("demo_digits.py", ["--epochs", "1"], "Test accuracy"),
    ("distributed_training_with_keras.py", ["--epochs", "1"], "Eval accuracy"),
    ("custom_training_loop.py", ["--epochs", "1"], "epoch 1: mean loss"),
    ("multi_worker.py", ["--epochs", "1"], "identical on every worker: True"),
    ("model_parallel.py", ["--epochs", "1"], "final accuracy"),
    ("checkpoint_and_resume.py", ["--epochs", "2"],
     "resumed run equals uninterrupted: True"),
]


def run_example(name, args, launch=False):
    # A crash in native code (a signal) prints the Python stack of each
    # thread, so a failure here says where it happened. Files an example
    # writes go to a scratch working directory.
    env = dict(os.environ, KERAS_BACKEND=BACKEND, PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(filter(None, [
                   str(EXAMPLES.parent), os.environ.get("PYTHONPATH")])))
    env.pop("XLA_FLAGS", None)  # each example sets its own device count
    env.pop("KD_RECORD_BAD_INPUTS", None)
    with tempfile.TemporaryDirectory(prefix="kd-example-") as directory:
        if not launch:  # forked from a Keras imported once, as python runs it
            return run_program([str(EXAMPLES / name), *args], cwd=directory,
                               env=env, timeout=TIMEOUT)
        return subprocess.run(
            [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
             str(EXAMPLES / name), *args], env=env, cwd=directory,
            capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("name, args, expected", RUNS,
                         ids=[r[0] for r in RUNS])
def test_example_runs(name, args, expected):
    done = run_example(name, args)
    if name == "model_parallel.py" and BACKEND == "tensorflow":
        # The documented refusal (was: "Unknown device 'CPU:1'" first).
        assert done.returncode != 0
        assert "Sharded variable layouts are not supported on the " \
               "'tensorflow' Keras backend" in done.stderr, done.stderr[-3000:]
        return
    if done.returncode in (-signal.SIGSEGV, -signal.SIGABRT):
        # TensorFlow crashed once in native code in 1 of ~40 runs of the
        # digits demo (CI, loaded machine; 0 of 16 reruns). A second crash
        # fails; the first one's stacks stay visible as a warning.
        warnings.warn(f"{name} crashed ({done.returncode}), rerun once:\n"
                      f"{done.stderr[-6000:]}")
        done = run_example(name, args)
    assert done.returncode == 0, (
        f"exit {done.returncode}\nstdout:\n{done.stdout[-1500:]}\n"
        f"stderr:\n{done.stderr[-6000:]}")
    assert expected in done.stdout


@pytest.mark.skipif(BACKEND != "torch", reason="torch: one process per "
                    "replica, so the docstring starts it with the launcher")
@pytest.mark.skipif(os.environ.get("KD_DOCS_BLOCKS", "1") == "0",
                    reason="a documented recipe: the release stack runs it")
def test_tutorial_example_under_the_launcher_as_its_docstring_says():
    # Regression (#19.2): each process took its own temporary checkpoint
    # directory and rank 1 found no `ckpt_12.weights.h5` (the chief alone
    # writes it).
    done = run_example("distributed_training_with_keras.py",
                       ["--epochs", "1"], launch=True)
    if "killed by SIGABRT" in done.stderr and done.stdout.count(
            "Eval accuracy") == 2:
        # Both workers finished, then one aborted at interpreter exit
        # ("terminate called without an active exception": a native thread
        # torn down while joinable; 2 of ~15 CI runs, 0 of 9 here). Known,
        # not yet fixed (#17 note); a second crash fails.
        warnings.warn("a worker aborted at exit after finishing, rerun once:"
                      f"\n{done.stderr[-3000:]}")
        done = run_example("distributed_training_with_keras.py",
                           ["--epochs", "1"], launch=True)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.count("Eval accuracy") == 2  # both processes
    assert "Number of devices: 2" in done.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_has_help(name):
    if BACKEND != "jax":
        pytest.skip("--help is backend-independent: checked once, on jax")
    done = run_example(name, ["--help"])
    assert done.returncode == 0 and "usage:" in done.stdout
