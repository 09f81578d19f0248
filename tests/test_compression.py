"""Compressed gradient all-reduce (#16): `kd.CommunicationOptions(
compression="fp16"|"bf16")`. JAX (8 replicas) and TensorFlow (4) in one
process here; torch across 2 processes in test_torch_multiprocess.py, JAX
across 2 in test_jax_multiprocess.py."""

import re

import numpy as np
import pytest
from conftest import BACKEND

import keras_distribute as kd


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


JAX_ONLY = pytest.mark.skipif(
    BACKEND != "jax", reason="JAX's compressed step (backend/jax_compression)")


@JAX_ONLY
def test_jax_refuses_compression_with_a_layout_map():
    import keras

    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    with pytest.raises(ValueError, match="compression='fp16' with a "
                       "layout_map.*compression=None"):
        kd.MirroredStrategy(
            layout_map=layout_map, communication_options=kd.
            CommunicationOptions(compression="fp16"))


@JAX_ONLY
def test_jax_compressed_step_compiles_to_a_16_bit_all_reduce():
    # The bytes on the wire: the all-reduces XLA compiled for one step.
    # fp16 stays 16-bit on CPU; XLA's CPU compiler widens a bf16 all-reduce
    # to f32 (GPUs and TPUs reduce bf16 natively), so bf16 is checked
    # before compilation.
    import jax
    import jax.numpy as jnp
    import keras
    from conftest import make_mlp

    from keras_distribute.backend.jax import compression as jax_compression

    def all_reduces(compression, compiled):
        strategy = kd.MirroredStrategy(
            communication_options=kd.CommunicationOptions(
                compression=compression))
        with strategy.scope():
            model = make_mlp()
            model.compile(optimizer="sgd", loss=keras.losses.
                          SparseCategoricalCrossentropy(from_logits=True))
            model.optimizer.build(model.trainable_variables)
        engine = strategy.engine
        x = jax.device_put(np.ones((16, 16), "float32"),
                           engine.distribution.get_data_layout(
                               (16, 16)).backend_layout)
        y = jax.device_put(np.zeros((16,), "int32"),
                           engine.distribution.get_data_layout(
                               (16,)).backend_layout)
        state = [[v.value for v in variables] for variables in (
            model.trainable_variables, model.non_trainable_variables,
            model.metrics_variables, model.optimizer.variables)]

        def step(trainable, non_trainable, metrics, optimizer_variables, x,
                 y):
            return jax.value_and_grad(
                model.compute_loss_and_updates, has_aux=True)(
                trainable, non_trainable, metrics, x, y, None,
                training=True, optimizer_variables=optimizer_variables)

        with strategy.scope(), jax_compression.compressing(
                model, engine, engine.gradient_compression or jnp.float32):
            lowered = jax.jit(step).lower(*state, x, y)
        if not compiled:
            return lowered.as_text()
        return [line for line in lowered.compile().as_text().splitlines()
                if "all-reduce(" in line]

    fp16 = all_reduces("fp16", compiled=True)
    assert any("f16[16,32]" in line for line in fp16), fp16
    assert not any("f32[16,32]" in line for line in fp16), fp16
    assert any("f32[16,32]" in line for line in all_reduces(None, True))
    bf16 = all_reduces("bf16", compiled=False)
    assert re.search(r"stablehlo.all_reduce.*?\}\) : \(tensor<16x32xbf16>\)",
                     bf16, re.DOTALL), bf16


def _fit_under(compression, kind, x, y):
    import contextlib

    import keras

    strategy = None if compression == "one device" else kd.MirroredStrategy(
        communication_options=kd.CommunicationOptions(
            compression=compression))
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="tanh")(inputs)
        if kind == "batch norm":
            hidden = keras.layers.BatchNormalization()(hidden)
        outputs = [keras.layers.Dense(3, kernel_regularizer="l2",
                                      name="classes")(hidden)]
        losses = [keras.losses.SparseCategoricalCrossentropy(
            from_logits=True)]
        targets = [y]
        if kind == "two outputs":
            outputs.append(keras.layers.Dense(1, name="value")(hidden))
            losses.append("mse")
            targets.append(y.astype("float32"))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(
            0.1, gradient_accumulation_steps=2 if kind == "accumulation"
            else None), loss=losses, metrics=[["accuracy"]] + [[]] * (
                len(outputs) - 1))
    sample_weight = np.linspace(0.5, 1.5, len(x)).astype("float32") if (
        kind == "sample weights") else None
    # 100 rows in batches of 16: the last batch (4) does not divide by the
    # 8 replicas and runs whole on every device, uncompressed.
    history = model.fit(x, targets, sample_weight=sample_weight,
                        batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), history.history


@JAX_ONLY
@pytest.mark.parametrize("kind", ["dense", "sample weights", "accumulation",
                                  "two outputs"])
def test_jax_compressed_fit_matches_one_device(kind, rng):
    x = rng.normal(size=(100, 16)).astype("float32")
    y = rng.integers(0, 3, size=(100,))
    weights, history = _fit_under("one device", kind, x, y)
    for compression in ("fp16", "bf16"):
        compressed, logs = _fit_under(compression, kind, x, y)
        for a, b in zip(compressed, weights):
            np.testing.assert_allclose(a, b, atol=1e-3)
        # Global logs: the per-output loss trackers add every replica's
        # share, as the uncompressed step does.
        assert logs.keys() == history.keys()
        for key in history:
            np.testing.assert_allclose(logs[key], history[key], rtol=1e-3)


@JAX_ONLY
def test_jax_compression_keeps_global_batch_statistics(rng):
    # BatchNormalization: per replica, a compressed step would normalise by
    # each slice's statistics; JAX's own step uses the global batch's. It
    # trains uncompressed (warned), equal to one device.
    x = rng.normal(size=(100, 16)).astype("float32")
    y = rng.integers(0, 3, size=(100,))
    weights, _ = _fit_under("one device", "batch norm", x, y)
    with pytest.warns(UserWarning, match="not applied.*batch statistics"):
        compressed, _ = _fit_under("fp16", "batch norm", x, y)
    for a, b in zip(compressed, weights):
        np.testing.assert_allclose(a, b, atol=1e-5)


@JAX_ONLY
def test_jax_compression_leaves_a_custom_train_step_alone(rng):
    import keras

    class Custom(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    strategy = kd.MirroredStrategy(communication_options=kd.
                                   CommunicationOptions(compression="bf16"))
    with strategy.scope():
        model = Custom([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="overrides `train_step`"):
        model.fit(rng.normal(size=(16, 4)), rng.normal(size=(16, 2)),
                  batch_size=8, verbose=0)
    assert _traced_reductions(strategy) is None


def _traced_reductions(strategy):
    """`[(dtype, bytes)]` the last traced step handed to the gradient
    all-reduce, or None where the engine's own all-reduce ran."""
    return list(strategy.engine.traced_gradient_reductions) or None


@pytest.mark.needs_strategy
def test_all_reduces_half_the_bytes_and_keeps_accuracy():
    # JAX (8 replicas) and TensorFlow (4): the digits demo's MLP, whose
    # steps hand every gradient to the all-reduce in 16 bits.
    from worker_training import digits_fit

    results = {}
    for compression in (None, "fp16", "bf16"):
        strategy = kd.MirroredStrategy(
            communication_options=kd.CommunicationOptions(
                compression=compression))
        assert strategy.communication_options.compression == compression
        accuracy, model, params = digits_fit(strategy, epochs=4)
        results[compression] = (accuracy, model.get_weights(),
                                _traced_reductions(strategy))
    assert results[None][2] is None  # the engine's own all-reduce
    for compression, dtype in (("fp16", "float16"), ("bf16", "bfloat16")):
        accuracy, weights, reduced = results[compression]
        # 2 bytes per parameter (4 uncompressed).
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
        reduced = strategy.engine.traced_gradient_reductions
        if compression:
            assert {name for name, _ in reduced} == {"float16"}
            assert sum(size for _, size in reduced) == 2 * model.count_params()
    for a, b in zip(weights["fp16"], weights[None]):
        np.testing.assert_allclose(a, b, atol=5e-3)
