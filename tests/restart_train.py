"""A `fit` with `kd.callbacks.BackupAndRestore` that a launcher restarts:
process 1 dies at the end of epoch 2 the first time (a marker file
remembers); the restarted job resumes from the backup. Each process writes
its final weights to `weights-rank<R>.npz` in the working directory.

Run by tests/test_cluster_recipes.py under `torchrun --max-restarts 1`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from worker_common import initial_weights  # noqa: E402
from worker_common import make_data  # noqa: E402
from worker_common import make_model  # noqa: E402

import keras_distribute as kd  # noqa: E402

strategy = kd.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.process_id


class DieOnce(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and rank == 1 and not os.path.exists("died"):
            open("died", "w").close()
            os._exit(3)


with open(f"epochs-rank{rank}.txt", "a") as log:
    log.write("start\n")


class EpochLog(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        with open(f"epochs-rank{rank}.txt", "a") as log:
            log.write(f"{epoch}\n")


x, y = make_data()
with strategy.scope():
    model = make_model(initial_weights())
model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
          callbacks=[kd.callbacks.BackupAndRestore("backup"), EpochLog(),
                     DieOnce()])
np.savez(f"weights-rank{rank}.npz", *model.get_weights())
