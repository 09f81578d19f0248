"""`kd.callbacks`: Keras callbacks for training under a strategy.

- `ShardedCheckpoint` keeps the latest (and, with `monitor`, the best)
  sharded checkpoints of a run (`sharded_checkpoint`); `BackupAndRestore`
  resumes an interrupted `fit` at the exact epoch and step
  (`backup_and_restore`); both save the state of `training_state` through
  `training_state_callback`.
- `PreemptionCheckpoint` saves that state at one step on every process
  when one receives SIGTERM, then exits with `PREEMPTION_EXIT_CODE`
  (`preemption_checkpoint`); for custom loops, tf.distribute's
  `PreemptionCheckpointHandler` is `checkpoint.preemption_handler`
  (`kd.experimental`).
- `RayReport` reports metrics and checkpoints to Ray Train and resumes
  from Ray's checkpoint (`ray_report`).
- `BroadcastGlobalVariables`, `MetricAverage`, `LearningRateWarmup`:
  Horovod's callbacks, for ported programs (`horovod`).

This package imports Keras (and so the backend framework): it is loaded on
first use of `kd.callbacks`. May import every package but `launch`.
"""

from keras_distribute.callbacks.backup_and_restore import BackupAndRestore  # noqa: F401
from keras_distribute.callbacks.horovod import BroadcastGlobalVariables  # noqa: F401
from keras_distribute.callbacks.horovod import LearningRateWarmup  # noqa: F401
from keras_distribute.callbacks.horovod import MetricAverage  # noqa: F401
from keras_distribute.callbacks.preemption_checkpoint import (
    PreemptionCheckpoint,  # noqa: F401
)
from keras_distribute.callbacks.ray_report import RayReport  # noqa: F401
from keras_distribute.callbacks.sharded_checkpoint import ShardedCheckpoint  # noqa: F401
from keras_distribute.job.exit_codes import PREEMPTION_EXIT_CODE  # noqa: F401
