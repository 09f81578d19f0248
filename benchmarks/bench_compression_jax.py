"""Compressed gradient all-reduce on JAX (8 simulated devices): step time
and bytes.

For each of no compression, fp16 and bf16: `model.fit` under
`kd.MirroredStrategy(communication_options=kd.CommunicationOptions(
compression=...))`, with `keras.distribution.DataParallel` (the native
engine, which has no compression) timed in the same run, trials
alternating. The bytes are those of the all-reduces XLA compiled into one
training step (parsed from the optimized HLO): what crosses between devices.
Prints one JSON object.

Usage:
    python benchmarks/bench_compression_jax.py [--devices 8] [--steps 60] \
        [--trials 5]
"""

import contextlib
import os
import re
import sys

from _args import fit_benchmark_args
from _results import record

ARGS = fit_benchmark_args(__doc__.splitlines()[0], devices=8)
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={ARGS.devices}")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import fit_step_times  # noqa: E402
from _common import make_model  # noqa: E402

import keras_distribute as kd  # noqa: E402
from keras_distribute.backend.jax import compression as jax_compression  # noqa: E402

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4}
_OPERAND = re.compile(r"\b(f32|f16|bf16|s32|u32)\[([\d,]*)\]")


def step_times(build, x, y):
    return fit_step_times(build(), x, y, ARGS.batch_size)


def all_reduce_bytes(strategy, model):
    """Bytes of the all-reduces XLA compiled into one training step (the
    gradients and the loss), per device."""
    engine = strategy.engine
    model.optimizer.build(model.trainable_variables)
    shape = (ARGS.batch_size, 256)
    x = jax.device_put(np.ones(shape, "float32"), engine.distribution.
                       get_data_layout(shape).backend_layout)
    y = jax.device_put(np.zeros(shape[:1], "int32"), engine.distribution.
                       get_data_layout(shape[:1]).backend_layout)
    state = [[v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.metrics_variables, model.optimizer.variables)]

    def step(trainable, non_trainable, metrics, optimizer_variables, x, y):
        return jax.value_and_grad(model.compute_loss_and_updates,
                                  has_aux=True)(
            trainable, non_trainable, metrics, x, y, None, training=True,
            optimizer_variables=optimizer_variables)

    dtype = engine.gradient_compression
    with strategy.scope(), (jax_compression.compressing(
            model, engine, dtype) if dtype is not None else
            contextlib.nullcontext()):
        text = jax.jit(step).lower(*state, x, y).compile().as_text()
    total = 0
    for line in text.splitlines():
        if " all-reduce(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-reduce(")[0]
        for kind, dims in _OPERAND.findall(result):
            total += _ITEMSIZE[kind] * int(np.prod(
                [int(d) for d in dims.split(",") if d] or [1]))
    return total


def main():
    rng = np.random.default_rng(0)
    n = ARGS.batch_size * ARGS.steps
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.integers(0, 10, size=(n,))
    native = keras.distribution.DataParallel()
    strategies = {name: kd.MirroredStrategy(
        communication_options=kd.CommunicationOptions(compression=name))
        for name in (None, "fp16", "bf16")}

    def build_with(strategy):
        def build():
            with strategy.scope():
                return make_model()
        return build

    def build_native():
        keras.distribution.set_distribution(native)
        return make_model()

    times = {name: [] for name in strategies}
    native_times = []
    for _ in range(ARGS.trials):
        for name, strategy in strategies.items():
            keras.distribution.set_distribution(None)
            times[name] += step_times(build_with(strategy), x, y)
        native_times += step_times(build_native, x, y)
        keras.distribution.set_distribution(None)
    native_ms = 1000 * float(np.median(native_times))
    rows = {}
    for name, strategy in strategies.items():
        kd_ms = 1000 * float(np.median(times[name]))
        with strategy.scope():
            model = make_model()
        rows[name or "none"] = {
            "kd_ms": round(kd_ms, 3),
            "ratio_vs_keras_data_parallel": round(kd_ms / native_ms, 3),
            "all_reduce_bytes_per_step": all_reduce_bytes(strategy, model),
        }
    for name in ("fp16", "bf16"):
        rows[name]["kd_step_time_vs_uncompressed"] = round(
            rows[name]["kd_ms"] / rows["none"]["kd_ms"], 3)
        rows[name]["bytes_vs_uncompressed"] = round(
            rows[name]["all_reduce_bytes_per_step"]
            / rows["none"]["all_reduce_bytes_per_step"], 3)
    record("compression_jax", {
        "benchmark": "compressed_all_reduce_jax",
        "devices": ARGS.devices,
        "global_batch": ARGS.batch_size,
        "parameters": make_model().count_params(),
        "steps_timed_per_trial": len(native_times) // ARGS.trials,
        "trials": ARGS.trials,
        "keras_data_parallel_ms": round(native_ms, 3),
        **rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
