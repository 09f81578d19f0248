"""Steady-state `fit` step time: kd.MirroredStrategy vs tf.distribute.

Both train the same Keras 3 model on the same data over the same logical CPU
devices; the native side builds it under `tf.distribute.MirroredStrategy`
directly. Trials alternate so that machine noise hits both alike; median
step times are compared. Then the same with an optimizer that clips
(`Adam(global_clipnorm=1.0)`): kd clips the replicas' summed gradient, in
cross-replica context, where Keras' TF optimizer under tf.distribute clips
each replica's part (other numbers than one device: the cost of doing it
right). Prints one JSON object.

Usage:
    python benchmarks/bench_fit_tf.py [--devices 4] [--steps 60] [--trials 5]
"""

import os
import sys

from _args import fit_benchmark_args
from _results import record

ARGS = fit_benchmark_args(__doc__.splitlines()[0], devices=4)
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _common import fit_step_times  # noqa: E402
from _common import make_model  # noqa: E402

import keras_distribute as kd  # noqa: E402

kd.simulate_cpu_devices(ARGS.devices)


def step_times(scope, x, y, clipping=False):
    import keras

    with scope():
        model = make_model(optimizer=keras.optimizers.Adam(
            global_clipnorm=1.0) if clipping else "adam")
    return fit_step_times(model, x, y, ARGS.batch_size)


def main():
    rng = np.random.default_rng(0)
    n = ARGS.batch_size * ARGS.steps
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.integers(0, 10, size=(n,))
    strategy = kd.MirroredStrategy()
    native = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")])
    kd_times, native_times = [], []
    kd_clipping, native_clipping = [], []
    for _ in range(ARGS.trials):
        kd_times += step_times(strategy.scope, x, y)
        native_times += step_times(native.scope, x, y)
    for _ in range(ARGS.trials):
        kd_clipping += step_times(strategy.scope, x, y, clipping=True)
        native_clipping += step_times(native.scope, x, y, clipping=True)
    kd_ms = 1000 * float(np.median(kd_times))
    native_ms = 1000 * float(np.median(native_times))
    kd_clip_ms = 1000 * float(np.median(kd_clipping))
    native_clip_ms = 1000 * float(np.median(native_clipping))
    record("fit_tensorflow", {
        "benchmark": "fit_step_time_tensorflow",
        "devices": strategy.num_replicas_in_sync,
        "global_batch": ARGS.batch_size,
        "steps_timed": len(kd_times),
        "kd_mirrored_ms": round(kd_ms, 3),
        "tf_distribute_mirrored_ms": round(native_ms, 3),
        "ratio": round(kd_ms / native_ms, 3),
        "goal": "<= 1.02",
        "clipping_kd_ms": round(kd_clip_ms, 3),
        "clipping_tf_distribute_ms": round(native_clip_ms, 3),
        "clipping_ratio": round(kd_clip_ms / native_clip_ms, 3),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
