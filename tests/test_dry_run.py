"""`kd.layouts.dry_run` and `python -m keras_distribute.planning` (issue #46,
item 3): a whole job checked on one machine before the launch.

22 distinct misconfigurations are seeded (one more on TensorFlow, whose
refusal of sharded layouts is its own finding); each must be caught with
its fix, and none of the correct configurations may be flagged. The cluster
is 2 hosts x 4 devices unless a case says otherwise.
"""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND
from keras.distribution import DeviceMesh
from keras.distribution import LayoutMap

import keras_distribute as kd

TESTS = os.path.dirname(os.path.abspath(__file__))
CLUSTER = {"hosts": 2, "devices_per_host": 4}


def make_model(width=512):
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(width, activation="relu", name="up"),
        keras.layers.Dense(64, name="down"),
        keras.layers.Dense(5, name="head")], name="mlp")


def wider_model():
    return make_model(width=1024)


def mesh(shape=(2, 4)):
    size = int(np.prod(shape))
    return DeviceMesh(shape, ["batch", "model"][:len(shape)],
                      [f"cpu:{i}" for i in range(size)])


def layout_map(entries, shape=(2, 4)):
    result = LayoutMap(mesh(shape))
    for key, axes in entries.items():
        result[key] = axes
    return result


def tensor_parallel():
    return layout_map({"mlp/up/kernel": (None, "model"),
                       "mlp/up/bias": ("model",),
                       "mlp/down/kernel": ("model", None)})


def training_bytes():
    """Variables, gradients and Adam's two slots of make_model, whole."""
    params = 64 * 512 + 512 + 512 * 64 + 64 + 64 * 5 + 5
    return 4 * params * 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Directories: this model's checkpoint, a checkpoint of the model
    saved under another name, a corrupt one, and a file."""
    root = tmp_path_factory.mktemp("checkpoints")
    kd.checkpoint.ShardedCheckpoint(model=make_model()).save(
        str(root / "ours" / "ckpt"))
    kd.checkpoint.ShardedCheckpoint(net=make_model()).save(
        str(root / "renamed" / "ckpt"))
    kd.checkpoint.ShardedCheckpoint(model=make_model()).save(
        str(root / "corrupt" / "ckpt"))
    (root / "corrupt" / "ckpt-1" / "index.json").write_text("{not json")
    (root / "file").write_text("x")
    return root


# name: (layout map (None: data parallel), dry_run's arguments, the finding
# kinds it must report). "{ckpt}" in a path is the fixture's directory.
MISCONFIGURED = {
    "a typo in a key": (
        lambda: layout_map({"mlp/up/kernal": (None, "model")}), {},
        {"unmatched_key"}),
    "a map written for another model": (
        lambda: layout_map({"decoder_block_.*/attention/query/kernel":
                            (None, "model", None)}), {}, {"unmatched_key"}),
    "two keys for one variable": (
        lambda: layout_map({".*up/kernel": (None, "model"),
                            ".*/up/.*kernel": ("model", None)}), {},
        {"several_keys"}),
    "a layout of the wrong rank": (
        lambda: layout_map({"mlp/up/kernel": ("model",)}), {}, {"rank"}),
    "an indivisible shard": (
        lambda: layout_map({"mlp/head/kernel": (None, "model")}), {},
        {"indivisible"}),
    "an indivisible shard over the batch axis (FSDP)": (
        lambda: layout_map({"mlp/head/bias": ("batch",)}), {},
        {"indivisible"}),
    "a large variable left replicated": (
        lambda: layout_map({}), {"giant_bytes": 100_000},
        {"replicated_giant"}),
    "a global batch the replicas do not divide": (
        lambda: layout_map({}), {"global_batch_size": 63}, {"batch_size"}),
    "a global batch smaller than the replicas": (
        None, {"global_batch_size": 4}, {"batch_size"}),
    "a global batch the hosts do not divide": (
        lambda: layout_map({}, (1, 8)), {"global_batch_size": 3},
        {"batch_size"}),
    "variables over a device's memory": (
        tensor_parallel, {"device_memory": 100_000}, {"memory"}),
    "activations over a device's memory": (
        None, {"global_batch_size": 8192,
               "device_memory": 2 * training_bytes()}, {"memory"}),
    "a mesh larger than the cluster": (
        tensor_parallel, {"hosts": 1, "devices_per_host": 4}, {"mesh"}),
    "a mesh smaller than the cluster": (
        tensor_parallel, {"hosts": 4, "devices_per_host": 4}, {"mesh"}),
    "a model-parallel group split across hosts": (
        lambda: layout_map({}, (2, 3)), {"hosts": 3, "devices_per_host": 2},
        {"hosts"}),
    "a checkpoint directory under a file": (
        None, {"checkpoint_directory": "{ckpt}/file/run"}, {"checkpoint"}),
    "a checkpoint directory that is a file": (
        None, {"checkpoint_directory": "{ckpt}/file"}, {"checkpoint"}),
    "a checkpoint of a different model": (
        None, {"checkpoint_directory": "{ckpt}/ours", "model": wider_model},
        {"checkpoint"}),
    "a checkpoint saved under another name": (
        None, {"checkpoint_directory": "{ckpt}/renamed"}, {"checkpoint"}),
    "a corrupt latest checkpoint": (
        None, {"checkpoint_directory": "{ckpt}/corrupt"}, {"checkpoint"}),
    "a storage kd cannot write to": (
        None, {"checkpoint_directory": "hdfs://namenode/run"},
        {"checkpoint"}),
    "Adam's slots over a device's memory (SGD's would fit)": (
        None, {"global_batch_size": 8, "optimizer": "adam",
               "device_memory": training_bytes() * 3 // 4}, {"memory"}),
}
if BACKEND == "tensorflow":
    MISCONFIGURED["sharded layouts on TensorFlow"] = (
        tensor_parallel, {}, {"backend"})


def shards(a_layout_map):
    """Whether the map shards a variable (TensorFlow refuses it)."""
    from keras_distribute.backend import get_backend

    try:
        get_backend().refuse_unsupported_layouts(a_layout_map)
    except NotImplementedError:
        return True
    return False


def run(make_map, arguments, checkpoints):
    arguments = dict(arguments)
    model = arguments.pop("model", make_model)
    if "checkpoint_directory" in arguments:
        arguments["checkpoint_directory"] = arguments[
            "checkpoint_directory"].replace("{ckpt}", str(checkpoints))
    for key, value in CLUSTER.items():
        arguments.setdefault(key, value)
    return kd.layouts.dry_run(model, make_map() if make_map else None,
                              **arguments)


@pytest.mark.parametrize("name", sorted(MISCONFIGURED))
def test_each_misconfiguration_is_caught_with_its_fix(name, checkpoints):
    make_map, arguments, kinds = MISCONFIGURED[name]
    if BACKEND == "tensorflow" and make_map is not None and shards(
            make_map()):
        kinds = kinds | {"backend"}  # (TensorFlow shards nothing)
    verdict = run(make_map, arguments, checkpoints)
    assert {f.kind for f in verdict.findings} == kinds, verdict.table()
    assert not verdict.ok
    table = verdict.table()
    assert "FAIL" in table and "finding(s) to fix" in table
    for finding in verdict.findings:
        assert finding.message in table
    if name == "activations over a device's memory":
        # The variables alone fit: what does not is the step.
        assert verdict.estimate.activations > 0
        assert "activations and workspace" in verdict.findings[0].message
    with pytest.raises(ValueError, match="The dry run found problems"):
        verdict.raise_if_any()


def test_at_least_twenty_distinct_misconfigurations_are_seeded():
    assert len(MISCONFIGURED) >= 22
    assert len({name.lower() for name in MISCONFIGURED}) == len(MISCONFIGURED)


CORRECT = {
    "data parallel": (None, {"global_batch_size": 64}),
    "tensor parallel": (tensor_parallel, {"global_batch_size": 64}),
    "planned": (lambda: kd.layouts.plan_layout(
        make_model, mesh(), min_shard_size=0,
        fsdp_min_size=4096).layout_map, {"global_batch_size": 64}),
    "fully sharded": (lambda: kd.layouts.fully_sharded(mesh(), min_size=512),
                      {"global_batch_size": 64}),
    "a group of three on hosts of three": (
        lambda: layout_map({}, (2, 3)),
        {"hosts": 2, "devices_per_host": 3, "global_batch_size": 64}),
    "resuming from this model's checkpoint": (
        None, {"checkpoint_directory": "{ckpt}/ours"}),
    "a new checkpoint directory": (
        None, {"checkpoint_directory": "{ckpt}/new/run"}),
}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_a_correct_configuration_is_ready_to_launch(name, checkpoints):
    make_map, arguments = CORRECT[name]
    if BACKEND == "tensorflow" and make_map is not None and shards(
            make_map()):
        pytest.skip("TensorFlow shards no variable: a sharded map is a "
                    "finding there (test_each_misconfiguration_...)")
    verdict = run(make_map, dict(arguments, device_memory=2**30),
                  checkpoints)
    assert verdict.ok, verdict.table()
    assert verdict.table().endswith("verdict: ready to launch")
    assert sorted(verdict.checked) == sorted(
        ["layout", "cluster", "memory"]
        + (["batch"] if "global_batch_size" in arguments else [])
        + (["checkpoint"] if "checkpoint_directory" in arguments else []))
    assert verdict.estimate.peak < 2**30
    assert not os.path.exists(checkpoints / "new")  # nothing written


PLAN_SCRIPT = '''
import keras

def make_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(512, activation="relu", name="up"),
        keras.layers.Dense(10, name="logits")], name="mlp")

def make_layout_map(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["mlp/up/kernel"] = (None, "model")
    layout_map["mlp/logits/kernal"] = ("model", None)
    return layout_map

if __name__ == "__main__":
    raise SystemExit("the training block ran")
'''


def test_the_command_line_prints_the_verdict_and_exits_by_it(tmp_path,
                                                            capsys):
    from keras_distribute.planning import command_line as plan

    script = tmp_path / "train.py"
    script.write_text(PLAN_SCRIPT)
    argv = [str(script), "--hosts", "2", "--devices-per-host", "4",
            "--mesh", "2,4", "--layout-map", "make_layout_map",
            "--batch-size", "63", "--device-memory", "1GB",
            "--checkpoint-dir", str(tmp_path / "train.py" / "ckpt")]
    assert plan.main(argv) == 1
    out = capsys.readouterr().out
    for expected in ("unmatched_key: mlp/logits/kernal", "batch_size",
                     "checkpoint: ", "memory per device                    "
                     "ok", "peak of a step",
                     f"verdict: {4 if BACKEND == 'tensorflow' else 3} "):
        assert expected in out, out


def test_the_pages_command_line_recipe_runs(tmp_path):
    # docs/tpu_and_model_parallel.md's train.py and its
    # `python -m keras_distribute.planning` command, as the page shows them
    # (the script's __main__ block does not run: it would print a table).
    import re
    import shlex

    page = (Path(TESTS).parent / "docs" / "tpu_and_model_parallel.md"
            ).read_text()
    (script,) = [b for b in re.findall(r"```python\n(.*?)^```", page,
                                       re.DOTALL | re.MULTILINE)
                 if b.startswith("# train.py")]
    (command,) = [b for b in re.findall(r"```bash\n(.*?)^```", page,
                                        re.DOTALL | re.MULTILINE)
                  if b.startswith("python -m keras_distribute.planning")]
    (tmp_path / "train.py").write_text(script)
    argv = shlex.split(command.replace("\\\n", " "))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable] + argv[1:], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == (1 if BACKEND == "tensorflow" else 0), (
        run.stdout + run.stderr[-3000:])
    if BACKEND == "tensorflow":  # (TensorFlow shards nothing)
        assert "backend: tensorflow" in run.stdout
    else:
        for line in ("mesh against the cluster             ok",
                     "checkpoint directory                 ok"):
            assert line in run.stdout
        assert run.stdout.rstrip().endswith("verdict: ready to launch")
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # nothing written


def _plan_on_jax(tmp_path, arguments, xla_flags=None):
    """`python -m keras_distribute.planning train.py <arguments>` on JAX
    in a fresh process (`xla_flags`: its XLA_FLAGS; None: unset), the
    page's script with its keys right; skips on other backends."""
    if BACKEND != "jax":
        pytest.skip("XLA's analysis: JAX (torch and TensorFlow estimate "
                    "on shapes or fake tensors, needing no devices)")
    (tmp_path / "train.py").write_text(PLAN_SCRIPT.replace(
        "kernal", "kernel"))
    env = dict(os.environ, KERAS_BACKEND="jax",
               PYTHONPATH=os.pathsep.join(
                   [os.path.dirname(TESTS), os.environ.get("PYTHONPATH",
                                                           "")]))
    env.pop("XLA_FLAGS", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run(
        [sys.executable, "-m", "keras_distribute.planning", "train.py"]
        + arguments, cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=240)


def test_the_command_line_compiles_for_a_mesh_larger_than_this_machine(
        tmp_path):
    # 4 hosts x 8 devices: 32 devices, 4 times the 8 this suite's JAX has.
    # The command gives JAX's CPU platform 32 devices before JAX starts,
    # so the estimate is XLA's analysis of the step compiled for the mesh,
    # not a shape trace; the layout check sees the same mesh.
    run = _plan_on_jax(tmp_path, [
        "--hosts", "4", "--devices-per-host", "8", "--mesh", "4,8",
        "--layout-map", "make_layout_map", "--batch-size", "256",
        "--device-memory", "1GB"],
        xla_flags="--xla_force_host_platform_device_count=8")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert ("from: XLA's memory analysis of the compiled step"
            in run.stdout), run.stdout
    assert "(32 device(s))" in run.stdout, run.stdout
    # In a process whose JAX started with 8 devices, the same mesh falls
    # back to the shape trace, and says so.
    mesh = DeviceMesh((4, 8), ["batch", "model"],
                      [f"cpu:{i}" for i in range(32)])
    namespace = {}
    exec(PLAN_SCRIPT.replace("kernal", "kernel").replace(
        "if __name__", "if False and __name__"), namespace)
    estimate = kd.layouts.estimate_memory(
        namespace["make_model"], namespace["make_layout_map"](mesh),
        batch_size=256)
    assert estimate.method.startswith("every layer's output"), estimate.method


@pytest.mark.parametrize("argv, match", [
    (["missing.py"], "No such file"),
    (["{script}", "--model", "nope"], "defines no model function named "
                                      "nope"),
    (["{script}", "--mesh", "2,x"], "--mesh takes positive integers"),
    (["{script}", "--mesh", "2,4", "--axes", "batch"], "--axes needs 2"),
    (["{script}", "--hosts", "2", "--devices-per-host", "4",
      "--device-memory", "lots"], "--device-memory takes a size"),
    (["{script}", "--layout-map", "make_layout_map"], "takes a mesh"),
    (["{script}", "--plan"], "--plan needs a mesh"),
    (["{script}", "--hosts", "2"], "Give hosts and devices_per_host "
                                   "together"),
    (["{script}", "--input-shape", "token_ids=16", "--input-shape", "16"],
     "one name=dims per named input"),
    (["{script}", "--input-shape", "a=16", "--input-shape", "a=8"],
     "each named input once"),
    (["{script}", "--input-shape", "=16"], "each named input once"),
])
def test_the_command_line_refuses_what_it_cannot_use(argv, match, tmp_path,
                                                     capsys):
    from keras_distribute.planning import command_line as plan

    script = tmp_path / "train.py"
    script.write_text(PLAN_SCRIPT)
    argv = [str(script) if a == "{script}" else str(tmp_path / a)
            if a.endswith(".py") else a for a in argv]
    assert plan.main(argv) == 2
    assert match in capsys.readouterr().err


def test_input_shapes_read_one_shape_or_one_per_named_input():
    from keras_distribute.planning.command_line import parse_input_shape

    assert parse_input_shape(None) is None
    assert parse_input_shape(["28,28,1"]) == (28, 28, 1)
    assert parse_input_shape(["token_ids=512", "padding_mask=512"]) == {
        "token_ids": (512,), "padding_mask": (512,)}


def test_sizes_read_as_people_write_them():
    from keras_distribute.planning.command_line import parse_bytes

    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1024") == 1024
    assert parse_bytes("1.5gb") == 1_500_000_000


BROKEN_SCRIPT = '''
import keras

def make_model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    raise RuntimeError("the tokenizer file is missing")
'''


def test_the_command_line_says_the_model_could_not_be_built(tmp_path,
                                                           capsys):
    from keras_distribute.planning import command_line as plan

    script = tmp_path / "train.py"
    script.write_text(BROKEN_SCRIPT)
    assert plan.main([str(script)]) == plan.MODEL_NOT_BUILT == 3
    err = capsys.readouterr().err
    assert "the model could not be built: make_model() raised " in err
    assert "RuntimeError: the tokenizer file is missing" in err
    assert "train.py" in err  # (the model function's traceback)


def test_the_command_line_runs_a_script_whose_model_compiles(tmp_path,
                                                            capsys):
    from keras_distribute.planning import command_line as plan

    script = tmp_path / "train.py"
    script.write_text(PLAN_SCRIPT.replace(
        '        keras.layers.Dense(10, name="logits")], name="mlp")',
        '        keras.layers.Dense(10, name="logits")], name="mlp")\n'
        '    model.compile(optimizer="adam", loss="mse")\n'
        '    return model').replace(
        "    return keras.Sequential([", "    model = keras.Sequential(["))
    assert plan.main([str(script), "--batch-size", "8"]) == plan.READY, (
        capsys.readouterr())
    assert "verdict: ready to launch" in capsys.readouterr().out


def test_the_command_line_gives_a_verdict_for_thousands_of_devices(
        tmp_path):
    # #72.11: 4,096 and 8,192 devices ended in XLA's "Multiprocess
    # computations aren't implemented on the CPU backend" traceback. Past
    # what XLA's CPU compiles for, the memory comes from a shape trace, and
    # the command says which parts were checked how.
    run = _plan_on_jax(tmp_path, [
        "--hosts", "1024", "--devices-per-host", "4", "--batch-size", "4096",
        "--device-memory", "1GB"])
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "the mesh's 4096 devices are more than XLA's CPU compiles" in (
        run.stdout)
    assert "(4096 device(s))" in run.stdout
    assert "from: every layer's output at one replica's batch" in run.stdout
    assert run.stdout.rstrip().endswith("verdict: ready to launch")
