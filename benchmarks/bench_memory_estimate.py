"""`kd.layouts.estimate_memory` against the real peak of a training step.

For each backend (a fresh process each: JAX on one CPU device, TensorFlow,
torch) and three models — an MLP, a CNN and a keras-hub `GemmaBackbone` —
the model is compiled (Adam, MSE) and `fit` one batch (everything is built
and compiled); then, five times, the process's peak resident memory
(Linux `VmHWM`) is reset (`/proc/self/clear_refs`), one more step runs
(`train_on_batch`), and the real step's transient memory is its peak less
the resident memory just before it (the median of the five is recorded).
glibc is told to map every block over 64 KiB on its own
(`MALLOC_MMAP_THRESHOLD_`), so a freed tensor leaves the resident set and
the next step's allocations show in it. On TensorFlow, whose CPU allocator
keeps freed memory for the next step, the real step is the allocator's own
count instead (`TF_CPU_ALLOCATOR_USE_BFC=true`: its peak bytes in use during
the step less those in use before it).

The estimate's counterpart: its peak less what stays resident between
steps (the variables and optimizer slots; on torch also the gradients,
which Keras' torch trainer keeps in `.grad` until the next step). The
estimate is made before the model is built for training, without its
memory (the function that builds the model is passed). The last backend,
"torch, 2 processes, ...", is a job of 2 gloo processes whose variables are
sharded over the batch axis (one-line FSDP for the MLP and the CNN,
keras-hub's own `get_layout_map` on a (2, 1) mesh for Gemma): the estimate
is made for that map and the real step measured in each process (the more
loaded one is recorded). Prints one JSON object and writes
benchmarks/results/memory_estimate.json.

Usage:
    python benchmarks/bench_memory_estimate.py [--backends jax torch tensorflow
        "torch, 2 processes, sharded over the batch axis"]
"""

import argparse
import json
import os
import subprocess
import sys

from _memory import proc_status
from _memory import reset_peak_resident
from _results import record

HERE = os.path.dirname(os.path.abspath(__file__))
# Rows of torch processes whose variables are sharded over the batch axis
# (FSDP), or over the model axis (tensor parallelism): processes, kind.
TORCH_FULLY_SHARDED = "torch, 2 processes, sharded over the batch axis"
TORCH_MODEL_PARALLEL = "torch, 2 processes, sharded over the model axis"
JOBS = {TORCH_FULLY_SHARDED: (2, "batch"), TORCH_MODEL_PARALLEL: (2, "model")}
# Steps measured after the first `fit` (the median is recorded: the first
# of them may still allocate what later steps reuse).
STEPS = 5


def models(keras):
    def mlp():
        keras.utils.set_random_seed(1)
        return keras.Sequential([  # (named: a planned map's keys)
            keras.Input((1024,)),
            keras.layers.Dense(4096, activation="relu", name="dense_in"),
            keras.layers.Dense(4096, activation="relu", name="dense_mid"),
            keras.layers.Dense(10, name="dense_out")], name="mlp")

    def cnn():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(64, 3, activation="relu", name="conv_in"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(128, 3, activation="relu", name="conv_out"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, name="head")], name="cnn")

    def gemma():
        import keras_hub

        keras.utils.set_random_seed(1)
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=8192, num_layers=4, num_query_heads=8,
            num_key_value_heads=8, hidden_dim=512, intermediate_dim=4096,
            head_dim=64, dtype="float32")

    return {"MLP 1024-4096-4096-10, batch 1024": (mlp, 1024, (1024,)),
            "CNN 64x64x3, 2 convolutions, batch 128": (cnn, 128, (64, 64, 3)),
            "keras-hub GemmaBackbone 4 layers, hidden 512, sequence 128, "
            "batch 16": (gemma, 16, {"token_ids": (128,),
                                     "padding_mask": (128,)})}


def batch(keras, make, size, input_shape):
    import numpy as np

    rng = np.random.default_rng(0)
    if isinstance(input_shape, dict):
        length = input_shape["token_ids"][0]
        x = {"token_ids": rng.integers(0, 8192, (size, length), "int32"),
             "padding_mask": np.ones((size, length), "int32")}
        return x, rng.normal(size=(size, length, 512)).astype("float32")
    x = rng.normal(size=(size,) + input_shape).astype("float32")
    return x, rng.normal(size=(size, 10)).astype("float32")


def job_map(keras, kd, name, make, processes, axis):
    """The map a torch job of `processes` trains the model `name` with.
    Over the batch axis: keras-hub's own `get_layout_map` for Gemma on a
    (processes, 1) mesh, one-line FSDP (`kd.layouts.fully_sharded`) for the
    others. Over the model axis: keras-hub's map for Gemma on a
    (1, processes) mesh, `kd.layouts.plan_layout` for the others."""
    devices = [f"cpu:{i}" for i in range(processes)]
    if axis == "model":
        mesh = keras.distribution.DeviceMesh((1, processes),
                                             ["batch", "model"], devices)
        if "Gemma" in name:
            import keras_hub

            return keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        return kd.layouts.plan_layout(make, mesh, fsdp=False).layout_map
    if "Gemma" in name:
        import keras_hub

        mesh = keras.distribution.DeviceMesh(
            (processes, 1), ["batch", "model"], devices)
        return keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    mesh = keras.distribution.DeviceMesh((processes,), ["batch"], devices)
    return kd.layouts.fully_sharded(mesh)


def steps_in_use(keras, model, x, y, steps=STEPS):
    """The bytes each of `steps` more steps (`train_on_batch`) takes above
    what was in use before it, and where they are read from."""
    real = []
    for _ in range(steps):
        if keras.backend.backend() == "tensorflow":
            # TensorFlow's CPU allocator keeps what a step freed for the
            # next one (the resident set barely moves); its own count of
            # the bytes in use (TF_CPU_ALLOCATOR_USE_BFC) is the real step.
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats("CPU:0")
            before = tf.config.experimental.get_memory_info("CPU:0")[
                "current"]
            model.train_on_batch(x, y)
            real.append(tf.config.experimental.get_memory_info("CPU:0")[
                "peak"] - before)
            real_from = "TensorFlow's CPU allocator (BFC)"
        else:
            before = reset_peak_resident()
            model.train_on_batch(x, y)
            real.append(proc_status("VmHWM") - before)
            real_from = "the process's resident memory (VmHWM)"
    return real, real_from + f", median of {steps}"


def measure_one_backend(processes=1, axis="batch"):
    """In a process of one backend: every model's estimate and real step
    (with `processes` > 1, one torch process of a job sharded over
    `axis`)."""
    import contextlib
    import gc

    import keras

    import keras_distribute as kd

    results = {}
    for name, (make, size, input_shape) in models(keras).items():
        layout_map, scope = None, contextlib.nullcontext()
        if processes > 1:
            layout_map = job_map(keras, kd, name, make, processes, axis)
            scope = kd.MirroredStrategy(layout_map=layout_map).scope()
        estimate = kd.layouts.estimate_memory(
            make, layout_map, batch_size=size, optimizer="adam", loss="mse",
            input_shape=input_shape)
        with scope:
            model = make()
            model.compile(optimizer="adam", loss="mse")
        x, y = batch(keras, make, size, input_shape)
        model.fit(x, y, batch_size=size, epochs=1, verbose=0)
        gc.collect()
        steps, real_from = steps_in_use(keras, model, x, y)
        real = sorted(steps)[len(steps) // 2]
        between_steps = estimate.parameters + estimate.optimizer + (
            estimate.gradients if keras.backend.backend() == "torch" else 0)
        estimated = estimate.peak - between_steps
        results[name] = {
            "estimated_transient_bytes": estimated,
            "real_transient_bytes": real,
            "real_steps_bytes": steps,
            "ratio": estimated / real if real else None,
            "estimated_peak_bytes": estimate.peak,
            "method": estimate.method,
            "real_from": real_from}
        del model
        gc.collect()
    if processes > 1:
        return results
    print(json.dumps(results))


def measure_job(processes=2, axis="batch"):
    """Every model's estimate and real step in each of `processes` torch
    processes of a job sharded over `axis`; prints the most loaded
    process's."""
    import keras_distribute as kd

    by_process = kd.launch(measure_one_backend, num_processes=processes,
                           args=(processes, axis), timeout=1800)
    print(json.dumps({name: max((p[name] for p in by_process),
                                key=lambda m: m["real_transient_bytes"])
                      for name in by_process[0]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+",
                        default=["jax", "torch", "tensorflow",
                                 TORCH_FULLY_SHARDED, TORCH_MODEL_PARALLEL])
    parser.add_argument("--child", action="store_true",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if os.environ.get("KD_BENCH_PROCESSES"):
            measure_job(int(os.environ["KD_BENCH_PROCESSES"]),
                        os.environ["KD_BENCH_AXIS"])
        else:
            measure_one_backend()
        return
    by_backend = {}
    for backend in args.backends:
        processes, axis = JOBS.get(backend, (None, ""))
        env = dict(os.environ, KERAS_BACKEND=backend.split(",")[0],
                   KD_BENCH_PROCESSES=str(processes or ""),
                   KD_BENCH_AXIS=axis,
                   MALLOC_MMAP_THRESHOLD_="65536", JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child"], env=env,
            capture_output=True, text=True, timeout=1800)
        if run.returncode:
            raise SystemExit(f"{backend}: {run.stderr[-3000:]}")
        by_backend[backend] = json.loads(run.stdout.strip().splitlines()[-1])
    import keras  # (its version, for the record)

    record("memory_estimate", {
        "goal": "within 10 % of the real peak", "by_backend": by_backend,
        "keras": keras.__version__})


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main()
