"""The Keras integration layer: every Keras-private name is a registry row,
checked before anything is patched; a Keras without one fails with one
clear error, never half-installed (no strategy needed: runs everywhere)."""

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_distribute as kd
from keras_distribute.integration import hooks
from keras_distribute.integration import registry


def test_every_row_of_this_backend_resolves_on_the_installed_keras():
    registry.check(keras.backend.backend())
    for row in registry.ROWS:
        assert row.reason and row.keras_versions, row.key


@pytest.fixture
def broken_row(monkeypatch):
    """The registry as a Keras that renamed the base trainer would have."""
    broken = registry.Row(
        "BaseTrainer", (("keras.src.trainers.trainer", "RenamedTrainer"),),
        "a model remembers its strategy", "3.10-3.16")
    rows = tuple(broken if r.key == "BaseTrainer" else r
                 for r in registry.ROWS)
    monkeypatch.setattr(registry, "ROWS", rows)
    monkeypatch.setattr(registry, "_BY_KEY", {r.key: r for r in rows})
    registry.forget()
    kd.integration.uninstall()
    yield
    monkeypatch.undo()
    registry.forget()
    kd.integration.install()


def test_a_renamed_keras_target_gives_one_clear_error(broken_row):
    before = keras.Model.fit
    with pytest.raises(kd.integration.KerasVersionError) as raised:
        kd.integration.install()
    message = str(raised.value)
    assert f"installed Keras {keras.__version__}" in message
    assert "BaseTrainer: none of ['keras.src.trainers.trainer:" \
           "RenamedTrainer'] exists" in message
    assert "Supported: keras>=3.15.1,<3.17" in message
    # Never half-installed: nothing was patched.
    assert keras.Model.fit is before and not hooks._originals


def test_a_changed_signature_is_refused_before_patching(monkeypatch):
    row = registry.Row("probe", (("keras.src.layers.layer", "Layer"),),
                       "test", "all", parameters=("self", "different"))
    call = registry.Row("probe.__call__", (), "test", "all",
                        parameters=("self", "different"))
    monkeypatch.setitem(registry._BY_KEY, "probe", row)
    monkeypatch.setitem(registry._BY_KEY, "probe.__call__", call)
    with pytest.raises(kd.integration.KerasVersionError,
                       match="probe.__call__: its parameters are"):
        registry.check("any", ["probe.__call__"])


def test_only_the_integration_package_names_keras_private_modules():
    import pathlib
    import re

    root = pathlib.Path(kd.__file__).parent
    offenders = [
        str(path.relative_to(root)) for path in root.rglob("*.py")
        if "integration" not in path.parts
        and re.search(r"^\s*(from|import) keras\.src", path.read_text(),
                      re.MULTILINE)]
    assert offenders == []


def test_a_renamed_private_attribute_is_refused_before_patching(monkeypatch):
    # Private attributes of Keras objects (set in __init__) are probed on a
    # fresh object: one clear error instead of an AttributeError mid-fit.
    row = registry.Row("Model._renamed_epoch", (), "test", "3.16",
                       instance_of="Model")
    monkeypatch.setitem(registry._BY_KEY, row.key, row)
    with pytest.raises(kd.integration.KerasVersionError,
                       match=r"Model._renamed_epoch: a new keras Sequential "
                             r"has no attribute '_renamed_epoch'"):
        registry.check("any", [row.key])
    registry.check("any", ["Model._initial_epoch", "Variable._value"])


SEEDED_PROGRAM = """
import os, random, sys
import numpy as np
import keras
use_strategy = sys.argv[1] == "strategy"
if use_strategy and keras.backend.backend() == "tensorflow":
    import keras_distribute as kd
    kd.simulate_cpu_devices(2)
keras.utils.set_random_seed(1)
if use_strategy:
    import keras_distribute as kd
    strategy = kd.MirroredStrategy()
    scope = strategy.scope()
else:
    import contextlib
    scope = contextlib.nullcontext()
with scope:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                              keras.layers.Dropout(0.5),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
draws = [random.random(), float(np.random.rand())]
if keras.backend.backend() == "torch":
    import torch
    draws.append(float(torch.rand(1)))
weights = [keras.ops.convert_to_numpy(w).tolist() for w in model.get_weights()]
print(repr((draws, weights)))
"""


def test_creating_a_strategy_leaves_the_random_streams_alone(tmp_path):
    """#30: on torch, creating the first strategy of a process drew from
    Python's `random` (a probe layer's default seed), so a seeded program
    built other weights under the strategy than without it. Creating a
    strategy and building under its scope now draws nothing from Python's,
    numpy's or torch's generators, on every backend."""
    import ast
    import concurrent.futures
    import os

    from program_runner import run_program

    script = tmp_path / "seeded.py"
    script.write_text(SEEDED_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["KERAS_BACKEND"] = BACKEND
    if BACKEND == "jax":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

    def run(mode):
        # A process of its own that imported nothing of the program yet
        # (forked from one that imported Keras: tests/program_runner.py,
        # which runs the two at once).
        done = run_program([str(script), mode], cwd=tmp_path, env=env,
                           timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return ast.literal_eval(done.stdout.strip().splitlines()[-1])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(run, ("plain", "strategy")))
    (plain_draws, plain_weights), (draws, weights) = outputs
    assert draws == plain_draws
    for a, b in zip(plain_weights, weights):
        np.testing.assert_array_equal(np.array(a), np.array(b))


CONFIGS_PROGRAM = """
import json, sys
import keras
from keras_distribute.integration import configs
from keras_distribute.training.config import describe
from keras.src.saving import serialization_lib
lazy = serialization_lib.tf
model = keras.Sequential([
    keras.Input((4,)), keras.layers.Dense(3, kernel_regularizer="l2"),
    keras.layers.BatchNormalization(), keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.AdamW(0.01), loss="mse",
              metrics=["mae"])
with configs.configs_read_without_tensorflow():
    stand_in = serialization_lib.tf is not lazy
    read = describe(model)
    with configs.configs_read_without_tensorflow():  # nested: no change
        again = describe(model)
imported_inside = "tensorflow" in sys.modules
restored = serialization_lib.tf is lazy
as_keras_reads = describe(model)  # Keras' own way: may import TensorFlow
with configs.configs_read_without_tensorflow():
    untouched_once_imported = serialization_lib.tf is lazy
print(json.dumps({
    "stand_in": stand_in, "imported_inside": imported_inside,
    "restored": restored, "same": read == again == as_keras_reads,
    "imported_after": "tensorflow" in sys.modules,
    "untouched_once_imported": untouched_once_imported}))
"""


def test_model_configs_are_read_without_importing_tensorflow(tmp_path):
    # Before each fit of several processes kd describes the model
    # (training/config.py); Keras' serialization imported all of TensorFlow
    # in a torch or JAX process to ask whether an object was one of its
    # types (~5 s of CPU per process). Read the same, TensorFlow left alone.
    import json
    import os

    from program_runner import run_program

    if BACKEND == "tensorflow":
        pytest.skip("the TensorFlow backend imports TensorFlow itself")
    script = tmp_path / "configs.py"
    script.write_text(CONFIGS_PROGRAM)
    env = dict(os.environ, KERAS_BACKEND=BACKEND)
    env.pop("KERAS_DISTRIBUTE_PRELOAD", None)  # (nothing imported before)
    done = run_program([str(script)], cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "stand_in": True, "imported_inside": False, "restored": True,
        "same": True, "imported_after": True,
        "untouched_once_imported": True}, result
