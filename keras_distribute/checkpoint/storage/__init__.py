"""A checkpoint on disk: its format, read as untrusted input, written
atomically, owned by the job that wrote it.

In layers, lowest first (each module uses only the ones before it):

- `format`: the on-disk schema, dtypes, checksums, `CheckpointError`;
  `validation`, `reading`, `parallel_io`: an index and its shards read as
  untrusted input (a read changes nothing on disk); `signing`: iterator
  states kd can prove it wrote.
- `writing`: temporaries, each process's shards, the atomic commit, the
  explicit recovery of an interrupted commit, removal of what kd wrote only;
  `lease`: one job per checkpoint directory; `ownership`: who wrote which
  checkpoint.
- `urls`: which paths are `s3://` / `gs://`; `store_answers`, `store_limits`:
  what a store answers, sorted, and how long it is waited for;
  `object_store`: `s3://` / `gs://` through fsspec (calls retried within one
  deadline each); `conditional_writes`: create / replace / delete decided
  by the store (S3's `If-None-Match` / `If-Match`);
  `remote_checkpoints`, `remote_lease`, `remote_writing`, `remote_reading`:
  the same checkpoint in object storage, committed by its index written last
  (no rename), read through a checked local copy; `paths`: which paths a
  checkpoint argument takes.
- `committed`: the committed checkpoints of a directory and their values
  (`CheckpointReader`, `latest_checkpoint`, `load_variable`, ...).

Imports no Keras, no framework and no engine: NumPy, h5py, the standard
library (s3fs or gcsfs only when such a path is used)
and `backend.interface`'s `whole_region` (a tuple of slices).
"""
