"""Data and model shared by the multi-process test workers.

No framework is imported at module level: a worker sets up its devices
first, then these helpers import Keras. (One exception, on the TensorFlow
backend: `tf_data_iterators_without_autotune`, below.)
"""

import contextlib
import os

import numpy as np


def tf_data_iterators_without_autotune():
    """Every tf.data iterator this process makes runs without autotuning.

    TensorFlow 2.21: destroying a tf.data iterator waits out its autotune
    thread's current sleep, which the iterator's cancellation does not cut
    short, and that sleep doubles with the iterator's age up to 60 s. A test
    that drops iterators (every interrupted `fit`, every epoch's distributed
    iterator once the garbage collector gets to it) then sat idle for 5 to
    60 s at a time: 41 s of a 45 s test, 35% of the TensorFlow stage's time
    on 2 cores. Autotuning only sizes buffers and parallelism (the elements
    and their order stay the same), so the tests keep what they check. This
    is the hook TensorFlow's own debug mode uses to switch autotuning off.
    """
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.data.ops import options as options_lib

    if getattr(dataset_ops.DatasetV2, "_kd_tests_without_autotune", False):
        return
    with_debug_options = dataset_ops.DatasetV2._apply_debug_options

    def apply_options(dataset):
        options = options_lib.Options()
        options.autotune.enabled = False
        return with_debug_options(dataset).with_options(options)

    dataset_ops.DatasetV2._apply_debug_options = apply_options
    dataset_ops.DatasetV2._kd_tests_without_autotune = True


if os.environ.get("KERAS_BACKEND") == "tensorflow":
    tf_data_iterators_without_autotune()  # in each TensorFlow worker too


def make_data(n=203, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    y = rng.integers(0, 3, size=(n,))
    return x, y


class Interrupt(Exception):
    """Raised by `interrupt_at`'s callback."""


def interrupt_at(step):
    """A Keras callback that stops `fit` abruptly (raising `Interrupt`, as a
    crash would) after `step` batches."""
    import keras

    class InterruptAt(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == step:
                raise Interrupt()

    return InterruptAt()


def initial_weights():
    """Fixed starting weights, so every process and the reference agree."""
    rng = np.random.default_rng(1)
    return [rng.normal(scale=0.3, size=s).astype("float32")
            for s in [(16, 32), (32,), (32, 3), (3,)]]


def make_model(weights=None):
    import keras

    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(3),
    ])
    if weights is not None:
        model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train_step_loop(strategy, batches, epochs=2):
    """The custom loop with `kd.train_step` (SGD 0.1, accuracy metric) over
    `batches` (global batches of 32), as every backend's worker runs it."""
    import keras

    import keras_distribute as kd

    with strategy.scope():
        model = make_model(initial_weights())
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    def step(inputs):
        xb, yb = inputs
        return kd.train_step(model, optimizer, loss_fn, xb, yb,
                             global_batch_size=32, metrics=[accuracy])

    dataset = strategy.experimental_distribute_dataset(batches)
    accuracies = []
    for _ in range(epochs):
        for batch in dataset:
            strategy.run(step, args=(batch,))
        accuracies.append(float(accuracy.result()))
        accuracy.reset_state()
    return {"weights": model.get_weights(), "accuracies": accuracies}


def assert_train_step_loop_matches_fit(results, n=128):
    """Every process of `train_step_loop` reached what `fit` reaches."""
    x, y = make_data(n=n)
    model = make_model(initial_weights())
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                        verbose=0).history
    for result in results:
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(result["accuracies"], history["accuracy"],
                                   rtol=1e-6)


def every_optimizer():
    """`{name: a function that makes it}`: every optimizer Keras ships, and
    the options that touch every gradient (clipping, EMA, accumulation,
    loss scale)."""
    from keras import optimizers as o

    return {
        "SGD nesterov clipvalue": lambda: o.SGD(
            0.1, momentum=0.9, nesterov=True, clipvalue=0.05),
        "RMSprop centered": lambda: o.RMSprop(0.01, centered=True),
        "Adam amsgrad": lambda: o.Adam(0.01, amsgrad=True),
        "AdamW clipnorm": lambda: o.AdamW(0.01, weight_decay=0.1,
                                          clipnorm=0.1),
        "Adadelta": lambda: o.Adadelta(1.0),
        "Adagrad": lambda: o.Adagrad(0.1),
        "Adamax": lambda: o.Adamax(0.01),
        "Adafactor": lambda: o.Adafactor(0.01),
        "Nadam": lambda: o.Nadam(0.01),
        "Ftrl": lambda: o.Ftrl(0.1),
        "Lion global_clipnorm": lambda: o.Lion(0.001, global_clipnorm=0.1),
        "Lamb": lambda: o.Lamb(0.01),
        "Muon": lambda: o.Muon(0.01),
        "Adam EMA": lambda: o.Adam(0.01, use_ema=True,
                                   ema_overwrite_frequency=3),
        "Adam accumulation": lambda: o.Adam(0.01,
                                            gradient_accumulation_steps=2),
        "LossScaleOptimizer": lambda: o.LossScaleOptimizer(o.Adam(0.01)),
    }


def every_optimizer_fit(strategy, rows=64):
    """`{optimizer name: weights}` after a 1-epoch fit (4 steps) of a small
    regressor with each of `every_optimizer()`, made in `strategy`'s
    scope."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 12)).astype("float32")
    y = np.tanh(x[:, :2])
    weights = {}
    for name, make_optimizer in every_optimizer().items():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([
                keras.Input((12,)), keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(2)])
            model.compile(optimizer=make_optimizer(), loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        weights[name] = model.get_weights()
    return weights


def train_unless_rank_one(strategy):
    """Rank 1 leaves at once; rank 0 trains and must fail within the timeout."""
    import os

    if os.environ["RANK"] == "1":
        return "left"
    x, y = make_data(n=3200)
    with strategy.scope():
        model = make_model(initial_weights())
    model.fit(x, y, batch_size=32, epochs=50, verbose=0)
    return "trained alone"


def fit_while_rank_one_hangs(strategy):
    """Rank 1 stays alive but hangs in a callback after epoch 1 (a save only
    it runs, a breakpoint); rank 0 must not wait for it without end."""
    import os
    import time

    import keras

    class HangOnRankOne(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if os.environ["RANK"] == "1":
                time.sleep(120)  # ended by the launcher long before

    x, y = make_data(n=256)
    with strategy.scope():
        model = make_model(initial_weights())
    model.fit(x, y, batch_size=32, epochs=3, verbose=0,
              callbacks=[HangOnRankOne()])
    return "trained"


def assert_hung_peer_is_named(launch, worker, limit_s=60):
    """Launches `worker` on 2 processes: the launch blames rank 1 (alive
    but behind), as named by rank 0, within `limit_s`."""
    import multiprocessing
    import time

    import pytest

    import keras_distribute as kd

    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match=r"Process 1 of 2 was lost "
                       r"\(named by process 0, which then") as info:
        launch(worker, num_processes=2, timeout=240)
    assert info.value.rank == 1
    import re

    assert re.search(r"process 1 of 2 on \S+ is alive but behind",
                     str(info.value))
    assert time.monotonic() - start < limit_s
    assert multiprocessing.active_children() == []


def assert_survivor_fails_within(launch, worker, timeout, limit_s=120):
    """Launches `worker` on 2 processes; process 0 must fail, naming 1."""
    import time

    import pytest

    import keras_distribute as kd

    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match=r"Process 0 of 2 (died|failed)"
                       r".*process\(es\) \[1\] had already finished") as info:
        launch(worker, num_processes=2, timeout=timeout)
    assert info.value.rank == 0
    assert time.monotonic() - start < limit_s
    return info.value


def fit_with_sharded_checkpoints(strategy, directory):
    """Every process saves through the callbacks (async, the chief commits);
    returns the final weights, which the last checkpoint must hold."""
    import keras_distribute as kd

    x, y = make_data(n=96)
    with strategy.scope():
        model = make_model(initial_weights())
    model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0,
              callbacks=[kd.callbacks.ShardedCheckpoint(
                  directory, save_freq=2, max_to_keep=2, monitor="loss"),
                  kd.callbacks.BackupAndRestore(
                      directory + "-backup", save_freq=3,
                      delete_checkpoint=False)])
    return {"weights": model.get_weights(),
            "next_input": save_and_resume_input_iterator(
                strategy, model, directory + "-iterator"),
            "tutorial": tutorial_checkpointing(
                strategy, model, os.path.join(directory + "-tutorial",
                                              "ckpt"))}


def tutorial_checkpointing(strategy, model, checkpoint_dir):
    """The checkpointing of the "Custom training loop with Keras and
    MultiWorkerMirroredStrategy" tutorial, ported: non-chief workers save
    into their own temporary directory and delete it after each save."""
    import shutil

    import keras

    import keras_distribute as kd

    def _is_chief(task_type, task_id, cluster_spec):
        return (task_type is None or task_type == "chief"
                or (task_type == "worker" and task_id == 0
                    and "chief" not in cluster_spec.as_dict()))

    def _get_temp_dir(dirpath, task_id):
        temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
        os.makedirs(temp_dir, exist_ok=True)
        return temp_dir

    def write_filepath(filepath, task_type, task_id, cluster_spec):
        dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
        if not _is_chief(task_type, task_id, cluster_spec):
            dirpath = _get_temp_dir(dirpath, task_id)
        return os.path.join(dirpath, base)

    resolver = strategy.cluster_resolver
    task_type, task_id, cluster_spec = (
        resolver.task_type, resolver.task_id, resolver.cluster_spec())
    with strategy.scope():
        epoch = keras.Variable(0, dtype="int32", trainable=False)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model, epoch=epoch)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id,
                                          cluster_spec)
    manager = kd.checkpoint.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1)
    returned = []
    while int(epoch) < 2:
        returned.append(manager.save())
        if not _is_chief(task_type, task_id, cluster_spec):
            shutil.rmtree(write_checkpoint_dir)  # fails if it was not made
        epoch.assign_add(1)
    # The Keras multi-worker tutorial: every worker saves the model, the
    # non-chief ones to a temporary directory they delete.
    model_path = os.path.join(os.path.dirname(checkpoint_dir), "model.keras")
    write_model_path = write_filepath(model_path, task_type, task_id,
                                      cluster_spec)
    model.save(write_model_path)
    if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(os.path.dirname(write_model_path))
    return {"returned": returned, "chief": _is_chief(task_type, task_id,
                                                     cluster_spec),
            "should_checkpoint": strategy.extended.should_checkpoint}


def save_and_resume_input_iterator(strategy, model, directory):
    """Each process saves its own tf.data iterator (at another position)
    and resumes it: returns the element after the saved position."""
    import tensorflow as tf

    import keras_distribute as kd

    process = strategy.engine.process_id

    def input_iterator():  # each process reads its own shard of the input
        return iter(tf.data.Dataset.range(20).shard(2, process))

    iterator = input_iterator()
    for _ in range(process + 1):
        next(iterator)
    path = kd.checkpoint.ShardedCheckpoint(
        model=model, iterator=iterator).write(directory)
    next(iterator)  # moves on; the restore takes it back
    resumed = input_iterator()
    kd.checkpoint.ShardedCheckpoint(model=model, iterator=resumed).read(
        path).assert_consumed()
    next_input = int(next(resumed))
    import keras

    if keras.backend.backend() != "tensorflow":  # TF's own: not saveable
        # A distributed dataset's iterator: each process its own position.
        def local(value):
            return [np.asarray(v).tolist()
                    for v in strategy.experimental_local_results(value)]

        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.range(12).batch(4))
        iterator = iter(dist)
        next(iterator)
        path = kd.checkpoint.ShardedCheckpoint(iterator=iterator).write(
            directory + "-distributed")
        expected = local(next(iterator))
        resumed = iter(dist)
        kd.checkpoint.ShardedCheckpoint(iterator=resumed).read(
            path).assert_consumed()
        assert local(next(resumed)) == expected, (local(next(resumed)),
                                                  expected)
    # Objects that carry no strategy, saved outside every scope: still one
    # collective save with one chief (the job's strategy), not one per
    # process racing on the same directory.
    path = kd.checkpoint.ShardedCheckpoint(
        counter=keras.Variable(5.0)).write(directory + "-outside-scope")
    import json

    with open(os.path.join(path, "index.json")) as f:
        assert json.load(f)["num_processes"] == 2
    return next_input


def assert_checkpoints_hold(results, directory):
    """The checkpoints the processes wrote restore into one process."""
    import keras

    import keras_distribute as kd

    for result in results[1:]:
        for a, b in zip(result["weights"], results[0]["weights"]):
            np.testing.assert_array_equal(a, b)
    latest = kd.checkpoint.latest_checkpoint(directory)
    assert latest is not None and latest.endswith("ckpt-8")  # 4 steps x 2
    assert len(kd.checkpoint.checkpoints_in(directory)) == 2
    index = kd.checkpoint.read_metadata(latest)
    assert index["epoch"] == 1 and index["step"] == 4  # the last batch
    model = make_model()
    kd.checkpoint.ShardedCheckpoint(model=model).read(latest).expect_partial()
    for a, b in zip(model.get_weights(), results[0]["weights"]):
        np.testing.assert_array_equal(a, b)
    # The best two by the monitored loss, linked from the latest saves
    # into best/ (the chief links once each save is committed).
    best = kd.checkpoint.checkpoints_in(os.path.join(directory, "best"))
    assert 1 <= len(best) <= 2
    best_values = [kd.checkpoint.read_metadata(path)["monitor_value"]
                   for path in best]
    for path in kd.checkpoint.checkpoints_in(directory):
        twin = os.path.join(directory, "best", os.path.basename(path))
        if twin in best:
            assert all(os.path.samefile(os.path.join(path, name),
                                        os.path.join(twin, name))
                       for name in os.listdir(path) if name != "index.json")
        else:
            value = kd.checkpoint.read_metadata(path)["monitor_value"]
            assert value >= max(best_values) or len(best) < 2
    backup = kd.checkpoint.latest_checkpoint(directory + "-backup")
    assert backup.endswith("backup-2")  # after steps 3 and 6 of 8
    assert kd.checkpoint.read_metadata(backup)["step"] == 2  # epoch 1, step 2
    assert not [name for name in os.listdir(directory)
                if name.endswith(".tmp")]
    # The tutorial's saves: one checkpoint (max_to_keep=1) in the chief's
    # directory, every process told where it is; the non-chief's own
    # directory was made and deleted.
    tutorial_dir = os.path.join(directory + "-tutorial", "ckpt")
    assert [r["tutorial"]["chief"] for r in results] == [True, False]
    assert [r["tutorial"]["should_checkpoint"] for r in results] == [
        True, False]
    for result in results:
        assert result["tutorial"]["returned"] == [
            os.path.join(tutorial_dir, "ckpt-1"),
            os.path.join(tutorial_dir, "ckpt-2")]
    assert os.listdir(tutorial_dir) == ["ckpt-2"]
    assert sorted(os.listdir(directory + "-tutorial")) == [
        "ckpt", "model.keras"]  # workertemp_1 deleted with the model save
    loaded = keras.models.load_model(
        os.path.join(directory + "-tutorial", "model.keras"))
    for a, b in zip(loaded.get_weights(), results[0]["weights"]):
        np.testing.assert_array_equal(a, b)
    assert int(kd.checkpoint.load_variable(tutorial_dir, "epoch")) == 1
    # Process 0 read 0 (next: 2), process 1 read 1, 3 (next: 5).
    assert [result["next_input"] for result in results] == [2, 5]
    import pytest
    import tensorflow as tf

    one_process = kd.checkpoint.ShardedCheckpoint(
        iterator=iter(tf.data.Dataset.range(20)))
    with pytest.raises(kd.checkpoint.CheckpointError,
                       match="iterator 'iterator' of 2 processes, but this "
                             "run has 1"):
        one_process.read(directory + "-iterator")


# A transformer block (attention + feed-forward) and the layouts that shard
# it over a "model" axis: the TPUStrategy test (JAX) and the DTensor test
# (torch) train it sharded and compare with one device.
TRANSFORMER_LAYOUTS = [
    (".*attention/(query|key|value)/kernel", (None, "model", None)),
    (".*attention/attention_output/kernel", ("model", None, None)),
    (".*ffn_in/kernel", (None, "model")),
    (".*ffn_out/kernel", ("model", None)),
]


def transformer_block(seed=3):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 16))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8,
                                                name="attention")
    x = keras.layers.LayerNormalization(name="norm1")(
        inputs + attention(inputs, inputs))
    hidden = keras.layers.Dense(32, activation="tanh", name="ffn_in")(x)
    x = keras.layers.LayerNormalization(name="norm2")(
        x + keras.layers.Dense(16, name="ffn_out")(hidden))
    outputs = keras.layers.Dense(3, name="head")(
        keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def transformer_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(64, 8, 16)).astype("float32"),
            rng.integers(0, 3, size=(64,)))


def keras_callbacks_resume(strategy, directory):
    """Keras' own ModelCheckpoint, CSVLogger and BackupAndRestore in a
    2-process job: fit is interrupted in epoch 3 (as a crash would), then a
    new model resumes from the backup. Returns the resumed run's history and
    weights."""
    import keras

    x, y = make_data(n=96)

    def fit(extra):
        with strategy.scope():
            model = make_model(initial_weights())
        callbacks = [
            keras.callbacks.ModelCheckpoint(
                os.path.join(directory, "ckpt_{epoch}.weights.h5"),
                save_weights_only=True),
            keras.callbacks.CSVLogger(os.path.join(directory, "log.csv"),
                                      append=True),
            keras.callbacks.BackupAndRestore(
                os.path.join(directory, "backup"))]
        history = model.fit(x, y, batch_size=32, epochs=4, shuffle=False,
                            verbose=0, callbacks=callbacks + extra)
        return history.history, model.get_weights()

    try:
        fit([interrupt_at(7)])  # 3 steps an epoch: in the third epoch
    except Interrupt:
        pass
    history, weights = fit([])
    return {"loss": history["loss"], "weights": weights}


def launch_keras_callbacks_resume(workers, directory, timeout):
    """Runs `workers.keras_callbacks_resume` on 2 processes: the resumed run
    equals one uninterrupted process; the chief alone wrote the files."""
    import pathlib

    import keras_distribute as kd

    results = kd.launch(workers.keras_callbacks_resume, num_processes=2,
                        args=(directory,), timeout=timeout)

    x, y = make_data(n=96)
    model = make_model(initial_weights())
    reference = model.fit(x, y, batch_size=32, epochs=4, shuffle=False,
                          verbose=0).history
    for result in results:
        assert len(result["loss"]) == 2  # epochs 3 and 4, after the backup
        np.testing.assert_allclose(result["loss"], reference["loss"][2:],
                                   rtol=1e-5)
        for a, b, c in zip(result["weights"], results[0]["weights"],
                           model.get_weights()):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, atol=1e-5)
    directory = pathlib.Path(directory)
    assert sorted(p.name for p in directory.iterdir()) == [
        "ckpt_1.weights.h5", "ckpt_2.weights.h5", "ckpt_3.weights.h5",
        "ckpt_4.weights.h5", "log.csv"]  # the backup went at the end
    rows = (directory / "log.csv").read_text().strip().splitlines()
    assert [row.split(",")[0] for row in rows] == [
        "epoch", "0", "1", "2", "3"]  # appended: one header


def diverged_random_states(strategy):
    """A model built in the scope after each process seeded differently
    (as `set_random_seed(rank)` does): every process must start from the
    chief's values and train one set of weights."""
    import keras

    rank = int(os.environ["RANK"])

    def build():
        keras.utils.set_random_seed(100 + rank)
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(8),
                                 keras.layers.Dense(3)])

    own = [np.asarray(w) for w in build().get_weights()]  # no strategy
    with strategy.scope():
        model = build()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial = model.get_weights()
    x, y = make_data(n=64)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {"own": own, "initial": initial, "trained": model.get_weights()}


def launch_diverged_random_states(workers, timeout):
    """Runs `workers.diverged_random_states` on 2 processes: process 0's
    values everywhere; training them equals one process from those values."""
    import keras

    import keras_distribute as kd

    results = kd.launch(workers.diverged_random_states, num_processes=2,
                        timeout=timeout)

    chief = results[0]["own"]
    assert not np.array_equal(results[1]["own"][0], chief[0])  # diverged
    for result in results:
        for a, b in zip(result["initial"], chief):
            np.testing.assert_array_equal(a, b)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8),
                              keras.layers.Dense(3)])
    model.set_weights(chief)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = make_data(n=64)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for result in results:
        for a, b, c in zip(result["trained"], results[0]["trained"],
                           model.get_weights()):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, atol=1e-5)


def counting_metrics_fit(callbacks=()):
    """A binary classifier with counting metrics (TruePositives,
    FalseNegatives), fit for 2 epochs (with `callbacks`) and evaluated:
    `(history, evaluation, model)`. Call it inside a strategy's scope or
    outside any."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (rng.random(64) > 0.5).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile("sgd", "binary_crossentropy", metrics=[
        keras.metrics.TruePositives(), keras.metrics.FalseNegatives()])
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        shuffle=False, callbacks=list(callbacks)).history
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0,
                                return_dict=True)
    return history, evaluation, model


def batchnorm_fit_every_variable(strategy, directory):
    """#30: a 2-process fit of a model with BatchNormalization, a layer
    counting the rows it saw and Dropout, with stock callbacks and a
    validation split; every variable (trainable or not), the optimizer's,
    `evaluate` and `predict` as this process holds them."""
    import keras

    class CountRows(keras.layers.Layer):
        def build(self, input_shape):
            self.seen = self.add_weight(shape=(), initializer="zeros",
                                        trainable=False, name="seen")

        def call(self, x, training=False):
            if training:
                self.seen.assign_add(keras.ops.cast(
                    keras.ops.shape(x)[0], self.seen.dtype))
            return x

    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 8)).astype("float32")
    y = (x[:, :1] * 2 + rng.normal(size=(120, 1)) * 0.1).astype("float32")
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
            keras.layers.BatchNormalization(), CountRows(),
            keras.layers.Dropout(0.2), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse",
                      metrics=["mae"])
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2,
                                      restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1),
        keras.callbacks.ModelCheckpoint(
            os.path.join(directory, "best.weights.h5"),
            save_weights_only=True, save_best_only=True),
    ]
    history = model.fit(x, y, batch_size=24, epochs=4, verbose=0,
                        validation_split=0.2, callbacks=callbacks)
    return {
        "variables": [keras.ops.convert_to_numpy(v.value)
                      for v in model.variables],
        "names": [v.path for v in model.variables],
        "optimizer": [keras.ops.convert_to_numpy(v.value)
                      for v in model.optimizer.variables],
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=24, verbose=0),
        "predict": model.predict(x, batch_size=24, verbose=0),
    }


def assert_one_state(results):
    """Every process holds the same value of every variable, and gives the
    same logs, evaluation and predictions."""
    first, *others = results
    assert any("moving_mean" in name for name in first["names"])
    for other in others:
        assert other["names"] == first["names"]
        for name, a, b in zip(first["names"], first["variables"],
                              other["variables"]):
            np.testing.assert_array_equal(a, b, err_msg=name)
        for a, b in zip(first["optimizer"], other["optimizer"]):
            np.testing.assert_array_equal(a, b)
        assert other["history"] == first["history"]
        np.testing.assert_array_equal(other["evaluate"], first["evaluate"])
        np.testing.assert_array_equal(other["predict"], first["predict"])


def different_training(strategy, rank, shapes=True):
    """#30: process 1 builds another dropout rate, then other layer sizes,
    then compiles with another momentum: every process's error (None: it
    trained). (A learning rate is a variable made in the scope: every
    process already takes the chief's.)"""
    import keras

    x = np.ones((32, 4), "float32")
    y = np.ones((32, 1), "float32")
    errors = []
    other = rank == 1
    cases = [(8, 0.3 if other else 0.1, 0.0),
             (4 if other else 8, 0.1, 0.0),
             (8, 0.1, 0.9 if other else 0.0),
             (8, 0.1, 0.0)]
    if not shapes:
        # (TensorFlow broadcasts each variable as it is made: other shapes
        # fail there, in its own collective, before any fit.)
        cases[1] = cases[0]
    for units, dropout, momentum in cases:
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(units),
                                      keras.layers.Dropout(dropout),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(
                0.01, momentum=momentum), loss="mse")
        try:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    return errors


def assert_different_training_is_refused(results):
    for errors in results:
        *refused, same = errors
        for error in refused:
            assert "process [1] built or compiled another model" in error
        assert same is None  # the same model trains afterwards
    dropout, units, momentum = results[1][:3]  # the differing process's
    assert ("layer 2 (Dropout), /rate: 0.1 in process 0, 0.3 in this "
            "process") in dropout
    assert "layer 1 (Dense), /units: 8 in process 0, 4 in" in units or (
        units == dropout)  # TensorFlow: the dropout case twice
    assert ("compile configuration, /optimizer/config/momentum: 0.0 in "
            "process 0, 0.9 in this process") in momentum
    assert "see the error of process 1" in results[0][0]


def keras_tuner_search(strategy, directory):
    """keras-tuner's RandomSearch with `distribution_strategy=` and a seed
    (every process draws the same hyperparameters): the best ones."""
    import keras
    import keras_tuner

    def build(hp):
        # As keras-tuner's getting-started guide: no input shape, so the
        # best model is built again by keras-tuner's `build_from_config`
        # (outside the strategy's scope).
        model = keras.Sequential([
            keras.layers.Flatten(),
            keras.layers.Dense(hp.Int("units", 4, 16, step=4),
                               activation="tanh"),
            keras.layers.Dropout(hp.Float("dropout", 0.0, 0.5, step=0.25)),
            keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(
            hp.Choice("learning_rate", [1e-2, 1e-3])), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x[:, :1].astype("float32")
    tuner = keras_tuner.RandomSearch(
        build, objective="val_loss", max_trials=2, seed=7,
        distribution_strategy=strategy, directory=directory,
        project_name="search", overwrite=True)
    tuner.search(x, y, batch_size=16, epochs=2, validation_split=0.25,
                 verbose=0)
    best = tuner.get_best_hyperparameters(1)[0].values
    completed = [t for t in tuner.oracle.trials.values()
                 if t.status == "COMPLETED"]
    model = tuner.get_best_models()[0]
    return {"best": best, "trials": len(tuner.oracle.trials),
            "completed": len(completed),
            "evaluate": float(model.evaluate(x, y, batch_size=16, verbose=0))}


def listing(directory):
    """What is in `directory`, sorted, but for the lease of a checkpoint
    manager still open there (`keras_distribute.checkpoint.storage.lease`:
    held while it is)."""
    import os

    return sorted(name for name in os.listdir(directory)
                  if name != ".keras_distribute-lease")


def assert_start_refused(worker, args, match, timeout, limit_s=60):
    """A 2-process job of `worker(*args)` must be refused as it forms, with
    a `kd.LaunchError` matching `match`, within `limit_s` (#43 start
    faults: different cluster descriptions, one index twice)."""
    import time

    import pytest

    import keras_distribute as kd

    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match=match):
        kd.launch(worker, num_processes=2, args=args, timeout=timeout)
    assert time.monotonic() - start < limit_s


def assert_taken_port_is_named(limit_s=60):
    """Process 0 of a 2-worker TF_CONFIG job whose own port another process
    holds must stop at once naming that port (#43: JAX's coordinator died
    by SIGSEGV, TensorFlow said only "Could not start gRPC server")."""
    import json
    import socket
    import subprocess
    import sys
    import time

    holder, free = socket.socket(), socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    free.bind(("127.0.0.1", 0))
    port, other = holder.getsockname()[1], free.getsockname()[1]
    free.close()
    config = {"cluster": {"worker": [f"127.0.0.1:{port}",
                                     f"127.0.0.1:{other}"]},
              "task": {"type": "worker", "index": 0}}
    start = time.monotonic()
    try:
        run = subprocess.run(
            [sys.executable, "-c", "import keras_distribute as kd\n"
             "kd.MultiWorkerMirroredStrategy()"],
            env={**os.environ, "TF_CONFIG": json.dumps(config)},
            capture_output=True, text=True, timeout=limit_s + 60)
    finally:
        holder.close()
    elapsed = time.monotonic() - start
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert (f"OSError: [Errno 98] Port {port} on " in run.stderr
            and "is already in use on this machine" in run.stderr
            and "End the process that holds it" in run.stderr), (
        run.stderr[-2000:])
    assert elapsed < limit_s, elapsed


def gemma_causal_lm(seed=3):
    """A small keras-hub GemmaCausalLM, compiled."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=2, num_query_heads=2,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=64,
        head_dim=8)
    model = keras_hub.models.GemmaCausalLM(backbone=backbone,
                                           preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), weighted_metrics=[])
    return model


def gemma_data():
    """Token ids and next tokens for `gemma_causal_lm`."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(32, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1],
         "padding_mask": np.ones((32, 8), "int32")}
    return x, tokens[:, 1:]


@contextlib.contextmanager
def recorded_regional_reads():
    """Inside: every region read through kd's regional weight loading
    (`LazyH5Array.read_regions`), as `(dataset shape, region)` in the list
    it yields."""
    from keras_distribute.integration import sharded_loading

    found = []
    original = sharded_loading.LazyH5Array.read_regions

    def recording(self, regions, into=None):
        found.extend((self.shape, tuple(r)) for r in regions)
        return original(self, regions, into)

    sharded_loading.LazyH5Array.read_regions = recording
    try:
        yield found
    finally:
        sharded_loading.LazyH5Array.read_regions = original


def kernel_reading_model(seed=3, lora=False):
    """A model whose middle layer computes with its sublayers' kernels
    itself, never calling them (as keras-hub's Gemma 4 block does): `gate`
    and `out` kernels read by `ops.matmul` in the block's `call`; with
    `lora`, a Dense head with LoRA adapters (merged into its kernel by
    `save_weights`)."""
    import keras

    class KernelReadingBlock(keras.layers.Layer):
        def build(self, input_shape):
            width = input_shape[-1]
            self.gate = keras.layers.Dense(32, use_bias=False, name="gate")
            self.gate.build((None, width))
            self.out = keras.layers.Dense(width, use_bias=False, name="out")
            self.out.build((None, 32))

        def call(self, x):
            hidden = keras.ops.tanh(keras.ops.matmul(x, self.gate.kernel))
            return x + keras.ops.matmul(hidden, self.out.kernel)

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(16, name="embed")(inputs)
    x = KernelReadingBlock(name="block")(x)
    head = keras.layers.Dense(3, name="head")
    outputs = head(x)
    if lora:
        head.enable_lora(2)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def kernel_reading_data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(32, 16)).astype("float32"),
            rng.integers(0, 3, size=(32,)))
