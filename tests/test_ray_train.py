"""Keras 3 `fit` under Ray Train on every backend (issue #18).

A local Ray cluster (2 CPUs), 2 Ray workers, the backend's own Ray trainer:
`TorchTrainer` (Ray makes the torch process group; kd joins it),
`TensorflowTrainer` (Ray sets TF_CONFIG) and `JaxTrainer` (Ray sets nothing
on CPU; kd's Ray resolver starts jax.distributed). The loop is
`workers_ray.train_loop_per_worker`: `kd.MultiWorkerMirroredStrategy()` and
`kd.callbacks.RayReport`. A worker killed in epoch 2 makes Ray restart
the group, which resumes from Ray's checkpoint (on JAX; the page's block runs
on every backend).
"""

import importlib
import os
from pathlib import Path

import numpy as np
import pytest

# The optional extra keras_distribute[ray]; scripts/setup_env.sh installs it.
import ray  # noqa: E402
import workers_ray
from conftest import BACKEND

TRAINERS = {"torch": ("ray.train.torch", "TorchTrainer"),
            "tensorflow": ("ray.train.tensorflow", "TensorflowTrainer"),
            "jax": ("ray.train.v2.jax", "JaxTrainer")}
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def local_ray():
    paths = [TESTS, os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "KERAS_BACKEND": BACKEND, "JAX_PLATFORMS": "cpu",
        # One device per worker: the job's 2 replicas are the 2 workers.
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "KERAS_DISTRIBUTE_TIMEOUT": "60",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "TF_CPP_MIN_LOG_LEVEL": "2"}})
    yield
    ray.shutdown()


def _trainer(config, name, storage, **kwargs):
    from ray.train import FailureConfig
    from ray.train import RunConfig
    from ray.train import ScalingConfig

    module, cls = TRAINERS[BACKEND]
    trainer = getattr(importlib.import_module(module), cls)
    return trainer(
        workers_ray.train_loop_per_worker, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=1)),
        **kwargs)


def _reference(epochs):
    x, y = workers_ray.make_data()
    model = workers_ray.make_model(workers_ray.initial_weights())
    history = model.fit(x, y, batch_size=workers_ray.BATCH, epochs=epochs,
                        shuffle=False, verbose=0)
    return model.get_weights(), history.history


@pytest.mark.skipif(BACKEND != "jax", reason=(
    "Ray's restart of a worker group and RayReport's resume from Ray's "
    "checkpoint are backend-independent; tested on JAX, the backend whose "
    "rendezvous kd makes itself again in the restarted group (Ray makes "
    "torch's process group and TF's TF_CONFIG). Every trainer's start: "
    "test_the_clusters_pages_ray_block_runs_in_this_cluster"))
def test_fit_under_ray_train_restarts_and_resumes_to_one_process(
        local_ray, tmp_path):
    out = tmp_path / "weights"
    out.mkdir()
    marker = tmp_path / "crashed"
    config = {"epochs": 3, "crash_epoch": 1, "marker": str(marker),
              "staging": str(tmp_path / "staging"), "out": str(out)}
    # Worker 1 dies at the end of epoch 2: Ray restarts the worker group,
    # which resumes from the checkpoint RayReport made after epoch 1.
    result = _trainer(config, "run", str(tmp_path / "ray_results")).fit()
    assert result.error is None
    assert marker.exists(), "worker 1 never crashed: the test tests nothing"
    assert result.metrics["epoch"] == 3 and result.checkpoint is not None

    weights, history = _reference(3)
    np.testing.assert_allclose(result.metrics["loss"], history["loss"][2],
                               rtol=1e-5)
    for rank in (0, 1):
        # Attempt 1 ran epochs 0 and 1 (worker 1 died at the end of 1); the
        # restart began again at epoch 1, from Ray's checkpoint.
        assert (out / f"epochs-rank{rank}.txt").read_text().split() == [
            "start", "0", "1", "start", "1", "2"]
        saved = np.load(out / f"rank{rank}.npz")
        for i, expected in enumerate(weights):
            np.testing.assert_allclose(saved[f"arr_{i}"], expected,
                                       atol=1e-5)


def test_the_clusters_pages_ray_block_runs_in_this_cluster(
        local_ray, tmp_path, monkeypatch):
    # docs/clusters.md's Ray block, as the page shows it, on this backend
    # (the page's docs test skips it: a second Ray cluster per backend cost
    # ~30 s of CI). Its `ray.init` / `ray.shutdown` are this module's
    # cluster, whose runtime environment sets what the page's does.
    import re

    page = (Path(TESTS).parent / "docs" / "clusters.md").read_text()
    (code,) = [block for block in re.findall(
        r"```python\n(.*?)^```", page, re.DOTALL | re.MULTILINE)
        if "ray.train" in block]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    namespace = {"__name__": "clusters_page"}
    exec(compile(code, "docs/clusters.md (Ray block)", "exec"), namespace)
    assert namespace["result"].metrics["epoch"] == 3


def test_ray_report_outside_ray_names_the_fix():
    import keras_distribute as kd

    with pytest.raises(RuntimeError, match="inside a Ray Train worker"):
        kd.callbacks.RayReport()
