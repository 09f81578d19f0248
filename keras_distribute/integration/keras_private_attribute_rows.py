"""The private attributes of Keras objects keras_distribute reads or sets:
rows of the table in `keras_private_rows` (`Row.instance_of`: probed on a
fresh object of that kind by `registry`)."""

from typing import Tuple

from keras_distribute.integration.keras_private_rows import Row

# Private attributes of Keras objects that modules outside this package read
# or set. Each is probed on a fresh object (no strategy, no variables
# beyond one scalar) before anything is patched.
_A = "private attribute of Keras' "
ROWS: Tuple[Row, ...] = (
    Row("Variable._value", (), _A + "Variable: the backend value, read "
        "without Keras' stateless-scope lookup and replaced when laid out "
        "(all engines, checkpoint pieces)", "3.10-3.16",
        "a public raw-value accessor", instance_of="Variable"),
    Row("Variable._direct_assign", (), _A + "Variable: lays a variable out "
        "again after its layout changed (JAX adopt, torch broadcast)",
        "3.10-3.16", instance_of="Variable", backends=("jax", "torch")),
    Row("Variable._layout", (), _A + "Variable: the layout a variable was "
        "made with (JAX adopt, torch sharding)", "3.10-3.16",
        instance_of="Variable", backends=("jax", "torch")),
    Row("Optimizer._learning_rate", (), _A + "BaseOptimizer: the planner "
        "reads the config of an optimizer compiled in a model built "
        "without values, whose learning-rate variable has none (a "
        "placeholder rate stands in while get_config runs)", "3.10-3.16",
        "a get_config that does not read variable values",
        instance_of="Optimizer"),
    Row("Model._initial_epoch", (), _A + "Trainer: the epoch a resumed fit "
        "starts from, as Keras' own BackupAndRestore sets it", "3.10-3.16",
        "a public resume hook", instance_of="Model"),
    Row("Model._compute_loss", (), _A + "Trainer: torch's train step "
        "through a held DDP computes the loss as Keras' does", "3.10-3.16",
        instance_of="Model", backends=("torch",)),
    Row("Model._loss_tracker", (), _A + "Trainer: see _compute_loss",
        "3.10-3.16", instance_of="Model", backends=("torch",)),
    Row("Model._compile_metrics", (), _A + "Trainer: BackupAndRestore "
        "restores mid-epoch metric state into compiled metrics that TF "
        "builds only at its first step (built from that batch first)",
        "3.10-3.16", instance_of="Model"),
    Row("Model._flatten_layers", (), _A + "Layer: TF names layers whose "
        "variables a replica cannot sync", "3.10-3.16", instance_of="Model",
        backends=("tensorflow",)),
    Row("Layer._call_has_training_arg", (), _A + "Layer: see "
        "Model._compute_loss", "3.10-3.16", instance_of="Layer",
        backends=("torch",)),
    Row("Layer._track_variables", (), _A + "Layer: a sharded layer's "
        "DTensors replace its variables' values", "3.10-3.16",
        instance_of="Layer", backends=("torch_sharding",)),
    Row("BackupAndRestore._save_model", (), _A + "BackupAndRestore: a "
        "non-chief process's save goes to scratch (chief_only_writes)",
        "3.10-3.16", instance_of="BackupAndRestore"),
    Row("BackupAndRestore._weights_path", (), _A + "BackupAndRestore: see "
        "_save_model", "3.10-3.16", instance_of="BackupAndRestore"),
    Row("BackupAndRestore._training_metadata_path", (), _A +
        "BackupAndRestore: see _save_model", "3.10-3.16",
        instance_of="BackupAndRestore"),
    Row("ModelCheckpoint._save_model", (), _A + "ModelCheckpoint: see "
        "BackupAndRestore._save_model", "3.10-3.16",
        instance_of="ModelCheckpoint"),
)
