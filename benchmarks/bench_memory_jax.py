"""FSDP memory per device on JAX: kd against Keras' own ModelParallel.

In one process with 8 simulated CPU devices, trials interleaved, the same
MLP (width -> width, 4 layers, ReLU, MSE, Adam) trains with its variables
sharded over the batch axis of a 1-D mesh of N = 1, 2, 4, 8 devices, twice:

- kd: `kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(mesh,
  min_size=0))`, `model.fit`;
- the anchor: `keras.distribution.ModelParallel` with the layout map kd's
  rule gives (each kernel and bias on its largest dimension N divides),
  set with `keras.distribution.set_distribution`, `model.fit`.

It records per device the bytes of the parameters and of the optimizer
state (the device's addressable shards, counted exactly) and the median
step time. Prints one JSON object and writes
benchmarks/results/memory_jax.json.

Usage:
    python benchmarks/bench_memory_jax.py [--width 1024] [--steps 8]
        [--trials 2] [--devices 1 2 4 8]
"""

import argparse
import os
import sys

from _results import record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS",
                      "--xla_force_host_platform_device_count=8")

BATCH_PER_DEVICE = 64
LAYERS = 4


def _device_bytes(variables, device):
    total = 0
    for variable in variables:
        for shard in variable.value.addressable_shards:
            if shard.device == device:
                total += shard.data.size * shard.data.dtype.itemsize
    return total


def _make_model(width):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, activation="relu", name=f"l{i}")
           for i in range(LAYERS - 1)]
        + [keras.layers.Dense(width, name=f"l{LAYERS - 1}")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _trial(name, width, steps, devices, x, y):
    import keras
    from _common import EpochTimer

    import keras_distribute as kd

    count = len(devices)
    mesh = keras.distribution.DeviceMesh((count,), ["batch"], devices)
    rule = kd.layouts.fully_sharded(mesh, min_size=0)
    if name == "kd":
        with kd.MirroredStrategy(layout_map=rule).scope():
            model = _make_model(width)
        fit_scope = None
    else:
        # The map kd's rule gives, written out for Keras: the same layouts.
        layout_map = keras.distribution.LayoutMap(mesh)
        for i in range(LAYERS):
            for name, shape in (("kernel", (width, width)),
                                ("bias", (width,))):
                layout = rule.layout_for(f"l{i}/{name}", shape)
                if layout is not None:
                    layout_map[f".*l{i}/{name}"] = layout.axes
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch")
        fit_scope = distribution
        with distribution.scope():
            model = _make_model(width)
    batch = BATCH_PER_DEVICE * count
    timer = EpochTimer()

    def fit(rows, callbacks):
        if fit_scope is None:
            return model.fit(x[:rows], y[:rows], batch_size=batch, epochs=1,
                             shuffle=False, verbose=0, callbacks=callbacks)
        with fit_scope.scope():
            return model.fit(x[:rows], y[:rows], batch_size=batch,
                             epochs=1, shuffle=False, verbose=0,
                             callbacks=callbacks)

    fit(2 * batch, [])  # compiled, optimizer slots made
    fit(steps * batch, [timer])
    device = devices[0]
    result = {
        "param_bytes": _device_bytes(model.trainable_weights, device),
        "optimizer_bytes": _device_bytes(model.optimizer.variables, device),
        "step_ms": 1000 * timer.per_step[0],
    }
    model = None  # frees it (the closures above are done with it)
    keras.backend.clear_session()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--devices", type=int, nargs="+",
                        default=[1, 2, 4, 8])
    args = parser.parse_args()
    import jax
    import numpy as np

    rows = {}
    for count in args.devices:
        devices = jax.devices()[:count]
        rng = np.random.default_rng(0)
        n = BATCH_PER_DEVICE * count * args.steps
        x = rng.normal(size=(n, args.width)).astype("float32")
        y = rng.normal(size=(n, args.width)).astype("float32")
        runs = {"kd": [], "model_parallel": []}
        for _ in range(args.trials):
            for name in runs:
                runs[name].append(_trial(name, args.width, args.steps,
                                         devices, x, y))
        rows[str(count)] = {
            name: {"param_bytes": trial[0]["param_bytes"],
                   "optimizer_bytes": trial[0]["optimizer_bytes"],
                   "step_ms": float(np.median([t["step_ms"]
                                               for t in trial]))}
            for name, trial in runs.items()}
        print(count, rows[str(count)], flush=True)
    whole = LAYERS * (args.width * args.width + args.width) * 4
    record("memory_jax", {
        "benchmark": "fsdp_memory_per_device_jax",
        "width": args.width, "layers": LAYERS,
        "batch_per_device": BATCH_PER_DEVICE,
        "model_bytes": whole, "adam_bytes": 2 * whole, "devices": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
