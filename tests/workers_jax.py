"""Bodies of the multi-process JAX tests (2 processes x 2 CPU devices).

Nothing here imports JAX at module level: each worker sets its device count
first, then starts `jax.distributed` through the strategy.
"""

import os

import numpy as np
from worker_common import fit_while_rank_one_hangs
from worker_common import initial_weights  # noqa: F401
from worker_common import make_data  # noqa: F401
from worker_common import make_model  # noqa: F401
from worker_common import train_unless_rank_one

BATCH = 32


def _jax_process(devices_per_process=2):
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices_per_process}")
    os.environ["JAX_PLATFORMS"] = "cpu"


def multi_worker_fit():
    """MultiWorkerMirroredStrategy on 2 processes x 2 devices: fit & co.

    The cluster comes from the environment kd.launch sets.
    """
    _jax_process()
    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    x, y = make_data()
    with strategy.scope():
        model = make_model(initial_weights())
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                        verbose=0, validation_split=0.2)
    ids = strategy.run(
        lambda: kd.get_replica_context().replica_id_in_sync_group)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    return {
        "replicas": strategy.num_replicas_in_sync,
        "local_ids": [int(v) for v in strategy.experimental_local_results(ids)],
        "sum_ids": float(strategy.reduce("sum", values, axis=None)),
        "gather": np.asarray(strategy.gather(
            strategy.experimental_distribute_values_from_function(
                lambda ctx: np.full((1,), ctx.replica_id_in_sync_group)),
            axis=0)).tolist(),
        "history": history.history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
        "predict": model.predict(x, batch_size=BATCH, verbose=0),
        "compressed": _compressed_fit(x, y),
    }


def _compressed_fit(x, y):
    """The same fit with the gradients all-reduced in fp16 over the job."""
    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(
            timeout_seconds=60, compression="fp16"))
    with strategy.scope():
        model = make_model(initial_weights())
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False,
                        verbose=0, validation_split=0.2)
    return {"history": history.history, "weights": model.get_weights(),
            "reduced": strategy.engine.traced_gradient_reductions}


def multi_worker_train_step():
    """docs/custom_training_loops.md's loop on 2 processes x 2 devices."""
    _jax_process()
    import tensorflow as tf
    from worker_common import train_step_loop

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    x, y = make_data(n=128)
    return train_step_loop(strategy, tf.data.Dataset.from_tensor_slices(
        (x, y)).batch(BATCH))


def hang_on_rank_one():
    """Rank 1 hangs alive in a callback; rank 0, waiting in the engine's
    native code, is ended by kd's watchdog naming rank 1."""
    _jax_process()
    import keras_distribute as kd

    return fit_while_rank_one_hangs(kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=10)))


def peer_leaves_early():
    """Process 1 returns at once; process 0 must fail within the timeout."""
    _jax_process()
    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=10))
    return train_unless_rank_one(strategy)


def peer_never_joins():
    """Only process 0 of a 2-process job starts: a clear timeout."""
    import time

    _jax_process()
    import keras_distribute as kd

    resolver = kd.cluster_resolver.SimpleClusterResolver(
        [os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"], "127.0.0.1:1"], 0)
    start = time.monotonic()
    try:
        kd.MultiWorkerMirroredStrategy(
            resolver, kd.CommunicationOptions(timeout_seconds=5))
    except TimeoutError as error:
        return str(error), time.monotonic() - start
    return "joined", time.monotonic() - start


def sharded_checkpoints(directory):
    """Checkpoint callbacks in a 2-process job."""
    _jax_process()
    from worker_common import fit_with_sharded_checkpoints

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return fit_with_sharded_checkpoints(strategy, directory)


def keras_callbacks_resume(directory):
    """Keras' own file callbacks, interrupted and resumed (2 processes)."""
    _jax_process()
    from worker_common import keras_callbacks_resume as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, directory)


def diverged_random_states():
    """Each process seeds differently, then builds the model."""
    _jax_process()
    from worker_common import diverged_random_states as body

    import keras_distribute as kd

    return body(kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60)))


def save_before_fit_one_device_per_process(directory):
    """One device per process (the launcher's default, one GPU per
    process): a checkpoint saved before any fit, then restored."""
    _jax_process(devices_per_process=1)
    import keras

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    with strategy.scope():
        model = make_model(initial_weights())
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=optimizer)
    manager = kd.checkpoint.CheckpointManager(checkpoint, directory,
                                              max_to_keep=1)
    path = manager.save()
    with strategy.scope():
        restored = make_model()
    kd.checkpoint.ShardedCheckpoint(model=restored).read(
        path).expect_partial()
    return {"path": path, "weights": restored.get_weights()}


def training_features(directory):
    """Gradient accumulation, Horovod helpers and PreemptionCheckpoint on
    one strategy (worker_training.py)."""
    _jax_process()
    from worker_training import training_features as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, directory)


def preemption_handler(directory):
    """kd.experimental.PreemptionCheckpointHandler's loop (2 processes)."""
    _jax_process()
    from worker_training import preemption_handler as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, directory)


def listening_addresses():
    """The addresses this process listens on after a short fit (#43: JAX's
    coordinator listened on every interface)."""
    _jax_process()
    import psutil

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    x, y = make_data(n=64)
    with strategy.scope():
        model = make_model(initial_weights())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return sorted({c.laddr.ip for c in psutil.Process().net_connections(
        kind="inet") if c.status == psutil.CONN_LISTEN})


def different_cluster_descriptions():
    """Process 1 is told of 3 processes, process 0 of 2 (#43): both refuse
    (raise) before training, naming the difference."""
    _jax_process()
    import keras_distribute as kd

    addresses = os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")
    rank = int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"])
    if rank == 1:
        addresses = addresses + ["127.0.0.1:1"]
    resolver = kd.cluster_resolver.SimpleClusterResolver(addresses, rank)
    kd.MultiWorkerMirroredStrategy(
        resolver, kd.CommunicationOptions(timeout_seconds=20))
    return "trained"


def born_sharded_from_process_zero():
    """2 processes x 2 devices, a (2, 2) mesh, random states diverged: a
    4 MiB kernel the map shards over the model axis, whose initializer
    has no seed given (each process draws its own), is made as its shards
    from process 0's seed; no process broadcasts it whole."""
    _jax_process()
    import random

    import jax
    import keras
    from jax.experimental import multihost_utils

    import keras_distribute as kd

    rank = int(os.environ["RANK"])
    kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*big/kernel"] = (None, "model")
    layout_map[".*ones/kernel"] = ("model", None)
    strategy = kd.MultiWorkerMirroredStrategy(
        layout_map=layout_map,
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    broadcast_sizes = []
    original = multihost_utils.broadcast_one_to_all

    def recording(value, *args, **kwargs):
        broadcast_sizes.append(int(np.size(value)))
        return original(value, *args, **kwargs)

    multihost_utils.broadcast_one_to_all = recording
    random.seed(100 + rank)  # diverged: each process draws its own seed
    try:
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((1024,)),
                keras.layers.Dense(1024, name="big"),
                keras.layers.Dense(1024, name="ones",
                                   kernel_initializer="ones"),
                keras.layers.Dense(3, name="head")])
    finally:
        multihost_utils.broadcast_one_to_all = original
    big = model.get_layer("big").kernel
    shards = {tuple(s.data.shape) for s in big.value.addressable_shards}
    return {"own_seed": model.get_layer("big").kernel_initializer.seed,
            "kernel": np.asarray(multihost_utils.process_allgather(
                big.value, tiled=True)),
            "ones": float(np.asarray(multihost_utils.process_allgather(
                model.get_layer("ones").kernel.value, tiled=True)).min()),
            "shards": sorted(shards),
            "largest_broadcast": max(broadcast_sizes, default=0),
            "processes": jax.process_count()}


def own_jitted_loop_then_save(directory):
    """keras-io's "Writing a training loop from scratch in JAX" (a jitted
    step of `stateless_call` and `stateless_apply`), each process given
    its own half of every batch as a NumPy array, then a checkpoint save;
    then the same loop given the whole batch in every process, and a save
    again. Returns what each save did and what the directory held."""
    _jax_process()
    import warnings

    import jax
    import keras

    import keras_distribute as kd

    rank = int(os.environ["RANK"])
    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    x, y = make_data(128)
    with strategy.scope():
        model = make_model(initial_weights())
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_and_updates(trainable, non_trainable, x, y):
        predicted, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True)
        return loss_fn(y, predicted), non_trainable

    gradient_of = jax.value_and_grad(loss_and_updates, has_aux=True)

    @jax.jit
    def train_step(state, data):
        trainable, non_trainable, slots = state
        (loss, non_trainable), grads = gradient_of(
            trainable, non_trainable, *data)
        trainable, slots = optimizer.stateless_apply(slots, grads, trainable)
        return loss, (trainable, non_trainable, slots)

    def train(rows_of):
        state = ([v.value for v in model.trainable_variables],
                 [v.value for v in model.non_trainable_variables],
                 [v.value for v in optimizer.variables])
        for start in range(0, 128, 32):
            rows = rows_of(start)
            _, state = train_step(state, (x[rows], y[rows]))
        for variables, values in zip((model.trainable_variables,
                                      model.non_trainable_variables,
                                      optimizer.variables), state):
            for variable, value in zip(variables, values):
                variable.assign(value)

    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=optimizer)
    manager = kd.checkpoint.CheckpointManager(checkpoint, directory,
                                              max_to_keep=3)
    out = {"first": os.path.basename(manager.save())}
    train(lambda start: slice(start + 16 * rank, start + 16 * (rank + 1)))
    try:
        manager.save()
        out["own_rows"] = None
    except kd.ReplicasDivergedError as raised:
        out["own_rows"] = str(raised)
    out["after_own_rows"] = sorted(  # (not the manager's lease file)
        name for name in os.listdir(directory) if not name.startswith("."))
    kd.set_divergence_check("warn")  # the escape: written, with a warning
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["warned"] = os.path.basename(manager.save())
        out["warnings"] = [str(w.message) for w in caught
                           if issubclass(w.category, RuntimeWarning)]
    finally:
        kd.set_divergence_check("raise")
    with strategy.scope():  # the same loop, every process the whole batch
        model.set_weights(initial_weights())
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
    checkpoint.optimizer = optimizer
    train(lambda start: slice(start, start + 32))
    out["whole_batch"] = os.path.basename(manager.save())
    out["weights"] = model.get_weights()
    return out


def divergence_in_every_region():
    """2 processes x 2 devices, a (2, 2) mesh: kernels sharded over the
    model axis (each process holds every piece of its replica), Adam's
    slots alike. Process 1 changes one region of one variable at a time
    (every copy of it it holds: its own replicas agree) and the check runs
    in both: `[(variable, region, the variable the check named)]`."""
    _jax_process()
    import jax
    import keras

    import keras_distribute as kd

    rank = int(os.environ["RANK"])
    kd.MultiWorkerMirroredStrategy(  # (the job first: then its devices)
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*big/kernel"] = (None, "model")
    layout_map[".*down/kernel"] = ("model", None)
    strategy = kd.MultiWorkerMirroredStrategy(
        layout_map=layout_map,
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, name="big"),
                                  keras.layers.Dense(4, name="down")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    model.fit(x, x[:, :4], batch_size=8, epochs=1, verbose=0)
    strategy.check_replicas_agree(model)  # no error

    def region_of(shard, shape):
        return tuple((index.start or 0,
                      size if index.stop is None else index.stop)
                     for index, size in zip(shard.index, shape))

    found = []
    variables = list(model.trainable_variables) + list(
        model.optimizer.variables)
    for variable in variables:
        value = variable.value
        regions = sorted({region_of(s, value.shape)
                          for s in value.addressable_shards})
        for target in regions:
            if rank == 1:
                shards = [jax.device_put(
                    np.asarray(s.data) + (region_of(s, value.shape)
                                          == target), s.device)
                    for s in value.addressable_shards]
                variable._value = jax.make_array_from_single_device_arrays(
                    value.shape, value.sharding, shards)
            try:
                strategy.check_replicas_agree(model)
                named = None
            except kd.ReplicasDivergedError as raised:
                named = raised.variable
            variable._value = value
            found.append((variable.path, target, named))
    return found
