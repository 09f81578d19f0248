"""Compressed gradient all-reduce (#16): `kd.CommunicationOptions(
compression="fp16"|"bf16")`. TensorFlow in one process (4 replicas) here;
torch across 2 processes in test_torch_multiprocess.py; JAX refuses it."""

import numpy as np
import pytest

import keras_distribute as kd
from conftest import BACKEND


def test_compression_names_are_checked():
    assert kd.CommunicationOptions(compression="float16").compression == (
        "fp16")
    assert kd.CommunicationOptions(compression="BF16").compression == "bf16"
    assert kd.CommunicationOptions().compression is None
    for bad in ("int8", 16, ""):
        with pytest.raises(ValueError, match="Expected `compression` to be "
                           "None, 'fp16' or 'bf16'"):
            kd.CommunicationOptions(compression=bad)
    with pytest.raises(ValueError, match="Expected `communication_options` "
                       "to be a `kd.CommunicationOptions`"):
        kd.MirroredStrategy(communication_options={"compression": "fp16"})


@pytest.mark.skipif(BACKEND != "jax", reason="JAX refuses compression")
def test_jax_refuses_compression_with_the_alternative():
    with pytest.raises(ValueError, match="compression='fp16'.*mixed "
                       "precision"):
        kd.MirroredStrategy(communication_options=kd.CommunicationOptions(
            compression="fp16"))


@pytest.mark.needs_strategy
@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="in-process replicas: TensorFlow (torch: across "
                    "processes; JAX refuses)")
def test_tf_all_reduces_half_the_bytes_and_keeps_accuracy():
    from keras_distribute.backend import tf_fit
    from worker_training import digits_fit

    results = {}
    for compression in (None, "fp16", "bf16"):
        strategy = kd.MirroredStrategy(
            communication_options=kd.CommunicationOptions(
                compression=compression))
        assert strategy.communication_options.compression == compression
        accuracy, model, params = digits_fit(strategy, epochs=4)
        reduced = tf_fit.traced_gradient_reductions.get(
            strategy._engine.tf_strategy)
        results[compression] = accuracy, model.get_weights(), reduced
    assert results[None][2] is None  # Keras' own all-reduce, untouched
    for compression, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        accuracy, weights, reduced = results[compression]
        # What one step hands to the all-reduce: every gradient, 2 bytes
        # per parameter (4 uncompressed).
        assert {name for name, _ in reduced} == {dtype}
        assert sum(size for _, size in reduced) == 2 * params
        assert abs(accuracy - results[None][0]) <= 0.005
        assert all(np.all(np.isfinite(w)) for w in weights)


@pytest.mark.needs_strategy
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's accumulation path")
def test_tf_compression_with_gradient_accumulation():
    # The accumulation path reduces in cross-replica context: the 16-bit
    # cast happens in the replica, before it.
    import keras

    from conftest import make_mlp
    from keras_distribute.backend import tf_fit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 3, size=(64,))
    weights = {}
    for compression in (None, "fp16"):
        strategy = kd.MirroredStrategy(
            communication_options=kd.CommunicationOptions(
                compression=compression))
        with strategy.scope():
            model = make_mlp()
            model.compile(optimizer=keras.optimizers.SGD(
                0.1, gradient_accumulation_steps=2), loss=keras.losses.
                SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights[compression] = model.get_weights()
        reduced = tf_fit.traced_gradient_reductions.get(
            strategy._engine.tf_strategy)
        if compression:
            assert {name for name, _ in reduced} == {"float16"}
            assert sum(size for _, size in reduced) == 2 * model.count_params()
    for a, b in zip(weights["fp16"], weights[None]):
        np.testing.assert_allclose(a, b, atol=5e-3)
