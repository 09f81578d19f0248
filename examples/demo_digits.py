"""Train a small classifier on scikit-learn's digits under kd.MirroredStrategy.

On a machine without accelerators, JAX and TensorFlow simulate 8 CPU devices
so that the strategy has 8 replicas to split every global batch across. On
PyTorch one process is one replica: start several with
`python -m keras_distribute.launch --nproc 2 examples/demo_digits.py`.

Usage:
    python examples/demo_digits.py [--epochs 10] [--batch-size 64]
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


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="global batch size, split across replicas")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_data()
    if keras.backend.backend() == "tensorflow":
        kd.simulate_cpu_devices(8)  # TensorFlow: 8 logical CPU devices
    strategy = kd.MirroredStrategy()
    print(f"Keras backend: {keras.backend.backend()}")
    print(f"Number of replicas in sync: {strategy.num_replicas_in_sync}")
    print(f"Strategy: {strategy}")
    if keras.backend.backend() == "torch" and "RANK" not in os.environ:
        print("PyTorch runs one replica per process: for more, run "
              "python -m keras_distribute.launch --nproc 2 "
              "examples/demo_digits.py")

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x_train, y_train, batch_size=args.batch_size,
              epochs=args.epochs, validation_split=0.1, verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size,
                                    verbose=0)
    print(f"Test loss: {loss:.4f}  Test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
