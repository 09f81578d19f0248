"""Sharded checkpoints: a JSON index plus HDF5 shards, reshardable, portable.

In layers, lowest first (each uses only the ones before it), as folders:

- `storage/`: the checkpoint on disk, free of Keras and engines: its format,
  validation and reading as untrusted input (a read changes nothing on
  disk), writing and the atomic commit, the directory's lease, who wrote
  which checkpoint, the committed checkpoints of a directory.
- `objects/`: what a checkpoint holds of the objects given to it (saved
  objects and their variables, object paths, `host_state`: one interface
  for each kind of object whose state is host values — input iterators,
  host arrays —, attached containers).
- `checkpointer`: how a save runs across processes (barriers, the chief's
  path, background saves, one at a time); `restoring`: all-or-nothing
  assignment, restores deferred until the variables exist.
- `sharded_checkpoint`: `ShardedCheckpoint`, the object-graph API (what is
  saved, under which keys; attaching objects after a restore);
  `checkpoint_manager` (its `retention` policies: the latest or the best
  N), `export`: on top of it; `preemption_handler`:
  tf.distribute's `PreemptionCheckpointHandler` (`kd.experimental`), a
  manager's save when a preemption signal arrives in a custom loop.

May import: `common`, `job`, `cluster_resolver`, `backend` (its contract),
`training`, `input`. Never the strategies or the integration layer.
"""

from keras_distribute.checkpoint.checkpoint_manager import CheckpointManager
from keras_distribute.checkpoint.export import export_weights
from keras_distribute.checkpoint.load_status import InitializationOnlyStatus
from keras_distribute.checkpoint.load_status import LoadStatus
from keras_distribute.checkpoint.options import CheckpointOptions
from keras_distribute.checkpoint.sharded_checkpoint import ShardedCheckpoint
from keras_distribute.checkpoint.storage.committed import CheckpointReader
from keras_distribute.checkpoint.storage.committed import checkpoints_in
from keras_distribute.checkpoint.storage.committed import latest_checkpoint
from keras_distribute.checkpoint.storage.committed import list_variables
from keras_distribute.checkpoint.storage.committed import load_checkpoint
from keras_distribute.checkpoint.storage.committed import load_variable
from keras_distribute.checkpoint.storage.committed import read_metadata
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import CheckpointMismatchError
from keras_distribute.checkpoint.storage.format import CheckpointStorageError
from keras_distribute.checkpoint.storage.lease import DirectoryInUseError

__all__ = ("CheckpointError", "CheckpointManager", "CheckpointMismatchError",
           "CheckpointStorageError",
           "CheckpointOptions", "CheckpointReader", "DirectoryInUseError",
           "InitializationOnlyStatus", "LoadStatus",
           "ShardedCheckpoint", "checkpoints_in", "export_weights",
           "latest_checkpoint", "list_variables", "load_checkpoint",
           "load_variable", "read_metadata")
