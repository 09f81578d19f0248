"""Interrupt a distributed `fit`, resume it exactly, and inspect the
checkpoints.

Trains a small classifier on scikit-learn's digits under kd.MirroredStrategy
with two callbacks: `kd.callbacks.BackupAndRestore` (a backup every few
batches) and `kd.callbacks.ShardedCheckpoint` (latest checkpoints, and the
best ones by validation accuracy). The first `fit` is interrupted half-way,
as a crash or a preempted machine would; running the same `fit` again
resumes at the exact epoch and batch, and ends with the same weights as a
run that was never interrupted. Then the checkpoint index is inspected and
the best checkpoint exported to a Keras `.weights.h5` file.

Usage:
    KERAS_BACKEND=jax python examples/checkpoint_and_resume.py [--epochs 3]
"""

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_distribute as kd  # noqa: E402

BATCH = 64


class Crash(Exception):
    """Stands in for a killed process."""


class CrashAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            raise Crash(f"interrupted after {self.steps} steps")


def data():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def make_model(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    return model


def train(strategy, epochs, callbacks):
    (x, y), validation = data()
    model = make_model(strategy)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=True,
              validation_data=validation, verbose=0, callbacks=callbacks)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--directory", default=None,
                        help="where checkpoints go (default: a temporary one)")
    args = parser.parse_args()
    directory = args.directory or tempfile.mkdtemp(prefix="kd-resume-")
    if keras.backend.backend() == "tensorflow":
        kd.simulate_cpu_devices(4)  # before TensorFlow starts
    strategy = (kd.MirroredStrategy() if keras.backend.backend() != "torch"
                else kd.get_strategy())  # torch: one process per replica
    print(f"{strategy.num_replicas_in_sync} replicas; checkpoints in "
          f"{directory}")
    steps = -(-1400 // BATCH) * args.epochs

    reference = train(strategy, args.epochs, [])

    def callbacks():
        return [kd.callbacks.BackupAndRestore(f"{directory}/backup",
                                              save_freq=5),
                kd.callbacks.ShardedCheckpoint(
                    f"{directory}/checkpoints", max_to_keep=2,
                    monitor="val_accuracy")]

    try:
        train(strategy, args.epochs, callbacks() + [CrashAfter(steps // 2)])
    except Crash as crash:
        backup = kd.checkpoint.latest_checkpoint(f"{directory}/backup")
        where = kd.checkpoint.read_metadata(backup)
        print(f"{crash}; last backup at epoch {where['epoch']}, "
              f"step {where['step']}")
    resumed = train(strategy, args.epochs, callbacks())
    same = all(np.array_equal(a, b) for a, b in zip(
        reference.get_weights(), resumed.get_weights()))
    print(f"resumed run equals uninterrupted: {same}")

    best = kd.checkpoint.latest_checkpoint(f"{directory}/checkpoints/best")
    for key, shape in kd.checkpoint.list_variables(best):
        if key.startswith("model/"):
            print(f"  {key:12s} {shape}")
    metadata = kd.checkpoint.read_metadata(best)
    print(f"best checkpoint: {os.path.basename(best)}, val_accuracy "
          f"{metadata['monitor_value']:.3f}")
    exported = kd.checkpoint.export_weights(
        best, make_model(strategy), f"{directory}/best.weights.h5")
    plain = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128),
                              keras.layers.Dropout(0.2),
                              keras.layers.Dense(10)])
    plain.load_weights(exported)  # plain Keras, no strategy, no kd
    print(f"exported to {exported}")


if __name__ == "__main__":
    main()
