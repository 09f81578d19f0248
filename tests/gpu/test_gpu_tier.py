"""The GPU tier (#33): the CUDA paths kd claims, run on a real GPU.

Every test here is marked `gpu` and skipped, with the reason, where the
active backend sees no GPU (CI's CPU machines): run the tier with
`scripts/gpu_check.sh` on a machine that has one. Results (parity, the
time `fit` is blocked by an async save, the step-time row) are written as
JSON under `$KD_GPU_RESULTS` when it is set.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import make_mlp

import keras_distribute as kd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def visible_gpus() -> int:
    """How many GPUs the active Keras backend sees (0 without CUDA)."""
    try:
        if BACKEND == "torch":
            import torch

            return torch.cuda.device_count()
        if BACKEND == "jax":
            import jax

            return len(jax.devices("gpu"))
        if BACKEND == "tensorflow":
            import tensorflow as tf

            return len(tf.config.list_physical_devices("GPU"))
    except RuntimeError:  # JAX: no GPU backend
        return 0
    return 0


GPUS = visible_gpus()
# KD_GPU_TIER_DRY_RUN=1: the tier's code runs on the CPU (its GPU-only
# checks skipped), to try the tier where no GPU is lent.
DRY_RUN = os.environ.get("KD_GPU_TIER_DRY_RUN") == "1"
ON_GPU = GPUS > 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not ON_GPU and not DRY_RUN,
        reason=f"GPU tier: the {BACKEND} backend sees no GPU here; "
        "scripts/gpu_check.sh runs it on a GPU machine"),
]


def record(name: str, values: dict) -> None:
    """Writes `values` to `$KD_GPU_RESULTS/<name>.json` (if set)."""
    directory = os.environ.get("KD_GPU_RESULTS")
    if directory:
        os.makedirs(directory, exist_ok=True)
        values = dict(values, backend=BACKEND, keras=keras.__version__,
                      date=time.strftime("%Y-%m-%d"), on_gpu=ON_GPU)
        with open(os.path.join(directory, f"{name}.json"), "w") as f:
            json.dump(values, f, indent=1)


def make_model():
    model = make_mlp()  # the parity tests' tanh MLP: 16 features, 3 classes
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def data(n=512):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 16)).astype("float32"),
            rng.integers(0, 3, size=(n,)))


def _exact_matmuls():
    """Both runs of a parity test multiply in full float32 (no TF32)."""
    if BACKEND == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif BACKEND == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")


def _torch_fit_in_a_launched_process(policy=None):
    """In one `kd.launch`ed process (torchrun's variables set): a plain
    Keras `fit` on the GPU, then the same under `kd.MirroredStrategy()`."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    if policy:
        keras.config.set_dtype_policy(policy)
    x, y = data()
    plain = make_model()
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    import torch.distributed as dist

    return {
        "plain": [w.astype("float32") for w in plain.get_weights()],
        "kd": [w.astype("float32") for w in model.get_weights()],
        "process_group": dist.get_backend() if dist.is_initialized()
        else None,
        "device": str(strategy.engine.device),
    }


@pytest.mark.skipif(BACKEND != "torch", reason="torch's CUDA path")
def test_torch_mirrored_strategy_on_the_gpu_matches_plain_fit():
    # One launched process is one replica on cuda:0, with no process group
    # (nothing to reduce with); the NCCL group needs two GPUs (below).
    (result,) = kd.launch(_torch_fit_in_a_launched_process, 1, timeout=300)
    if ON_GPU:
        assert result["process_group"] is None
        assert result["device"].startswith("cuda")
    for a, b in zip(result["plain"], result["kd"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    record("gpu_parity_torch", {"max_difference": float(max(
        np.abs(a - b).max() for a, b in zip(result["plain"], result["kd"])))})


def _torch_two_replicas_on_nccl():
    import torch
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = data()
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    return {"kd": [w.astype("float32") for w in model.get_weights()],
            "process_group": dist.get_backend(),
            "device": str(strategy.engine.device)}


@pytest.mark.skipif(BACKEND != "torch", reason="torch's NCCL path")
@pytest.mark.skipif(GPUS < 2, reason="the NCCL group of two replicas needs "
                    "two GPUs (NCCL refuses two ranks on one device); this "
                    f"machine has {GPUS}")
def test_torch_two_replicas_on_nccl_match_plain_fit():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = data()
    plain = make_model()
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    results = kd.launch(_torch_two_replicas_on_nccl, 2, timeout=300)
    assert [r["process_group"] for r in results] == ["nccl", "nccl"]
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    for result in results:
        for a, b in zip(plain.get_weights(), result["kd"]):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's GPU devices")
def test_jax_mirrored_strategy_on_the_gpus_matches_plain_fit():
    _exact_matmuls()
    x, y = data()
    plain = make_model()
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    strategy = kd.MirroredStrategy()
    if ON_GPU:
        assert strategy.num_replicas_in_sync == GPUS
        assert all("gpu" in str(d).lower() or "cuda" in str(d).lower()
                   for d in strategy.extended.worker_devices), \
            strategy.extended.worker_devices
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.skipif(BACKEND not in ("jax", "torch"),
                    reason="the tier machine has GPU builds of JAX and torch")
def test_mixed_bfloat16_matches_plain_fit_within_its_tolerance():
    if BACKEND == "torch":
        (result,) = kd.launch(_torch_fit_in_a_launched_process, 1,
                              args=("mixed_bfloat16",), timeout=300)
        pairs = list(zip(result["plain"], result["kd"]))
    else:
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            x, y = data()
            plain = make_model()
            plain.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                      verbose=0)
            with kd.MirroredStrategy().scope():
                model = make_model()
            model.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                      verbose=0)
            pairs = list(zip(plain.get_weights(), model.get_weights()))
        finally:
            keras.config.set_dtype_policy("float32")
    for a, b in pairs:
        np.testing.assert_allclose(a, b, atol=2e-2)


def _trained_in_scope():
    strategy = kd.MirroredStrategy() if BACKEND == "jax" else None
    if strategy is None:
        return make_model()
    with strategy.scope():
        return make_model()


def _weights_bytes(model):
    return [w.tobytes() for w in model.get_weights()]


def test_checkpoint_of_gpu_variables_round_trips_bit_exactly_via_cpu(
        tmp_path):
    model = _trained_in_scope()
    x, y = data()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    ShardedCheckpoint = kd.checkpoint.ShardedCheckpoint
    path = ShardedCheckpoint(model=model).save(str(tmp_path / "gpu"))
    fresh = _trained_in_scope()
    ShardedCheckpoint(model=fresh).restore(path).assert_consumed()
    assert _weights_bytes(fresh) == _weights_bytes(model)
    np.savez(tmp_path / "expected.npz", *model.get_weights())

    # The same checkpoint read on the CPU (no GPU visible), saved there,
    # and that save read back onto the GPU: every byte equal.
    script = textwrap.dedent(f"""
        import numpy as np, keras, keras_distribute as kd
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((16,)),
            keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(3)])
        kd.checkpoint.ShardedCheckpoint(model=model).read({path!r})
        expected = np.load({str(tmp_path / 'expected.npz')!r})
        for i, w in enumerate(model.get_weights()):
            assert w.tobytes() == expected[f"arr_{{i}}"].tobytes(), i
        kd.checkpoint.ShardedCheckpoint(model=model).save(
            {str(tmp_path / 'cpu')!r})
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", script], env=env, check=True,
                   timeout=300)
    back = _trained_in_scope()
    ShardedCheckpoint(model=back).read(str(tmp_path / "cpu-1"))
    assert _weights_bytes(back) == _weights_bytes(model)


def test_async_save_blocks_fit_for_about_the_device_to_host_copy(tmp_path):
    keras.utils.set_random_seed(1)
    strategy = kd.MirroredStrategy() if BACKEND == "jax" else None
    scope = strategy.scope() if strategy is not None else None
    if scope is not None:
        scope.__enter__()
    try:
        model = keras.Sequential([keras.Input((2048,)),
                                  keras.layers.Dense(4096),
                                  keras.layers.Dense(4096),
                                  keras.layers.Dense(10)])
    finally:
        if scope is not None:
            scope.__exit__(None, None, None)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    options = kd.checkpoint.CheckpointOptions(enable_async=True)
    checkpoint.save(str(tmp_path / "warm"), options=options)
    checkpoint.sync()
    started = time.perf_counter()
    weights = model.get_weights()  # the device-to-host copy alone
    copy_s = time.perf_counter() - started
    started = time.perf_counter()
    checkpoint.save(str(tmp_path / "async"), options=options)
    blocked_s = time.perf_counter() - started
    checkpoint.sync()
    total_s = time.perf_counter() - started
    megabytes = sum(w.nbytes for w in weights) / 2**20
    record(f"gpu_async_save_{BACKEND}", {
        "megabytes": megabytes, "device_to_host_copy_s": copy_s,
        "save_blocked_s": blocked_s, "save_total_s": total_s})
    assert blocked_s < max(4 * copy_s, 0.5), (blocked_s, copy_s)


@pytest.mark.skipif(BACKEND not in ("jax", "torch"),
                    reason="the tier machine has GPU builds of JAX and torch")
def test_fit_step_time_on_the_gpu_is_recorded():
    def step_ms(model, x, y):
        timings = []

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.started = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                timings.append(time.perf_counter() - self.started)

        model.fit(x, y, batch_size=256, epochs=4, shuffle=False, verbose=0,
                  callbacks=[Timer()])
        return 1000 * float(np.median(timings[1:])) / (len(x) // 256)

    x, y = data(256 * 40)
    plain_ms = step_ms(make_model(), x, y)
    if BACKEND == "torch":
        def kd_ms():
            import keras_distribute as kd_inner

            with kd_inner.MirroredStrategy().scope():
                model = make_model()
            return step_ms(model, x, y)

        (kd_step_ms,) = kd.launch(kd_ms, 1, timeout=300)
    else:
        with kd.MirroredStrategy().scope():
            model = make_model()
        kd_step_ms = step_ms(model, x, y)
    record(f"gpu_fit_{BACKEND}", {
        "native_step_ms": plain_ms, "kd_step_ms": kd_step_ms,
        "ratio": kd_step_ms / plain_ms})
    assert kd_step_ms > 0 and plain_ms > 0


def _torch_fully_sharded_on_nccl():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = data()
    world = torch.distributed.get_world_size() if (
        torch.distributed.is_initialized()) else 2
    prefix = "gpu" if torch.cuda.is_available() else "cpu"  # dry run: gloo
    mesh = keras.distribution.DeviceMesh(
        (2,), ["batch"], [f"{prefix}:{r}" for r in range(2)])
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=0))
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    kernel = model.layers[0].kernel.value
    return {"weights": [w.astype("float32") for w in model.get_weights()],
            "kernel_local": tuple(kernel.to_local().shape),
            "world": world}


@pytest.mark.skipif(BACKEND != "torch", reason="torch's FSDP over NCCL")
@pytest.mark.skipif(ON_GPU and GPUS < 2, reason="FSDP over an NCCL group "
                    "needs two GPUs (NCCL refuses two ranks on one device); "
                    f"this machine has {GPUS}")
def test_torch_fully_sharded_on_nccl_matches_plain_fit():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    x, y = data()
    plain = make_model()
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    results = kd.launch(_torch_fully_sharded_on_nccl, 2, timeout=300)
    for result in results:
        assert result["kernel_local"] == (16, 16)  # (16, 32) over 2
        for a, b in zip(plain.get_weights(), result["weights"]):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's GPU devices")
def test_jax_fully_sharded_over_the_gpus_matches_plain_fit():
    import jax

    _exact_matmuls()
    x, y = data()
    plain = make_model()
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    devices = jax.devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=0))
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    kernel = model.layers[0].kernel.value
    shards = {s.data.shape for s in kernel.addressable_shards}
    record("gpu_fully_sharded_jax", {"devices": len(devices),
                                     "kernel_shards": sorted(shards)})


ESTIMATE_PROGRAM = textwrap.dedent('''
    import json
    import keras, numpy as np
    import keras_distribute as kd

    def make():
        return keras.Sequential([keras.Input((1024,)),
                                 keras.layers.Dense(4096, activation="relu"),
                                 keras.layers.Dense(4096, activation="relu"),
                                 keras.layers.Dense(10)], name="mlp")

    estimate = kd.layouts.estimate_memory(make, batch_size=1024,
                                          optimizer="adam", loss="mse")
    backend = keras.backend.backend()
    if backend == "torch":
        import torch
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    model = make()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 1024)).astype("float32")
    y = rng.normal(size=(1024, 10)).astype("float32")
    model.fit(x, y, batch_size=1024, epochs=2, verbose=0)
    if backend == "torch":
        peak = (torch.cuda.max_memory_allocated()
                if torch.cuda.is_available() else None)
    else:
        import jax
        stats = jax.devices()[0].memory_stats() or {}  # (None on a CPU)
        peak = stats.get("peak_bytes_in_use")
    print(json.dumps({"estimate": estimate.peak, "real": peak,
                      "method": estimate.method}))
''')


@pytest.mark.skipif(BACKEND == "tensorflow", reason=(
    "TensorFlow's estimate is a layer-output trace, not the framework's "
    "accounting"))
def test_the_memory_estimate_is_within_ten_percent_of_the_devices_peak():
    # A fresh process: the device's peak counts only this model's fit.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]),
        XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = subprocess.run([sys.executable, "-c", ESTIMATE_PROGRAM], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    record("gpu_memory_estimate", found)
    if not ON_GPU:
        pytest.skip("the estimate ran; a device peak needs a GPU")
    assert abs(found["estimate"] - found["real"]) <= 0.1 * found["real"], (
        found)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's GPU devices")
def test_jax_load_weights_reads_each_gpus_slice(tmp_path):
    import jax
    from worker_common import recorded_regional_reads

    saved = make_model()
    path = str(tmp_path / "model.weights.h5")
    saved.save_weights(path)
    devices = jax.devices()
    mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
    with kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(
            mesh, min_size=0)).scope():
        model = make_model()
    with recorded_regional_reads() as read:
        model.load_weights(path)
    for a, b in zip(saved.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert read  # region by region, onto the devices
    record("gpu_sharded_loading_jax", {"devices": len(devices),
                                       "regions_read": len(read)})
