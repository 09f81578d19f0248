"""Sharded checkpoints: a JSON index plus HDF5 shards, reshardable, portable."""

from keras_distribute.checkpoint.format import CheckpointError
from keras_distribute.checkpoint.sharded_checkpoint import LoadStatus
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint
from keras_distribute.checkpoint.sharded_checkpoint import latest_checkpoint

__all__ = ["CheckpointError", "LoadStatus", "ShardedCheckpoint",
           "latest_checkpoint"]
