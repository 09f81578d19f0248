"""The exit codes a process of a job and its launcher agree on."""

# The exit code of a process that saved its state on a preemption signal
# (`kd.callbacks.PreemptionCheckpoint`,
# `kd.experimental.PreemptionCheckpointHandler`): restart me. The launcher
# (`python -m keras_distribute.launch`) exits with it too, and restarts on
# it under `--max-restarts`. tf.distribute's PreemptionCheckpointHandler
# uses the same.
PREEMPTION_EXIT_CODE = 42
