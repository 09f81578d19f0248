"""Save / restore of the sharded checkpoint on TensorFlow (4 logical CPU
devices), against `tf.train.Checkpoint` on the same state.

The state (`--megabytes` of float32 Keras variables, 8 matrices) is made
under `kd.MirroredStrategy()` (mirrored on every device). Each trial saves
it with kd's `ShardedCheckpoint`, with `tf.train.Checkpoint.write` of the
same variables (followed by an fsync of its files: TF does not sync) and
raw `numpy.save` + `fsync` (the limit of the disk), then restores each into
zeroed variables. Trials interleave the methods, after one unrecorded
warm-up trial; medians with [min, max].
Prints one JSON object.

    python benchmarks/bench_checkpoint_tf.py --megabytes 1024
"""

import glob
import os
import shutil
import sys
import tempfile
import time

from _args import checkpoint_args
from _results import record

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fsync_files(pattern: str) -> None:
    for name in glob.glob(pattern):
        with open(name, "rb") as f:
            os.fsync(f.fileno())


def main():
    import numpy as np

    import keras_distribute as kd

    args = checkpoint_args(__doc__, devices=4).parse_args()
    kd.simulate_cpu_devices(args.devices)
    import tensorflow as tf
    from _common import checkpoint_summary
    from _common import make_checkpoint_state

    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_checkpoint_state(args.megabytes, seed=0)
    expected = [np.array(v.numpy()) for v in model.weights]
    variables = [v.value for v in model.weights]
    zeros = [np.zeros(v.shape, np.float32) for v in model.weights]
    directory = tempfile.mkdtemp(dir=args.directory, prefix="kd-bench-")
    quiet = kd.checkpoint.CheckpointOptions(verbose=0)
    native = tf.train.Checkpoint(variables=variables)
    times = {f"{kind}/{method}": [] for kind in ("save", "restore")
             for method in ("kd", "tf", "numpy")}

    def numpy_save(where):
        os.makedirs(where)
        for i, v in enumerate(model.weights):
            with open(os.path.join(where, f"{i}.npy"), "wb") as f:
                np.save(f, v.numpy())
                f.flush()
                os.fsync(f.fileno())

    def numpy_restore(where):
        for i, v in enumerate(model.weights):
            v.assign(np.load(os.path.join(where, f"{i}.npy")))

    def tf_save(where):
        native.write(os.path.join(where, "ckpt"))
        _fsync_files(os.path.join(where, "ckpt*"))

    try:
        for trial in range(-1, args.repeats):  # -1: a warm-up, not recorded
            where = {m: os.path.join(directory, f"{m}-{trial}")
                     for m in ("kd", "tf", "numpy")}
            checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
            saves = {
                "kd": lambda: checkpoint.write(where["kd"], options=quiet),
                "tf": lambda: tf_save(where["tf"]),
                "numpy": lambda: numpy_save(where["numpy"]),
            }
            restores = {
                "kd": lambda: kd.checkpoint.ShardedCheckpoint(
                    model=model).read(where["kd"],
                                      options=quiet).assert_consumed(),
                "tf": lambda: native.read(os.path.join(
                    where["tf"], "ckpt")).assert_consumed(),
                "numpy": lambda: numpy_restore(where["numpy"]),
            }
            order = ["kd", "tf", "numpy"]
            order = order[trial % 3:] + order[:trial % 3]  # interleaved
            for method in order:
                seconds = _timed(saves[method])
                if trial >= 0:
                    times[f"save/{method}"].append(seconds)
            for method in order:
                for v, z in zip(model.weights, zeros):
                    v.assign(z)
                seconds = _timed(restores[method])
                if trial >= 0:
                    times[f"restore/{method}"].append(seconds)
                for v, e in zip(model.weights, expected):
                    if not np.array_equal(v.numpy(), e):
                        raise AssertionError(f"{method} did not restore "
                                             f"{v.path} exactly")
            for path in where.values():
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    summary = checkpoint_summary(times, ("kd", "tf", "numpy"), anchor="tf")
    record("checkpoint_tf", {
        "megabytes": args.megabytes, "devices": args.devices,
        "repeats": args.repeats, **summary, "bit_exact": True,
        "runs": times})


if __name__ == "__main__":
    main()
