"""Sharded checkpoints: a JSON index plus HDF5 shards, reshardable, portable.

In layers, lowest first (each module uses only the ones before it):

- `format`: the on-disk schema, dtypes, checksums, `CheckpointError`;
  `validation`, `reading`, `parallel_io`: an index and its shards read as
  untrusted input; `signing`: iterator states kd can prove it wrote.
- `writing`: temporaries, each process's shards, the atomic commit, removal
  of what kd wrote only; `ownership`: who wrote which checkpoint;
  `lease`: one job per checkpoint directory.
- `saved_objects`, `object_paths`, `iterator_state`, `attached_containers`:
  what a checkpoint holds of the objects given to it.
- `checkpointer`: how a save runs across processes (barriers, the chief's
  path, background saves, one at a time); `restoring`: all-or-nothing
  assignment, restores deferred until the variables exist.
- `sharded_checkpoint`: `ShardedCheckpoint`, the object-graph API (what is
  saved, under which keys; attaching objects after a restore);
  `checkpoint_manager`, `committed`, `export`: on top of it.

May import: `common`, `job`, `cluster_resolver`, `backend` (its contract),
`training`, `input`. Never the strategies or the integration layer.
"""

from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.committed import CheckpointReader
from keras_distribute.checkpoint.committed import checkpoints_in
from keras_distribute.checkpoint.committed import latest_checkpoint
from keras_distribute.checkpoint.committed import list_variables
from keras_distribute.checkpoint.committed import load_checkpoint
from keras_distribute.checkpoint.committed import load_variable
from keras_distribute.checkpoint.committed import read_metadata
from keras_distribute.checkpoint.export import export_weights
from keras_distribute.checkpoint.format import CheckpointError
from keras_distribute.checkpoint.format import CheckpointMismatchError
from keras_distribute.checkpoint.lease import DirectoryInUseError
from keras_distribute.checkpoint.load_status import InitializationOnlyStatus
from keras_distribute.checkpoint.load_status import LoadStatus
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointMismatchError",
           "CheckpointOptions", "CheckpointReader", "DirectoryInUseError",
           "InitializationOnlyStatus", "LoadStatus",
           "ShardedCheckpoint", "checkpoints_in", "export_weights",
           "latest_checkpoint", "list_variables", "load_checkpoint",
           "load_variable", "read_metadata"]
