"""Keras `fit` / `evaluate` / `predict` under a strategy: same numbers as one
device, global batch, short last batch, model remembers its strategy."""

import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import NUM_DEVICES
from conftest import cpu_names

import keras_distribute as kd

pytestmark = pytest.mark.needs_strategy
BATCH = 32
# Rows whose last batch has fewer rows than there are replicas: 2 (1 where
# there are 2 replicas: KD_TEST_TF_DEVICES=2).
FEWER_ROWS_THAN_REPLICAS = BATCH + min(2, NUM_DEVICES - 1)


def make_data(n=203, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = rng.integers(0, 3, size=(n,))
    return x, y


def make_model(build=True):
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(3)]
    model = keras.Sequential(([keras.Input((16,))] if build else []) + layers)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def assert_same_weights(a, b, atol=1e-5):
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, atol=atol)


def test_fit_equals_single_device_with_short_last_batch(strategy):
    # 203 samples, batch 32 on 8 replicas: the last batch has 11 rows.
    x, y = make_data()
    reference = make_model()
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=3,
                                shuffle=False, verbose=0)
    with strategy.scope():
        model = make_model()
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                        verbose=0)
    assert_same_weights(reference, model)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key],
                                   ref_history.history[key], rtol=1e-5)
    results = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(
        results, reference.evaluate(x, y, batch_size=BATCH, verbose=0),
        rtol=1e-5)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    assert predictions.shape == (203, 3)
    np.testing.assert_allclose(
        predictions, reference.predict(x, batch_size=BATCH, verbose=0),
        atol=1e-5)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="JAX's optimizers "
                    "update global arrays; torch's in processes: "
                    "test_torch_multiprocess.py")
def test_every_keras_optimizer_trains_like_one_device(strategy):
    # Keras' TF optimizer clips each replica's part of the gradient before
    # its all-reduce (clipvalue, clipnorm, global_clipnorm): under kd the
    # clip sees the sum, as on one device (and as Keras 2 optimizers did).
    from worker_common import every_optimizer_fit

    reference = every_optimizer_fit(kd.MirroredStrategy(devices=["cpu:0"]))
    replicated = every_optimizer_fit(strategy)
    for name, weights in reference.items():
        for a, b in zip(replicated[name], weights):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's replicas hold a "
                    "copy each; JAX's SPMD step and torch's one replica "
                    "per process hold one")
def test_batch_statistics_are_one_state_on_every_replica(strategy):
    # Each replica's BatchNormalization updates its own copy of the moving
    # statistics from its slice; when fit returns (and at every epoch end,
    # before evaluate and predict) every copy holds the first's, so predict
    # answers alike whatever the batch size and equals the saved state.
    x, y = make_data()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((16,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(), keras.layers.Dense(3)])
        model.compile(optimizer="adam", loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    for variable in model.layers[1].non_trainable_variables:
        copies = [np.asarray(c) for c in variable.value.values]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(
        model.predict(x, batch_size=200, verbose=0), predicted, atol=1e-6)
    plain = keras.models.clone_model(model)
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(plain.predict(x, batch_size=BATCH, verbose=0),
                               predicted, atol=1e-6)


def test_variables_are_replicated_on_every_device(strategy):
    with strategy.scope():
        model = make_model()
    kernel = model.layers[0].kernel
    copies = strategy.experimental_local_results(kernel)
    assert len(copies) == NUM_DEVICES
    for copy in copies[1:]:
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(copies[0]))


@pytest.mark.skipif(BACKEND != "jax", reason="inspects Keras' JAX trainer")
def test_global_batch_is_split_across_replicas(strategy, monkeypatch):
    from keras.src.backend.jax import trainer as jax_trainer

    seen = []
    hooked = jax_trainer._distribute_data

    def spy(data, layouts=None, *args, **kwargs):  # 3.16: is_super_batch
        result = hooked(data, layouts, *args, **kwargs)
        seen.append(keras.tree.flatten(result)[0])
        return result

    monkeypatch.setattr(jax_trainer, "_distribute_data", spy)
    x, y = make_data(n=40)
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    full, short = seen[0], seen[-1]
    assert full.shape == (32, 16)
    assert {s.data.shape for s in full.addressable_shards} == {(4, 16)}
    assert short.shape == (8, 16)
    assert len(full.sharding.device_set) == NUM_DEVICES


def test_fit_outside_scope_still_distributes(strategy):
    x, y = make_data(n=64)
    with strategy.scope():
        model = make_model()
    from keras_distribute.common import context

    assert context.model_strategy(model) is strategy
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # outside scope
    kernel = model.layers[0].kernel
    assert strategy.extended.variable_created_in_scope(kernel)
    assert len(strategy.experimental_local_results(kernel)) == NUM_DEVICES
    reference = make_model()
    reference.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert_same_weights(reference, model)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX relays stray variables out")
def test_lazily_built_model_and_optimizer_from_outside(strategy):
    x, y = make_data(n=64)
    optimizer = keras.optimizers.SGD(0.1)  # created outside the scope
    with strategy.scope():
        model = make_model(build=False)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, np.eye(3)[y], batch_size=BATCH, verbose=0)
    for variable in model.variables + optimizer.variables:
        assert strategy.extended.variable_created_in_scope(variable), (
            variable.path)


def test_model_created_outside_scope_then_fit_inside_is_an_error(strategy):
    x, y = make_data(n=32)
    model = make_model()
    with pytest.raises(ValueError, match="created outside any strategy scope"):
        with strategy.scope():
            model.fit(x, y, verbose=0)


def test_mixing_strategies_is_an_error(strategy):
    other = kd.MirroredStrategy(cpu_names(2))
    with strategy.scope():
        model = make_model()
    with pytest.raises(ValueError, match="Mixing strategies"):
        with other.scope():
            model.fit(*make_data(n=32), verbose=0)
    with pytest.raises(ValueError, match="Mixing different strategies"):
        with strategy.scope(), other.scope():
            pass


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF cannot mirror later")
def test_optimizer_created_outside_scope_is_an_error_on_tf(strategy):
    x, y = make_data(n=64)
    optimizer = keras.optimizers.SGD(0.1)
    with strategy.scope():
        model = make_model()
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="outside the strategy's scope"):
        model.fit(x, np.eye(3)[y], batch_size=BATCH, verbose=0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's input iterators")
@pytest.mark.parametrize("build", [True, False], ids=["built", "unbuilt"])
def test_the_symbolic_build_reads_no_batch_and_the_numbers_hold(
        strategy, monkeypatch, build):
    """Keras' TF trainer peeks at a batch to build the model, once per
    `fit` and per evaluation, and drops that iterator at once, while
    TensorFlow's MultiDeviceIterator still prefetches: under load that
    crashed the process (a segfault in CI, in `EpochIterator.reset`). Under
    a kd strategy the build reads shapes from the dataset's spec: no
    iterator is made for it, and the numbers stay those of one device."""
    import traceback

    from tensorflow.python.distribute import input_lib

    made_by = []
    original = input_lib.DistributedDataset.__iter__

    def recording(self):
        made_by.append([frame.name for frame in traceback.extract_stack()])
        return original(self)

    monkeypatch.setattr(input_lib.DistributedDataset, "__iter__", recording)
    x, y = make_data(n=200)
    with strategy.scope():
        model = make_model(build=build)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0,
                        validation_data=(x[:70], y[:70]))
    result = model.evaluate(x[:70], y[:70], batch_size=BATCH, verbose=0)
    assert made_by, "fit made no distributed iterator: the check saw nothing"
    assert not [names for names in made_by
                if "_maybe_symbolic_build" in names]
    plain = make_model(build=build)
    plain_history = plain.fit(x, y, batch_size=BATCH, epochs=3, verbose=0,
                              validation_data=(x[:70], y[:70]))
    assert_same_weights(model, plain)
    np.testing.assert_allclose(history.history["val_loss"],
                               plain_history.history["val_loss"], rtol=1e-5)
    np.testing.assert_allclose(
        result, plain.evaluate(x[:70], y[:70], batch_size=BATCH, verbose=0),
        rtol=1e-5)


def test_fit_failure_leaves_model_usable(strategy):
    x, y = make_data(n=64)
    with strategy.scope():
        model = make_model()

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    before = model.get_weights()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=BATCH, callbacks=[Boom()], verbose=0)
    assert all(v.value is not None for v in model.variables)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert not np.allclose(model.get_weights()[0], before[0])


def test_train_and_predict_on_batch_with_odd_batch(strategy):
    x, y = make_data(n=13)
    reference = make_model()
    with strategy.scope():
        model = make_model()
    np.testing.assert_allclose(model.train_on_batch(x, y),
                               reference.train_on_batch(x, y), rtol=1e-5)
    np.testing.assert_allclose(model.predict_on_batch(x),
                               reference.predict_on_batch(x), atol=1e-5)
    np.testing.assert_allclose(model.test_on_batch(x, y),
                               reference.test_on_batch(x, y), rtol=1e-5)


def test_fit_on_tf_data_with_validation(strategy):
    import tensorflow as tf

    x, y = make_data(n=100)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    reference = make_model()
    ref = reference.fit(train, validation_data=train, epochs=2, verbose=0)
    with strategy.scope():
        model = make_model()
    hist = model.fit(train, validation_data=train, epochs=2, verbose=0)
    np.testing.assert_allclose(hist.history["val_loss"],
                               ref.history["val_loss"], rtol=1e-5)
    assert_same_weights(reference, model)


def test_model_save_and_load_round_trip(strategy, tmp_path):
    with strategy.scope():
        model = make_model()
    model.fit(*make_data(n=64), batch_size=BATCH, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "compile() was not called"
        restored = keras.models.load_model(path)
    assert restored.compiled
    for a, b in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_hooks_uninstall_restores_keras():
    from keras_distribute.integration import registry

    kd.MirroredStrategy(cpu_names(1))
    assert hasattr(keras.Model.fit, "_kd_original")
    kd.integration.uninstall()
    try:
        assert not hasattr(keras.Model.fit, "_kd_original")
        assert not hasattr(keras.Model.compile, "_kd_original")
        assert not hasattr(registry.resolve("BaseTrainer").__init__,
                           "__wrapped__")
    finally:
        kd.integration.install()


@pytest.mark.skipif(BACKEND != "tensorflow", reason="per-replica BN: TF")
def test_warns_when_replicas_get_empty_batches_with_unsynced_batchnorm(
        strategy):
    x, y = make_data(n=FEWER_ROWS_THAN_REPLICAS)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)), keras.layers.BatchNormalization(),
            keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="synchronized=True"):
        model.fit(x, np.eye(3)[y], batch_size=BATCH, verbose=0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="synchronized BN on TF")
def test_synchronized_batchnorm_matches_single_device_with_empty_replicas(
        strategy):
    x, y = make_data(n=162)

    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([
            keras.Input((16,)), keras.layers.Dense(32, activation="tanh"),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        return model

    reference = make()
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = make()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_same_weights(reference, model)


def test_last_batch_smaller_than_replica_count(strategy):
    x, y = make_data(n=FEWER_ROWS_THAN_REPLICAS)  # some replicas get none
    reference = make_model()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                             verbose=0).history
    with strategy.scope():
        model = make_model()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0).history
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)
    assert_same_weights(reference, model)


# Sizes that do not divide by the replicas (4 or 8; 2 with
# KD_TEST_TF_DEVICES=2): 6 and the replicas + 2, or 5 and 3 on 2.
UNEVEN = (5, 3) if NUM_DEVICES == 2 else (6, NUM_DEVICES + 2)


@pytest.mark.parametrize("n, batch_size", [
    (UNEVEN[0], UNEVEN[0]), (UNEVEN[0], 64), (UNEVEN[1], UNEVEN[1])])
def test_first_batch_that_does_not_divide_by_the_replicas(strategy, n,
                                                          batch_size):
    # Regression (TF): a global batch of 6 on 4 replicas, or a dataset
    # smaller than one batch, failed in Keras' symbolic build (it averaged
    # the replicas' unequal first slices: AddN [2, 4] != [0, 4]).
    x, y = make_data(n=n)
    reference = make_model()
    expected = reference.fit(x, y, batch_size=batch_size, epochs=2,
                             shuffle=False, verbose=0).history
    with strategy.scope():
        model = make_model()
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
                        verbose=0).history
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)
    assert_same_weights(reference, model)


def test_train_on_batch_with_a_tf_data_batch_equals_numpy(strategy):
    # Regression (#19.4, JAX): tf.Tensors from a tf.data iterator, as the TF
    # checkpoint guide's loop feeds them, raised "Cannot interpret
    # 'tf.float32' as a data type".
    import conftest
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.integers(0, 3, size=(32,))
    losses = []
    for batch in [(x, y), next(iter(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32)))]:
        with strategy.scope():
            model = conftest.make_mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
        losses.append(model.train_on_batch(*batch))
        losses.append(model.train_on_batch(*batch))
    assert losses[:2] == losses[2:]


def test_fit_takes_a_distributed_dataset_as_tf_distribute_does(strategy):
    # tf.distribute's Keras trains on `strategy.experimental_distribute_
    # dataset(ds)` as on `ds`; so does every kd strategy, and on the
    # global batches of a single-pipeline `distribute_datasets_from_function`.
    import tensorflow as tf

    x, y = make_data(n=100)  # a short last batch
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with strategy.scope():
        reference = make_model()
    expected = reference.fit(train, validation_data=train, epochs=2,
                             verbose=0).history

    def per_replica(ctx):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(
            ctx.get_per_replica_batch_size(BATCH))

    for distributed in (strategy.experimental_distribute_dataset(train),
                        strategy.distribute_datasets_from_function(
                            per_replica)):
        with strategy.scope():
            model = make_model()
        history = model.fit(distributed, validation_data=distributed,
                            epochs=2, verbose=0).history
        for key in expected:
            np.testing.assert_allclose(history[key], expected[key],
                                       rtol=1e-5)
        assert_same_weights(reference, model)
        # As many optimizer steps as batches: the call that finds the
        # dataset exhausted (its length is unknown to Keras on TF) counted
        # one more on some replicas (a divergence) or all.
        assert int(model.optimizer.iterations) == int(
            reference.optimizer.iterations) == 2 * 4
        np.testing.assert_allclose(
            model.predict(distributed, verbose=0),
            reference.predict(train, verbose=0), atol=1e-5)
    # Per-replica batches that are not a tf.data.Dataset (here a list):
    # fit cannot rebatch them; the error says what to pass instead.
    lists = strategy.distribute_datasets_from_function(
        lambda ctx: [(x[i:i + 4], y[i:i + 4]) for i in range(0, 96, 4)])
    with pytest.raises(ValueError, match="batches are per replica.*Pass the "
                       "dataset batched with the global batch size"):
        model.fit(lists, verbose=0)
    other = kd.MirroredStrategy(cpu_names(2))
    if BACKEND != "tensorflow":  # TF's own distributed datasets go to Keras
        with pytest.raises(ValueError, match="distributed dataset of another "
                           "strategy"):
            model.evaluate(other.experimental_distribute_dataset(train),
                           verbose=0)


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's CPU collectives (JAX)")
def test_eager_fit_over_several_cpu_devices_warns_of_xla_rendezvous_aborts(
        strategy):
    # keras-io's KerasHub data-parallel example compiles with
    # jit_compile=False; on 8 CPU devices XLA aborted the process after two
    # steps (rendezvous timeout, exit 134), under Keras' own DataParallel
    # too. kd says so before it can happen, and what to do (#30 item 9).
    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
    y = np.zeros((32,), "int32")
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
                      jit_compile=False)
    with pytest.warns(UserWarning, match="jit_compile=False.*CPU devices.*"
                      "rendezvous.*jit_compile=True"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        model.evaluate(x, y, batch_size=16, verbose=0)
    with strategy.scope():
        compiled = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not [w for w in caught if "rendezvous" in str(w.message)]
