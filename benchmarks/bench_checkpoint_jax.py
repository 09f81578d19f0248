"""Save / restore throughput of the sharded checkpoint, against the others.

The same state (`--megabytes` of float32 Keras variables, ~1 GB by default)
is saved and restored by kd's `ShardedCheckpoint`, orbax-checkpoint (if
installed: `pip install orbax-checkpoint`), Keras `save_weights` /
`load_weights`, and raw `numpy.save` / `numpy.load` of the same bytes (the
limit of the disk). Also: how long an asynchronous kd save blocks, against
the device-to-host copy of the state; and the peak memory of each restore
(each in a fresh process: peak RSS minus the state it restores into).
Prints one JSON object; ratios are each method's time over numpy's.

    KERAS_BACKEND=jax python benchmarks/bench_checkpoint_jax.py --megabytes 1024
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys

from _results import record
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")


def make_state(megabytes: int, seed=None):
    """Eight float32 matrices of equal size, as Keras variables in a model
    (random with a seed, else zeros)."""
    import keras
    import numpy as np

    rows = max(1, int(megabytes * 2**20 / 4 / 8 / 1024))

    class Holder(keras.Model):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(seed)
            self.parts = [self.add_weight(
                shape=(rows, 1024), name=f"w{i}",
                initializer="zeros" if seed is None else
                keras.initializers.Constant(
                    rng.standard_normal((rows, 1024), np.float32)))
                for i in range(8)]

        def call(self, x):
            return x

    model = Holder()
    model.built = True
    return model


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save_all(model, directory: str) -> dict:
    import jax
    import numpy as np

    import keras_distribute as kd

    arrays = [v.value for v in model.weights]
    times = {}
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    times["kd"] = timed(lambda: checkpoint.write(f"{directory}/kd"))
    # Asynchronous kd save: how long fit would be blocked, against a plain
    # copy of the state to new host memory (what the save must do).
    copies = []
    copy = timed(lambda: copies.extend(
        np.array(jax.device_get(a), copy=True) for a in arrays))
    del copies[:]
    options = kd.checkpoint.CheckpointOptions(enable_async=True)
    start = time.perf_counter()
    checkpoint.write(f"{directory}/kd_async", options=options)
    blocked = time.perf_counter() - start
    checkpoint.sync()
    total = time.perf_counter() - start
    times["keras_save_weights"] = timed(
        lambda: model.save_weights(f"{directory}/keras.weights.h5"))

    def numpy_save():
        os.makedirs(f"{directory}/numpy")
        for i, a in enumerate(arrays):
            with open(f"{directory}/numpy/{i}.npy", "wb") as f:
                np.save(f, np.asarray(a))
                f.flush()
                os.fsync(f.fileno())

    times["numpy"] = timed(numpy_save)
    try:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        state = {f"w{i}": a for i, a in enumerate(arrays)}

        def orbax_save():
            checkpointer.save(f"{directory}/orbax", state)
            checkpointer.wait_until_finished()

        times["orbax"] = timed(orbax_save)
        checkpointer.close()
    except ImportError:
        times["orbax"] = None

    return {"save_s": times, "async": {"blocked_s": blocked, "total_s": total,
                                       "device_to_host_copy_s": copy}}


def restore_one(method: str, directory: str, megabytes: int) -> dict:
    """Runs in a fresh process: restore once, report time and peak RSS."""
    import numpy as np

    import keras_distribute as kd

    model = make_state(megabytes)  # zeros: the restore must overwrite them
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if method == "kd":
        fn = lambda: kd.checkpoint.ShardedCheckpoint(model=model).read(  # noqa
            f"{directory}/kd").assert_consumed()
    elif method == "keras_save_weights":
        fn = lambda: model.load_weights(f"{directory}/keras.weights.h5")  # noqa
    elif method == "numpy":
        def fn():
            for i, v in enumerate(model.weights):
                v.assign(np.load(f"{directory}/numpy/{i}.npy"))
    else:
        import orbax.checkpoint as ocp

        def fn():
            checkpointer = ocp.StandardCheckpointer()
            target = {f"w{i}": v.value for i, v in enumerate(model.weights)}
            restored = checkpointer.restore(f"{directory}/orbax", target)
            for i, v in enumerate(model.weights):
                v.assign(restored[f"w{i}"])
            checkpointer.close()
    seconds = timed(fn)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reference = make_state(megabytes, seed=0).weights[0]
    exact = bool(np.array_equal(np.asarray(model.weights[0].value),
                                np.asarray(reference.value)))
    return {"restore_s": seconds, "extra_peak_rss_mb": (peak - baseline) / 1024,
            "bit_exact": exact}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--directory", default=None,
                        help="where to write (default: a temporary one)")
    parser.add_argument("--restore-one", nargs=2, metavar=("METHOD", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.restore_one:
        print(json.dumps(restore_one(*args.restore_one, args.megabytes)))
        return
    directory = tempfile.mkdtemp(dir=args.directory, prefix="kd-bench-")
    try:
        model = make_state(args.megabytes, seed=0)
        result = {"megabytes": args.megabytes, **save_all(model, directory)}
        del model
        result["restore"] = {}
        for method, seconds in result["save_s"].items():
            if seconds is None:
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--megabytes", str(args.megabytes),
                 "--restore-one", method, directory],
                capture_output=True, text=True, check=True)
            result["restore"][method] = json.loads(out.stdout.splitlines()[-1])
        numpy_save = result["save_s"]["numpy"]
        numpy_restore = result["restore"]["numpy"]["restore_s"]
        result["save_time_vs_numpy"] = {
            k: round(v / numpy_save, 3) for k, v in result["save_s"].items()
            if v is not None}
        result["restore_time_vs_numpy"] = {
            k: round(v["restore_s"] / numpy_restore, 3)
            for k, v in result["restore"].items()}
        result["async"]["blocked_vs_copy"] = round(
            result["async"]["blocked_s"]
            / result["async"]["device_to_host_copy_s"], 3)
        record("checkpoint_jax", result)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
