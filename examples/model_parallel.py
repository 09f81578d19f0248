"""Model parallelism with a LayoutMap: shard a wide MLP over 2 devices.

JAX: the mesh is 4 replicas x 2 model devices (8 simulated CPU devices).
PyTorch: 2 replicas x 2 model processes (4 gloo processes through
`kd.launch`, variables as DTensors). The wide layers' kernels are split over
the "model" axis; `describe_layout` shows the bytes each device holds.
TensorFlow refuses sharded layouts.

Usage:
    python examples/model_parallel.py [--epochs 3]
    KERAS_BACKEND=torch python examples/model_parallel.py --epochs 1
"""

import argparse
import os

BACKEND = os.environ.setdefault("KERAS_BACKEND", "jax")
if BACKEND == "jax":
    os.environ.setdefault("XLA_FLAGS",
                          "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from keras.distribution import DeviceMesh  # noqa: E402
from keras.distribution import LayoutMap  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_distribute as kd  # noqa: E402


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu", name="wide_in"),
        keras.layers.Dense(64, activation="relu", name="wide_out"),
        keras.layers.Dense(10, name="head"),
    ])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def train(epochs):
    """Runs once (JAX) or in every process (torch)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    if BACKEND == "jax":
        import jax

        mesh = DeviceMesh((4, 2), ["batch", "model"], jax.devices()[:8])
    else:  # one process per device
        mesh = DeviceMesh((2, 2), ["batch", "model"],
                          [f"cpu:{i}" for i in range(4)])
    layout_map = LayoutMap(mesh)
    layout_map[".*wide_in/kernel"] = (None, "model")   # column-split
    layout_map[".*wide_in/bias"] = ("model",)
    layout_map[".*wide_out/kernel"] = ("model", None)  # row-split
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    with strategy.scope():
        model = make_model()
    if int(os.environ.get("RANK", "0")) == 0:
        strategy.describe_layout(model)
    chief = int(os.environ.get("RANK", "0")) == 0
    history = model.fit(x, y, batch_size=128, epochs=epochs,
                        verbose=2 if chief else 0)
    return (history.history["accuracy"][-1],
            strategy.num_replicas_in_sync)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    if BACKEND == "torch":
        accuracy, replicas = kd.launch(train, args=(args.epochs,),
                                       num_processes=4)[0]
    else:
        accuracy, replicas = train(args.epochs)
    print(f"final accuracy {accuracy:.4f} on {replicas} replicas x 2 "
          "model devices")


if __name__ == "__main__":
    main()
