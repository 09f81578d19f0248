"""Steps users write (torch), run in each launched process or in one.

keras-io's "Customizing what happens in fit() with PyTorch" (its
`train_step`/`test_step` with `loss.backward()` and `optimizer.apply`), its
GAN (two optimizers), a step that forwards through a `DistributedDataParallel`
of its own (DDP's hooks reduce), one that never calls an optimizer, one that
calls it twice, gradient accumulation, and a step that bypasses the
optimizer (the divergence check's case). Module-level so that `kd.launch`
can send them; called directly in the test process they are the one-process
reference. No framework is imported at module level.
"""

import numpy as np


def _data(n, features=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = np.tanh(x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    return x, y


def _weights(shapes, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=0.3, size=s).astype("float32") for s in shapes]


def _models():
    import keras
    import torch

    class GuideModel(keras.Model):
        """keras-io's torch guide: its train_step and test_step as written
        there (the test_step returns the loss itself, not a tracker)."""

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            loss.backward()
            trainable_weights = [v for v in self.trainable_weights]
            gradients = [v.value.grad for v in trainable_weights]
            with torch.no_grad():
                self.optimizer.apply(gradients, trainable_weights)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            return {"loss": self.compute_loss(y=y, y_pred=y_pred)}

    class ThroughOwnDdp(keras.Model):
        """Forwards through a DDP it makes itself: DDP's hooks reduce."""

        def train_step(self, data):
            x, y = data
            if torch.distributed.is_initialized():
                if "ddp" not in self.__dict__:
                    self.__dict__["ddp"] = (
                        torch.nn.parallel.DistributedDataParallel(self))
                forward = self.__dict__["ddp"]
            else:
                forward = self
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=forward(x, training=True))
            loss.backward()
            weights = self.trainable_weights
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in weights], weights)
            return {"raw_loss": loss}

    class NoOptimizer(keras.Model):
        """Looks at the data, never updates a variable."""

        def train_step(self, data):
            x, y = data
            loss = self.compute_loss(y=y, y_pred=self(x))
            return {"raw_loss": loss, "rows": float(x.shape[0])}

    class TwoUpdates(keras.Model):
        """Calls its optimizer twice a step (two half-steps)."""

        def train_step(self, data):
            x, y = data
            for _ in range(2):
                self.zero_grad()
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
                loss.backward()
                weights = self.trainable_weights
                grads = [v.value.grad for v in weights]
                with torch.no_grad():
                    self.optimizer.apply_gradients(zip(grads, weights))
            return {"raw_loss": loss}

    class Gan(keras.Model):
        """keras-io's GAN shape: a discriminator and a generator, each with
        its own optimizer (the noise comes with the data, so that one
        process and two draw the same)."""

        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
            self.built = True  # as the guide: its parts are built

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = keras.losses.MeanSquaredError()

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def train_step(self, data):
            real, noise = data[:, :4], data[:, 4:]
            fake = self.generator(noise)
            self.zero_grad()
            predictions = self.discriminator(
                torch.cat([real, fake.detach()], dim=0))
            labels = torch.cat([torch.ones_like(predictions[:len(real)]),
                                torch.zeros_like(predictions[len(real):])])
            d_loss = self.loss_fn(labels, predictions)
            d_loss.backward()
            d_weights = self.discriminator.trainable_weights
            with torch.no_grad():
                self.d_optimizer.apply([v.value.grad for v in d_weights],
                                       d_weights)
            self.zero_grad()
            g_loss = self.loss_fn(torch.ones_like(predictions[:len(real)]),
                                  self.discriminator(self.generator(noise)))
            g_loss.backward()
            g_weights = self.generator.trainable_weights
            with torch.no_grad():
                self.g_optimizer.apply([v.value.grad for v in g_weights],
                                       g_weights)
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(),
                    "g_loss": self.g_loss_tracker.result()}

    class ManualUpdate(keras.Model):
        """Bypasses the optimizer: each process steps on its own gradients."""

        def train_step(self, data):
            x, y = data
            self.zero_grad()
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            loss.backward()
            with torch.no_grad():
                for v in self.trainable_weights:
                    v.assign(v - 0.1 * v.value.grad)
            return {"raw_loss": loss}

    class AutoEncoder(keras.Model):
        """Trains and validates on `x` alone (keras-io's autoencoders and
        VAE): its steps get the batch itself, as Keras hands it."""

        def train_step(self, data):
            self.zero_grad()
            loss = torch.mean((self(data, training=True) - data) ** 2)
            loss.backward()
            weights = self.trainable_weights
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in weights],
                                     weights)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

        def test_step(self, data):
            return {"loss": torch.mean((self(data) - data) ** 2)}

    return {"guide": GuideModel, "ddp": ThroughOwnDdp,
            "no_optimizer": NoOptimizer, "twice": TwoUpdates, "gan": Gan,
            "manual": ManualUpdate, "autoencoder": AutoEncoder}


def _autoencoder(cls):
    import keras

    inputs = keras.Input((12,))
    code = keras.layers.Dense(4, activation="tanh")(inputs)
    model = cls(inputs, keras.layers.Dense(12)(code))
    model.loss_tracker = keras.metrics.Mean(name="loss")
    model.set_weights(_weights([(12, 4), (4,), (4, 12), (12,)], 7))
    return model


def _regressor(cls, seed):
    import keras

    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = cls(inputs, keras.layers.Dense(1)(hidden))
    model.set_weights(_weights([(12, 8), (8,), (8, 1), (1,)], seed))
    return model


def _gan(cls):
    import keras

    discriminator = keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(1)])
    generator = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(4, activation="tanh")])
    discriminator.set_weights(_weights([(4, 6), (6,), (6, 1), (1,)], 5))
    generator.set_weights(_weights([(8, 4), (4,)], 6))
    return cls(discriminator, generator)


class BatchLogs:
    """A callback factory recording every batch's logs."""

    @staticmethod
    def make():
        import keras

        class Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.logs = []

            def on_train_batch_end(self, batch, logs=None):
                self.logs.append({k: float(v) for k, v in logs.items()})

        return Recorder()


def _fit(model, x, y=None, n_epochs=2, batch_size=32, **fit_kwargs):
    recorder = BatchLogs.make()
    history = model.fit(x, y, batch_size=batch_size, epochs=n_epochs,
                        shuffle=False, verbose=0, callbacks=[recorder],
                        **fit_kwargs)
    return {"history": history.history, "batch_logs": recorder.logs,
            "weights": model.get_weights()}


def user_steps():
    """Every step kind under `kd.MirroredStrategy()`; in N processes (each
    gets its rows of every global batch) or in one (the reference)."""
    import keras
    import torch

    import keras_distribute as kd

    torch.set_num_threads(1)
    models = _models()
    strategy = kd.MirroredStrategy()
    out = {}
    x, y = _data(101)  # the last batch, 5 rows, splits 2 + 3
    with strategy.scope():
        model = _regressor(models["guide"], 1)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                      metrics=["mae"])
    out["guide"] = _fit(model, x, y)
    out["guide"]["evaluate"] = model.evaluate(x, y, batch_size=32, verbose=0)
    # No reader of per-batch logs (no callbacks, verbose=0): only the
    # epoch's results are made global, from the metrics' states.
    with strategy.scope():
        model = _regressor(models["guide"], 1)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                      metrics=["mae"])
    out["guide_quiet"] = {"history": model.fit(
        x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history}
    with strategy.scope():
        model = _regressor(models["guide"], 1)
        model.compile(optimizer=keras.optimizers.SGD(
            0.1, gradient_accumulation_steps=2), loss="mse", metrics=["mae"])
    out["accumulation"] = _fit(model, x, y)
    x, y = _data(128)
    for kind in ("ddp", "no_optimizer", "twice"):
        with strategy.scope():
            model = _regressor(models[kind], 2)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        out[kind] = _fit(model, x, y)
    with strategy.scope():
        gan = _gan(models["gan"])
        gan.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1))
    out["gan"] = _fit(gan, _data(96)[0])
    # x alone, validated each epoch: the validation run inside fit must not
    # change how the next epoch's batches reach the step (#44).
    with strategy.scope():
        model = _autoencoder(models["autoencoder"])
        model.compile(optimizer=keras.optimizers.SGD(0.1))
    out["autoencoder"] = _fit(model, _data(96)[0], n_epochs=3,
                              validation_data=_data(40, seed=1)[0])
    return out


def _mirrored(processes, fully_sharded):
    """`kd.MirroredStrategy()`; `fully_sharded`: every variable sharded
    over the batch axis of a 1-D mesh of `processes`."""
    import keras

    import keras_distribute as kd

    if not fully_sharded:
        return kd.MirroredStrategy()
    mesh = keras.distribution.DeviceMesh(
        (processes,), ["batch"], [f"cpu:{r}" for r in range(processes)])
    return kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=0))


def fully_sharded_user_steps(processes):
    """The guide's step, a step that calls its optimizer twice and the GAN
    with every variable sharded over the batch axis of a 1-D mesh of
    `processes` (kd.layouts.fully_sharded; 1: no sharding, the reference)."""
    import keras
    import torch

    torch.set_num_threads(1)
    models = _models()
    strategy = _mirrored(processes, fully_sharded=processes > 1)
    out = {}
    x, y = _data(101)  # the last batch, 5 rows, splits 2 + 3
    for kind in ("guide", "twice"):
        with strategy.scope():
            model = _regressor(models[kind], 1)
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        out[kind] = _fit(model, x, y)["weights"]
    with strategy.scope():
        gan = _gan(models["gan"])
        gan.compile(keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.1))
    out["gan"] = _fit(gan, _data(96)[0])["weights"]
    kernel = gan.discriminator.layers[0].kernel.value
    out["kernel_local"] = tuple(kernel.to_local().shape) if hasattr(
        kernel, "to_local") else tuple(kernel.shape)
    if processes > 1:  # a step that wraps the model in its own DDP
        with strategy.scope():
            model = _regressor(models["ddp"], 1)
            model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            out["ddp_error"] = None
        except RuntimeError as error:
            out["ddp_error"] = str(error)
    return out


def own_loops(processes, fully_sharded=False):
    """keras-io's "Writing a training loop from scratch in PyTorch", its
    loop as written (`loss.backward()`, then the Keras optimizer's `apply`
    on the variables' `.grad`), outside `fit` and `strategy.run`: with a
    Keras optimizer (Adam, then SGD with `global_clipnorm`: the clip must
    see the averaged gradients), with gradients the loop all-reduces itself
    first, and with a torch optimizer. Each of `processes` processes trains
    on its half of every 32-row batch; with 1, on the whole batch (the
    reference). `fully_sharded`: every variable sharded over the processes
    (kd.layouts.fully_sharded), Keras optimizers only."""
    import os

    import keras
    import torch
    import torch.distributed as dist

    import keras_distribute as kd

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    strategy = _mirrored(processes, fully_sharded)
    x, y = _data(128)
    rows = 32 // processes
    out = {}
    makers = {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "clipped": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
        "reduced_by_hand": lambda: keras.optimizers.Adam(0.01),
        "torch_optim": None,
    }
    if fully_sharded:
        makers = {kind: makers[kind] for kind in ("adam", "clipped")}
    for kind, make_optimizer in makers.items():
        with strategy.scope():
            model = _regressor(_models()["guide"], 1)
            optimizer = make_optimizer() if make_optimizer else None
        if optimizer is None:
            torch_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = keras.losses.MeanSquaredError()
        for epoch in range(2):
            for start in range(0, 128, 32):
                mine = slice(start + rank * rows, start + (rank + 1) * rows)
                logits = model(torch.as_tensor(x[mine]))
                loss = loss_fn(torch.as_tensor(y[mine]), logits)
                model.zero_grad()
                loss.backward()
                if optimizer is None:
                    torch_optimizer.step()
                    continue
                weights = [v for v in model.trainable_weights]
                gradients = [v.value.grad for v in weights]
                if kind == "reduced_by_hand" and processes > 1:
                    for gradient in gradients:
                        dist.all_reduce(gradient)
                        gradient /= processes
                with torch.no_grad():  # (the variables as a generator)
                    optimizer.apply(gradients, (v for v in weights))
        out[kind] = model.get_weights()
        if kind == "torch_optim" and processes > 1:
            try:  # a torch optimizer is not kd's to sync: the check says so
                strategy.check_replicas_agree(model)
                out["torch_optim_check"] = None
            except kd.ReplicasDivergedError as raised:
                out["torch_optim_check"] = str(raised)
    return out


def diverging_step(mode):
    """A step that bypasses the optimizer: the check's error (or warning)."""
    import warnings

    import torch

    import keras_distribute as kd

    torch.set_num_threads(1)
    kd.set_divergence_check(mode)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = _regressor(_models()["manual"], 3)
        model.compile(optimizer="sgd", loss="mse")
    x, y = _data(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.fit(x, y, batch_size=32, epochs=2, verbose=0)
            error = None
        except kd.ReplicasDivergedError as raised:
            error = (str(raised), raised.variable)
    try:
        strategy.check_replicas_agree(model)
        on_demand = None
    except kd.ReplicasDivergedError as raised:
        on_demand = raised.variable
    return {"error": error, "on_demand": on_demand,
            "first_variable": model.trainable_variables[0].path,
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, RuntimeWarning)
                         and "diverged" in str(w.message)]}


def weights_inside_the_scope():
    """The transfer-learning guide's read: `get_weights()` inside the scope
    (each process's random state differs: the values must still agree)."""
    import os

    import keras
    import torch

    import keras_distribute as kd

    torch.set_num_threads(1)
    keras.utils.set_random_seed(int(os.environ.get("RANK", "0")))
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        base = keras.Sequential([keras.Input((5,)),
                                 keras.layers.Dense(4), keras.layers.Dense(2)])
        inside = [w.copy() for w in base.layers[0].get_weights()]
        base.trainable = False
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(1)(base(inputs, training=False))
        model = keras.Model(inputs, outputs)
        head_inside = [w.copy() for w in model.layers[-1].get_weights()]
    return {"inside": inside, "head_inside": head_inside,
            "after": base.layers[0].get_weights(),
            "head_after": model.layers[-1].get_weights()}


def tf_guide_programs(strategy):
    """keras-io's "Customizing what happens in fit() with TensorFlow": its
    train_step (a loss tracker fed `compute_loss`'s value) and its GAN (no
    `call`: built by its step), under `strategy` (a kd one, or the default
    strategy: the one-device reference)."""
    import keras
    import tensorflow as tf

    class CustomModel(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(),
                    "mae": self.mae_metric.result()}

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            self.loss_tracker.update_state(
                self.compute_loss(y=y, y_pred=y_pred))
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(),
                    "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    class Gan(keras.Model):
        def __init__(self, discriminator, generator):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def train_step(self, data):
            real, noise = data[:, :4], data[:, 4:]
            fake = self.generator(noise)
            combined = tf.concat([fake, real], axis=0)
            labels = tf.concat([tf.ones_like(real[:, :1]),
                                tf.zeros_like(real[:, :1])], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss,
                                  self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(
                zip(grads, self.discriminator.trainable_weights))
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(
                    tf.zeros_like(real[:, :1]),
                    self.discriminator(self.generator(noise)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(
                zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(),
                    "g_loss": self.g_loss_tracker.result()}

    out = {}
    x, y = _data(128)
    with strategy.scope():
        inputs = keras.Input((12,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = CustomModel(inputs, keras.layers.Dense(1)(hidden))
        model.set_weights(_weights([(12, 8), (8,), (8, 1), (1,)], 1))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    out["guide"] = _fit(model, x, y)
    out["guide"]["evaluate"] = model.evaluate(x, y, batch_size=32,
                                              verbose=0, return_dict=True)
    with strategy.scope():
        discriminator = keras.Sequential([
            keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
            keras.layers.Dense(1)])
        generator = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(4, activation="tanh")])
        discriminator.set_weights(_weights([(4, 6), (6,), (6, 1), (1,)], 5))
        generator.set_weights(_weights([(8, 4), (4,)], 6))
        gan = Gan(discriminator, generator)
        gan.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1),
                    keras.losses.BinaryCrossentropy(from_logits=True))
    out["gan"] = _fit(gan, _data(96)[0])
    return out
