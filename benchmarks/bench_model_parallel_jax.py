"""Sharded (model-parallel) vs replicated: step time and memory per device.

The same MLP-heavy model trains on 8 simulated CPU devices twice in one run:
replicated over 8 replicas (`MirroredStrategy`), and with its large kernels
sharded over a model axis of 2 (`TPUStrategy`, 4 replicas x 2 logical
devices). Memory per device is what the variables occupy on one device
(`strategy.describe_layout`). Prints one JSON object.

On a 2-core machine keep the model small: 8 simulated devices share two
cores, and with much wider layers XLA's CPU collectives can time out waiting
for a starved device thread (an artefact of simulation, not of kd).

Usage:
    python benchmarks/bench_model_parallel_jax.py [--steps 20] [--trials 3]
"""

import os
import sys

from _results import record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    from _args import model_parallel_args

    return model_parallel_args(__doc__.splitlines()[0], width=512)


ARGS = parse_args()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import EpochTimer  # noqa: E402
from _common import make_wide_mlp  # noqa: E402
from _common import sharded_vs_replicated  # noqa: E402
from keras.distribution import DeviceMesh  # noqa: E402
from keras.distribution import LayoutMap  # noqa: E402

import keras_distribute as kd  # noqa: E402


def make_model():
    return make_wide_mlp(ARGS.width)


def variable_bytes(strategy, model):
    total = 0
    for variable in model.weights:
        total += strategy.engine.variable_layout(variable)[1]
    return total


def run(strategy, x, y):
    with strategy.scope():
        model = make_model()
    timer = EpochTimer()
    model.fit(x, y, batch_size=256, epochs=3, shuffle=False, verbose=0,
              callbacks=[timer])
    return timer.per_step[1:], variable_bytes(strategy, model)


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * ARGS.steps, 256)).astype("float32")
    y = rng.integers(0, 10, size=(256 * ARGS.steps,))
    replicated = kd.MirroredStrategy()
    layout_map = LayoutMap(DeviceMesh((4, 2), ["batch", "model"],
                                      jax.devices()))
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    sharded = kd.TPUStrategy(
        device_assignment=kd.DeviceAssignment(4, 2, devices=jax.devices()),
        layout_map=layout_map)
    times = {"replicated": [], "sharded": []}
    memory = {}
    for _ in range(ARGS.trials):
        for name, strategy in (("replicated", replicated),
                               ("sharded", sharded)):
            per_step, nbytes = run(strategy, x, y)
            times[name] += per_step
            memory[name] = nbytes
    ms = {k: 1000 * float(np.median(v)) for k, v in times.items()}
    record("model_parallel_jax", sharded_vs_replicated(
        "model_parallel_vs_replicated_jax", "device", ms, memory,
        devices=8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
