"""Many small variables: restore against save, on every backend.

A model of `--variables` small float32 Keras variables (alternately a
32 x 32 kernel and a 32-wide bias, ~2 KB each) is saved and restored by
kd's `ShardedCheckpoint`, by Keras `save_weights` / `load_weights` and by
the backend's own tool (`tf.train.Checkpoint` on TensorFlow,
`torch.distributed.checkpoint` on torch; JAX has none without orbax,
which is not installed here). Each backend runs in its own process, one
unrecorded warm-up trial first, then `--repeats` trials interleaving the
methods; each restore goes into zeroed variables and is checked bit for
bit. What it shows is the per-variable cost: issue #43 asked that kd
restore 5,000 variables in at most the time it saves them.

    python benchmarks/bench_checkpoint_many.py --variables 5000
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import median_spread
from _results import record

BACKENDS = ("jax", "tensorflow", "torch")


def _model(count: int):
    import keras
    import numpy as np

    class ManySmall(keras.Model):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.parts = [self.add_weight(
                shape=(32, 32) if i % 2 == 0 else (32,), name=f"w{i}",
                initializer=keras.initializers.Constant(rng.standard_normal(
                    (32, 32) if i % 2 == 0 else (32,)).astype("float32")))
                for i in range(count)]

        def call(self, x):
            return x

    model = ManySmall()
    model.built = True
    return model


def _native(backend: str, model, where: str):
    """(save, restore) of the backend's own checkpoint tool, or None."""
    if backend == "tensorflow":
        import tensorflow as tf

        native = tf.train.Checkpoint(
            variables=[v.value for v in model.weights])

        def save():
            native.write(where)
            for name in os.listdir(os.path.dirname(where)):
                if name.startswith(os.path.basename(where)):
                    with open(os.path.join(os.path.dirname(where), name),
                              "rb+") as file:
                        os.fsync(file.fileno())
        return save, lambda: native.read(where).assert_consumed()
    if backend == "torch":
        import torch.distributed.checkpoint as dcp

        def state():
            return {v.path: v.value for v in model.weights}
        return (lambda: dcp.save(state(), checkpoint_id=where, no_dist=True),
                lambda: dcp.load(state(), checkpoint_id=where, no_dist=True))
    return None


def worker(backend: str, count: int, repeats: int) -> dict:
    """Times every method in this process (`KERAS_BACKEND` is `backend`)."""
    import numpy as np

    import keras_distribute as kd

    model = _model(count)
    saved = [np.array(v.numpy(), copy=True) for v in model.weights]
    root = tempfile.mkdtemp(prefix="kd-many-")
    times = {}
    bit_exact = True

    def zero():
        for variable in model.weights:
            variable.assign(np.zeros(variable.shape, "float32"))

    def check():
        nonlocal bit_exact
        bit_exact &= all(np.array_equal(v.numpy(), s)
                         for v, s in zip(model.weights, saved))

    for trial in range(repeats + 1):
        where = os.path.join(root, str(trial))
        os.makedirs(where)
        methods = {
            "kd": (lambda: kd.checkpoint.ShardedCheckpoint(
                       model=model).write(f"{where}/kd"),
                   lambda: kd.checkpoint.ShardedCheckpoint(
                       model=model).read(f"{where}/kd")),
            "keras": (lambda: model.save_weights(
                          f"{where}/keras.weights.h5"),
                      lambda: model.load_weights(
                          f"{where}/keras.weights.h5")),
        }
        native = _native(backend, model, f"{where}/native")
        if native is not None:
            methods["native"] = native
        order = list(methods)[trial % len(methods):] + list(
            methods)[:trial % len(methods)]
        for method in order:
            save, restore = methods[method]
            start = time.perf_counter()
            save()
            save_s = time.perf_counter() - start
            zero()
            start = time.perf_counter()
            restore()
            restore_s = time.perf_counter() - start
            check()
            if trial:  # trial 0 warms up
                times.setdefault(f"save/{method}", []).append(save_s)
                times.setdefault(f"restore/{method}", []).append(restore_s)
    import shutil

    shutil.rmtree(root)
    return {"times": times, "bit_exact": bit_exact}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variables", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=BACKENDS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.variables, args.repeats)))
        return
    result = {"variables": args.variables, "repeats": args.repeats,
              "backends": {}}
    for backend in BACKENDS:
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--worker", backend,
             "--variables", str(args.variables), "--repeats",
             str(args.repeats)], capture_output=True, text=True,
            env={**os.environ, "KERAS_BACKEND": backend}, check=False)
        if run.returncode:
            raise SystemExit(f"the {backend} worker failed:\n"
                             f"{run.stderr[-3000:]}")
        measured = json.loads(run.stdout.strip().splitlines()[-1])
        times = measured["times"]
        figures = {key: median_spread(values)
                   for key, values in times.items()}
        methods = sorted({key.split("/")[1] for key in times})
        figures["restore_over_save"] = {
            method: median_spread([r / s for r, s in zip(
                times[f"restore/{method}"], times[f"save/{method}"])])
            for method in methods}
        figures["bit_exact"] = measured["bit_exact"]
        result["backends"][backend] = figures
    record("checkpoint_many", result)


if __name__ == "__main__":
    main()
