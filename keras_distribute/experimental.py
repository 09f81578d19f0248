"""`kd.experimental`: tf.distribute's `experimental` names kd implements.

`PreemptionCheckpointHandler` and `TerminationConfig` (custom training
loops that save on preemption; `fit` has `kd.callbacks.PreemptionCheckpoint`).
"""

from keras_distribute.checkpoint.preemption_handler import (
    PreemptionCheckpointHandler,  # noqa: F401
)
from keras_distribute.checkpoint.preemption_handler import TerminationConfig  # noqa: F401
