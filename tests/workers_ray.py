"""The training loop the Ray Train tests run in each Ray worker.

A Keras `fit` under `kd.MultiWorkerMirroredStrategy()` with
`kd.callbacks.RayReport`, exactly as a user's `train_loop_per_worker`.
Ray workers import this module by name (tests/ is on their PYTHONPATH).
"""

import os
import time

import numpy as np
from worker_common import initial_weights
from worker_common import make_data
from worker_common import make_model

BATCH = 32


def crash_once(marker, rank, epoch):
    """A callback that ends worker `rank` abruptly (as a lost node would) at
    the end of `epoch`, the first time only (`marker` remembers)."""
    import keras

    class CrashOnce(keras.callbacks.Callback):
        def on_epoch_end(self, done, logs=None):
            context_rank = _rank()
            if (done == epoch and context_rank == rank
                    and not os.path.exists(marker)):
                open(marker, "w").close()
                # Ray's controller registers a reported checkpoint when it
                # next polls the workers: let it see epoch 1's first.
                time.sleep(2)
                os._exit(3)

    return CrashOnce()


def epoch_log(path):
    """A callback that appends each epoch `fit` starts to `path`."""
    import keras

    class EpochLog(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            with open(path, "a") as log:
                log.write(f"{epoch}\n")

    return EpochLog()


def _rank():
    import ray.train

    return ray.train.get_context().get_world_rank()


def train_loop_per_worker(config):
    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    x, y = make_data()
    with strategy.scope():
        model = make_model(initial_weights())
    log = os.path.join(config["out"], f"epochs-rank{_rank()}.txt")
    with open(log, "a") as file:
        file.write("start\n")
    callbacks = [kd.callbacks.RayReport(config["staging"]), epoch_log(log)]
    if config.get("crash_epoch") is not None:
        callbacks.append(crash_once(config["marker"], 1, config["crash_epoch"]))
    model.fit(x, y, batch_size=BATCH, epochs=config["epochs"], shuffle=False,
              verbose=0, callbacks=callbacks)
    np.savez(os.path.join(config["out"], f"rank{_rank()}.npz"),
             *model.get_weights())
