"""docs/clusters.md's shell recipes and engine environments, reproduced on
one machine: two processes with what each engine sets, the page's own
`train.py`, 127.0.0.1 for the hosts. (Ray Train: tests/test_ray_train.py
and the page's Python blocks.)
"""

import json
import os
import sys

import pytest
from conftest import BACKEND
from test_docs_blocks import ROOT
from test_docs_blocks import page_blocks
from test_docs_recipes import _env
from test_docs_recipes import _free_port
from test_docs_recipes import _run_together

PAGE = ROOT / "docs" / "clusters.md"

pytestmark = pytest.mark.skipif(
    os.environ.get("KD_DOCS_BLOCKS", "1") == "0",
    reason="KD_DOCS_BLOCKS=0 (scripts/test.sh: the next-Keras stack)")
# Engines that describe a job by its coordinator alone: TensorFlow needs
# every worker's address and refuses them, saying so.
COORDINATOR_ONLY = ("Describe the job with TF_CONFIG"
                    if BACKEND == "tensorflow" else "")


@pytest.fixture
def train_script(tmp_path):
    (line, code), *_ = page_blocks(PAGE, BACKEND)
    assert "MultiWorkerMirroredStrategy" in code and "done" in code, (
        f"clusters.md:{line}: the first block is not train.py")
    path = tmp_path / "train.py"
    path.write_text(code)
    return path


def _both_done(outputs):
    for rank, output in enumerate(outputs):
        assert f"process {rank} of 2 done" in output, output[-3000:]


@pytest.mark.skipif(BACKEND != "torch", reason=(
    "the page: TensorFlow takes TF_CONFIG, not torchrun; JAX under torchrun: "
    "test_jax_multiprocess.py::test_torchrun_launches_a_jax_job"))
def test_torchrun_on_two_nodes(train_script):
    text = PAGE.read_text()
    assert ("torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\\n"
            "  --rdzv-endpoint node0:29400 --rdzv-id keras-job train.py"
            ) in text
    # Two torchrun agents (two "nodes") meeting at one c10d rendezvous.
    endpoint = f"127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "keras-job", "train.py"]
    outputs = _run_together([(argv, _env()), (argv, _env())],
                            train_script.parent)
    assert sorted(r for r in range(2) for o in outputs
                  if f"process {r} of 2 done" in o) == [0, 1]


def test_kubeflow_pytorchjob_variables(train_script):
    port = str(_free_port())
    commands = [([sys.executable, "train.py"], _env(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
        WORLD_SIZE="2")) for rank in range(2)]
    outputs = _run_together(commands, train_script.parent,
                            refused=COORDINATOR_ONLY)
    if not COORDINATOR_ONLY:
        _both_done(outputs)


def test_kubeflow_tfjob_with_a_chief(train_script):
    # A TFJob with a Chief replica: the chief is process 0.
    chief, worker = (f"127.0.0.1:{_free_port()}" for _ in range(2))
    cluster = {"chief": [chief], "worker": [worker]}
    commands = [([sys.executable, "train.py"], _env(TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": task}))) for task in (
            {"type": "chief", "index": 0}, {"type": "worker", "index": 0})]
    _both_done(_run_together(commands, train_script.parent))


def test_jax_indexed_job_variables(train_script):
    text = PAGE.read_text()
    assert "JAX_COORDINATOR_ADDRESS, value:" in text
    assert "completionMode: Indexed" in text
    coordinator = f"127.0.0.1:{_free_port()}"
    commands = [([sys.executable, "train.py"], _env(
        JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2",
        JOB_COMPLETION_INDEX=str(index))) for index in range(2)]
    outputs = _run_together(commands, train_script.parent,
                            refused=COORDINATOR_ONLY)
    if not COORDINATOR_ONLY:
        _both_done(outputs)


@pytest.mark.skipif(BACKEND == "tensorflow",
                    reason="the page: TensorFlow takes TF_CONFIG, not torchrun")
def test_torchrun_max_restarts_resumes_from_the_backup(tmp_path):
    # #17/#18: a process dies in epoch 2; torchrun restarts the job, which
    # resumes from BackupAndRestore's backup and ends at the weights of one
    # process that was never interrupted.
    import numpy as np
    import worker_common

    assert "`--max-restarts 1`" in PAGE.read_text()
    script = ROOT / "tests" / "restart_train.py"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--max-restarts", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(script)]
    _run_together([(argv, _env())], tmp_path)
    assert (tmp_path / "died").exists(), "no process died: nothing tested"
    x, y = worker_common.make_data()
    model = worker_common.make_model(worker_common.initial_weights())
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    for rank in (0, 1):
        # The restart began at epoch 1 (the backup of the end of epoch 0).
        assert (tmp_path / f"epochs-rank{rank}.txt").read_text().split() == [
            "start", "0", "1", "start", "1", "2"]
        saved = np.load(tmp_path / f"weights-rank{rank}.npz")
        for i, expected in enumerate(model.get_weights()):
            np.testing.assert_allclose(saved[f"arr_{i}"], expected,
                                       atol=1e-5)
