"""TensorFlow custom training loops under `strategy.run` (the tf.distribute
tutorial pattern) and sparse (embedding) gradients across replicas."""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import NUM_DEVICES
from conftest import cpu_names
from conftest import make_mlp as make_model

import keras_distribute as kd

pytestmark = [
    pytest.mark.needs_strategy,
    pytest.mark.skipif(BACKEND != "tensorflow",
                       reason="GradientTape loop: TensorFlow backend"),
]
GLOBAL_BATCH = 64


def test_gradient_tape_loop_in_tf_function_matches_fit(strategy):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 16)).astype("float32")  # short last batch: 8
    y = rng.integers(0, 3, size=(200,))
    reference = make_model()
    reference.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False,
                  verbose=0)

    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def train_step(inputs, global_batch):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = kd.compute_average_loss(loss_fn(yb, logits),
                                           global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(yb, logits)
        return loss

    @tf.function
    def distributed_step(inputs, global_batch):
        per_replica = strategy.run(train_step, args=(inputs, global_batch))
        return strategy.reduce("sum", per_replica, axis=None)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    for _ in range(3):
        for start, inputs in zip(range(0, 200, GLOBAL_BATCH), dist_dataset):
            size = tf.constant(min(GLOBAL_BATCH, 200 - start))
            distributed_step(inputs, size)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert 0.0 < float(accuracy.result()) <= 1.0
    assert len(strategy.experimental_local_results(
        optimizer.iterations)) == NUM_DEVICES


def test_embedding_model_trains_on_replicas(strategy):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(96, 6))
    labels = rng.integers(0, 2, size=(96,))

    def make():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
        return model

    reference = make()
    reference.fit(tokens, labels, batch_size=32, epochs=2, shuffle=False,
                  verbose=0)
    with strategy.scope():
        model = make()
    model.fit(tokens, labels, batch_size=32, epochs=2, shuffle=False,
              verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    table = strategy.experimental_local_results(model.layers[0].embeddings)
    for copy in table[1:]:
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(table[0]))


def test_variable_of_another_strategy_in_run_is_a_clear_error():
    # Regression: a bare IndexError from inside tf.distribute.
    small = kd.MirroredStrategy(cpu_names(NUM_DEVICES // 2))
    with small.scope():
        variable = keras.Variable(np.ones(3, "float32"))
    with pytest.raises(ValueError, match="variable created under another "
                       "strategy.*inside this strategy's scope"):
        kd.MirroredStrategy().run(lambda: variable.value * 2.0)


def test_compute_average_loss_with_an_unknown_static_batch(strategy):
    # Regression: None * num_replicas inside tf.function over a dataset
    # whose batch size is unknown statically (tf.nn.compute_average_loss
    # works there).
    import tensorflow as tf

    n = strategy.num_replicas_in_sync
    dataset = tf.data.Dataset.from_tensor_slices(
        np.arange(6 * n, dtype="float32")).batch(2 * n)

    @tf.function
    def step(iterator):  # as the multi-worker custom-loop tutorial does
        return strategy.run(kd.compute_average_loss, args=(next(iterator),))

    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    totals = [float(strategy.reduce("sum", step(iterator), axis=None))
              for _ in range(3)]
    expected = [np.arange(6 * n, dtype="float32")[i:i + 2 * n].mean()
                for i in range(0, 6 * n, 2 * n)]
    np.testing.assert_allclose(totals, expected, rtol=1e-6)


def test_tutorial_loop_with_an_optimizer_not_built_yet(strategy):
    # keras#23085: `@tf.function` around `strategy.run(step)` with an
    # optimizer that makes its slots in the first step failed with "You must
    # feed a value for placeholder tensor" on Keras 3.15.
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.integers(0, 3, size=(64,))
    reference = make_model()
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.Adam(0.01)  # not built
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    def step(inputs):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            loss = kd.compute_average_loss(loss_fn(yb, model(xb)),
                                           global_batch_size=32)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_step(inputs):
        return strategy.reduce("SUM", strategy.run(step, args=(inputs,)),
                               axis=None)

    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    for _ in range(2):
        for batch in dataset:
            distributed_step(batch)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _tutorial_model():
    # The tutorial's model: no input shape, so its first call builds it.
    regularizer = keras.regularizers.L2(1e-3)
    return keras.Sequential([
        keras.layers.Conv2D(4, 3, activation="relu",
                            kernel_regularizer=regularizer),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(8, activation="relu",
                           kernel_regularizer=regularizer),
        keras.layers.Dense(10, kernel_regularizer=regularizer),
    ])


def test_custom_training_tutorial_with_a_model_built_in_the_first_step(
        strategy, tmp_path):
    # The tf.distribute "Custom training" tutorial as written: its model is
    # built by its first call inside `@tf.function` around `strategy.run`,
    # and step 1 failed with "You must feed a value for placeholder tensor"
    # (Keras 3 made the layers' mirrored variables inside the traced
    # function; plain tf.distribute + Keras 3 fails the same way) (#30).
    import tensorflow as tf

    rng = np.random.default_rng(0)
    images = rng.random((96, 10, 10, 1)).astype("float32")
    labels = rng.integers(0, 10, 96)
    global_batch = 8 * strategy.num_replicas_in_sync

    keras.utils.set_random_seed(3)
    reference = _tutorial_model()
    reference.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reference.fit(images, labels, batch_size=global_batch, epochs=2,
                  shuffle=False, verbose=0)

    dataset = tf.data.Dataset.from_tensor_slices(
        (images, labels)).batch(global_batch)
    train_dist_dataset = strategy.experimental_distribute_dataset(dataset)
    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(
                    tf.add_n(model_losses))
            return loss

        train_accuracy = keras.metrics.SparseCategoricalAccuracy()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _tutorial_model()
        optimizer = keras.optimizers.Adam(0.01)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(kd.ReduceOp.SUM, per_replica_losses,
                               axis=None)

    losses = []
    for _ in range(2):
        total_loss, num_batches = 0.0, 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        losses.append(float(total_loss / num_batches))
        checkpoint.save(str(tmp_path / "ckpt"))
    assert np.isfinite(losses).all() and 0 < float(train_accuracy.result())
    # Every variable the first step made is one mirrored variable: every
    # replica holds the same value, which is the one-device run's.
    for variable in model.weights + optimizer.variables:
        copies = strategy.experimental_local_results(variable.value)
        assert len(copies) == strategy.num_replicas_in_sync, variable.path
        for copy in copies[1:]:
            np.testing.assert_array_equal(copies[0].numpy(),
                                          copy.numpy())
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-5)


def _keras_io_gan():
    """keras-io's DCGAN ("Customizing what happens in fit()"): its own
    train_step with two optimizers, shrunk to 8 x 8 images."""
    import tensorflow as tf

    latent_dim = 8

    class GAN(keras.Model):
        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator, self.generator = discriminator, generator
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            self.loss_fn = loss_fn
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, real_images):
            ops = keras.ops
            batch_size = ops.shape(real_images)[0]
            latent = keras.random.normal((batch_size, latent_dim),
                                         seed=self.seed_generator)
            generated = self.generator(latent)
            combined = ops.concatenate([generated, real_images], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)),
                                      ops.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(
                zip(grads, self.discriminator.trainable_weights))
            latent = keras.random.normal((batch_size, latent_dim),
                                         seed=self.seed_generator)
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(
                    ops.zeros((batch_size, 1)),
                    self.discriminator(self.generator(latent)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(
                zip(grads, self.generator.trainable_weights))
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {m.name: m.result() for m in self.metrics}

    layers = keras.layers
    discriminator = keras.Sequential([
        keras.Input((8, 8, 1)), layers.Conv2D(8, 3, strides=2,
                                              padding="same"),
        layers.LeakyReLU(0.2), layers.GlobalMaxPooling2D(), layers.Dense(1)])
    generator = keras.Sequential([
        keras.Input((latent_dim,)), layers.Dense(4 * 4 * 8),
        layers.LeakyReLU(0.2), layers.Reshape((4, 4, 8)),
        layers.Conv2DTranspose(8, 4, strides=2, padding="same"),
        layers.LeakyReLU(0.2),
        layers.Conv2D(1, 4, padding="same", activation="sigmoid")])
    gan = GAN(discriminator, generator)
    gan.compile(keras.optimizers.Adam(3e-4), keras.optimizers.Adam(3e-4),
                keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


def test_a_gans_own_step_on_an_empty_replica_batch_is_explained(strategy):
    # #71: keras-io's GAN under kd.MirroredStrategy(): the last, short
    # global batch leaves some replicas 0 rows, and TensorFlow's oneDNN
    # Conv2D gives an empty batch a wrong shape ([0,8,8,8] for 1 filter), so
    # the step's concat fails at the epoch's end (plain tf.distribute fails
    # on the step too). kd says so: a warning before fit runs when it knows
    # the sizes, a note on the error otherwise; the batch dropped, it trains.
    import tensorflow as tf

    if NUM_DEVICES < 2:
        pytest.skip("needs several replicas")
    conv_breaks = tf.nn.conv2d(tf.zeros((0, 8, 8, 8)),
                               tf.zeros((4, 4, 8, 1)), 1, "SAME").shape[-1] != 1
    x = np.random.default_rng(0).random((33, 8, 8, 1)).astype("float32")
    with strategy.scope():
        gan = _keras_io_gan()
    with pytest.warns(UserWarning, match=(
            f"1 example\\(s\\) for {NUM_DEVICES} replicas, so some replicas "
            "run GAN's own train_step on an empty batch.*oneDNN.*"
            "drop_remainder=True.*TF_ENABLE_ONEDNN_OPTS=0")):
        if conv_breaks:
            with pytest.raises(tf.errors.InvalidArgumentError):
                gan.fit(x, batch_size=16, epochs=1, verbose=0)
        else:
            gan.fit(x, batch_size=16, epochs=1, verbose=0)
    if conv_breaks:
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            gan.fit(tf.data.Dataset.from_tensor_slices(x).batch(16),
                    epochs=1, verbose=0)
        (note,) = raised.value.__notes__
        assert "keras_distribute: if the global batch of this step had " \
               f"fewer examples than the {NUM_DEVICES} replicas" in note
        assert "GAN's own train_step on an empty batch" in note
    history = gan.fit(
        tf.data.Dataset.from_tensor_slices(x).batch(16, drop_remainder=True),
        epochs=1, verbose=0)
    assert np.isfinite(history.history["d_loss"]).all()
