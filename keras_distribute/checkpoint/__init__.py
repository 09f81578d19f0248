"""Sharded checkpoints: a JSON index plus HDF5 shards, reshardable, portable."""

from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.committed import CheckpointReader
from keras_distribute.checkpoint.committed import checkpoints_in
from keras_distribute.checkpoint.committed import latest_checkpoint
from keras_distribute.checkpoint.committed import list_variables
from keras_distribute.checkpoint.committed import load_checkpoint
from keras_distribute.checkpoint.committed import load_variable
from keras_distribute.checkpoint.committed import read_metadata
from keras_distribute.checkpoint.format import CheckpointError
from keras_distribute.checkpoint.format import CheckpointMismatchError
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.load_status import InitializationOnlyStatus
from keras_distribute.checkpoint.load_status import LoadStatus
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint
from keras_distribute.checkpoint.export import export_weights

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointMismatchError", "CheckpointOptions",
           "CheckpointReader", "InitializationOnlyStatus", "LoadStatus",
           "ShardedCheckpoint", "checkpoints_in", "export_weights",
           "latest_checkpoint", "list_variables", "load_checkpoint",
           "load_variable", "read_metadata"]
