"""Steady-state `fit` step time: kd.MirroredStrategy vs keras.distribution.

Both train the same model on the same data over the same simulated devices;
the only difference is who sets up the distribution. Trials alternate
between the two so that machine noise hits both alike; the median step time
of each is compared. Prints one JSON object.

Usage:
    python benchmarks/bench_fit_jax.py [--devices 8] [--steps 60] [--trials 5]
"""

import os
import sys

from _args import fit_benchmark_args
from _results import record

ARGS = fit_benchmark_args(__doc__.splitlines()[0], devices=8)
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={ARGS.devices}")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _common import fit_step_times  # noqa: E402
from _common import make_model  # noqa: E402

import keras_distribute as kd  # noqa: E402


def step_times(build, x, y):
    return fit_step_times(build(), x, y, ARGS.batch_size)


def main():
    rng = np.random.default_rng(0)
    n = ARGS.batch_size * ARGS.steps
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.integers(0, 10, size=(n,))
    strategy = kd.MirroredStrategy()
    native = keras.distribution.DataParallel()

    def build_kd():
        with strategy.scope():
            return make_model()

    def build_native():
        keras.distribution.set_distribution(native)
        return make_model()

    kd_times, native_times = [], []
    for _ in range(ARGS.trials):
        keras.distribution.set_distribution(None)
        kd_times += step_times(build_kd, x, y)
        native_times += step_times(build_native, x, y)
        keras.distribution.set_distribution(None)
    kd_ms = 1000 * float(np.median(kd_times))
    native_ms = 1000 * float(np.median(native_times))
    record("fit_jax", {
        "benchmark": "fit_step_time_jax",
        "devices": strategy.num_replicas_in_sync,
        "global_batch": ARGS.batch_size,
        "steps_timed": len(kd_times),
        "kd_mirrored_ms": round(kd_ms, 3),
        "keras_data_parallel_ms": round(native_ms, 3),
        "ratio": round(kd_ms / native_ms, 3),
        "goal": "<= 1.02",
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
