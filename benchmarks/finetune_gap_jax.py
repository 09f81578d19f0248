"""Where the transfer-learning program's 8-device result leaves one device's.

keras-io's "Transfer learning & fine-tuning" shape (a SeparableConv2D +
MaxPooling + BatchNormalization base, frozen, then unfrozen and recompiled
with Adam(1e-2)) on 8 simulated JAX devices under kd, under Keras' own
`keras.distribution.DataParallel`, and on one device: the largest weight
difference after the frozen phase and after fine-tuning steps, in float32
or float64. Findings in docs/testing.md ("Parity with one device, and where
it ends").

    python benchmarks/finetune_gap_jax.py [float32|float64]
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
DTYPE = sys.argv[1] if len(sys.argv) > 1 else "float32"
if DTYPE == "float64":
    os.environ["JAX_ENABLE_X64"] = "1"

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_distribute as kd  # noqa: E402

STEPS = 64


def build():
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.SeparableConv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.SeparableConv2D(8, 3, activation="relu")(x)
    base = keras.Model(inputs, x)
    outer = keras.Input((16, 16, 3))
    y = keras.layers.GlobalAveragePooling2D()(base(outer, training=False))
    return base, keras.Model(outer, keras.layers.Dense(1)(y))


class KerasDataParallel:
    """Keras' own DataParallel, entered like a strategy."""

    def __init__(self):
        self.distribution = keras.distribution.DataParallel()

    def scope(self):
        return self.distribution.scope()


def train(strategy, initial, x, y):
    """The frozen phase, then STEPS fine-tuning steps: the weights after
    the frozen phase and after each step."""
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    with strategy.scope():
        base, model = build()
        model.set_weights(initial)
        base.trainable = False
        model.compile(optimizer=keras.optimizers.Adam(), loss=loss)
        for start in range(0, len(x), 32):
            model.train_on_batch(x[start:start + 32], y[start:start + 32])
    frozen = model.get_weights()
    base.trainable = True
    steps = []
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
        for step in range(STEPS):
            start = (step * 32) % len(x)
            model.train_on_batch(x[start:start + 32], y[start:start + 32])
            steps.append(model.get_weights())
    return frozen, steps


def gap(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


def main():
    keras.config.set_floatx(DTYPE)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16, 16, 3)).astype(DTYPE)
    y = (x.mean(axis=(1, 2, 3)) > 0).astype(DTYPE)[:, None]
    keras.utils.set_random_seed(0)
    initial = build()[1].get_weights()
    one_frozen, one = train(kd.get_strategy(), initial, x, y)
    kd_frozen, ours = train(kd.MirroredStrategy(), initial, x, y)
    keras_frozen, keras_dp = train(KerasDataParallel(), initial, x, y)
    print(f"{DTYPE}: kd vs Keras' DataParallel (8 devices): frozen "
          f"{gap(kd_frozen, keras_frozen):.3g}, after {STEPS} steps "
          f"{gap(ours[-1], keras_dp[-1]):.3g}")
    print(f"{DTYPE}: 8 devices vs one, frozen phase: "
          f"{gap(kd_frozen, one_frozen):.3g}")
    for step in (1, 2, 4, 8, 16, 32, 40, 48, 56, 64):
        print(f"{DTYPE}: 8 devices vs one, fine-tuning step {step}: "
              f"{gap(ours[step - 1], one[step - 1]):.3g}")


if __name__ == "__main__":
    main()
