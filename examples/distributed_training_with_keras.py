"""TensorFlow's "Distributed training with Keras" tutorial, on keras_distribute.

The tutorial's steps with scikit-learn's digits instead of MNIST (no download):
a MirroredStrategy, a global batch of 64 per replica, a small CNN built and
compiled in the scope, ModelCheckpoint / LearningRateScheduler / a callback
printing the learning rate, then restoring the last checkpoint and evaluating.
Runs on any Keras backend (`KERAS_BACKEND`); on torch, start it with

    python -m keras_distribute.launch --nproc 2 \
        examples/distributed_training_with_keras.py

Usage:
    python examples/distributed_training_with_keras.py [--epochs 12]
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_distribute as kd  # noqa: E402

BATCH_SIZE_PER_REPLICA = 64


def load_data():
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]  # (n, 8, 8, 1)
    labels = digits.target.astype("int32")
    split = int(0.8 * len(images))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def decay(epoch):
    """The tutorial's learning-rate schedule."""
    if epoch < 3:
        return 1e-3
    if 3 <= epoch < 7:
        return 1e-4
    return 1e-5


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--checkpoint-dir", default="training_checkpoints",
                        help="where checkpoints go, shared by every process "
                             "(default, as in the tutorial: "
                             "./training_checkpoints)")
    args = parser.parse_args(argv)

    if keras.backend.backend() == "tensorflow":
        kd.simulate_cpu_devices(4)
    strategy = kd.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    batch_size = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    (x_train, y_train), (x_test, y_test) = load_data()

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.Adam(),
            metrics=["accuracy"],
        )

    # Every process reads the chief's files after fit (the chief alone writes
    # them; fit returns in every process once they are complete), so the
    # directory is one they all see.
    checkpoint_dir = args.checkpoint_dir
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rate = float(np.asarray(model.optimizer.learning_rate))
            print(f"\nLearning rate for epoch {epoch + 1} is {rate}")

    callbacks = [
        keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                        save_weights_only=True),
        keras.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]
    model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs,
              callbacks=callbacks, verbose=2)

    model.load_weights(checkpoint_prefix.format(epoch=args.epochs))
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=batch_size,
                                    verbose=0)
    print(f"Eval loss: {loss:.4f}, Eval accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
