"""What a checkpoint holds of the objects given to it.

- `saved_objects`: the leaves of the object graph (models, optimizers,
  variables, distributed iterators, nested checkpoints) and their keys;
- `object_paths`: a saved key matched to a variable of the model it is
  restored into;
- `iterator_state`: a distributed iterator's position, signed;
- `attached_containers`: containers attached after a restore.

May import `checkpoint.storage`, `backend` (its contract) and `input`;
never the modules above it in `checkpoint/`.
"""
