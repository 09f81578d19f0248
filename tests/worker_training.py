"""The #16 training features across 2 processes, on every backend.

Each backend's `workers_*` module wraps a body here with its own strategy;
the `launch_*` helpers run it under `kd.launch` and compare it with one
process.
"""

import numpy as np
import worker_checkpoint
from worker_common import initial_weights
from worker_common import listing
from worker_common import make_data
from worker_common import make_model

# Accumulate 3 batches per update, keep an EMA and write it into the
# weights every 4 updates: the 2 conditional updates Keras wraps in
# `ops.cond`.
ACCUMULATION = {"gradient_accumulation_steps": 3, "use_ema": True,
                "ema_overwrite_frequency": 4}


def accumulating_model():
    import keras

    model = make_model(initial_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9, **ACCUMULATION),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit_accumulating(model):
    x, y = make_data(n=100)  # batch 16: 6 full batches and one of 4
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                     verbose=0).history


def gradient_accumulation(strategy):
    """`fit` of the accumulating model under `strategy` (in each process)."""
    with strategy.scope():
        model = accumulating_model()
    history = _fit_accumulating(model)
    return {"loss": history["loss"], "weights": model.get_weights(),
            "iterations": int(model.optimizer.iterations)}


def check_gradient_accumulation(results):
    """`gradient_accumulation` of 2 processes: identical weights in both,
    equal to one process (short last batch included)."""
    reference = accumulating_model()
    history = _fit_accumulating(reference)
    for result in results:
        # 14 batches, one update every 3.
        assert result["iterations"] == 14 // 3
        np.testing.assert_allclose(result["loss"], history["loss"],
                                   rtol=1e-5)
        for a, b, c in zip(result["weights"], results[0]["weights"],
                           reference.get_weights()):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, atol=1e-5)


def digits_fit(strategy, epochs=10):
    """The digits demo's MLP trained under `strategy`: `(test accuracy,
    weights, parameter count)`."""
    import keras
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16).astype("float32")
    y = digits.target
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    model.fit(x[:1400], y[:1400], batch_size=64, epochs=epochs, verbose=0)
    accuracy = model.evaluate(x[1400:], y[1400:], verbose=0,
                              return_dict=True)["accuracy"]
    return accuracy, model, model.count_params()


def compressed_all_reduce():
    """torch, each rank: the digits fit uncompressed, fp16 and bf16, and
    the bytes of gradient all-reduce gloo performed in one profiled epoch
    (the profiler's `gloo:all_reduce` events of the gradients' size)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    import keras_distribute as kd

    itemsize = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2}
    results = {}
    for compression in (None, "fp16", "bf16"):
        strategy = kd.MirroredStrategy(
            communication_options=kd.CommunicationOptions(
                compression=compression))
        accuracy, model, params = digits_fit(strategy)
        rng = np.random.default_rng(0)
        x = rng.random((256, 64)).astype("float32")
        y = rng.integers(0, 10, 256)
        with profile(activities=[ProfilerActivity.CPU],
                     record_shapes=True) as profiler:
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # 4 steps
        wire = [itemsize[event.input_dtypes[0]] * params
                for event in profiler.events()
                if event.name == "gloo:all_reduce"
                and event.input_shapes == [[params]]]
        results[compression] = {
            "accuracy": accuracy, "weights": model.get_weights(),
            "wire_bytes_per_step": sum(wire) / 4, "steps": len(wire),
            "counted": strategy.engine.gradient_bytes_reduced,
            "params": params}
    return results


def launch_compressed_all_reduce(workers, timeout):
    """Runs `workers.compressed_all_reduce` on 2 ranks: 16-bit all-reduce
    moves half the bytes, ranks agree, accuracy within 0.5 %."""
    import keras_distribute as kd

    results = kd.launch(workers.compressed_all_reduce, num_processes=2,
                        timeout=timeout)
    for result in results:
        plain = result[None]
        assert plain["steps"] == 4
        assert plain["wire_bytes_per_step"] == 4 * plain["params"]
        for compression in ("fp16", "bf16"):
            compressed = result[compression]
            assert compressed["steps"] == 4
            assert compressed["wire_bytes_per_step"] == (
                plain["wire_bytes_per_step"] / 2)
            # kd's own count: 2 bytes per parameter, every step (22 x 10
            # digits steps and the 4 profiled ones).
            assert compressed["counted"] == 2 * plain["params"] * (220 + 4)
            assert abs(compressed["accuracy"] - plain["accuracy"]) <= 0.005
            for a, b in zip(compressed["weights"],
                            results[0][compression]["weights"]):
                np.testing.assert_array_equal(a, b)


def horovod_helpers(strategy):
    """Each process: the Horovod-style collectives and callbacks, with
    values that differ per process."""
    import keras

    import keras_distribute as kd

    rank, count = kd.process_index(), kd.process_count()
    tensor = kd.allreduce(keras.ops.ones((2,)) * (rank + 1), op="sum")
    collectives = {
        "count": count, "rank": rank,
        "average": float(kd.allreduce(float(rank + 1))),
        "sum": float(kd.allreduce(rank + 1, op="sum")),
        "max": float(kd.allreduce(np.float32(rank), op="max")),
        "tensor": keras.ops.convert_to_numpy(tensor).tolist(),
        "tensor_is_backend": not isinstance(tensor, np.ndarray),
        "gathered": kd.allgather(np.arange(rank + 1) + 10 * rank).tolist(),
        "broadcast": kd.broadcast(np.array([rank * 10.0]),
                                  root_rank=1).tolist(),
    }

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.start, self.rates, self.local = None, [], []

        def on_train_begin(self, logs=None):
            self.start = self.model.get_weights()

        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.first = self.model.get_weights()

        def on_train_batch_begin(self, batch, logs=None):
            self.rates.append(float(keras.ops.convert_to_numpy(
                self.model.optimizer.learning_rate)))

        def on_epoch_end(self, epoch, logs=None):
            self.local.append(logs["local"])

    class WriteLocal(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["local"] = float(rank)  # differs per process

    x, y = make_data(n=64)
    with strategy.scope():
        model = make_model(initial_weights())
    # Processes start from different weights (where the engine lets a
    # process assign its own: on JAX every process takes process 0's).
    model.set_weights([w + rank for w in initial_weights()])
    before = model.get_weights()
    record = Record()
    size = strategy.num_replicas_in_sync
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False,
                        verbose=0, callbacks=[
                            kd.callbacks.BroadcastGlobalVariables(root_rank=1),
                            WriteLocal(), kd.callbacks.MetricAverage(),
                            kd.callbacks.LearningRateWarmup(
                                initial_lr=0.05 * size, warmup_epochs=2),
                            record])
    return {"collectives": collectives, "before": before,
            "start": record.start, "first": record.first, "rates": record.rates,
            "local": record.local, "size": size,
            "loss": history.history["loss"], "weights": model.get_weights()}


def check_horovod_helpers(results):
    """`horovod_helpers` of 2 processes: Horovod's semantics."""
    for rank, result in enumerate(results):
        c = result["collectives"]
        assert (c["count"], c["rank"]) == (2, rank)
        assert (c["average"], c["sum"], c["max"]) == (1.5, 3.0, 1.0)
        assert c["tensor"] == [3.0, 3.0] and c["tensor_is_backend"]
        assert c["gathered"] == [0, 10, 11]  # 1 row, then 2, in rank order
        assert c["broadcast"] == [10.0]
        # Every process starts from process 1's weights as they were (Keras
        # 3.16 torch: its DDP re-broadcasts rank 0's at the first step; the
        # callback broadcasts again after it, as Horovod's does).
        import keras

        if not (keras.backend.backend() == "torch"
                and keras.version() >= "3.16"):
            for a, b in zip(result["start"], results[1]["before"]):
                np.testing.assert_array_equal(a, b)
        for a, b in zip(result["first"], results[0]["first"]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(result["weights"], results[0]["weights"]):
            np.testing.assert_array_equal(a, b)
        assert result["local"] == [0.5, 0.5, 0.5]  # averaged over ranks
        # Horovod's ramp: initial_lr / size -> initial_lr over 2 epochs of
        # 4 batches, then constant.
        size, target = result["size"], 0.05 * result["size"]
        expected = [target * ((e + b / 4) * (size - 1) / 2 + 1) / size
                    for e in range(2) for b in range(4)] + [target] * 4
        np.testing.assert_allclose(result["rates"], expected, rtol=1e-6)
    np.testing.assert_allclose(results[0]["loss"], results[1]["loss"],
                               rtol=1e-6)


def preemption(strategy, directory):
    """Each process: 5 runs, each SIGTERM'd at a seeded step in process 0,
    1 or both, stopped by `PreemptionCheckpoint(exit_code=None)` and resumed
    by a new model and callback; and one uninterrupted run."""
    import os
    import random
    import signal

    import keras

    import keras_distribute as kd

    rank = kd.process_index()
    x, y = make_data(n=96)  # batch 16: 6 steps an epoch, 18 in all

    def fit(callbacks):
        with strategy.scope():
            model = make_model(initial_weights())
        model.fit(x, y, batch_size=16, epochs=3, shuffle=True, verbose=0,
                  callbacks=callbacks)
        return model

    keras.utils.set_random_seed(3)
    reference = fit([]).get_weights()
    runs = []
    for seed in range(5):
        choose = random.Random(seed)
        step, targets = choose.randrange(1, 18), [[0], [1], [0, 1]][seed % 3]

        class Terminate(keras.callbacks.Callback):
            seen = 0

            def on_train_batch_end(self, batch, logs=None):
                self.seen += 1
                if self.seen == step and rank in targets:
                    os.kill(os.getpid(), signal.SIGTERM)

        path = os.path.join(directory, f"seed-{seed}")
        keras.utils.set_random_seed(3)
        first = kd.callbacks.PreemptionCheckpoint(path, exit_code=None)
        fit([Terminate(), first])
        saved = sorted(n for n in os.listdir(path) if n[0] != ".")
        second = kd.callbacks.PreemptionCheckpoint(path, exit_code=None)
        resumed = fit([second])
        runs.append({"step": step, "targets": targets,
                     "preempted": (first.preempted, second.preempted),
                     "saved": saved, "left": sorted(os.listdir(path)) if
                     os.path.isdir(path) else [],
                     "weights": resumed.get_weights()})
    return {"reference": reference, "runs": runs}


def check_preemption(results):
    """`preemption` of 2 processes: every run saved once at the signalled
    step and ends bit-identical to the uninterrupted one."""
    for result in results:
        for run in result["runs"]:
            assert run["preempted"] == (True, False), run["step"]
            assert len(run["saved"]) == 1, run["saved"]  # one backup
            assert run["left"] == [], run["left"]  # removed at the end
            for a, b, c in zip(run["weights"], result["reference"],
                               results[0]["reference"]):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(b, c)


def preemption_handler(strategy, directory):
    """Each process: the tf.distribute fault-tolerance loop with
    `kd.experimental.PreemptionCheckpointHandler` — uninterrupted; SIGTERM
    to process 1 before run call 6 (its `exit_fn` stops the loop); resumed
    by a new handler from `total_run_calls`."""
    import os
    import signal

    import keras
    import tensorflow as tf

    import keras_distribute as kd

    steps, epochs, global_batch = 4, 3, 16
    x, y = make_data(n=steps * global_batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)

    class Stop(Exception):
        pass

    def stop():
        raise Stop()

    def train(kill_before, path):
        with strategy.scope():
            model = make_model(initial_weights())
            optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
            optimizer.build(model.trainable_variables)
        checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                     optimizer=optimizer)
        handler = kd.experimental.PreemptionCheckpointHandler(
            getattr(strategy, "cluster_resolver", None), checkpoint, path,
            kd.experimental.TerminationConfig(exit_fn=stop))
        start = handler.total_run_calls

        def step(batch):
            return kd.train_step(model, optimizer, loss_fn, *batch,
                                 global_batch_size=global_batch)

        def distributed_step(batch):
            return strategy.run(step, args=(batch,))

        try:
            for _ in range(handler.total_run_calls // steps, epochs):
                batches = iter(strategy.experimental_distribute_dataset(
                    dataset))
                for _ in range(handler.total_run_calls % steps):
                    next(batches)  # the steps done before the restart
                for _ in range(handler.total_run_calls % steps, steps):
                    if handler.total_run_calls + 1 == kill_before and (
                            kd.process_index() == 1):
                        os.kill(os.getpid(), signal.SIGTERM)
                    handler.run(distributed_step, next(batches))
        except Stop:
            return None, start, handler.total_run_calls
        return model.get_weights(), start, handler.total_run_calls

    reference = train(0, os.path.join(directory, "reference"))
    stopped = train(6, os.path.join(directory, "run"))
    resumed = train(0, os.path.join(directory, "run"))
    return {"reference": reference, "stopped": stopped, "resumed": resumed,
            "saved": listing(os.path.join(directory, "run"))}


def check_preemption_handler(results):
    """`preemption_handler` of 2 processes: both stop after run call 6,
    resume there and end bit-identical to no interruption."""
    for result in results:
        assert result["reference"][1:] == (0, 12)
        assert result["stopped"][0] is None and result["stopped"][1:] == (
            0, 6)
        assert result["resumed"][1:] == (6, 12)
        assert result["saved"] == ["ckpt-6"]
        for a, b, c in zip(result["resumed"][0], result["reference"][0],
                           results[0]["reference"][0]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(b, c)


def training_features(strategy, directory):
    """Each process: the #16 and #17 `fit` features (and #43's directory
    lease) one after another on one strategy (one launch per backend:
    starting the processes is most of what these tests cost)."""
    import os

    return {
        "accumulation": gradient_accumulation(strategy),
        "horovod": horovod_helpers(strategy),
        "preemption": preemption(strategy, os.path.join(directory, "fit")),
        "spread": worker_checkpoint.spread_writes(strategy, directory),
        "spread_s3": worker_checkpoint.spread_writes(
            strategy, os.environ["KD_TEST_S3_PREFIX"]),
        "leased": worker_checkpoint.directory_held_by_another_job(
            strategy, directory),
    }


def launch_training_features(workers, directory, timeout):
    """Runs `workers.training_features` on 2 processes and checks each."""
    import os
    import uuid

    import s3_server

    import keras_distribute as kd

    # Each process also writes its own shards to a real S3-API server (#47).
    with s3_server.s3_server() as endpoint:
        s3_server.make_bucket(endpoint, "kd-test")
        saved = dict(os.environ)
        os.environ.update(s3_server.environment(endpoint),
                          KD_TEST_S3_PREFIX=f"s3://kd-test/{uuid.uuid4().hex}")
        try:
            results = kd.launch(workers.training_features, num_processes=2,
                                args=(directory,), timeout=timeout)
            worker_checkpoint.check_spread_writes(
                [r["spread_s3"] for r in results])
        finally:
            os.environ.clear()
            os.environ.update(saved)
            from keras_distribute.checkpoint.storage import object_store

            object_store.forget_stores()
    check_gradient_accumulation([r["accumulation"] for r in results])
    check_horovod_helpers([r["horovod"] for r in results])
    check_preemption([r["preemption"] for r in results])
    worker_checkpoint.check_spread_writes([r["spread"] for r in results])
    worker_checkpoint.check_directory_held_by_another_job(
        [r["leased"] for r in results])


def launch_preemption_handler(workers, directory, timeout):
    """Runs `workers.preemption_handler` on 2 fresh processes (its
    `strategy.run` loop combines the metric variables every process holds:
    after the other features' chief-only saves those differ, an open
    limit of the torch engine) and checks it."""
    import keras_distribute as kd

    check_preemption_handler(kd.launch(
        workers.preemption_handler, num_processes=2, args=(directory,),
        timeout=timeout))
