"""Keras state inside `strategy.run`: a function that calls a model sees
its current weights, metrics updated inside `run` read global values, and a
short per-replica batch runs a model call (the tf.distribute custom-training
tutorial's loop shape). Torch: test_torch_multiprocess.py (custom loop)."""

import keras
import numpy as np
import pytest

import keras_distribute as kd

pytestmark = pytest.mark.needs_strategy


def per_replica_rows(strategy, x):
    """`x` split into the strategy's replicas as a distributed dataset does
    (uneven when the rows do not divide)."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(x).batch(len(x))
    (batch,) = list(strategy.experimental_distribute_dataset(dataset))
    return batch


def local_rows(strategy, per_replica):
    return np.concatenate([keras.ops.convert_to_numpy(v) for v in
                           strategy.experimental_local_results(per_replica)])


def test_run_sees_the_current_weights(strategy):
    # Regression (JAX): the compiled run baked the weights in as constants:
    # set_weights(2 * ones) then run still gave the old 4.0.
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)),
                                  keras.layers.Dense(1, use_bias=False)])
    x = np.full((2 * strategy.num_replicas_in_sync, 2), 2.0, "float32")
    batch = per_replica_rows(strategy, x)
    seen = []
    for scale in (1.0, 2.0, 3.0):
        if scale == 3.0:
            model.layers[0].kernel.assign(np.full((2, 1), scale, "float32"))
        else:
            model.set_weights([np.full((2, 1), scale, "float32")])
        out = strategy.run(lambda b: model(b), args=(batch,))
        seen.append(float(local_rows(strategy, out)[0, 0]))
    assert seen == [4.0, 8.0, 12.0]


@pytest.mark.parametrize("rows", [16, 37])  # 37: a short, uneven batch
def test_metrics_updated_inside_run_are_global(strategy, rows):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(3, activation="tanh")])
        mean = keras.metrics.Mean()
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4)).astype("float32")
    y = rng.integers(0, 3, size=(rows,))
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(rows)

    def step(xb, yb):
        logits = model(xb)
        accuracy.update_state(yb, logits)
        mean.update_state(keras.ops.sum(logits, axis=-1))
        return logits

    for xb, yb in strategy.experimental_distribute_dataset(dataset):
        out = strategy.run(step, args=(xb, yb))
    expected = keras.ops.convert_to_numpy(model(x))
    np.testing.assert_allclose(local_rows(strategy, out), expected,
                               atol=1e-6)
    np.testing.assert_allclose(float(mean.result()), expected.sum(-1).mean(),
                               rtol=1e-5)
    np.testing.assert_allclose(float(accuracy.result()),
                               np.mean(expected.argmax(-1) == y), rtol=1e-6)


def test_metrics_updated_with_gathered_and_reduced_values(strategy):
    # Regression (#20.9, JAX): a gathered value was committed to one device
    # and a metric's variables (made in the scope) to all of them:
    # "Received incompatible devices for jitted computation".
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        mean = keras.metrics.Mean()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 4)).astype("float32")
    y = rng.integers(0, 3, size=(37,))
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    for xb, yb in strategy.experimental_distribute_dataset(dataset):
        logits = strategy.run(lambda b: model(b), args=(xb,))
        accuracy.update_state(strategy.gather(yb, axis=0),
                              strategy.gather(logits, axis=0))
        mean.update_state(strategy.reduce(
            "sum", strategy.run(lambda b: keras.ops.sum(model(b)),
                                args=(xb,)), axis=None))
    expected = keras.ops.convert_to_numpy(model(x))
    np.testing.assert_allclose(float(accuracy.result()),
                               np.mean(expected.argmax(-1) == y), rtol=1e-6)
    sums = [expected[i:i + 16].sum() for i in range(0, 37, 16)]
    np.testing.assert_allclose(float(mean.result()), np.mean(sums),
                               rtol=1e-5)


def test_metric_of_per_replica_values_as_in_tf_distribute(strategy):
    # The example: Mean over range(8) spread over the replicas.
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        mean = keras.metrics.Mean()
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(8.0).reshape(n, -1)[
            ctx.replica_id_in_sync_group])
    strategy.run(mean.update_state, args=(values,))
    assert float(mean.result()) == 3.5


def test_numpy_of_per_replica_values_tensors_and_variables(strategy):
    n = strategy.num_replicas_in_sync
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, "float32"))
    doubled = strategy.run(lambda v: v * 2, args=(values,))
    got = kd.numpy(doubled)
    assert isinstance(got, tuple) and len(got) == n
    for replica, array in enumerate(got):
        assert isinstance(array, np.ndarray)
        np.testing.assert_array_equal(array, [2.0 * replica] * 2)
    with strategy.scope():
        variable = keras.Variable(np.ones(3, "float32"))
    nested = kd.numpy({"v": variable, "t": keras.ops.ones(2), "none": None})
    assert isinstance(nested["v"], np.ndarray) and nested["none"] is None
    np.testing.assert_array_equal(nested["t"], [1.0, 1.0])
