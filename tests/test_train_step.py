"""`kd.train_step`: one custom-loop step for every backend (the tutorials'
GradientTape step, rewritten once) reaches the weights `fit` reaches."""

import keras
import numpy as np
import pytest
from conftest import make_mlp as make_model

import keras_distribute as kd

GLOBAL_BATCH = 32


def data(n=96):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 16)).astype("float32"),
            rng.integers(0, 3, size=(n,)))


def fit_reference(x, y, epochs=2):
    model = make_model()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs,
                        shuffle=False, verbose=0)
    return model, history.history


def custom_loop(strategy, x, y, epochs=2):
    import tensorflow as tf

    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    def step(inputs):
        xb, yb = inputs
        return kd.train_step(model, optimizer, loss_fn, xb, yb,
                             global_batch_size=GLOBAL_BATCH,
                             metrics=[accuracy])

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    accuracies, losses = [], []
    for _ in range(epochs):
        for batch in dataset:
            losses.append(float(strategy.reduce(
                "sum", strategy.run(step, args=(batch,)), axis=None)))
        accuracies.append(float(accuracy.result()))
        accuracy.reset_state()
    return model, accuracies, losses


@pytest.mark.needs_strategy
def test_train_step_under_a_strategy_matches_fit(strategy):
    x, y = data()
    reference, history = fit_reference(x, y)
    model, accuracies, losses = custom_loop(strategy, x, y)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(accuracies, history["accuracy"], rtol=1e-6)
    assert np.isfinite(losses).all()


def test_train_step_without_a_strategy_matches_fit():
    # The default strategy: the same code on one device, every backend.
    x, y = data()
    reference, history = fit_reference(x, y)
    model, accuracies, _ = custom_loop(kd.get_strategy(), x, y)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(accuracies, history["accuracy"], rtol=1e-6)


def test_train_step_needs_per_example_losses():
    model = make_model()
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    x, y = data(8)
    with pytest.raises(ValueError, match="rank >= 1.*reduction=None"):
        kd.train_step(model, optimizer,
                      keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), x, y)


@pytest.mark.needs_strategy
def test_train_step_all_reduces_in_the_strategys_compression():
    # #16: `kd.train_step` under CommunicationOptions(compression="fp16")
    # sums the gradients in 16 bits (JAX: inside `run`; TF: the optimizer's
    # all-reduce) and still reaches fit's weights, to fp16's precision
    # (Adam divides by sqrt(v), so small gradients carry its rounding).
    x, y = data()
    reference, history = fit_reference(x, y)
    strategy = kd.MirroredStrategy(communication_options=kd.
                                   CommunicationOptions(compression="fp16"))
    model, accuracies, _ = custom_loop(strategy, x, y)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-2)  # Adam: 1/sqrt(v)
    np.testing.assert_allclose(accuracies, history["accuracy"], atol=0.02)
    reduced = strategy.engine.traced_gradient_reductions
    assert {dtype for dtype, _ in reduced} == {"float16"}
    assert sum(size for _, size in reduced) == 2 * model.count_params()
