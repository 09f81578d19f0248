"""`kd.callbacks`: Keras callbacks for training under a strategy.

- `ShardedCheckpoint` keeps the latest (and, with `monitor`, the best)
  sharded checkpoints of a run; `BackupAndRestore` resumes an interrupted
  `fit` at the exact epoch and step (`state_callbacks`).
- `PreemptionCheckpoint` saves that state at one step on every process
  when one receives SIGTERM, then exits with `PREEMPTION_EXIT_CODE`
  (`preemption`).
- `RayReport` reports metrics and checkpoints to Ray Train and resumes
  from Ray's checkpoint (`ray_callbacks`).
- `BroadcastGlobalVariables`, `MetricAverage`, `LearningRateWarmup`:
  Horovod's callbacks, for ported programs (`horovod_callbacks`).

This module imports Keras (and so the backend framework): it is loaded on
first use of `kd.callbacks`.
"""

from keras_distribute.horovod_callbacks import BroadcastGlobalVariables  # noqa: F401
from keras_distribute.horovod_callbacks import LearningRateWarmup  # noqa: F401
from keras_distribute.horovod_callbacks import MetricAverage  # noqa: F401
from keras_distribute.launch_processes import PREEMPTION_EXIT_CODE  # noqa: F401
from keras_distribute.preemption import PreemptionCheckpoint  # noqa: F401
from keras_distribute.backup_callback import BackupAndRestore  # noqa: F401
from keras_distribute.checkpoint_callback import ShardedCheckpoint  # noqa: F401
from keras_distribute.ray_callbacks import RayReport  # noqa: F401
