"""Mixed precision under a strategy (#16): `mixed_bfloat16` and
`mixed_float16` (+ the loss scale) train as one device does, variables stay
float32 and round-trip through a sharded checkpoint, and a non-finite
gradient on one replica skips the step on every replica. Torch (one replica
per process): test_torch_multiprocess.py."""

import keras
import numpy as np
import pytest

import keras_distribute as kd

pytestmark = pytest.mark.needs_strategy

# bfloat16 keeps 8 bits of mantissa: a different summation order (8 replicas
# against one device) moves results by a few units of its last place.
TOLERANCE = {"mixed_bfloat16": 5e-2, "mixed_float16": 5e-3}


@pytest.fixture
def policy(request):
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(request.param)
    yield request.param
    keras.mixed_precision.set_dtype_policy(previous)


def _data(rows=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype("float32")
    y = rng.integers(0, 3, size=(rows,))
    return x, y


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(3),
        keras.layers.Activation("linear", dtype="float32"),  # float32 logits
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def _strategy(compression):
    return kd.MirroredStrategy(communication_options=kd.CommunicationOptions(
        compression=compression))


@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"],
                         indirect=True)
def test_fit_equals_one_device_and_variables_stay_float32(policy, compression,
                                                          tmp_path):
    # Also with the gradients all-reduced in fp16 (the loss scale's
    # gradients, in mixed_float16).
    strategy = _strategy(compression)
    x, y = _data()
    with strategy.scope():
        model = _model()
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                        verbose=0).history
    reference = _model()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                             verbose=0).history
    assert model.layers[0].compute_dtype == policy.split("_")[1]
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOLERANCE[policy])
    np.testing.assert_allclose(history["loss"], expected["loss"],
                               rtol=TOLERANCE[policy])
    # float32 variables round-trip bit-exactly through a sharded checkpoint.
    path = kd.checkpoint.ShardedCheckpoint(model=model).write(
        str(tmp_path / "ckpt"))
    with strategy.scope():
        restored = _model()
    kd.checkpoint.ShardedCheckpoint(model=restored).read(path)
    for a, b in zip(restored.get_weights(), model.get_weights()):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("compression", [None, "fp16"])
@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_a_non_finite_gradient_on_one_replica_skips_the_step_everywhere(
        policy, compression):
    strategy = _strategy(compression)
    x, y = _data(rows=32)
    with strategy.scope():
        model = _model()
    model.train_on_batch(x, y)  # builds the optimizer (a LossScaleOptimizer)
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
    before = model.get_weights()
    poisoned = x.copy()
    poisoned[0, 0] = np.inf  # only the first replica's slice
    model.train_on_batch(poisoned, y)
    for a, b in zip(model.get_weights(), before):  # the step was skipped
        np.testing.assert_array_equal(a, b)
    assert float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) == (
        scale / 2)
    # Every replica holds the same weights and loss scale.
    for variable in model.weights + [optimizer.dynamic_scale]:
        local = kd.numpy(strategy.experimental_local_results(variable))
        for value in local[1:]:
            np.testing.assert_array_equal(value, local[0])
