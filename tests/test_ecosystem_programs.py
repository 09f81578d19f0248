"""Programs other people wrote, ported by the import change (issue #30):
keras-io's "Distributed training with Keras 3" guide
(guides/distribution.py)."""

import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_distribute as kd

# The guide's model, its fake dataset and its calls, as written there
# (keras.distribution.set_distribution(...) -> kd.MirroredStrategy(...)).


def _guide_model():
    from keras import layers

    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu",
                     name="d1")(y)
    y = layers.Dropout(0.4)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    return keras.Model(inputs=inputs, outputs=y)


def _guide_dataset():
    from tensorflow import data as tf_data

    images = np.random.normal(size=(8 * 16, 28, 28, 1))
    labels = np.random.normal(size=(8 * 16, 10))
    return tf_data.Dataset.from_tensor_slices((images, labels)).batch(16)


@pytest.mark.skipif(BACKEND != "jax", reason="the guide runs on JAX's 8 "
                    "simulated devices (its 2 x 4 mesh)")
def test_keras_io_distribution_guide_model_parallel_as_written():
    """Its layout map names `d1/bias` of a `use_bias=False` layer (Keras
    ignores it; kd raised) and lays out `d2/output`, a layer's output. kd
    follows Keras: a warning names the bias key, none names the output."""
    import jax

    keras.utils.set_random_seed(1)
    devices = jax.devices("cpu")
    mesh_2d = keras.distribution.DeviceMesh(
        shape=(2, 4), axis_names=["data", "model"], devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh_2d)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/output"] = ("data", None)
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    dataset = _guide_dataset()
    with strategy.scope():
        model = _guide_model()
    initial = model.get_weights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(loss="mse")
        history = model.fit(dataset, epochs=3, verbose=0)
        loss = model.evaluate(dataset, verbose=0)
    unmatched = [str(w.message) for w in caught
                 if "matches none of the variables" in str(w.message)]
    assert len(unmatched) == 1 and "'d1/bias'" in unmatched[0]
    assert tuple(model.get_layer("d1").kernel.value.sharding.spec) == (
        None, "model")
    # The guide's own program, under Keras' ModelParallel: the same numbers.
    keras.utils.set_random_seed(1)
    with keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="data").scope():
        reference = _guide_model()
        reference.set_weights(initial)
        reference.compile(loss="mse")
        expected = reference.fit(dataset, epochs=3, verbose=0)
        expected_loss = reference.evaluate(dataset, verbose=0)
    np.testing.assert_allclose(history.history["loss"],
                               expected.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


@pytest.mark.skipif(BACKEND == "torch", reason="torch: one replica per "
                    "process, tuned across 2 processes in "
                    "test_torch_multiprocess.py")
def test_keras_tuner_distribution_strategy(tmp_path):
    """keras-tuner's `distribution_strategy=` takes a kd strategy: each
    trial's model is built in its scope and trained over the replicas."""
    from worker_common import keras_tuner_search

    strategy = kd.MirroredStrategy()
    result = keras_tuner_search(strategy, str(tmp_path))
    # Every trial trained (a failed trial is only logged by keras-tuner),
    # and the best model, built again outside the scope, evaluates.
    assert result["trials"] == result["completed"] == 2
    assert set(result["best"]) == {"units", "dropout", "learning_rate"}
    assert np.isfinite(result["evaluate"])


def _hub_classifier():
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=8, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def test_keras_hub_task_model_in_a_strategy_scope_matches_one_device():
    """A keras-hub task model (BertTextClassifier over a small BertBackbone,
    fed token ids) built in a kd strategy's scope trains to the weights of
    the same program without a strategy."""
    try:
        import keras_hub

        keras_hub.models.BertTextClassifier  # (its modules load lazily)
    except ImportError as error:  # keras-hub 0.32 predates Keras 3.16
        pytest.skip(f"keras-hub does not import with Keras "
                    f"{keras.__version__}: {error}")
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 50, (32, 8)),
         "segment_ids": np.zeros((32, 8), "int32"),
         "padding_mask": np.ones((32, 8), bool)}
    y = rng.integers(0, 2, (32,))
    keras.utils.set_random_seed(1)
    reference = _hub_classifier()
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                             verbose=0)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = _hub_classifier()
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0)
    np.testing.assert_allclose(history.history["loss"],
                               expected.history["loss"], rtol=1e-4)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA SPMD on 8 simulated JAX "
                    "devices, against Keras' own DataParallel")
def test_fine_tuning_equals_keras_data_parallel_bit_for_bit():
    """#42 item 7: the transfer-learning program's 8-device run leaves the
    one-device run after ~30 fine-tuning steps (docs/testing.md, "Parity
    with one device"). kd runs the program Keras' own DataParallel runs,
    bit for bit; the first steps are within rounding of one device."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / (
        "finetune_gap_jax.py")
    spec = importlib.util.spec_from_file_location("finetune_gap_jax", path)
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    program.STEPS = 6
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16, 16, 3)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("float32")[:, None]
    keras.utils.set_random_seed(0)
    initial = program.build()[1].get_weights()
    one_frozen, one = program.train(kd.get_strategy(), initial, x, y)
    kd_frozen, ours = program.train(kd.MirroredStrategy(), initial, x, y)
    keras_frozen, theirs = program.train(program.KerasDataParallel(),
                                         initial, x, y)
    assert program.gap(kd_frozen, keras_frozen) == 0.0
    assert all(program.gap(a, b) == 0.0 for a, b in zip(ours, theirs))
    assert program.gap(kd_frozen, one_frozen) < 1e-6
    assert program.gap(ours[-1], one[-1]) < 1e-5
