"""What every other package uses: the lowest layer.

- `context`: which strategy is current; replica and cross-replica contexts.
- `values`: `PerReplica` and the other distributed values.
- `reduce_op`, `cross_device_ops`: `ReduceOp` and tf.distribute's
  cross-device-ops and communication options (names, checked arguments).
- `devices`, `layouts`: device names and the mesh axes a layout shards.
- `errors`: `WorkerLostError`.
- `input_context`: `InputContext`, which pipeline a `dataset_fn` builds.
- `batches`: how a global batch divides among the input pipelines.
- `keras_services`: the typed services the integration layer hands down.
- `simulate`: several CPU devices for tests.

May import: nothing else of keras_distribute, no framework at module level.
"""
