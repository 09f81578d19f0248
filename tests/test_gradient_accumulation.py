"""Gradient accumulation and EMA under a strategy (#16), in one process:
`gradient_accumulation_steps=k`, and EMA written into the weights, train as
one device does, with a short last batch, in `fit` and (TensorFlow) in a
`strategy.run` loop (both at once: across processes). On
TensorFlow Keras' conditional update used to fail inside the replica
('merge_call called while defining a new graph'). Across processes (all
three backends): test_*_multi*.py through worker_training.py."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import make_mlp

import keras_distribute as kd

pytestmark = pytest.mark.needs_strategy


def _data(rows=100):  # batch 16: 6 full batches and a short one of 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype("float32")
    y = rng.integers(0, 3, size=(rows,))
    return x, y


def _compiled(**optimizer_options):
    model = make_mlp()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9,
                                       **optimizer_options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("options", [
    {"gradient_accumulation_steps": 3},
    {"use_ema": True, "ema_overwrite_frequency": 3, "clipnorm": 0.5},
], ids=["accumulation", "ema_overwrite_clip"])
def test_fit_equals_one_device(strategy, options):
    x, y = _data()
    with strategy.scope():
        model = _compiled(**options)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                        verbose=0).history
    reference = _compiled(**options)
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                             verbose=0).history
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)
    # 14 batches, one update per `gradient_accumulation_steps` of them.
    assert int(model.optimizer.iterations) == int(
        reference.optimizer.iterations)
    if "gradient_accumulation_steps" in options:
        steps = options["gradient_accumulation_steps"]
        assert int(model.optimizer.iterations) == 14 // steps
        # Accumulators hold the same partial sum as one device's.
        for a, b in zip(model.optimizer._accumulated_gradients,
                        reference.optimizer._accumulated_gradients):
            np.testing.assert_allclose(keras.ops.convert_to_numpy(a),
                                       keras.ops.convert_to_numpy(b),
                                       atol=2e-6)


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="GradientTape loop: TensorFlow backend")
def test_accumulating_optimizer_in_a_strategy_run_loop(strategy):
    import tensorflow as tf

    x, y = _data()
    reference = _compiled(gradient_accumulation_steps=2)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    with strategy.scope():
        model = make_mlp()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9,
                                         gradient_accumulation_steps=2)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)

    def train_step(inputs, global_batch):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            loss = kd.compute_average_loss(
                loss_fn(yb, model(xb, training=True)),
                global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def distributed_step(inputs, global_batch):
        strategy.run(train_step, args=(inputs, global_batch))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    for start, inputs in zip(range(0, 100, 16),
                             strategy.experimental_distribute_dataset(dataset)):
        distributed_step(inputs, tf.constant(min(16, 100 - start)))
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    assert int(optimizer.iterations) == 3
