"""Input pipelines under a strategy.

- `datasets`: `DistributedDataset`, `InputContext`, `InputOptions`.
- `iterator`: `DistributedIterator`, `OptionalValue`, its saved state.
- `data_sources`: what `fit` may be given (arrays, tf.data, PyDataset,
  torch DataLoader) and how a global batch splits into replicas.
- `process_data`: each process' share of `fit`'s data, balanced, and the
  rules around every trainer call (`with_process_rules`).
- `tf_data_state`: a `tf.data` iterator's position as bytes, and back.

May import: `common`, `job`, `cluster_resolver`, `backend`, `training`.
"""
