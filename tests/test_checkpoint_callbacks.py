"""Checkpoint manager, asynchronous saves, deferred restores, the checkpoint
callbacks (resume after an interrupt), export, and a save killed by SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from conftest import BACKEND
from worker_common import Interrupt
from worker_common import interrupt_at as InterruptAt
from worker_common import listing

import keras_distribute as kd
from keras_distribute.checkpoint.storage.lease import LEASE

ckpt = kd.checkpoint


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(96, 6)).astype("float32"),
            rng.normal(size=(96, 2)).astype("float32"))


def strategy_scope(in_scope=True):
    strategy = kd.MirroredStrategy() if BACKEND != "torch" and in_scope else (
        kd.get_strategy())
    return strategy.scope()


def make_model(in_scope=True):
    keras.utils.set_random_seed(7)
    with strategy_scope(in_scope):
        model = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(2),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse",
                      metrics=["mae"])
    return model


def state(model):
    return [keras.ops.convert_to_numpy(v.value).copy()
            for v in model.weights + model.optimizer.variables]


def fit(model, callbacks, epochs=3):
    x, y = data()
    return model.fit(x, y, batch_size=16, epochs=epochs, shuffle=True,
                     verbose=0, callbacks=callbacks)


# (save_freq, interrupted after step, batch of epoch 1 the backup is at,
# model made in a kd strategy's scope): batch 1 is the case where the first
# skipped batch draws the epoch's shuffle order, so the RNG must be restored
# only after it was taken; without a strategy, TensorFlow builds compiled
# metrics only in the first step, so their state is restored from there.
@pytest.mark.parametrize("save_freq,stop_at,backup_batch,in_scope",
                         [(4, 10, 2, True), (7, 10, 1, True),
                          (4, 10, 2, False)])
def test_backup_and_restore_resumes_mid_epoch_to_the_same_weights(
        tmp_path, save_freq, stop_at, backup_batch, in_scope):
    backup_dir = str(tmp_path / "backup")
    model = make_model(in_scope)
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    reference = fit(model, [stopper])
    expected, expected_best = state(model), stopper.best

    # Interrupted in epoch 1 (6 steps per epoch, 3 epochs).
    model = make_model(in_scope)
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    with pytest.raises(Interrupt):
        fit(model, [kd.callbacks.BackupAndRestore(
            backup_dir, save_freq=save_freq), stopper, InterruptAt(stop_at)])
    metadata = ckpt.read_metadata(ckpt.latest_checkpoint(backup_dir))
    assert (metadata["epoch"], metadata["step"]) == (1, backup_batch)

    # A new process would start from scratch: new model, other RNG states.
    np.random.seed(123)
    model = make_model(in_scope)
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    seen = {"begin": [], "end": []}
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen["begin"].append(batch),
        on_train_batch_end=lambda batch, logs: seen["end"].append(
            (batch, sorted(logs or {}))))
    resumed = fit(model, [kd.callbacks.BackupAndRestore(
        backup_dir, save_freq=save_freq), stopper, counter])
    for a, b in zip(expected, state(model)):
        np.testing.assert_array_equal(a, b)
    assert stopper.best == expected_best
    # The batches skipped (trained on before the interruption) reach no
    # callback: epoch 1 from the backup's batch on, then all of epoch 2.
    batches = list(range(backup_batch, 6)) + list(range(6))
    assert seen["begin"] == batches
    assert [batch for batch, _ in seen["end"]] == batches
    assert all(keys for _, keys in seen["end"])  # (real logs, never {})
    assert len(resumed.history["loss"]) == 2  # epochs 1 and 2 ran
    np.testing.assert_allclose(resumed.history["loss"],
                               reference.history["loss"][1:], rtol=1e-6)
    np.testing.assert_allclose(resumed.history["mae"],
                               reference.history["mae"][1:], rtol=1e-6)
    assert not os.path.exists(backup_dir)  # deleted once fit completed
    assert model._initial_epoch is None  # a later fit starts at epoch 0


def test_backup_at_epoch_ends_restores_callback_state(tmp_path):
    backup_dir = str(tmp_path / "backup")
    model = make_model()
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    with pytest.raises(Interrupt):
        fit(model, [kd.callbacks.BackupAndRestore(backup_dir), stopper,
                    InterruptAt(14)])
    best_before = stopper.best
    metadata = ckpt.read_metadata(ckpt.latest_checkpoint(backup_dir))
    assert (metadata["epoch"], metadata["step"]) == (2, 0)
    model = make_model()
    stopper = keras.callbacks.EarlyStopping("loss", patience=50)
    history = fit(model, [kd.callbacks.BackupAndRestore(
        backup_dir, delete_checkpoint=False), stopper])
    assert len(history.history["loss"]) == 1
    assert stopper.best <= best_before
    assert ckpt.read_metadata(ckpt.latest_checkpoint(backup_dir))[
        "epoch"] == 3


def test_backup_keeps_early_stopping_best_weights(tmp_path):
    # mode="max" on a falling loss: the best epoch is the first, before the
    # interruption, so the resumed run must get its weights from the backup.
    backup_dir = str(tmp_path / "backup")

    def stopper():
        return keras.callbacks.EarlyStopping(
            "loss", mode="max", patience=50, restore_best_weights=True)

    model = make_model()
    first_epoch = []
    fit(model, [stopper(), keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: epoch or first_epoch.append(
            [w.copy() for w in model.get_weights()]))])
    expected = model.get_weights()
    for a, b in zip(expected, first_epoch[0]):  # restored at the end
        np.testing.assert_array_equal(a, b)
    model = make_model()
    with pytest.raises(Interrupt):
        fit(model, [kd.callbacks.BackupAndRestore(backup_dir, save_freq=4),
                    stopper(), InterruptAt(10)])
    assert any("best_weights" in key for key, _ in ckpt.list_variables(
        ckpt.latest_checkpoint(backup_dir)))
    model = make_model()
    resumed_stopper = stopper()
    fit(model, [kd.callbacks.BackupAndRestore(backup_dir, save_freq=4),
                resumed_stopper])
    assert resumed_stopper.best_epoch == 0
    for a, b in zip(expected, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_sharded_checkpoint_callback_keeps_latest_and_best(tmp_path):
    x, y = data()
    model = make_model()
    directory = str(tmp_path / "run")
    callback = kd.callbacks.ShardedCheckpoint(
        directory, max_to_keep=2, monitor="val_loss")
    history = model.fit(x, y, batch_size=16, epochs=5, verbose=0,
                        validation_data=(x[:32], y[:32]), callbacks=[callback])
    steps = [6 * (e + 1) for e in range(5)]
    assert [os.path.basename(p) for p in ckpt.checkpoints_in(directory)] == [
        f"ckpt-{steps[-2]}", f"ckpt-{steps[-1]}"]
    losses = history.history["val_loss"]
    best_two = sorted(range(5), key=lambda e: losses[e])[:2]
    assert sorted(os.listdir(callback.best_directory)) == sorted(
        f"ckpt-{steps[e]}" for e in best_two)
    for e in best_two:
        meta = ckpt.read_metadata(os.path.join(callback.best_directory,
                                               f"ckpt-{steps[e]}"))
        assert meta["monitor_value"] == pytest.approx(losses[e])
    # The latest one holds the final weights; export them for Keras.
    weights_file = str(tmp_path / "final.weights.h5")
    ckpt.export_weights(ckpt.latest_checkpoint(directory), make_model(),
                        weights_file)
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16),
                              keras.layers.Dropout(0.25),
                              keras.layers.Dense(2)])
    plain.load_weights(weights_file)
    for a, b in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_save_best_only_writes_improvements_only(tmp_path):
    x, y = data()
    model = make_model()
    callback = kd.callbacks.ShardedCheckpoint(
        str(tmp_path / "run"), monitor="loss", save_best_only=True,
        max_to_keep=1, async_save=False)
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                        callbacks=[callback])
    (kept,) = ckpt.checkpoints_in(callback.best_directory)
    assert ckpt.read_metadata(kept)["monitor_value"] == pytest.approx(
        min(history.history["loss"]))
    assert ckpt.checkpoints_in(str(tmp_path / "run")) == []
    # A resumed run goes on numbering after the best one kept (it never
    # replaces it) and still writes only improvements.
    best_loss = min(history.history["loss"])
    again = kd.callbacks.ShardedCheckpoint(
        str(tmp_path / "run"), monitor="loss", save_best_only=True,
        max_to_keep=2, async_save=False)
    more = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                     callbacks=[again])
    improvements = [best_loss]
    for loss in more.history["loss"]:
        if loss < improvements[-1]:
            improvements.append(loss)
    kept_now = ckpt.checkpoints_in(callback.best_directory)
    assert [ckpt.read_metadata(p)["monitor_value"] for p in kept_now] == (
        pytest.approx(improvements[-2:]))
    first_number = int(kept.rsplit("-", 1)[1])
    assert all(int(p.rsplit("-", 1)[1]) > first_number
               for p in kept_now if p != kept)


def test_callback_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a "
                       "positive number.*Received: save_freq=0"):
        kd.callbacks.BackupAndRestore(str(tmp_path), save_freq=0)
    with pytest.raises(ValueError, match="needs a metric to compare"):
        kd.callbacks.ShardedCheckpoint(str(tmp_path), save_best_only=True)
    with pytest.raises(ValueError, match="mode must be"):
        kd.callbacks.ShardedCheckpoint(str(tmp_path), mode="best")
    with pytest.raises(ValueError, match="directory must name"):
        kd.callbacks.BackupAndRestore("")
    x, y = data()
    model = make_model()
    with pytest.raises(ValueError, match="monitors 'val_acc', which is not "
                       "in the logs"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[
            kd.callbacks.ShardedCheckpoint(str(tmp_path), monitor="val_acc")])
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    unbuilt.compile(optimizer="sgd", loss="mse")
    callback = kd.callbacks.BackupAndRestore(str(tmp_path / "b"))
    callback.set_model(unbuilt)
    with pytest.raises(ValueError, match="needs a built model"):
        callback.on_train_begin()


def make_plain_model():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def trained():
    model = make_plain_model()
    x, y = data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model


def test_manager_keeps_the_last_n_and_one_every_n_steps(tmp_path):
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer)
    os.makedirs(tmp_path / "ckpt-0.tmp")  # left by an interrupted run
    manager = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2,
                                     keep_every_n_steps=30)
    assert not os.path.exists(tmp_path / "ckpt-0.tmp")
    assert manager.restore_or_initialize() is None
    for step in (10, 20, 30, 40, 50, 60):
        manager.save(checkpoint_number=step)
    assert [os.path.basename(p) for p in manager.checkpoints] == [
        "ckpt-50", "ckpt-60"]
    assert listing(tmp_path) == ["ckpt-10", "ckpt-40", "ckpt-50",
                                            "ckpt-60"]
    with pytest.raises(ValueError, match="checkpoint_number must grow"):
        manager.save(checkpoint_number=60)
    # A new manager (a restarted run) finds them again.
    again = ckpt.CheckpointManager(
        ckpt.ShardedCheckpoint(model=make_plain_model()), str(tmp_path),
        max_to_keep=2)
    assert again.latest_checkpoint.endswith("ckpt-60")
    assert again.restore_or_initialize().endswith("ckpt-60")
    with pytest.raises(ValueError, match="max_to_keep must be a positive"):
        ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=0)


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_keeps_the_best_n_by_a_metric(tmp_path, async_save):
    # orbax's best_fn, tf.keras ModelCheckpoint(save_best_only) for more
    # than one: the kept ones are the best, not the newest.
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    options = ckpt.CheckpointOptions(enable_async=async_save)
    manager = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2,
                                     best_metric="val_loss")
    assert manager.best_checkpoint is None and manager.best_value is None
    assert not manager.would_keep({"val_loss": float("nan")})  # even empty
    losses = {1: 0.5, 2: 0.3, 3: 0.9, 4: float("nan"), 5: 0.4, 6: 0.4}
    written = {}
    for number, loss in losses.items():
        written[number] = manager.save(checkpoint_number=number,
                                       options=options,
                                       metadata={"val_loss": loss})
    manager.sync()
    # 3 (worse than both kept), 4 (NaN) and 6 (only equal to the worst
    # kept) are not written at all; 1 went when 5 was committed.
    assert [n for n, path in written.items() if path is None] == [3, 4, 6]
    assert listing(tmp_path) == ["ckpt-2", "ckpt-5"]
    assert manager.best_checkpoint.endswith("ckpt-2")
    assert manager.best_value == pytest.approx(0.3)
    assert manager.latest_checkpoint.endswith("ckpt-5")
    assert manager.would_keep({"val_loss": 0.35})
    assert not manager.would_keep({"val_loss": 0.45})
    # A restarted run ranks what it finds; higher is better with "max".
    manager.close()
    again = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2,
                                   best_metric="val_loss")
    assert again.best_checkpoint.endswith("ckpt-2")
    assert again.save(metadata={"val_loss": 0.1}).endswith("ckpt-6")
    assert listing(tmp_path) == ["ckpt-2", "ckpt-6"]
    again.close()
    with pytest.raises(ValueError, match=r"ranked by metadata\['val_loss'\]"
                       r".*Received: metadata=\{'loss': 0.2\}"):
        again.save(metadata={"loss": 0.2})
    with pytest.raises(ValueError, match="keep_every_n_steps keeps "
                       "checkpoints by age"):
        ckpt.CheckpointManager(checkpoint, str(tmp_path), best_metric="acc",
                               keep_every_n_steps=5)
    with pytest.raises(ValueError, match="best_mode must be 'min'.*"
                       "Received: best_mode='best'"):
        ckpt.CheckpointManager(checkpoint, str(tmp_path), best_metric="acc",
                               best_mode="best")
    with pytest.raises(ValueError, match="best_metric must name a metadata "
                       "entry.*Received: best_metric=''"):
        ckpt.CheckpointManager(checkpoint, str(tmp_path), best_metric="")


def test_best_retention_deletes_only_what_its_owner_wrote(tmp_path):
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    # Written by hand (no owner), with the metric: ranked, never deleted.
    foreign = checkpoint.write(str(tmp_path / "ckpt-1"),
                               metadata={"acc": 0.1})
    manager = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=1,
                                     best_metric="acc", best_mode="max")
    assert manager.best_checkpoint == foreign
    manager.save(metadata={"acc": 0.7})
    assert listing(tmp_path) == ["ckpt-1", "ckpt-2"]
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-2"]
    manager.close()


@pytest.mark.parametrize("async_save", [False, True])
def test_save_link_keeps_a_copy_without_writing_it_again(tmp_path,
                                                         async_save):
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    options = ckpt.CheckpointOptions(enable_async=async_save)
    latest = ckpt.CheckpointManager(checkpoint, str(tmp_path / "run"),
                                    max_to_keep=1)
    best = ckpt.CheckpointManager(checkpoint, str(tmp_path / "best"),
                                  max_to_keep=1, best_metric="loss",
                                  owner="best-of-run")
    kept = []
    for number, loss in ((1, 0.5), (2, 0.9), (3, 0.2)):
        saved = latest.save(checkpoint_number=number, options=options,
                            metadata={"loss": loss})
        kept.append(best.save_link(saved, checkpoint_number=number,
                                   metadata={"loss": loss}))
    latest.sync()
    assert kept[1] is None  # worse than the one kept
    assert listing(tmp_path / "run") == ["ckpt-3"]
    assert listing(tmp_path / "best") == ["ckpt-3"]
    source, copy = str(tmp_path / "run" / "ckpt-3"), kept[2]
    from keras_distribute.checkpoint.storage import ownership

    assert ownership.owner_of(source) == "CheckpointManager/ckpt"
    assert ownership.owner_of(copy) == "best-of-run"
    shards = [name for name in os.listdir(source) if name != "index.json"]
    assert shards and all(os.path.samefile(os.path.join(source, name),
                                           os.path.join(copy, name))
                          for name in shards)  # linked, not written again
    fresh = make_plain_model()
    ckpt.ShardedCheckpoint(model=fresh).read(copy).assert_consumed()
    for a, b in zip(model.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    # A link whose source failed to save links and deletes nothing.
    from keras_distribute.checkpoint.storage import writing as ckpt_writing

    def broken_disk(*args, **kwargs):
        raise OSError("No space left on device")

    original = ckpt_writing._write_shards
    ckpt_writing._write_shards = broken_disk
    try:
        failed = ckpt.CheckpointOptions(enable_async=True)
        saved = latest.save(checkpoint_number=4, options=failed,
                            metadata={"loss": 0.1})
        best.save_link(saved, checkpoint_number=4, metadata={"loss": 0.1})
        with pytest.raises(OSError, match="No space left"):
            latest.sync()
    finally:
        ckpt_writing._write_shards = original
    assert listing(tmp_path / "best") == ["ckpt-3"]
    assert best.checkpoints == [copy] and latest.checkpoints == [source]
    latest.close()
    best.close()


def test_manager_interval_step_counter_and_init_fn(tmp_path):
    # tf.train.CheckpointManager(..., step_counter=, checkpoint_interval=,
    # init_fn=): saves closer than the interval are skipped (None).
    step = keras.Variable(0.0, trainable=False)
    initialized = []
    checkpoint = ckpt.ShardedCheckpoint(step=step)
    manager = ckpt.CheckpointManager(
        checkpoint, str(tmp_path), max_to_keep=None, step_counter=step,
        checkpoint_interval=10, init_fn=lambda: initialized.append(True))
    assert manager.restore_or_initialize() is None and initialized == [True]
    saved = []
    for _ in range(25):
        step.assign_add(1.0)
        saved.append(manager.save(checkpoint_number=step) is not None)
    assert [i + 1 for i, s in enumerate(saved) if s] == [1, 11, 21]
    assert manager.save(checkpoint_number=26) is None  # 5 steps after 21
    assert manager.save(checkpoint_number=26,
                        check_interval=False).endswith("ckpt-26")
    assert [os.path.basename(p) for p in manager.checkpoints] == [
        "ckpt-1", "ckpt-11", "ckpt-21", "ckpt-26"]
    # A restarted run: the interval counts from the restored step.
    step.assign(0.0)
    again = ckpt.CheckpointManager(
        checkpoint, str(tmp_path), max_to_keep=None, step_counter=step,
        checkpoint_interval=10, init_fn=lambda: initialized.append(True))
    assert again.restore_or_initialize().endswith("ckpt-26")
    assert float(step) == 25.0 and initialized == [True]
    step.assign(30.0)
    assert again.save(checkpoint_number=step) is None
    with pytest.raises(ValueError, match="pass step_counter="):
        ckpt.CheckpointManager(checkpoint, str(tmp_path),
                               checkpoint_interval=5)
    with pytest.raises(ValueError, match="checkpoint_interval must be a "
                                         "positive"):
        ckpt.CheckpointManager(checkpoint, str(tmp_path), step_counter=step,
                               checkpoint_interval=0)


def test_restore_of_none_initializes_as_in_the_tf_checkpoint_guide(
        tmp_path):
    # status = ckpt.restore(manager.latest_checkpoint): None on a first run.
    model = trained()
    initial = state(model)
    checkpoint = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer)
    manager = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=3)
    assert manager.latest_checkpoint is None
    status = checkpoint.restore(manager.latest_checkpoint)
    status.expect_partial()
    with pytest.raises(AssertionError, match="No checkpoint was given"):
        status.assert_consumed()
    for a, b in zip(initial, state(model)):
        np.testing.assert_array_equal(a, b)  # untouched
    path = manager.save()
    again = ckpt.ShardedCheckpoint(model=make_plain_model())
    again.restore(manager.latest_checkpoint).expect_partial()
    assert again.save_counter == 1 and path == manager.latest_checkpoint


def guide_loop(directory, steps, make_iterator):
    """The TF "Training checkpoints" guide's train_and_checkpoint, ported:
    a step variable, the net, its optimizer and the input iterator."""
    net = make_plain_model()
    checkpoint = ckpt.ShardedCheckpoint(
        step=keras.Variable(1, trainable=False), optimizer=net.optimizer,
        net=net,
        iterator=make_iterator())
    manager = ckpt.CheckpointManager(checkpoint, directory, max_to_keep=3)
    checkpoint.restore(manager.latest_checkpoint)
    first_inputs = []
    for _ in range(steps):
        x, y = (t.numpy() for t in next(checkpoint.iterator))
        first_inputs.append(float(x[0, 0]))
        net.train_on_batch(x, y)
        checkpoint.step.assign_add(1)
        if int(checkpoint.step) % 5 == 0:
            manager.save()
    return net, checkpoint, manager, first_inputs


def test_training_checkpoints_guide_loop_resumes_the_iterator(tmp_path):
    tf = pytest.importorskip("tensorflow")
    x, y = data()

    def make_iterator():  # the pipeline a restarted program builds again
        return iter(tf.data.Dataset.from_tensor_slices((x, y)).repeat()
                    .shuffle(64, seed=3).batch(8))

    whole, _, _, whole_inputs = guide_loop(
        str(tmp_path / "whole"), 14, make_iterator)
    # Interrupted after 11 steps (last save at step 10 = 9 batches read) ...
    guide_loop(str(tmp_path / "cut"), 11, make_iterator)
    # ... and started again: step, optimizer, net and input position return.
    resumed, checkpoint, manager, resumed_inputs = guide_loop(
        str(tmp_path / "cut"), 5, make_iterator)
    assert int(checkpoint.step) == 15
    assert resumed_inputs == whole_inputs[9:]
    for a, b in zip(state(whole), state(resumed)):
        np.testing.assert_array_equal(a, b)
    assert [os.path.basename(p) for p in manager.checkpoints] == [
        "ckpt-1", "ckpt-2", "ckpt-3"]
    assert sorted(k for k, _ in ckpt.list_variables(
        manager.latest_checkpoint) if k.startswith("iterator")) == [
        "iterator/process-00000", "iterator/signature-00000"]


def test_int_and_float_of_scalar_variables_made_in_scope():
    # `if int(ckpt.step) % 10 == 0` with the step made in a strategy's
    # scope: on TF the Keras variable holds a MirroredVariable.
    with strategy_scope():
        step = keras.Variable(1, trainable=False)
        rate = keras.Variable(0.5)
    step.assign_add(1)
    assert int(step) == 2 and float(rate) == 0.5 and int(rate) == 0
    with pytest.raises(TypeError):
        int(keras.Variable(np.ones(2, "float32")))


def test_checkpoint_objects_are_attributes(tmp_path):
    tf = pytest.importorskip("tensorflow")
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    assert checkpoint.model is model
    checkpoint.step = keras.Variable(7, trainable=False)  # now tracked
    checkpoint.iterator = iter(tf.data.Dataset.range(10))
    next(checkpoint.iterator)
    path = checkpoint.save(str(tmp_path / "c"))
    assert {k for k, _ in ckpt.list_variables(path)} >= {
        "step", "iterator/process-00000"}
    other = ckpt.ShardedCheckpoint(model=make_plain_model(),
                                   step=keras.Variable(0, trainable=False),
                                   iterator=iter(tf.data.Dataset.range(10)))
    other.restore(path).assert_consumed()
    assert int(other.step) == 7 and int(next(other.iterator)) == 1
    # Without the iterator: reported, accepted by expect_partial.
    partial = ckpt.ShardedCheckpoint(model=make_plain_model(),
                                     step=keras.Variable(0, trainable=False))
    status = partial.restore(path)
    with pytest.raises(AssertionError, match="iterator/process-00000"):
        status.assert_consumed()
    status.expect_partial()
    del other.iterator
    with pytest.raises(AttributeError, match="no object 'iterator'.*'model'"):
        other.iterator
    with pytest.raises(ValueError, match="'save' is a ShardedCheckpoint "
                                         "method"):
        ckpt.ShardedCheckpoint(save=keras.Variable(1.0))
    with pytest.raises(ValueError, match="tf.data iterators. Received: "
                                         "data/0=int"):
        checkpoint.data = [1, 2]  # a list of objects is fine; of ints not
    with pytest.raises(ValueError, match="step=ResourceVariable.*"
                       r"step=keras.Variable\(value\)"):
        ckpt.ShardedCheckpoint(step=tf.Variable(1))
    # An iterator of another pipeline does not fit the saved state.
    wrong = ckpt.ShardedCheckpoint(
        iterator=iter(tf.data.Dataset.range(10).map(lambda v: (v, v))))
    with pytest.raises(ckpt.CheckpointError, match="does not fit"):
        wrong.restore(path)


def test_async_save_returns_after_the_copy_and_reraises_failures(
        tmp_path, monkeypatch):
    from keras_distribute.checkpoint.storage import writing as ckpt_writing

    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer)
    options = ckpt.CheckpointOptions(enable_async=True)
    first = checkpoint.save(str(tmp_path / "c"), options=options)
    expected = state(model)
    model.fit(*data(), epochs=1, verbose=0)  # changes weights meanwhile
    checkpoint.sync()
    fresh = make_plain_model()
    fresh.optimizer.build(fresh.trainable_variables)
    ckpt.ShardedCheckpoint(model=fresh, optimizer=fresh.optimizer).read(
        first).assert_consumed()
    for a, b in zip(expected, state(fresh)):
        np.testing.assert_array_equal(a, b)

    def broken_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt_writing, "_write_shards", broken_disk)
    checkpoint.save(str(tmp_path / "c"), options=options)  # returns
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(str(tmp_path / "c"), options=options)
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(str(tmp_path)) == first
    assert sorted(os.listdir(tmp_path)) == ["c-1"]
    checkpoint.sync()  # the failure was raised once
    assert checkpoint.save(str(tmp_path / "c")).endswith("c-3")  # 2 failed
    assert ckpt.CheckpointOptions(
        experimental_enable_async_checkpoint=True).enable_async


def test_async_saves_reuse_their_host_buffers(tmp_path):
    # #15: the copy an asynchronous save makes goes into host memory kept
    # from the save before (no fresh allocation once warm), and each
    # checkpoint still holds the values of its own moment.
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer)
    options = ckpt.CheckpointOptions(enable_async=True)

    def buffer_addresses():
        return {key: buffer.ctypes.data for key, buffer
                in checkpoint._checkpointer.host_buffers._buffers.items()}

    paths, states = [], []
    for _ in range(2):
        paths.append(checkpoint.save(str(tmp_path / "c"), options=options))
        states.append(state(model))
        if len(paths) == 1:
            first_buffers = buffer_addresses()
        model.fit(*data(), epochs=1, verbose=0)  # changes weights meanwhile
    checkpoint.sync()
    assert first_buffers and buffer_addresses() == first_buffers
    for path, expected in zip(paths, states):
        fresh = make_plain_model()
        fresh.optimizer.build(fresh.trainable_variables)
        ckpt.ShardedCheckpoint(model=fresh, optimizer=fresh.optimizer).read(
            path).assert_consumed()
        for a, b in zip(expected, state(fresh)):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(states[0][0], states[1][0])


def test_manager_forgets_a_background_save_that_failed(tmp_path,
                                                      monkeypatch):
    from keras_distribute.checkpoint.storage import writing as ckpt_writing

    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    manager = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=1)
    first = manager.save()
    options = ckpt.CheckpointOptions(enable_async=True)

    def broken_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt_writing, "_write_shards", broken_disk)
    manager.save(options=options)  # returns; fails in the background
    with pytest.raises(OSError, match="No space left"):
        manager.sync()
    monkeypatch.undo()
    assert manager.latest_checkpoint == first and manager.checkpoints == [
        first]
    assert ckpt.latest_checkpoint(str(tmp_path)) == first  # kept on disk
    later = manager.save(options=options)
    manager.sync()
    assert manager.checkpoints == [later] and not os.path.exists(first)


def corrupt_largest_piece(path):
    """Flips one byte inside the data of a checkpoint's largest dataset."""
    import h5py

    shard = os.path.join(path, "shards-00000.h5")
    with h5py.File(shard, "r") as h5:
        datasets = []
        h5.visititems(lambda name, node: datasets.append(node.id.get_offset())
                      if isinstance(node, h5py.Dataset) and node.size > 40
                      else None)
    with open(shard, "r+b") as f:
        f.seek(datasets[0] + 3)
        byte = f.read(1)
        f.seek(datasets[0] + 3)
        f.write(bytes([byte[0] ^ 0x10]))


def test_backup_falls_back_to_the_older_backup_when_the_newest_is_corrupt(
        tmp_path):
    backup_dir = str(tmp_path / "backup")
    model = make_model()
    reference = fit(model, [])
    expected = state(model)
    model = make_model()
    with pytest.raises(Interrupt):  # in epoch 2: backups of epochs 0 and 1
        fit(model, [kd.callbacks.BackupAndRestore(backup_dir),
                    InterruptAt(15)])
    newest = ckpt.latest_checkpoint(backup_dir)
    assert ckpt.read_metadata(newest)["epoch"] == 2
    corrupt_largest_piece(newest)
    model, moved = make_model(), []
    with pytest.warns(UserWarning, match="resuming from the older backup"):
        resumed = fit(model, [kd.callbacks.BackupAndRestore(backup_dir),
                              keras.callbacks.LambdaCallback(
                                  on_epoch_begin=lambda *_: moved.append(
                                      sorted(n for n in os.listdir(
                                          backup_dir) if n[0] != ".")))])
    assert moved[0] == ["backup-1", os.path.basename(newest) + ".corrupt"]
    assert len(resumed.history["loss"]) == 2  # epochs 1 and 2 again
    np.testing.assert_allclose(resumed.history["loss"],
                               reference.history["loss"][1:], rtol=1e-6)
    for a, b in zip(expected, state(model)):
        np.testing.assert_array_equal(a, b)
    assert not os.path.exists(backup_dir)  # the finished run cleaned up


def test_restore_is_deferred_until_the_variables_exist(tmp_path):
    model = trained()
    path = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer
                                  ).write(str(tmp_path / "c"))
    keras.utils.set_random_seed(9)
    fresh = keras.Sequential([keras.layers.Dense(5), keras.layers.Dense(2)])
    fresh.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    status = ckpt.ShardedCheckpoint(model=fresh, optimizer=fresh.optimizer
                                    ).read(path)
    with pytest.raises(AssertionError, match="do not exist yet"):
        status.assert_consumed()
    fresh.build((None, 6))                       # the model's variables ...
    fresh.optimizer.build(fresh.trainable_variables)   # ... and the slots
    status.assert_consumed()
    for a, b in zip(state(model), state(fresh)):
        np.testing.assert_array_equal(a, b)


def test_read_can_require_a_match_first_or_restore_only_what_exists(
        tmp_path):
    model = trained()
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    # A model with more variables than saved: refused before any assign.
    bigger = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                               keras.layers.Dense(2), keras.layers.Dense(2)])
    before = bigger.get_weights()
    with pytest.raises(ckpt.CheckpointMismatchError, match="holds no value "
                       "for.*Nothing was restored"):
        ckpt.ShardedCheckpoint(model=bigger).read(
            path, require_existing_matched=True)
    for a, b in zip(before, bigger.get_weights()):
        np.testing.assert_array_equal(a, b)
    # An optimizer whose slots do not exist yet: defer=False restores now
    # what exists (its iteration count) and nothing later.
    saved = ckpt.ShardedCheckpoint(optimizer=model.optimizer).write(
        str(tmp_path / "o"))
    fresh = keras.optimizers.Adam(1e-2)
    checkpoint = ckpt.ShardedCheckpoint(optimizer=fresh)
    status = checkpoint.read(saved, defer=False)
    assert int(fresh.iterations) == int(model.optimizer.iterations) > 0
    fresh.build(make_plain_model().trainable_variables)
    assert not any(np.any(keras.ops.convert_to_numpy(v.value))
                   for v in fresh.variables[2:])  # slots left as made
    with pytest.raises(AssertionError):
        status.assert_consumed()


class SubclassedNet(keras.Model):
    """The TF guides' subclassed model: no variables before its first call."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))


@pytest.mark.parametrize("in_scope", [True, False])
def test_subclassed_model_restored_before_its_first_call(tmp_path, in_scope):
    # Regression: the first call builds the layers under Keras' stateless
    # symbolic build, which discarded the deferred restore, and
    # assert_consumed() then passed with the fresh weights.
    x = data()[0][:4]
    with strategy_scope(in_scope):
        keras.utils.set_random_seed(1)
        saved = SubclassedNet()
        saved(x)
        path = ckpt.ShardedCheckpoint(model=saved).write(str(tmp_path / "c"))
        keras.utils.set_random_seed(2)
        fresh = SubclassedNet()
        status = ckpt.ShardedCheckpoint(model=fresh).read(path)
        with pytest.raises(AssertionError, match="do not exist yet"):
            status.assert_consumed()
        out = keras.ops.convert_to_numpy(fresh(x))
    status.assert_consumed()
    for a, b in zip(saved.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The first call's output already used the restored weights.
    np.testing.assert_allclose(out, keras.ops.convert_to_numpy(saved(x)),
                               rtol=1e-6, atol=1e-6)


def test_built_model_with_fewer_variables_is_restored_partially(tmp_path):
    model = trained()
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    with strategy_scope():
        smaller = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5)])
    status = ckpt.ShardedCheckpoint(model=smaller).read(path)
    for a, b in zip(model.get_weights()[:2], smaller.get_weights()):
        np.testing.assert_array_equal(a, b)
    status.assert_existing_objects_matched()  # as tf.train.Checkpoint
    with pytest.raises(AssertionError, match="checkpoint only: "
                       "\\['model/2', 'model/3'\\]"):
        status.assert_consumed()


def test_list_and_load_variables(tmp_path):
    model = trained()
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    assert ckpt.list_variables(path)[0] == ("model/0", (6, 5))
    np.testing.assert_array_equal(ckpt.load_variable(path, "model/0"),
                                  model.get_weights()[0])
    with pytest.raises(KeyError, match="has no variable 'model/9'"):
        ckpt.load_variable(path, "model/9")
    with pytest.raises(ValueError, match="end in '.weights.h5'"):
        ckpt.export_weights(path, model, str(tmp_path / "w.h5"))


def test_load_checkpoint_reader_as_in_the_tf_guide(tmp_path):
    # reader = tf.train.load_checkpoint('./tf_ckpts/'): a directory of
    # numbered checkpoints means its latest one.
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model,
                                        step=keras.Variable(3.0))
    checkpoint.save(str(tmp_path / "ckpt"))
    checkpoint.step.assign(4.0)
    checkpoint.save(str(tmp_path / "ckpt"))
    reader = ckpt.load_checkpoint(str(tmp_path))
    assert reader.path.endswith("ckpt-2")
    shapes = reader.get_variable_to_shape_map()
    assert shapes["step"] == () and shapes["model/0"] == (6, 5)
    assert reader.get_variable_to_dtype_map()["step"] == np.float32
    assert reader.has_tensor("model/3") and not reader.has_tensor("x")
    assert reader.get_tensor("step") == 4.0
    np.testing.assert_array_equal(reader.get_tensor("model/0"),
                                  model.get_weights()[0])
    assert ckpt.list_variables(str(tmp_path)) == sorted(shapes.items())
    assert ckpt.load_variable(str(tmp_path), "step") == 4.0
    assert ckpt.read_metadata(str(tmp_path))["save_counter"] == 2
    with pytest.raises(KeyError, match="no variable 'x'"):
        reader.get_tensor("x")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load_checkpoint(str(tmp_path / "nothing"))


def test_an_interrupted_commit_is_read_in_place_and_recovered_by_the_manager(
        tmp_path):
    model = trained()
    path = ckpt.ShardedCheckpoint(model=model).save(str(tmp_path / "c"))
    os.replace(path, path + ".old")  # died between the commit's renames
    before = sorted(os.listdir(tmp_path))
    # Every way to read it finds it, and none changes the disk (#44: a read
    # renamed it back): the writer or the manager does, explicitly.
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    assert ckpt.checkpoints_in(str(tmp_path)) == [path]
    restored = make_plain_model()
    ckpt.ShardedCheckpoint(model=restored).read(path).expect_partial()
    for saved, read in zip(model.get_weights(), restored.get_weights()):
        np.testing.assert_array_equal(saved, read)
    assert dict(ckpt.list_variables(path)) == dict(
        ckpt.list_variables(str(tmp_path)))
    np.testing.assert_array_equal(ckpt.load_variable(path, "model/0"),
                                  model.get_weights()[0])
    assert ckpt.load_checkpoint(path).has_tensor("model/0")
    assert ckpt.read_metadata(str(tmp_path))["save_counter"] == 1
    assert sorted(os.listdir(tmp_path)) == before
    with ckpt.CheckpointManager(ckpt.ShardedCheckpoint(model=model),
                                str(tmp_path), checkpoint_name="c"):
        assert sorted(os.listdir(tmp_path)) == sorted(["c-1", LEASE])
    assert os.path.isfile(os.path.join(path, "index.json"))


KILLED_SAVER = textwrap.dedent("""
    import sys, numpy as np, keras, keras_distribute as kd
    big = keras.Variable(np.ones((2048, 4096), "float32"))  # 32 MiB
    checkpoint = kd.checkpoint.ShardedCheckpoint(big=big)
    checkpoint.save(sys.argv[1])                 # big-1: complete
    big.assign(big * 2.0)
    print("saved", flush=True)
    for _ in range(100):          # replaces big-1; killed during one of these
        checkpoint.write(sys.argv[1] + "-1")
""")


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    prefix = str(tmp_path / "big")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    process = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, prefix],
                               env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while not os.path.exists(prefix + "-1.tmp"):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(0.05)  # in the middle of writing shards
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(30)
    assert process.returncode == -signal.SIGKILL
    # Either the old or a new complete checkpoint, never a mix or nothing.
    assert ckpt.latest_checkpoint(str(tmp_path)) == prefix + "-1"
    big = keras.Variable(np.zeros((2048, 4096), "float32"))
    ckpt.ShardedCheckpoint(big=big).read(prefix + "-1").assert_consumed()
    value = keras.ops.convert_to_numpy(big.value)
    low, high = float(value.min()), float(value.max())
    assert low == high and low in (1.0, 2.0)
    manager = ckpt.CheckpointManager(ckpt.ShardedCheckpoint(big=big),
                                     str(tmp_path), checkpoint_name="big")
    assert listing(tmp_path) == ["big-1"]  # unfinished: cleaned
    assert manager.latest_checkpoint == prefix + "-1"


def test_nested_checkpoints_lists_and_dicts_as_in_the_tf_guide(tmp_path):
    # The TF guide's `tf.train.Checkpoint(l1=tf.train.Checkpoint(...))`,
    # and list/dict attributes: refused before.
    model = trained()
    extra = [keras.Variable(np.arange(3.0)), keras.layers.Dense(2)]
    extra[1].build((None, 4))
    root = ckpt.ShardedCheckpoint(
        l1=ckpt.ShardedCheckpoint(net=model, step=keras.Variable(7.0)),
        items=extra, table={"scale": keras.Variable(np.full(2, 3.0))})
    path = root.write(str(tmp_path / "c"))
    keys = [key for key, _ in ckpt.list_variables(path)]
    assert "l1/step" in keys and "l1/net/0" in keys and "items/0" in keys
    assert "items/1/0" in keys and "table/scale" in keys
    fresh_extra = [keras.Variable(np.zeros(3)), keras.layers.Dense(2)]
    fresh = make_plain_model()
    step, scale = keras.Variable(0.0), keras.Variable(np.zeros(2))
    status = ckpt.ShardedCheckpoint(
        l1=ckpt.ShardedCheckpoint(net=fresh, step=step),
        items=fresh_extra, table={"scale": scale}).read(path)
    fresh_extra[1].build((None, 4))  # deferred until built
    status.assert_consumed()
    assert float(step.numpy()) == 7.0
    np.testing.assert_array_equal(fresh_extra[0].numpy(), [0.0, 1.0, 2.0])
    for a, b in zip(extra[1].get_weights() + model.get_weights(),
                    fresh_extra[1].get_weights() + fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="Dict keys of saved objects must be "
                       "strings"):
        ckpt.ShardedCheckpoint(table={(1, 2): keras.Variable(1.0)})


def test_a_dropped_checkpoint_keeps_its_deferred_restore(tmp_path):
    # A guide's resume in one expression, before the optimizer is built:
    # the checkpoint object is collected at once, its optimizer restore
    # must still arrive (tf.train.Checkpoint keeps it) - and it must not
    # keep the model alive once nothing waits.
    import gc
    import weakref

    model = trained()
    path = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer
                                  ).write(str(tmp_path / "c"))
    keras.utils.set_random_seed(9)
    fresh = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                              keras.layers.Dense(2)])
    fresh.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ckpt.ShardedCheckpoint(model=fresh, optimizer=fresh.optimizer
                           ).restore(path)
    gc.collect()
    fresh.optimizer.build(fresh.trainable_variables)
    for a, b in zip(state(model), state(fresh)):
        np.testing.assert_array_equal(a, b)
    assert int(fresh.optimizer.iterations) == int(
        model.optimizer.iterations) > 0
    # Applied: nothing of it is held any more.
    from keras_distribute.checkpoint import restoring
    assert not restoring.kept_after_drop
    # Dropped with its objects, never built: released with them.
    other = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                              keras.layers.Dense(2)])
    other.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ckpt.ShardedCheckpoint(model=other, optimizer=other.optimizer
                           ).restore(path)
    gc.collect()
    assert len(restoring.kept_after_drop) == 1
    model_ref = weakref.ref(other)
    del other
    gc.collect()
    assert model_ref() is None  # not held: collected with its optimizer
    assert not restoring.kept_after_drop


def test_checkpoint_numbers_of_any_size_order_exactly(tmp_path):
    # A nanosecond timestamp as the step (19 digits) and a number past
    # int64: ordered as integers, seen by a new manager, and a save is
    # never numbered below one that exists.
    timestamp = 1796656304171905536
    model = trained()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    manager = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=9)
    saved = [manager.save(checkpoint_number=timestamp - 5),
             manager.save(checkpoint_number=timestamp), manager.save()]
    assert saved[-1] == str(tmp_path / f"ckpt-{timestamp + 1}")
    manager.close()
    again = ckpt.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=9)
    assert again.checkpoints == saved
    assert again.restore_or_initialize() == saved[-1]
    assert again.save() == str(tmp_path / f"ckpt-{timestamp + 2}")
    huge = 10**30
    assert again.save(checkpoint_number=huge) == str(
        tmp_path / f"ckpt-{huge}")
    assert ckpt.checkpoints_in(str(tmp_path))[-1] == str(
        tmp_path / f"ckpt-{huge}")
    assert ckpt.latest_checkpoint(str(tmp_path)) == str(
        tmp_path / f"ckpt-{huge}")
    again.close()
