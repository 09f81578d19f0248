"""What a training step needs beyond the engine.

- `custom_loop`: `kd.train_step`, a custom-loop step under a strategy.
- `losses`: `compute_average_loss`, `scale_regularization_loss`.
- `collectives`: Horovod-style `kd.allreduce`, `allgather`, `broadcast`.
- `model_state`: the model state every process must hold alike (seeds,
  BatchNorm statistics, optimizer slots).
- `config`: how a model was compiled, read once for `fit`.

May import: `common`, `job`, `cluster_resolver`, `backend`.
"""
