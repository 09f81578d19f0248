"""A complete custom training loop (stateless Keras + jax.grad under `run`)
reaches the same weights as `fit`."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import make_mlp as make_model

import keras_distribute as kd

pytestmark = [
    pytest.mark.needs_strategy,
    pytest.mark.skipif(BACKEND != "jax", reason="jax.grad loop: JAX backend"),
]
GLOBAL_BATCH = 64


def test_jax_custom_loop_matches_fit(strategy):
    import jax
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = rng.integers(0, 3, size=(256,))
    reference = make_model()
    reference.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False,
                  verbose=0)

    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    def train_step(trainable, non_trainable, opt_vars, xb, yb):
        def loss_of(trainable):
            logits, _ = model.stateless_call(trainable, non_trainable, xb)
            return kd.compute_average_loss(loss_fn(yb, logits),
                                           global_batch_size=GLOBAL_BATCH)

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        grads = kd.get_replica_context().all_reduce("sum", grads)
        trainable, opt_vars = optimizer.stateless_apply(
            opt_vars, grads, trainable)
        return loss, trainable, opt_vars

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    opt_vars = [v.value for v in optimizer.variables]
    losses = []
    for _ in range(3):
        for xb, yb in dist_dataset:
            loss, trainable, opt_vars = strategy.run(
                train_step, args=(trainable, non_trainable, opt_vars, xb, yb))
            losses.append(float(strategy.reduce("sum", loss, axis=None)))
            # Every replica holds the same weights after the all-reduce.
            for value in trainable:
                parts = strategy.experimental_local_results(value)
                np.testing.assert_array_equal(parts[0], parts[-1])
            trainable = [v.values[0] for v in trainable]
            opt_vars = [v.values[0] for v in opt_vars]
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert losses[-1] < losses[0]


def test_run_is_compiled_once_per_function(strategy):
    calls = []

    def fn(x):
        calls.append(1)  # Python side effects run while tracing only
        return x * 2

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    strategy.run(fn, args=(values,))
    # The first call traces twice: once abstractly to find the Keras
    # variables `fn` touches (they become inputs), once to compile.
    assert len(calls) == 2
    for _ in range(3):
        strategy.run(fn, args=(values,))
    assert len(calls) == 2


def test_run_errors(strategy):
    with pytest.raises(ValueError, match="Expected `fn` to be callable"):
        strategy.run(3)
    with pytest.raises(ValueError, match=r"args=\(x,\)"):
        strategy.run(lambda x: x, args=np.ones(2))
    with pytest.raises(RuntimeError, match="inside `strategy.run`"):
        strategy.run(lambda: strategy.run(lambda: 1.0))
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.reduce("sum", 1.0))
    small = kd.MirroredStrategy(["CPU:0", "CPU:1"])
    values = small.experimental_distribute_values_from_function(lambda c: 1.0)
    with pytest.raises(ValueError, match="has 2 components"):
        strategy.run(lambda v: v, args=(values,))


def test_reduce_and_gather_errors(strategy):
    with pytest.raises(ValueError, match="Cannot SUM a value"):
        strategy.reduce("sum", np.float32(1.0), axis=None)
    assert float(strategy.reduce("mean", np.float32(2.0), axis=None)) == 2.0
    scalars = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(1.0))
    with pytest.raises(ValueError, match="rank >= 1"):
        strategy.gather(scalars, axis=0)
    vectors = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(2))
    with pytest.raises(ValueError, match="out of range"):
        strategy.gather(vectors, axis=3)
    with pytest.raises(ValueError, match="out of range"):
        strategy.reduce("sum", vectors, axis=2)
    uneven = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(ctx.replica_id_in_sync_group + 1))
    with pytest.raises(ValueError, match="axis=0"):
        strategy.reduce("sum", uneven, axis=None)
    assert float(strategy.reduce("sum", uneven, axis=0)) == sum(range(1, 9))
    with pytest.raises(ValueError, match="Received: reduce_op='max'"):
        strategy.reduce("max", vectors)


def test_failing_replica_in_threaded_run_raises(strategy):
    uneven = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(ctx.replica_id_in_sync_group + 1))

    def fn(x):
        ctx = kd.get_replica_context()
        if x.shape[0] == 3:
            raise KeyError("replica 2 failed")
        return ctx.all_reduce("sum", x.sum())

    with pytest.raises(KeyError, match="replica 2 failed"):
        strategy.run(fn, args=(uneven,))
