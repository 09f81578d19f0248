"""Bodies of the multi-process torch tests; each runs in every launched rank.

Module-level so that `kd.launch` can send them to the worker processes.
"""

import os
import sys

import numpy as np
from worker_common import Interrupt
from worker_common import fit_while_rank_one_hangs
from worker_common import initial_weights  # noqa: F401
from worker_common import interrupt_at
from worker_common import make_data  # noqa: F401
from worker_common import make_model  # noqa: F401
from worker_common import recorded_regional_reads
from worker_common import train_unless_rank_one

BATCH = 32


def _setup():
    import torch

    torch.set_num_threads(1)


class RecordLogs:
    """A callback factory: records the logs every batch and epoch sees."""

    @staticmethod
    def make():
        import keras

        class Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.batch_logs, self.epoch_logs = [], []

            def on_train_batch_end(self, batch, logs=None):
                self.batch_logs.append(dict(logs))

            def on_epoch_end(self, epoch, logs=None):
                self.epoch_logs.append(dict(logs))

        return Recorder()


def fit_evaluate_predict(seed_per_rank=True):
    """Fit (short last batch), evaluate, predict; report what each rank saw."""
    _setup()

    import keras_distribute as kd

    x, y = make_data()
    strategy = kd.MirroredStrategy()
    rank = int(os.environ["RANK"])
    with strategy.scope():
        model = make_model()
        # Different initial weights per rank: the rank-0 broadcast must win.
        rng = np.random.default_rng(100 + rank)
        model.set_weights([w + rng.normal(size=w.shape).astype("float32")
                           for w in initial_weights()])
        if rank == 0:
            model.set_weights(initial_weights())
    recorder = RecordLogs.make()
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                        verbose=0, callbacks=[recorder])
    return {
        "replicas": strategy.num_replicas_in_sync,
        "history": history.history,
        "batch_logs": recorder.batch_logs,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
        "predict": model.predict(x, batch_size=BATCH, verbose=0),
        "predict_on_batch": np.asarray(model.predict_on_batch(x[:13])),
        "train_on_batch": model.train_on_batch(x[:13], y[:13]),
        # (nothing here seeds through keras.utils.set_random_seed, which
        # imports TensorFlow to seed it where it is installed)
        "tensorflow_imported": "tensorflow" in sys.modules,
    }


def docs_examples():
    """The tf.distribute documentation examples, on 2 process-replicas."""
    _setup()
    import keras

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    out = {}
    local = lambda v: [np.asarray(t).tolist()  # noqa: E731
                       for t in strategy.experimental_local_results(v)]
    # range(4).batch(2):
    dataset = [np.arange(2 * i, 2 * i + 2) for i in range(2)]
    out["doubled"] = [
        local(strategy.run(lambda x: x * 2, args=(x,)))
        for x in strategy.experimental_distribute_dataset(dataset)]
    ids = strategy.run(
        lambda: kd.get_replica_context().replica_id_in_sync_group)
    out["ids"] = local(ids)
    out["sum_ids"] = float(strategy.reduce("SUM", ids, axis=None))
    array_value = np.array([3.0, 2.0, 1.0])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group])
    out["array_value"] = local(values)
    out["all_reduce"] = local(strategy.run(
        lambda: kd.get_replica_context().all_reduce("sum", 1.0)))
    out["all_gather"] = local(strategy.run(
        lambda: kd.get_replica_context().all_gather(
            np.array([1, 2, 3]), axis=0)))
    pair = strategy.experimental_distribute_values_from_function(
        lambda _: np.array([[1], [2]]))
    out["gather_shape"] = tuple(strategy.gather(pair, axis=0).shape)
    halves = strategy.experimental_distribute_values_from_function(
        lambda ctx: (np.arange(4, dtype="float32")
                     + 4 * ctx.replica_id_in_sync_group))
    out["reduce_none"] = np.asarray(
        strategy.reduce("sum", halves, axis=None)).tolist()
    out["reduce_axis0"] = float(strategy.reduce("mean", halves, axis=0))
    # A short batch of 6 over 2 replicas: the mean divides by 6.
    short = list(strategy.experimental_distribute_dataset(
        [np.arange(8.0), np.arange(8.0, 14.0)]))[-1]
    out["short_mean"] = float(strategy.reduce("mean", short, axis=0))
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id,
                         ctx.num_replicas_in_sync))
        return [np.full((2,), ctx.input_pipeline_id)]

    out["from_function"] = [local(x) for x in
                            strategy.distribute_datasets_from_function(dataset_fn)]
    out["contexts"] = contexts
    out["avg_loss"] = float(strategy.reduce("sum", strategy.run(
        lambda: kd.compute_average_loss(keras.ops.ones((3,)))), axis=None))
    return out


def custom_loop():
    """torch backward + all_reduce of gradients under `run` == fit."""
    _setup()
    import keras
    import torch

    import keras_distribute as kd

    x, y = make_data(n=128)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model(initial_weights())
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        # Updated inside `run` on each process: read global, as on TF.
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        mean = keras.metrics.Mean()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)
    global_batch = 32
    # The tf.distribute issue's example: range(8), 4 values per process.
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(4.0) + 4 * ctx.replica_id_in_sync_group)
    strategy.run(mean.update_state, args=(values,))

    def step(xb, yb):
        logits = model(xb)
        accuracy.update_state(yb, logits)
        loss = kd.compute_average_loss(loss_fn(yb, logits),
                                       global_batch_size=global_batch)
        model.zero_grad()
        loss.backward()
        weights = model.trainable_variables
        grads = kd.get_replica_context().all_reduce(
            "sum", [v.value.grad for v in weights])
        with torch.no_grad():
            optimizer.apply(grads, weights)
        return loss

    batches = [(x[i:i + global_batch], y[i:i + global_batch])
               for i in range(0, 128, global_batch)]
    losses, accuracies = [], []
    for _ in range(2):
        for xb, yb in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.run(step, args=(xb, yb))
            losses.append(float(strategy.reduce("sum", per_replica, axis=None)))
        accuracies.append(float(accuracy.result()))
        accuracy.reset_state()
    return {"weights": model.get_weights(), "losses": losses,
            "accuracies": accuracies, "mean": float(mean.result())}


def train_step_loop():
    """The same loop with `kd.train_step` (the backend-neutral step)."""
    _setup()
    from worker_common import train_step_loop as loop

    import keras_distribute as kd

    x, y = make_data(n=128)
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 128, 32)]
    return loop(kd.MirroredStrategy(), batches)


def input_types():
    """fit on tf.data, a PyDataset and a torch DataLoader: same weights."""
    _setup()
    import keras
    import tensorflow as tf
    import torch

    import keras_distribute as kd

    x, y = make_data(n=96)
    strategy = kd.MirroredStrategy()

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32]

    sources = {
        "tf_data": tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
        "py_dataset": Batches(),
        "data_loader": torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)),
            batch_size=32),
    }
    weights = {}
    for name, source in sources.items():
        with strategy.scope():
            model = make_model(initial_weights())
        model.fit(source, epochs=2, verbose=0)
        weights[name] = model.get_weights()
    return weights


def single_process_info():
    import keras_distribute as kd

    return kd.MirroredStrategy().num_replicas_in_sync


def raise_on_rank_one():
    if os.environ["RANK"] == "1":
        raise KeyError("rank one is broken")
    return "ok"


def die_on_rank_one_during_training():
    """Rank 1 dies mid-training; rank 0 must fail within the timeout."""
    _setup()
    import keras

    import keras_distribute as kd

    x, y = make_data(n=256)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model(initial_weights())

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and os.environ["RANK"] == "1":
                os._exit(3)

    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, callbacks=[Die()])
    return "finished"


def rank_and_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def how_it_started(tag):
    """What a launched process took from the launcher (starting.py)."""
    import signal
    import sys

    print(f"launched process {os.environ['RANK']} says {tag}", flush=True)
    return {"parent": os.getppid(), "keras_preloaded": "keras" in sys.modules,
            "tensorflow_preloaded": "tensorflow" in sys.modules,
            "tag": os.environ.get("KD_TEST_TAG"),
            "random": float(np.random.rand()),
            "sigint": signal.getsignal(signal.SIGINT)
            is signal.default_int_handler}


def timeout_setting():
    """The communication timeout a launched process reads (kd's own
    KERAS_DISTRIBUTE_TIMEOUT, from the environment it was given)."""
    from keras_distribute.common import cross_device_ops

    return cross_device_ops.communication_timeout_s()


def fit_quiet():
    """fit with nothing reading batch logs: epoch logs must still be global."""
    _setup()
    import keras_distribute as kd

    x, y = make_data()
    with kd.MirroredStrategy().scope():
        model = make_model(initial_weights())
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0)
    return history.history


def multi_worker_from_tf_config(port):
    """MultiWorkerMirroredStrategy from TF_CONFIG (torchrun vars removed)."""
    _setup()
    import json

    import keras_distribute as kd

    rank = int(os.environ["RANK"])
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                 "KERAS_DISTRIBUTION_JOB_ADDRESSES",
                 "KERAS_DISTRIBUTION_NUM_PROCESSES",
                 "KERAS_DISTRIBUTION_PROCESS_ID"):
        os.environ.pop(name)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
        "task": {"type": "worker", "index": rank}})
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    resolver = strategy.cluster_resolver
    x, y = make_data(n=100)
    with strategy.scope():
        model = make_model(initial_weights())
    history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False,
                        verbose=0)
    return {"replicas": strategy.num_replicas_in_sync,
            "task": (resolver.task_type, resolver.task_id, resolver.is_chief),
            "weights": model.get_weights(), "history": history.history}


def multi_worker_peer_never_joins(port):
    """Only worker 0 of a 2-worker TF_CONFIG starts: a clear timeout."""
    import json
    import time

    import keras_distribute as kd

    os.environ.pop("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
        "task": {"type": "worker", "index": 0}})
    start = time.monotonic()
    try:
        kd.MultiWorkerMirroredStrategy(
            communication_options=kd.CommunicationOptions(timeout_seconds=3))
    except TimeoutError as error:
        return str(error), time.monotonic() - start
    return "joined", time.monotonic() - start


def fit_with_file_callbacks(directory):
    """ModelCheckpoint, CSVLogger, BackupAndRestore and EarlyStopping."""
    _setup()
    import keras

    import keras_distribute as kd

    x, y = make_data(n=96)
    with kd.MirroredStrategy().scope():
        model = make_model(initial_weights())
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(directory, "ckpt_{epoch}.weights.h5"),
            save_weights_only=True),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
        # Stops once the (global) loss improves by less than 10 %.
        keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.1,
                                      patience=0),
    ]
    history = model.fit(x, y, batch_size=32, epochs=20, verbose=0,
                        callbacks=callbacks)
    return len(history.history["loss"]), model.get_weights()


def rank_dependent_callbacks_and_saves(directory):
    """Horovod-style programs: a ModelCheckpoint on the chief only (per the
    migration table's `hvd.rank() == 0`), every process loading the chief's
    file after fit, `model.save` + `load_model` in every process, and
    kd's BackupAndRestore in both."""
    _setup()
    import keras

    import keras_distribute as kd

    x, y = make_data(n=96)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model(initial_weights())
    chief_file = os.path.join(directory, "chief.weights.h5")
    callbacks = [keras.callbacks.ModelCheckpoint(
        chief_file, save_weights_only=True)] if (
            strategy.extended.should_checkpoint) else []
    callbacks.append(kd.callbacks.BackupAndRestore(
        os.path.join(directory, "backup"), save_freq=2))
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=callbacks)
    with strategy.scope():
        loaded = make_model()
    loaded.load_weights(chief_file)  # written by the chief before fit ended
    reloaded = []
    for _ in range(3):
        path = os.path.join(directory, "model.keras")
        model.save(path)  # every process, the same path
        reloaded.append(keras.saving.load_model(path).get_weights())
    return {"weights": model.get_weights(),
            "loaded": loaded.get_weights(), "reloaded": reloaded}


def peer_leaves_early():
    """Rank 1 returns at once; rank 0 must fail within the timeout."""
    _setup()
    os.environ["KERAS_DISTRIBUTE_TIMEOUT"] = "10"
    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    return train_unless_rank_one(strategy)


def freeze_on_rank_one():
    """Rank 1 stops itself (SIGSTOP) after joining; rank 0 trains and must
    fail within the timeout, the launch blaming rank 1."""
    _setup()
    os.environ["KERAS_DISTRIBUTE_TIMEOUT"] = "5"
    import signal

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
    return train_unless_rank_one(strategy)


def hang_on_rank_one():
    """Rank 1 hangs alive in a callback; rank 0's collective fails within
    the timeout with `kd.WorkerLostError` naming rank 1."""
    _setup()
    os.environ["KERAS_DISTRIBUTE_TIMEOUT"] = "5"
    import keras_distribute as kd

    try:
        return fit_while_rank_one_hangs(kd.MirroredStrategy())
    except kd.WorkerLostError as error:
        assert error.rank == 1 and isinstance(error.__cause__, RuntimeError)
        raise


def auto_shard_policies(directory):
    """What each worker reads under FILE, DATA, AUTO and OFF."""
    _setup()
    import tensorflow as tf

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    files = [os.path.join(directory, f"part{i}.txt") for i in range(2)]
    seen = {}
    for policy in ("FILE", "DATA", "AUTO", "OFF"):
        dataset = tf.data.TextLineDataset(files).map(
            lambda line: tf.strings.to_number(line, tf.int32)).batch(2)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, policy)
        dataset = dataset.with_options(options)
        seen[policy] = [
            [int(v) for v in np.asarray(
                strategy.experimental_local_results(x)[0])]
            for x in strategy.experimental_distribute_dataset(dataset)]
    return seen


def sharded_checkpoints(directory):
    """Checkpoint callbacks in a 2-process group."""
    _setup()
    from worker_common import fit_with_sharded_checkpoints

    import keras_distribute as kd

    return fit_with_sharded_checkpoints(kd.MultiWorkerMirroredStrategy(),
                                        directory)


# ------------------------------------------------- sharded layouts (DTensor)
def sharded_optimizer():
    """The optimizer of the sharded-layout runs and of their one-process
    reference: Adam with a global norm clip that cuts most steps (the
    global norm over gradients sharded in several ways, e.g. DTensors on
    two meshes under FSDP)."""
    import keras

    return keras.optimizers.Adam(1e-2, global_clipnorm=0.3)


def make_sharded_parts(seed=3, dropout=True):
    """A model with a sharded Embedding, a column- then row-sharded Dense
    pair and a plain Dense, its data, and the layout map's (key, axes)
    entries."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(12, 8, name="embed"),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu", name="up"),
        keras.layers.Dropout(0.2 if dropout else 0.0),
        keras.layers.Dense(3, name="down"),
        keras.layers.Dense(3, name="plain"),  # not in the map: stays plain
    ])
    rng = np.random.default_rng(1)
    x = rng.integers(0, 12, size=(100, 5)).astype("int32")
    y = rng.normal(size=(100, 3)).astype("float32")
    layouts = [(".*embed/embeddings", (None, "model")),
               (".*up/kernel", (None, "model")), (".*up/bias", ("model",)),
               (".*down/kernel", ("model", None))]
    return model, x, y, layouts


def sharded_fit(directory):
    """fit / evaluate / predict / checkpoint with layouts sharded over 2
    processes (DTensor); returns what rank 0 and 1 saw."""
    _setup()
    import keras

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         devices=["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    _, x, y, layouts = make_sharded_parts()
    for key, axes in layouts:
        layout_map[key] = axes
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    with strategy.scope():
        model, _, _, _ = make_sharded_parts()
        model.compile(optimizer=sharded_optimizer(), loss="mse",
                      metrics=["mae"])
    initial = model.get_weights()
    # Keras' file callbacks: the chief writes; reading the sharded weights
    # is a collective the other process joins (no deadlock).
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(directory, "keras.weights.h5"),
            save_weights_only=True),
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"),
                                         delete_checkpoint=False),
        kd.callbacks.ShardedCheckpoint(os.path.join(directory, "latest"),
                                       max_to_keep=1)]
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                        verbose=0, callbacks=callbacks)
    local_shapes = [tuple(v.value.to_local().shape) if hasattr(
        v.value, "to_local") else None for v in model.weights]
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    path = checkpoint.write(os.path.join(directory, "ckpt"))
    # Export reads the sharded weights whole: every process takes part.
    kd.checkpoint.export_weights(path, model, os.path.join(
        directory, "export.weights.h5"))
    weights = model.get_weights()
    # A restore into a freshly made sharded model gives the same weights.
    with strategy.scope():
        fresh, _, _, _ = make_sharded_parts(seed=9)
        fresh.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    kd.checkpoint.ShardedCheckpoint(model=fresh).read(path).expect_partial()
    restored = fresh.get_weights()
    # set_weights gives each process its part of whole values.
    fresh.set_weights(initial)
    reset = fresh.get_weights()
    errors = {}
    indivisible = keras.distribution.LayoutMap(mesh)
    indivisible[".*odd/kernel"] = (None, "model")
    with kd.MirroredStrategy(layout_map=indivisible).scope():
        try:
            keras.layers.Dense(5, name="odd").build((None, 4))
        except ValueError as error:
            errors["indivisible"] = str(error)
    unmatched = keras.distribution.LayoutMap(mesh)
    unmatched["up/kernel"] = (None, "model")  # not the whole path
    with kd.MirroredStrategy(layout_map=unmatched).scope():
        other, _, _, _ = make_sharded_parts()
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            other.compile(optimizer="sgd", loss="mse")
        errors["unmatched"] = " ".join(str(w.message) for w in caught)
    outside, _, _, _ = make_sharded_parts()  # built outside the scope
    try:
        with strategy.scope():
            outside.compile(optimizer="sgd", loss="mse")
    except ValueError as error:
        errors["outside"] = str(error)
    return {
        "mesh": mesh_report(strategy, model, layout_map),
        "reset": reset,
        "errors": errors,
        "replicas": strategy.num_replicas_in_sync,
        "initial": initial,
        "history": history.history,
        "weights": weights,
        "restored": restored,
        "local_shapes": local_shapes,
        "layout": strategy.describe_layout(model, print_fn=lambda s: None),
        "evaluate": model.evaluate(x, y, batch_size=16, verbose=0),
        "predict": model.predict(x, batch_size=16, verbose=0),
        "optimizer": [keras.ops.convert_to_numpy(v) for v in
                      model.optimizer.variables],
    }


def resume_mid_epoch(directory):
    """An uninterrupted fit, then one interrupted mid-epoch and resumed by
    kd.callbacks.BackupAndRestore; returns both histories and weights."""
    _setup()
    import keras

    import keras_distribute as kd

    x, y = make_data(n=96)
    strategy = kd.MirroredStrategy()

    def fit(callbacks):
        with strategy.scope():
            model = make_model(initial_weights())
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=True,
                            verbose=0, callbacks=callbacks)
        return model, history.history

    keras.utils.set_random_seed(4)
    reference, expected = fit([])
    keras.utils.set_random_seed(4)
    try:  # 6 steps per epoch: a backup after step 8 = epoch 1, batch 2
        fit([kd.callbacks.BackupAndRestore(directory, save_freq=4),
             interrupt_at(10)])
    except Interrupt:
        pass
    keras.utils.set_random_seed(99)  # a new run: other RNG states
    resumed, history = fit([kd.callbacks.BackupAndRestore(directory,
                                                          save_freq=4)])
    return {"expected": expected, "history": history,
            "reference": reference.get_weights(),
            "resumed": resumed.get_weights()}


def mesh_report(strategy, model, layout_map):
    """The torch mesh the sharded engine uses and, for each sharded
    variable, its placements next to those Keras' torch backend gives its
    layout (Keras 3.16; None on Keras without a torch distribution)."""
    import keras
    from torch.distributed.tensor import DTensor

    engine = strategy.engine
    mesh = layout_map.device_mesh
    report = {"ranks": engine.torch_mesh.mesh.tolist(),
              "model_ranks": engine.model_mesh.mesh.tolist(),
              "names": list(engine.torch_mesh.mesh_dim_names),
              "keras_layouts": engine.keras_layouts}
    if keras.version() >= "3.16":
        keras_mesh = mesh if len(mesh.shape) > 1 else engine.keras_mesh
        report["is_keras_backend_mesh"] = (
            engine.torch_mesh is keras_mesh.backend_mesh)

        def keras_placements(variable):
            layout = layout_map[variable.path]  # None: replicated
            axes = layout.axes if layout else [None] * len(variable.shape)
            return keras.distribution.TensorLayout(
                axes, keras_mesh).backend_layout.placements[1:]

        report["placements"] = [
            (str(v.value.placements), str(keras_placements(v)))
            for v in model.weights if isinstance(v.value, DTensor)]
    return report


def sharded_data_parallel_fit(directory):
    """2 replicas x 2 model shards (4 processes): fit, predict, checkpoint."""
    _setup()
    import keras

    import keras_distribute as kd

    # Listed out of rank order: the names place the processes (ranks 0
    # and 2 hold replica 0 between them, 1 and 3 replica 1).
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], ["cpu:0", "cpu:2", "cpu:1", "cpu:3"])
    layout_map = keras.distribution.LayoutMap(mesh)
    _, x, y, layouts = make_sharded_parts(dropout=False)
    for key, axes in layouts:
        layout_map[key] = axes
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    with strategy.scope():
        model, _, _, _ = make_sharded_parts(dropout=False)
        model.compile(optimizer=sharded_optimizer(), loss="mse",
                      metrics=["mae"])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                        verbose=0)
    path = kd.checkpoint.ShardedCheckpoint(model=model).write(
        os.path.join(directory, "ckpt"))

    # Interrupted in epoch 1 (7 steps per epoch), resumed by BackupAndRestore.
    def fit(callbacks):
        with strategy.scope():
            again, _, _, _ = make_sharded_parts(dropout=False)
            again.compile(optimizer=sharded_optimizer(), loss="mse",
                          metrics=["mae"])
        logs = again.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                         verbose=0, callbacks=callbacks)
        return again, logs.history

    backup = os.path.join(directory, "backup")
    try:
        fit([kd.callbacks.BackupAndRestore(backup, save_freq=4),
             interrupt_at(10)])
    except Interrupt:
        pass
    resumed, resumed_history = fit([kd.callbacks.BackupAndRestore(
        backup, save_freq=4)])
    weights = model.get_weights()
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
    predicted = model.predict(x, batch_size=16, verbose=0)
    # The divergence check compares the pieces that several processes
    # hold (here each model-axis half, on its 2 replicas): one replica's
    # half changed behind the optimizer's back is named.
    strategy.check_replicas_agree(model)  # no error
    import torch

    kernel = model.get_layer("up").kernel
    if torch.distributed.get_rank() == 1:  # replica 1, the first half
        with torch.no_grad():
            kernel.value.to_local().add_(1.0)
    try:
        strategy.check_replicas_agree(model)
        diverged = None
    except kd.ReplicasDivergedError as raised:
        diverged = (raised.variable, str(raised))
    return {
        "diverged": diverged,
        "up_kernel_path": kernel.path,
        "mesh": mesh_report(strategy, model, layout_map),
        "resumed": resumed.get_weights(),
        "resumed_history": resumed_history,
        "replicas": strategy.num_replicas_in_sync,
        "history": history.history,
        "weights": weights,
        "local_shapes": [tuple(v.value.to_local().shape) if hasattr(
            v.value, "to_local") else None for v in model.weights],
        "evaluate": evaluated,
        "predict": predicted,
        "path": path,
    }


def sharded_transformer_block():
    """The transformer block with its attention and feed-forward kernels
    sharded over 2 processes (DTensor); returns the trained weights."""
    _setup()
    import keras
    from worker_common import TRANSFORMER_LAYOUTS
    from worker_common import transformer_block
    from worker_common import transformer_data

    import keras_distribute as kd

    # A 1-D mesh: all model axis, one replica over both processes.
    mesh = keras.distribution.DeviceMesh((2,), ["model"], ["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in TRANSFORMER_LAYOUTS:
        layout_map[key] = axes
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    with strategy.scope():
        model = transformer_block()
    x, y = transformer_data()
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    query = model.get_layer("attention")._query_dense.kernel.value
    return {"weights": model.get_weights(),
            "replicas": strategy.num_replicas_in_sync,
            "mesh": mesh_report(strategy, model, layout_map),
            "query_local": tuple(query.to_local().shape)}


def keras_callbacks_resume(directory):
    """Keras' own file callbacks, interrupted and resumed (2 ranks)."""
    _setup()
    from worker_common import keras_callbacks_resume as body

    import keras_distribute as kd

    return body(kd.MirroredStrategy(), directory)


def diverged_random_states():
    """Each rank seeds differently, then builds the model."""
    _setup()
    from worker_common import diverged_random_states as body

    import keras_distribute as kd

    return body(kd.MirroredStrategy())


def counting_metrics_and_one_ddp():
    """Counting metrics (TruePositives: its result is a view of its
    variable) and the number of DDP wrappers and metric all-reduces."""
    _setup()
    import torch

    import keras_distribute as kd

    made = []
    original_init = torch.nn.parallel.DistributedDataParallel.__init__

    def counting_init(self, *args, **kwargs):
        made.append(type(args[0]).__name__)
        original_init(self, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel.__init__ = counting_init
    import keras
    from worker_common import counting_metrics_fit

    strategy = kd.MirroredStrategy()
    current = []

    class Current(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            current.append(keras.distribution.distribution())

    with strategy.scope():
        history, evaluation, model = counting_metrics_fit(
            callbacks=[Current()])
    ddp_group = getattr(model, "ddp_model", None)
    reductions = []
    original_all_reduce = torch.distributed.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        reductions.append(tuple(tensor.shape))
        return original_all_reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting_all_reduce
    try:
        results = {k: float(v) for k, v in model.get_metrics_result().items()}
    finally:
        torch.distributed.all_reduce = original_all_reduce
    distribution = strategy.distribution
    return {"history": history, "evaluate": evaluation, "results": results,
            "ddp": made, "reductions": reductions,
            "distribution": None if distribution is None else {
                "type": type(distribution).__name__,
                "devices": list(distribution.device_mesh.devices.flat),
                "keras_devices": keras.distribution.list_devices(),
                "auto_shard_dataset": distribution.auto_shard_dataset,
                "current_in_fit": current[0] is distribution,
                "ddp_group_is_the_mesh_group": ddp_group is not None and (
                    ddp_group.process_group
                    is distribution.device_mesh.backend_mesh.get_group(
                        "batch"))}}


def mixed_precision(policy):
    """`fit` under a mixed policy on 2 ranks, then a step whose gradient is
    non-finite on rank 0 only (its half of the global batch)."""
    _setup()
    import keras

    import keras_distribute as kd

    keras.mixed_precision.set_dtype_policy(policy)
    x, y = make_data(n=96)
    with kd.MirroredStrategy().scope():
        model = make_model(initial_weights())
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                        verbose=0).history
    trained = model.get_weights()
    skipped = None
    if policy == "mixed_float16":
        scale = float(keras.ops.convert_to_numpy(
            model.optimizer.dynamic_scale))
        poisoned = x[:32].copy()
        poisoned[0, 0] = np.inf  # in rank 0's rows only
        model.train_on_batch(poisoned, y[:32])
        skipped = {
            "unchanged": all(np.array_equal(a, b) for a, b in
                             zip(model.get_weights(), trained)),
            "scale_before": scale,
            "scale_after": float(keras.ops.convert_to_numpy(
                model.optimizer.dynamic_scale))}
    return {"loss": history["loss"], "weights": trained,
            "dtypes": sorted({v.dtype for v in model.trainable_variables}),
            "skipped": skipped}


def compressed_all_reduce():
    """The digits fit with and without 16-bit gradient all-reduce."""
    _setup()
    from worker_training import compressed_all_reduce as body

    return body()


def training_features(directory):
    """Gradient accumulation, Horovod helpers and PreemptionCheckpoint on
    one strategy (worker_training.py)."""
    _setup()
    from worker_training import training_features as body

    import keras_distribute as kd

    return body(kd.MirroredStrategy(), directory)


def preemption_handler(directory):
    """kd.experimental.PreemptionCheckpointHandler's loop (2 processes)."""
    _setup()
    from worker_training import preemption_handler as body

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    return body(strategy, directory)


def run_with_different_metric_variables():
    """Rank 1 holds an extra "sum" metric variable (as chief-only work or the
    garbage collector leave them) when `run` updates a metric: the processes
    combine the variables they share, and no collective goes out of step."""
    _setup()
    import keras

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    with strategy.scope():
        mean = keras.metrics.Mean(name="shared")
        if strategy.cluster_resolver is None and int(
                os.environ["RANK"]) == 1:
            extra = keras.metrics.Sum(name="only_on_rank_1")
            extra.update_state(5.0)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(4.0) + 4 * ctx.replica_id_in_sync_group)
    results = []
    for _ in range(2):
        strategy.run(mean.update_state, args=(values,))
        results.append(float(mean.result()))
    return results


def wrong_lengths():
    """Every mistake of array lengths, in every rank: the error each raised
    (none may reach a collective, where gloo would abort the other)."""
    import keras

    import keras_distribute as kd

    _setup()
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model(initial_weights())
    x, y = make_data()
    calls = {
        "fit y": lambda: model.fit(x, y[:-3], batch_size=BATCH, verbose=0),
        "fit sample_weight": lambda: model.fit(
            x, y, sample_weight=np.ones(len(x) - 1), batch_size=BATCH,
            verbose=0),
        "fit validation_data": lambda: model.fit(
            x, y, validation_data=(x[:10], y[:9]), batch_size=BATCH,
            verbose=0),
        "evaluate": lambda: model.evaluate(x[:-1], y, verbose=0),
        "train_on_batch": lambda: model.train_on_batch(x[:8], y[:7]),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    # The job still works afterwards: the same numbers in every rank.
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return errors, history.history["loss"], keras.ops.convert_to_numpy(
        model.weights[0].value)


def run_returns_plain_values():
    """keras-io's "Multi-GPU distributed training with PyTorch", ported to
    `strategy.run`: the step's loss is read with `.item()`."""
    import torch

    import keras_distribute as kd

    _setup()
    strategy = kd.MirroredStrategy()
    rank = int(os.environ["RANK"])

    def step(x):
        return torch.sum(x) * (rank + 1)

    loss = strategy.run(step, args=(torch.ones(3),))
    rows = strategy.run(lambda: torch.full((2, 1), float(rank)))
    return {
        "type": type(loss).__name__,
        "item": loss.item(),
        "sum": float(strategy.reduce("SUM", loss, axis=None)),
        "mean": float(strategy.reduce("MEAN", loss, axis=None)),
        "gathered": strategy.gather(rows, axis=0).flatten().tolist(),
        "local": len(strategy.experimental_local_results(loss)),
        "numpy": float(kd.numpy(loss)),
    }


def batchnorm_one_state(directory):
    """#30: BatchNorm statistics and every other variable, 2 processes."""
    from worker_common import batchnorm_fit_every_variable

    import keras_distribute as kd

    _setup()
    return batchnorm_fit_every_variable(kd.MirroredStrategy(), directory)


def different_training():
    from worker_common import different_training as body

    import keras_distribute as kd

    _setup()
    return body(kd.MirroredStrategy(), int(os.environ["RANK"]))


def keras_tuner_search(directory):
    from worker_common import keras_tuner_search as body

    import keras_distribute as kd

    _setup()
    # Each process keeps its own oracle files (keras-tuner writes them).
    return body(kd.MirroredStrategy(),
                os.path.join(directory, os.environ["RANK"]))


def unknown_cardinality():
    """#30: a tf.data pipeline whose cardinality tf.data does not know (a
    filter, as keras-hub preprocessing pipelines have): the per-process fit
    and the same pipeline of known length give the same numbers."""
    import keras
    import tensorflow as tf

    import keras_distribute as kd

    _setup()
    x, y = make_data(n=96)
    known = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    unknown = known.filter(lambda features, labels: True)
    assert int(unknown.cardinality()) == -2
    results = []
    for dataset in (known, unknown):
        with kd.MirroredStrategy().scope():
            model = make_model(initial_weights())
        history = model.fit(dataset, epochs=2, verbose=0)
        results.append((history.history["loss"], model.evaluate(
            dataset, verbose=0), [keras.ops.convert_to_numpy(w)
                                  for w in model.weights]))
    return results


def compiled_fit():
    """`jit_compile=True` (Keras' step through `torch.compile`) under the
    strategy: the history, the weights, and how many frames dynamo compiled
    by the end of the first epoch and of the third (the same when no step
    recompiles)."""
    _setup()
    import keras
    import torch

    import keras_distribute as kd

    x, y = make_data()
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model(initial_weights())
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], jit_compile=True)
    counters = torch._dynamo.utils.counters["frames"]
    modes = []  # dynamo's DDP setting while `fit` runs

    class ReadMode(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            modes.append(torch._dynamo.config.optimize_ddp)

    first = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                      verbose=0, callbacks=[ReadMode()]).history
    compiled_after_one = counters["total"]
    rest = model.fit(x, y, batch_size=BATCH, epochs=3, initial_epoch=1,
                     shuffle=False, verbose=0).history
    return {"loss": first["loss"] + rest["loss"],
            "weights": [w.tolist() for w in model.get_weights()],
            "jit_compile": model.jit_compile,
            "compiled": (compiled_after_one, counters["total"]),
            "mode_in_fit": modes,
            "mode_after_fit": torch._dynamo.config.optimize_ddp}


def listening_addresses():
    """The addresses this process listens on after a short fit (#43: a
    one-host job's store listened on every interface)."""
    import psutil

    import keras_distribute as kd

    _setup()
    x, y = make_data(n=64)
    with kd.MirroredStrategy().scope():
        model = make_model(initial_weights())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(
        kind="inet") if c.status == psutil.CONN_LISTEN})


def different_cluster_descriptions(change):
    """Process 1 is told of 3 processes (`change="count"`), or calls itself
    process 0 as well (`change="index"`), beside a process 0 told of 2
    (#43): the processes refuse before the group forms."""
    import os

    import keras_distribute as kd

    _setup()
    if int(os.environ["RANK"]) == 1:
        if change == "count":
            os.environ["WORLD_SIZE"] = "3"
        else:
            os.environ["RANK"] = "0"
    os.environ["KERAS_DISTRIBUTE_TIMEOUT"] = "20"
    kd.MirroredStrategy()
    return "trained"


FSDP_LAYOUTS = {
    # Every variable sharded over the batch axis (FSDP / ZeRO-3).
    "fsdp": [(".*embed/embeddings", ("batch", None)),
             (".*up/kernel", ("batch", None)), (".*up/bias", ("batch",)),
             (".*down/kernel", ("batch", None))],
    # Batch x model: both axes cut the embedding and the first kernel.
    "fsdp_x_model": [(".*embed/embeddings", ("batch", "model")),
                     (".*up/kernel", ("batch", "model")),
                     (".*up/bias", ("model",)),
                     (".*down/kernel", ("model", None))],
}


def every_optimizer_fully_sharded():
    """Every Keras optimizer's fit with every variable sharded over the 2
    processes (kd.layouts.fully_sharded, min_size=0: the small ones stay
    replicated on the model sub-mesh, beside the sharded ones)."""
    _setup()
    import keras
    from worker_common import every_optimizer_fit

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    return every_optimizer_fit(kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=0)))


def fully_sharded_fit(directory, shape, kind, restore_from=None):
    """fit / evaluate / predict / checkpoint with variables sharded over
    the batch axis (FSDP-style) on a `shape` mesh of processes; with
    `restore_from`, first a checkpoint written by another mesh is read
    into a fresh model (reshard N -> M)."""
    _setup()
    import keras

    import keras_distribute as kd

    size = int(np.prod(shape))
    mesh = keras.distribution.DeviceMesh(
        tuple(shape), ["batch", "model"][:len(shape)],
        [f"cpu:{r}" for r in range(size)])
    if kind == "one_line":  # the one-line FSDP, over a 1-D mesh
        layout_map = kd.layouts.fully_sharded(mesh, min_size=32)
    else:
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in FSDP_LAYOUTS.get(kind, ()):
            layout_map[key] = axes
    if kind == "one_line_x_model":  # composed with a model-axis map
        _, _, _, model_axis_layouts = make_sharded_parts()
        for key, axes in model_axis_layouts:
            layout_map[key] = axes
        layout_map = kd.layouts.fully_sharded(layout_map, min_size=32)
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    _, x, y, _ = make_sharded_parts(dropout=False)
    with strategy.scope():
        model, _, _, _ = make_sharded_parts(dropout=False)
        model.compile(optimizer=sharded_optimizer(), loss="mse",
                      metrics=["mae"])
    restored = None
    if restore_from is not None:
        with strategy.scope():
            fresh, _, _, _ = make_sharded_parts(seed=9, dropout=False)
        kd.checkpoint.ShardedCheckpoint(model=fresh).read(
            restore_from).expect_partial()
        restored = fresh.get_weights()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                        verbose=0)
    path = kd.checkpoint.ShardedCheckpoint(
        model=model, optimizer=model.optimizer).write(
            os.path.join(directory, "ckpt"))
    return {
        "replicas": strategy.num_replicas_in_sync,
        "history": history.history,
        "weights": model.get_weights(),
        "local_shapes": _local_shapes(model.weights),
        "slot_shapes": _local_shapes(model.optimizer.variables),
        "evaluate": model.evaluate(x, y, batch_size=16, verbose=0),
        "predict": model.predict(x, batch_size=16, verbose=0),
        "path": path,
        "restored": restored,
    }


def _local_shapes(variables):
    return [tuple(v.value.to_local().shape) if hasattr(
        v.value, "to_local") else None for v in variables]


def fully_sharded_load_weights(weights_path):
    """A model made under one-line FSDP over 2 processes loads a Keras
    `.weights.h5` / `.weights.json`: the regions each process read (HDF5
    hyperslabs through LazyH5Array) and the whole weights after."""
    _setup()
    import keras

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh((2,), ["batch"],
                                         ["cpu:0", "cpu:1"])
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=32))
    with strategy.scope():
        model, _, _, _ = make_sharded_parts(seed=9, dropout=False)
    with recorded_regional_reads() as read:
        model.load_weights(weights_path)
    return {"read": read,
            "local_shapes": [tuple(v.value.to_local().shape)
                             if hasattr(v.value, "to_local") else None
                             for v in model.weights],
            "weights": model.get_weights()}


def fully_sharded_step_memory(width=512, depth=4, rows=8, axis="batch"):
    """One process's step under one-line FSDP (every variable sharded over
    the batch axis; with `axis="model"`, every kernel cut by columns over
    the model axis of a (1, N) mesh instead: tensor parallelism): kd's
    estimate of its peak, and the real one — every storage Keras'
    train_step makes on this process's real tensors (a DTensor's local
    part), counted as made and freed, plus what was resident — and what is
    still alive when the forward pass ends."""
    _setup()

    import keras
    import torch
    from torch.distributed.tensor import DTensor

    import keras_distribute as kd
    from keras_distribute.backend.torch.storage_counting import LiveStorageBytes

    class LocalStorageBytes(LiveStorageBytes):
        # (a DTensor's storage is its local tensor's; made with
        # kernel_copies: gloo's collectives' staging buffers too, checked
        # against the resident memory by test_gloo_collectives_hold_...)
        def storage_holder(self, value):
            return value._local_tensor if isinstance(value, DTensor) else (
                value)

    size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    devices = [f"cpu:{r}" for r in range(size)]
    if axis == "model":
        mesh = keras.distribution.DeviceMesh((1, size), ["batch", "model"],
                                             devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        replicas = 1
    elif axis == "both":
        mesh = keras.distribution.DeviceMesh(
            (2, size // 2), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = ("batch", "model")
        replicas = 2
    else:
        mesh = keras.distribution.DeviceMesh((size,), ["batch"], devices)
        layout_map = kd.layouts.fully_sharded(mesh, min_size=0)
        replicas = size

    def make():
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, name=f"d{i}") for i in range(depth)])

    estimate = kd.layouts.estimate_memory(
        make, layout_map, batch_size=rows * replicas, optimizer="adam",
        loss="mse")
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    with strategy.scope():
        model = make()
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows * replicas, width)).astype("float32")
    model.fit(x, x, batch_size=rows * replicas, epochs=1, verbose=0)
    replica = rank // (size // replicas)
    mine = torch.as_tensor(x[replica * rows:(replica + 1) * rows])

    def local(variable):
        value = variable.value
        return value._local_tensor if isinstance(value, DTensor) else value

    resident = [local(v) for v in model.variables + model.optimizer.variables
                + model.metrics_variables] + [mine]
    resident_bytes = sum(t.untyped_storage().nbytes() for t in resident)
    with LocalStorageBytes(resident, kernel_copies=True) as live:
        model.train_step((mine, mine))
    with LocalStorageBytes(resident, kernel_copies=True) as forward:
        loss = keras.ops.mean(keras.ops.square(model(mine, training=True)
                                               - mine))
        after_forward = forward.live
        loss.backward()
    for variable in model.trainable_variables:
        variable.value.grad = None
    return {"estimate": estimate.peak, "method": estimate.method,
            "real": resident_bytes + live.peak,
            "after_forward": after_forward,
            "kernel_bytes": width * width * 4}


def model_parallel_mlp_step_memory():
    """One process's step of an MLP (256-1024-1024-10, batch 256) whose
    kernels `plan_layout` cuts over the model axis of a (1, 2) mesh: kd's
    estimate of what the step makes above what stays between steps, and
    the real count — every storage Keras' train_step makes on this
    process's real tensors (a DTensor's local part), with its kernels'
    copies; and, with Python's cycle collector off, whether a sharded
    layer's input outlives its call (a reference cycle keeping it)."""
    _setup()

    import gc
    import weakref

    import keras
    import torch
    from torch.distributed.tensor import DTensor

    import keras_distribute as kd
    from keras_distribute.backend.torch.storage_counting import LiveStorageBytes

    class LocalStorageBytes(LiveStorageBytes):
        def storage_holder(self, value):
            return value._local_tensor if isinstance(value, DTensor) else (
                value)

    def make():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((256,)),
            keras.layers.Dense(1024, activation="relu", name="dense_in"),
            keras.layers.Dense(1024, activation="relu", name="dense_mid"),
            keras.layers.Dense(10, name="dense_out")], name="mlp")

    size = int(os.environ["WORLD_SIZE"])
    mesh = keras.distribution.DeviceMesh(
        (1, size), ["batch", "model"], [f"cpu:{r}" for r in range(size)])
    plan = kd.layouts.plan_layout(make, mesh, fsdp=False)
    estimate = kd.layouts.estimate_memory(
        make, plan.layout_map, batch_size=256, optimizer="adam", loss="mse")
    with kd.MirroredStrategy(layout_map=plan.layout_map).scope():
        model = make()
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=(256, 256)).astype("float32"))
    y = torch.as_tensor(rng.normal(size=(256, 10)).astype("float32"))
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)

    def local(value):
        return value._local_tensor if isinstance(value, DTensor) else value

    held = ([local(v.value) for v in model.variables
             + model.optimizer.variables + model.metrics_variables]
            + [local(v.value.grad) for v in model.trainable_variables
               if v.value.grad is not None] + [x, y])
    with LocalStorageBytes(held, kernel_copies=True) as live:
        model.train_step((x, y))
    gc.collect()
    gc.disable()
    try:
        given = torch.as_tensor(rng.normal(size=(256, 1024)).astype(
            "float32"))
        given_ref = weakref.ref(given)
        output = model.get_layer("dense_mid")(given)
        del given, output
        input_outlives_call = given_ref() is not None
    finally:
        gc.enable()
    # (the gradients counted: the real step makes them, the last step's
    # held before it are not counted in either)
    return {"estimated": estimate.peak - estimate.parameters
            - estimate.optimizer - x.nbytes - y.nbytes,
            "real": live.peak, "method": estimate.method,
            "layouts": {path: tuple(layout.axes) for path, layout in
                        plan.layout_map.items()},
            "input_outlives_call": input_outlives_call}


def born_sharded_fit():
    """2 processes, one-line FSDP, random states diverged: a 4 MiB kernel
    whose GlorotUniform has no seed given (each process draws its own) is
    made as this process's half from process 0's seed, no draw of it
    whole, and a 4 MiB kernel of zeros as its half (no whole fill); then
    one fit epoch."""
    _setup()
    import random

    import keras
    import torch

    import keras_distribute as kd

    rank = int(os.environ["RANK"])
    mesh = keras.distribution.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh))
    largest = {"rand": [], "normal": [], "zeros": [], "ones": []}
    for name in largest:
        original = getattr(torch, name)

        def recording(*args, _original=original, _name=name, **kwargs):
            value = _original(*args, **kwargs)
            largest[_name].append(value.numel())
            return value

        setattr(torch, name, recording)
    random.seed(100 + rank)  # diverged: each process draws its own seed
    try:
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((1024,)),
                keras.layers.Dense(1024, name="big"),
                keras.layers.Dense(1024, kernel_initializer="zeros",
                                   name="zero"),
                keras.layers.Dense(3, name="head")])
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    finally:
        for name in largest:
            setattr(torch, name, getattr(torch, name).__kwdefaults__[
                "_original"])
    kernel = model.get_layer("big").kernel
    local = tuple(kernel.value.to_local().shape)
    initial = model.get_weights()
    x = np.random.default_rng(0).normal(size=(32, 1024)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    return {"own_seed": model.get_layer("big").kernel_initializer.seed,
            "local": local, "largest_draw": max(
                largest["rand"] + largest["normal"], default=0),
            "largest_fill": max(largest["zeros"] + largest["ones"],
                                default=0),
            "zero_local": tuple(
                model.get_layer("zero").kernel.value.to_local().shape),
            "initial": initial, "trained": model.get_weights()}


def small_cnn():
    """A CNN whose convolution kernels the tensor-parallel test shards."""
    import keras

    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((12, 12, 3)),
        keras.layers.Conv2D(8, 3, activation="relu", name="conv_a"),
        keras.layers.Conv2D(6, 3, activation="relu", name="conv_b"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3, name="head")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def small_cnn_data():
    rng = np.random.default_rng(2)
    return (rng.normal(size=(32, 12, 12, 3)).astype("float32"),
            rng.normal(size=(32, 3)).astype("float32"))


def sharded_convolutions():
    """2 processes, a (1, 2) mesh: conv_a's kernel and bias cut by output
    channels, conv_b's kernel by input channels (tensor parallelism, as
    `plan_layout` plans a CNN); fit 2 epochs."""
    _setup()
    import keras

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"],
                                         ["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*conv_a/kernel"] = (None, None, None, "model")
    layout_map[".*conv_a/bias"] = ("model",)
    layout_map[".*conv_b/kernel"] = (None, None, "model", None)
    with kd.MirroredStrategy(layout_map=layout_map).scope():
        model = small_cnn()
    x, y = small_cnn_data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return {"weights": model.get_weights(),
            "local": [tuple(model.get_layer(name).kernel.value.to_local()
                            .shape) for name in ("conv_a", "conv_b")]}


def gloo_collective_staging(rows=4096):
    """A gloo reduce-scatter of a whole (rows, 1024) tensor onto the
    processes, then an all-gather of one cut over them: each collective's
    peak resident memory above what was resident before it, and kd's count
    of it (the storages it makes and `kernel_copy_bytes`). The
    reduce-scatter comes first: gloo may reuse for its copy memory an
    earlier collective left it (then none of it shows in the resident
    set)."""
    _setup()
    import ctypes

    import torch
    from conftest import proc_status
    from conftest import reset_peak_resident
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import Partial

    from keras_distribute.backend.torch.storage_counting import LiveStorageBytes

    # glibc maps every block over 64 KiB on its own (M_MMAP_THRESHOLD):
    # freed tensors leave the resident set.
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    measured = {}
    cut = distribute_tensor(torch.rand(rows, 1024), mesh, [Shard(0)])
    partial = torch.distributed.tensor.DTensor.from_local(
        torch.rand(rows, 1024), mesh, [Partial()], run_check=False)
    for name, value, placement in (("reduce_scatter", partial, Shard(0)),
                                   ("all_gather", cut, Replicate())):
        before = reset_peak_resident()
        with LiveStorageBytes([value.to_local()],
                              kernel_copies=True) as counted:
            result = value.redistribute(mesh, [placement]).to_local()
            if isinstance(result, AsyncCollectiveTensor):
                result = result.wait()  # (measured once the work is done)
            real = proc_status("VmHWM") - before
        measured[name] = {"real": real, "counted": counted.peak,
                          "result": result.numel() * 4}
        del result
    return measured


def guide_model_parallel_unseeded(processes_per_replica=2):
    """keras-io's "Distributed training with Keras 3" model under
    `kd.MirroredStrategy(layout_map=...)`: d1 sharded over the model axis,
    a Dropout after it, no Keras seed set (each process's torch generator
    its own). Returns the weights after fit and whether fit raised."""
    _setup()
    import keras
    import torch

    import keras_distribute as kd

    world = int(os.environ["WORLD_SIZE"])
    # Each process's torch generator its own, as after any draw one rank
    # makes alone, or a script's `torch.manual_seed(seed + rank)`.
    torch.manual_seed(1000 + int(os.environ["RANK"]))
    mesh = keras.distribution.DeviceMesh(
        (world // processes_per_replica, processes_per_replica),
        ["batch", "model"], devices=[f"cpu:{r}" for r in range(world)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    with strategy.scope():
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
        hidden = keras.layers.Dropout(0.5)(hidden)
        outputs = keras.layers.Dense(4, name="d2")(hidden)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    try:
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        error = None
    except kd.ReplicasDivergedError as raised:
        error = str(raised)
    return {"error": error, "weights": model.get_weights()}


def _lora_model():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(64, activation="tanh",
                                                 name="up"),
                              keras.layers.Dense(8, name="down")])
    model.get_layer("up").enable_lora(4)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _lora_data():
    x = np.random.default_rng(0).normal(size=(32, 32)).astype("float32")
    return x, np.tanh(x[:, :8])


def lora_fully_sharded(directory):
    """`enable_lora` in the scope of one-line FSDP over 2 processes: the
    adapters' layout, the weights after fit, and `save_weights`."""
    _setup()
    import keras

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=64))
    with strategy.scope():
        model = _lora_model()
    up = model.get_layer("up")
    local = {name: tuple(getattr(up, name).value.to_local().shape)
             if hasattr(getattr(up, name).value, "to_local") else None
             for name in ("lora_kernel_a", "lora_kernel_b")}
    x, y = _lora_data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.save_weights(os.path.join(directory, "lora.weights.h5"))
    return {"local": local, "weights": model.get_weights(),
            "trainable": [v.path for v in model.trainable_variables],
            "predict": model.predict(x, verbose=0)}


def _bfloat16_model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64, activation="tanh", name="up",
                           dtype="bfloat16"),
        keras.layers.Dense(8, name="down", dtype="bfloat16")])


def fully_sharded_load_bfloat16(weights_path):
    """A bfloat16 model made under one-line FSDP over 2 processes loads a
    Keras `.weights.h5` of bfloat16 weights: its shards' shapes and dtypes,
    and the whole weights after (as float32: bfloat16 values exactly);
    then kd's checkpoint of it restored into a fresh sharded model."""
    _setup()
    import keras

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh((2,), ["batch"], ["cpu:0", "cpu:1"])
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh, min_size=64))
    with strategy.scope():
        model = _bfloat16_model(seed=9)
    model.load_weights(weights_path)
    # kd's own checkpoint of the sharded bfloat16 model, restored into a
    # fresh one: the same assignment of each process's piece.
    written = kd.checkpoint.ShardedCheckpoint(model=model).write(
        os.path.join(os.path.dirname(weights_path), "bf16-ckpt"))
    with strategy.scope():
        fresh = _bfloat16_model(seed=11)
    kd.checkpoint.ShardedCheckpoint(model=fresh).read(
        written).assert_consumed()
    return {"local_shapes": [tuple(v.value.to_local().shape)
                             if hasattr(v.value, "to_local") else None
                             for v in model.weights],
            "dtypes": [str(w.dtype) for w in model.get_weights()],
            "weights": [w.astype("float32") for w in model.get_weights()],
            "restored": [w.astype("float32") for w in fresh.get_weights()]}


def kernel_reading_block(directory):
    """`worker_common.kernel_reading_model` (a block computing with its
    sublayers' kernels itself) under a map sharding those kernels, on a
    (2, 1) mesh (over the batch axis: FSDP-style) and a (1, 2) one (over
    the model axis), with a LoRA head whose adapters the map leaves on
    the model sub-mesh: trained weights, which kernels are sharded, and
    `save_weights` (LoRA merged into the kernel) read back as a file; then
    the divergence check, one process's adapter changed."""
    _setup()
    import os

    import keras
    import torch
    from worker_common import kernel_reading_data
    from worker_common import kernel_reading_model

    import keras_distribute as kd

    results = {}
    for shape in ((2, 1), (1, 2)):
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"],
                                             ["cpu:0", "cpu:1"])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["block/gate/kernel"] = ("batch", "model")
        layout_map["block/out/kernel"] = ("model", "batch")
        layout_map["head/kernel"] = ("batch", None)
        strategy = kd.MirroredStrategy(layout_map=layout_map)
        with strategy.scope():
            model = kernel_reading_model(lora=True)
        x, y = kernel_reading_data()
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        path = os.path.join(directory, f"{shape[0]}x{shape[1]}.weights.h5")
        model.save_weights(path)
        results[shape] = {
            "weights": model.get_weights(), "path": path,
            "local": {v.path: tuple(v.value.to_local().shape)
                      for v in model.weights
                      if hasattr(v.value, "to_local")}}
    # The divergence check covers the adapters: one process's changed.
    adapter = model.get_layer("head").lora_kernel_a
    if torch.distributed.get_rank() == 1:
        adapter.assign(adapter.value + 1e-3)
    try:
        strategy.check_replicas_agree(model)
        results["diverged"] = None
    except kd.ReplicasDivergedError as error:
        results["diverged"] = str(error)
    return results
