"""Bodies of the multi-worker TensorFlow tests (2 worker processes)."""

import os

from worker_common import fit_while_rank_one_hangs
from worker_common import initial_weights
from worker_common import make_data as common_make_data
from worker_common import make_model
from worker_common import train_unless_rank_one


def make_data(n=101, seed=0):
    return common_make_data(n, seed)


def multi_worker_fit(directory):
    """tf.distribute MWMS under kd: fit, evaluate, run/reduce, callbacks.

    The cluster comes from the environment kd.launch sets.
    """
    import keras

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    resolver = strategy.cluster_resolver
    x, y = make_data()
    with strategy.scope():
        model = make_model(initial_weights())
    history = model.fit(
        x, y, batch_size=20, epochs=2, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.CSVLogger(
            os.path.join(directory, "log.csv"))])
    ids = strategy.run(
        lambda: kd.get_replica_context().replica_id_in_sync_group)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "task": (resolver.task_type, resolver.task_id),
        "sum_ids": float(strategy.reduce("sum", ids, axis=None)),
        "history": history.history,
        "weights": model.get_weights(),
        "evaluate": model.evaluate(x, y, batch_size=20, verbose=0),
    }


def hang_on_rank_one():
    """Rank 1 hangs alive in a callback; rank 0, waiting in the engine's
    native code, is ended by kd's watchdog naming rank 1."""
    import keras_distribute as kd

    return fit_while_rank_one_hangs(kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=10)))


def peer_leaves_early():
    """Worker 1 returns at once; worker 0 must fail within the timeout."""
    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=10))
    return train_unless_rank_one(strategy)


def sharded_checkpoints(directory):
    """Checkpoint callbacks in a 2-worker job."""
    from worker_common import fit_with_sharded_checkpoints

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return fit_with_sharded_checkpoints(strategy, directory)


def keras_callbacks_resume(directory):
    """Keras' own file callbacks, interrupted and resumed (2 workers)."""
    from worker_common import keras_callbacks_resume as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, directory)


def diverged_random_states():
    """Each worker seeds differently, then builds the model (2 workers)."""
    from worker_common import diverged_random_states as body

    import keras_distribute as kd

    return body(kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60)))


def training_features(directory):
    """Gradient accumulation, Horovod helpers and PreemptionCheckpoint on
    one strategy (worker_training.py)."""
    from worker_training import training_features as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, directory)


def preemption_handler(directory):
    """kd.experimental.PreemptionCheckpointHandler's loop (2 processes)."""
    from worker_training import preemption_handler as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, directory)


def peer_never_joins():
    """Only worker 0 of a 2-worker job starts: ended after the timeout with
    the cause, not a hang (#17: it waited past 180 s)."""
    import keras_distribute as kd

    own = os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")[0]
    resolver = kd.cluster_resolver.SimpleClusterResolver(
        [own, "127.0.0.1:1"], 0)
    kd.MultiWorkerMirroredStrategy(
        resolver, kd.CommunicationOptions(timeout_seconds=5))
    return "joined"


def fit_thread_count(steps):
    """Native threads before and after `steps` more training steps: TF's
    per-collective timeouts held a sleeping thread per collective."""
    import keras

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    x, y = make_data(n=32 * steps)
    with strategy.scope():
        model = make_model(initial_weights())
    counts = []

    class Count(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            counts.append(len(os.listdir("/proc/self/task")))

    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Count()])
    return counts


def batchnorm_one_state(directory):
    """#30: BatchNorm statistics and every other variable, 2 workers."""
    from worker_common import batchnorm_fit_every_variable

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return batchnorm_fit_every_variable(strategy, directory)


def different_training():
    """#30: workers that would train different models (2 workers)."""
    from worker_common import different_training as body

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy(
        communication_options=kd.CommunicationOptions(timeout_seconds=60))
    return body(strategy, strategy.cluster_resolver.process_id,
                shapes=False)


def different_cluster_descriptions(change):
    """Worker 1 is told of 3 workers (`change="count"`), or calls itself
    worker 0 as well (`change="index"`), beside a worker 0 told of 2
    (#43): the workers refuse before training, naming the difference."""
    import keras_distribute as kd

    addresses = os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")
    rank = int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"])
    if rank == 1:
        if change == "count":
            addresses = addresses + ["127.0.0.1:1"]
        else:
            rank = 0
    resolver = kd.cluster_resolver.SimpleClusterResolver(addresses, rank)
    strategy = kd.MultiWorkerMirroredStrategy(
        resolver, kd.CommunicationOptions(timeout_seconds=20))
    x, y = make_data()
    with strategy.scope():
        model = make_model(initial_weights())
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    return "trained"
