"""The shell recipes of docs/multi_worker.md, reproduced on one machine.

Each starts the page's own `train.py` (its first Python block) as the
recipe says — `python -m keras_distribute.launch`, torchrun, a SLURM step,
`TF_CONFIG` workers — with the hosts replaced by 127.0.0.1 and free ports,
two processes, and must end with every process exiting 0. JAX processes get
2 simulated CPU devices each, as the page says.
"""

import json
import os
import pathlib
import sys

import pytest
from conftest import BACKEND
from program_runner import failure_excerpt
from program_runner import run_together
from test_docs_blocks import ROOT
from test_docs_blocks import page_blocks

PAGE = ROOT / "docs" / "multi_worker.md"
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    os.environ.get("KD_DOCS_BLOCKS", "1") == "0",
    reason="KD_DOCS_BLOCKS=0 (scripts/test.sh: the next-Keras stack)")


def _free_port() -> int:
    # Below the ephemeral range: see free_port's docstring.
    from keras_distribute.launch.processes import free_port

    return free_port()


def _recipe(start: str) -> str:
    """The page's bash block that starts with `start` (so that an edit of
    the page that drops the recipe fails here)."""
    text = PAGE.read_text()
    blocks = text.split("```bash\n")[1:]
    found = [b.split("```")[0] for b in blocks if b.lstrip().startswith(start)]
    assert found, f"docs/multi_worker.md has no recipe starting {start!r}"
    return found[0]


@pytest.fixture
def train_script(tmp_path) -> pathlib.Path:
    (line, code), *_ = page_blocks(PAGE, BACKEND)
    assert "MultiWorkerMirroredStrategy" in code, (
        f"multi_worker.md:{line}: the first block is not train.py")
    path = tmp_path / "train.py"
    path.write_text(code)
    return path


def _env(**extra) -> dict:
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2",
               JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join(
                   filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for name in list(env):  # no cluster description from outside
        if name.startswith(("SLURM_", "TF_CONFIG", "KERAS_DISTRIBUTE",
                            "KERAS_DISTRIBUTION", "TORCHELASTIC")) or name in (
                                "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name)
    env.pop("KD_RECORD_BAD_INPUTS", None)
    env.update(extra)
    return env


def _run_together(commands, cwd, refused: str = "") -> list:
    """Starts every `(argv, env)` at once (`python train.py` forked from the
    program server, tests/program_runner.py); all must exit 0 in time (or,
    with `refused`, all fail saying it). Returns their outputs."""
    results = run_together(commands, cwd=cwd, timeout=TIMEOUT_S)
    codes = [code for code, _ in results]
    outputs = [output for _, output in results]
    if refused:
        assert all(c != 0 and refused in o for c, o in zip(codes, outputs)), (
            "\n".join(f"--- process {i} exited {c}:\n{failure_excerpt(o)}"
                      for i, (c, o) in enumerate(zip(codes, outputs))))
        return outputs
    assert codes == [0] * len(codes), "\n".join(
        f"--- process {i} exited {c}:\n{failure_excerpt(o)}"
        for i, (c, o) in enumerate(zip(codes, outputs)))
    return outputs


def test_the_launcher_recipe(train_script):
    argv = _recipe("python -m keras_distribute.launch").split()
    assert argv[:5] == ["python", "-m", "keras_distribute.launch", "--nproc",
                        "2"] and argv[5] == "train.py"
    _run_together([([sys.executable] + argv[1:], _env())],
                  train_script.parent)


@pytest.mark.skipif(BACKEND == "tensorflow",
                    reason="the page: TensorFlow takes TF_CONFIG, not torchrun")
def test_the_torchrun_recipe(train_script):
    recipe = _recipe("torchrun").replace("\\\n", " ").split()
    assert recipe[:3] == ["torchrun", "--nnodes", "2"]
    assert "--rdzv-backend" in recipe and recipe[-1] == "train.py"
    # One machine: one node with both processes, the endpoint local.
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "train.py"]
    _run_together([(argv, _env())], train_script.parent)


def test_the_slurm_recipe(train_script):
    recipe = _recipe("#SBATCH")
    assert "export KERAS_DISTRIBUTE_PORT=" in recipe
    assert "srun python train.py" in recipe
    port = str(_free_port())
    # What srun gives each task of a 2-task step on one node.
    commands = [([sys.executable, "train.py"], _env(
        SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
        SLURM_JOB_NODELIST="127.0.0.1", SLURM_NODELIST="127.0.0.1",
        KERAS_DISTRIBUTE_PORT=port)) for rank in range(2)]
    # The page: TensorFlow needs one address per worker, which SLURM's
    # variables do not give; it is refused, saying to use TF_CONFIG.
    _run_together(commands, train_script.parent, refused=(
        "Describe the job with TF_CONFIG" if BACKEND == "tensorflow"
        else ""))


def test_the_tf_config_recipe(train_script):
    recipe = _recipe("export TF_CONFIG=")
    assert '"cluster": {"worker":' in recipe and "python train.py" in recipe
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    commands = [([sys.executable, "train.py"], _env(TF_CONFIG=json.dumps({
        "cluster": {"worker": workers},
        "task": {"type": "worker", "index": index}}))) for index in range(2)]
    _run_together(commands, train_script.parent)


def test_the_horovod_port_runs_under_the_launcher(tmp_path):
    # #16: docs/migration.md's port of Horovod's tensorflow2_keras_mnist.py,
    # as the page says to start it; the chief alone writes the checkpoints.
    text = (ROOT / "docs" / "migration.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```python\n")[1:]]
    ports = [code for code in blocks
             if "kd.callbacks.BroadcastGlobalVariables(0)" in code]
    assert len(ports) == 1, "docs/migration.md: the Horovod port is missing"
    assert "python -m keras_distribute.launch --nproc 2 train.py" in text
    (tmp_path / "train.py").write_text(ports[0])
    _run_together([([sys.executable, "-m", "keras_distribute.launch",
                     "--nproc", "2", "train.py"], _env())], tmp_path)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        f"checkpoint-{epoch}.keras" for epoch in range(1, 5)]
