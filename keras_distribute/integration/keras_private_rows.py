"""The table of every Keras-private name keras_distribute touches (the
private attributes of Keras objects: `keras_private_attribute_rows`).

One `Row` per name: what is used, why, on which Keras versions, what
upstream change would make it unnecessary, and the parameters a patched
callable must take (read and checked by `registry`).
"""

import dataclasses
from typing import Optional
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class Row:
    """One Keras-private name.

    Attributes:
        key: How keras_distribute asks for it.
        candidates: `(module, attribute path)` places, tried in order; an
            empty attribute path means the module itself.
        reason: Why keras_distribute needs it.
        keras_versions: The Keras versions it is known on.
        upstream: The upstream change that would make it unnecessary.
        parameters: For a callable, the names its parameters must start
            with (`None`: not checked).
        backends: The backends that use it (empty: all).
        optional: Present on some of the supported Keras versions only
            (`resolve` gives `None` where it is absent; `check` passes).
        instance_of: For a private attribute of Keras objects (set in
            `__init__`, so absent from the class): the kind of object
            probed for it (see `_PROBES`); the key is `"Kind.attribute"`.
    """

    key: str
    candidates: Tuple[Tuple[str, str], ...]
    reason: str
    keras_versions: str
    upstream: str = "-"
    parameters: Optional[Tuple[str, ...]] = None
    backends: Tuple[str, ...] = ()
    optional: bool = False
    instance_of: Optional[str] = None


_S = "keras.src."
ROWS: Tuple[Row, ...] = (
    Row("BaseTrainer",
        ((_S + "trainers.trainer", "BaseTrainer"),
         (_S + "trainers.trainer", "Trainer")),
        "a model remembers the strategy it was created under (__init__); "
        "metric results and the symbolic build are read through it",
        "3.10-3.15 (Trainer), 3.16 (BaseTrainer)",
        "a public hook for 'model created in a distribution scope'"),
    Row("BaseTrainer.__init__", (), "see BaseTrainer", "all",
        parameters=("self",)),
    Row("BaseTrainer._symbolic_build", (),
        "deferred checkpoint restores apply before fit builds its step",
        "3.10-3.16", parameters=("self", "iterator", "data_batch")),
    Row("BaseTrainer.get_metrics_result", (),
        "torch: metric states read once, combined over processes",
        "3.10-3.15 (3.16's torch Trainer combines them itself)",
        "keras 3.16 torch distribution_lib", parameters=("self",),
        backends=("torch",)),
    Row("Layer", ((_S + "layers.layer", "Layer"),),
        "deferred checkpoint restores and torch sharded layers apply "
        "after a layer's build (_post_build) and call", "3.10-3.16",
        "a public post-build callback"),
    Row("Layer._post_build", (), "see Layer", "3.10-3.16",
        parameters=("self",)),
    Row("Layer.add_weight", (), "torch sharding: a variable added to a "
        "built layer (LoRA's adapters, `enable_lora`) is laid out as the "
        "layer's were at its build", "3.10-3.16",
        "a public post-build callback", parameters=("self",),
        backends=("torch_sharding",)),
    Row("BaseOptimizer", ((_S + "optimizers.base_optimizer",
                           "BaseOptimizer"),),
        "deferred restores of optimizer slots as they are created",
        "3.10-3.16"),
    Row("BaseOptimizer.add_variable_from_reference", (), "see BaseOptimizer",
        "3.10-3.16", parameters=("self", "reference_variable", "name")),
    Row("saving_lib", ((_S + "saving.saving_lib", ""),),
        "a chief-only save builds Keras' reference objects (an Optimizer "
        "with variables) outside every strategy: under it, their variables "
        "are a collective only the saving process joins", "3.10-3.16",
        "saving that builds no variables to list attribute names"),
    Row("saving_lib.get_attr_skipset", (), "see saving_lib", "3.10-3.16",
        parameters=("obj_type",)),
    Row("saving_lib._save_state", (), "torch sharding: a layer's variables "
        "read whole while Keras saves them (LoRA merges its adapters, laid "
        "out on another mesh, into the kernel)", "3.10-3.16",
        parameters=("saveable", "weights_store"),
        backends=("torch_sharding",)),
    Row("saving_lib.safe_get_h5_dataset", (), "see H5IOStore", "3.15-3.16",
        parameters=("group", "name")),
    Row("serialization_lib", ((_S + "saving.serialization_lib", ""),),
        "kd reads every process's model configuration before a fit of "
        "several processes: a stand-in for the module's lazy `tf` answers "
        "'is this a TensorFlow type?' without importing TensorFlow in a "
        "torch or JAX job (integration/configs.py; absent: TensorFlow may "
        "be imported, as Keras does)", "3.10-3.16",
        "a serialization that imports TensorFlow only to convert its types",
        optional=True),
    Row("LazyModule", ((_S + "utils.module_utils", "LazyModule"),),
        "see serialization_lib", "3.10-3.16", optional=True),
    Row("H5IOStore", ((_S + "saving.saving_lib", "H5IOStore"),),
        "load_weights under a strategy: the weights store hands out each "
        "dataset unread (its entry group, _h5_entry_group, is read; where "
        "it is absent Keras' own whole-array path runs), so that each "
        "process reads only its regions", "3.15-3.16",
        "a lazy read (or a layout-aware load) in Keras' weights store"),
    Row("H5IOStore.__getitem__", (), "see H5IOStore", "3.15-3.16",
        parameters=("self", "key")),
    Row("Layer._load_serialized_variables", (), "see H5IOStore: the "
        "loader Dense, EinsumDense and Embedding call on Keras 3.16, which "
        "only assigns what it reads", "3.16", optional=True),
    Row("KerasVariable", ((_S + "backend.common.variables", "Variable"),),
        "see H5IOStore: a variable assigned an unread dataset reads its "
        "own regions", "3.10-3.16"),
    Row("KerasVariable.assign", (), "see KerasVariable", "3.10-3.16",
        parameters=("self", "value")),
    Row("stateless_scope", ((_S + "backend.common.stateless_scope", ""),),
        "a deferred restore waits out Keras' stateless symbolic build",
        "3.10-3.16", "a public in_stateless_scope()"),
    Row("seed_generator", ((_S + "random.seed_generator", ""),),
        "a model built without values (kd.layouts) must not leave Keras' "
        "global seed generator holding a value-less state (it is hidden "
        "while the build runs), nor its name scope stack holding a scope "
        "a TensorFlow graph refused", "3.10-3.16",
        "a public way to scope the global seed generator; TF's name_scope "
        "joining the stack only once TensorFlow took the name"),
    Row("seed_generator.GLOBAL_SEED_GENERATOR", (), "see seed_generator",
        "3.10-3.16"),
    Row("global_state", ((_S + "backend.common.global_state", ""),),
        "see seed_generator", "3.10-3.16"),
    Row("global_state.get_global_attribute", (), "see seed_generator",
        "3.10-3.16", parameters=("name",)),
    Row("global_state.set_global_attribute", (), "see seed_generator",
        "3.10-3.16", parameters=("name", "value")),
    Row("jax_trainer", ((_S + "backend.jax.trainer", ""),),
        "a short last batch gets its own data layout (the trainer reuses "
        "the first batch's)", "3.10-3.16", backends=("jax",)),
    Row("jax_trainer._distribute_data", (), "see jax_trainer", "3.10-3.16",
        parameters=("data", "layouts"), backends=("jax",)),
    Row("distribution_lib", ((_S + "distribution.distribution_lib", ""),),
        "the distribution current while the JAX trainer lays out data",
        "3.10-3.16", backends=("jax",)),
    Row("jax_distribution_lib", ((_S + "backend.jax.distribution_lib", ""),),
        "one global seed for every process after jax.distributed starts "
        "(as keras.distribution.initialize does)", "3.10-3.16",
        "keras.distribution.initialize accepting an initialized runtime",
        backends=("jax",)),
    Row("jax_distribution_lib.distribute_tensor", (),
        "several JAX processes: a new variable takes process 0's value "
        "(as tf.distribute and torch broadcast it), not an error when the "
        "processes' random states differ", "3.10-3.16",
        "a broadcast option in keras.distribution",
        parameters=("tensor", "layout"), backends=("jax",)),
    Row("jax_core", ((_S + "backend.jax.ops.core", ""),
                     (_S + "backend.jax.core", "")),
        "one JAX process: a variable the layout shards, of 4 MiB or more, "
        "is made as its shards (the jitted initializer Keras keeps for 250 "
        "MB x devices)", "3.10-3.15 (core), 3.16 (ops.core)",
        "a size option for sharded initialisation in keras.distribution",
        backends=("jax",)),
    Row("jax_core.should_shard_at_init", (), "see jax_core",
        "3.10-3.16", parameters=("init_layout", "shape"), backends=("jax",)),
    Row("jax_Variable", ((_S + "backend.jax.ops.core", "Variable"),
                         (_S + "backend.jax.core", "Variable")),
        "several JAX processes: a large sharded variable whose initializer "
        "has a seed is made as its shards from process 0's seed",
        "3.10-3.15 (core), 3.16 (ops.core)",
        "a size option for sharded initialisation in keras.distribution",
        backends=("jax",)),
    Row("jax_Variable._initialize_with_initializer", (), "see jax_Variable",
        "3.10-3.16", parameters=("self", "initializer"), backends=("jax",)),
    Row("jax_Variable._initialize_layout", (), "see jax_Variable",
        "3.10-3.16", parameters=("self",), backends=("jax",)),
    Row("Loss", ((_S + "losses.loss", "Loss"),),
        "TF: each replica's loss weighted by local/global batch (Keras "
        "divides by the replica count: wrong for an uneven short batch)",
        "3.10-3.16", backends=("tensorflow",)),
    Row("Loss.__call__", (), "see Loss", "3.10-3.16",
        parameters=("self", "y_true", "y_pred"), backends=("tensorflow",)),
    Row("loss_module", ((_S + "losses.loss", ""),),
        "TF: the logged loss undoes the weighting above", "3.10-3.16",
        backends=("tensorflow",)),
    Row("loss_module.scale_loss_for_distribution", (), "TF: inside a "
        "Keras step the scaling goes to the gradient only (a user's "
        "train_step logs the true loss)", "3.10-3.16",
        parameters=("value",), backends=("tensorflow",)),
    Row("loss_module.unscale_loss_for_distribution", (), "see loss_module",
        "3.10-3.16", parameters=("value",), backends=("tensorflow",)),
    Row("tf_Variable", ((_S + "backend.tensorflow.ops.core", "Variable"),
                        (_S + "backend.tensorflow.core", "Variable")),
        "TF: int()/float() of a scalar variable made in a strategy scope",
        "3.10-3.15 (core), 3.16 (ops.core)", backends=("tensorflow",)),
    Row("TFOptimizer", ((_S + "backend.tensorflow.optimizer",
                         "TFOptimizer"),),
        "TF: an optimizer first applied inside a tf.function under a "
        "strategy makes its slots under init_scope (else 'You must feed a "
        "value for placeholder tensor'); Keras 3.16 does this itself",
        "3.10-3.15 (patched), 3.16 (own add_variable)", "keras#23087",
        backends=("tensorflow",)),
    Row("tf_Variable._initialize_with_initializer", (),
        "TF: a layer built by its first call inside a tf.function under a "
        "strategy makes its variables under init_scope (else 'You must feed "
        "a value for placeholder tensor'), as tf.keras 2 built layers",
        "3.10-3.16", parameters=("self", "initializer"),
        backends=("tensorflow",)),
    Row("TFOptimizer.add_variable", (), "see TFOptimizer", "3.10-3.16",
        parameters=("self", "shape", "initializer", "dtype"),
        backends=("tensorflow",)),
    Row("TFOptimizer._all_reduce_sum_gradients", (),
        "TF: CommunicationOptions(compression=...) casts the gradients "
        "the optimizer all-reduces to 16 bits and back", "3.10-3.16",
        parameters=("self", "grads_and_vars"), backends=("tensorflow",)),
    Row("TFOptimizer._backend_apply_gradients", (),
        "TF: gradient accumulation / EMA overwrite wrap the update in "
        "ops.cond, where tf.distribute refuses merge_call, and clipping "
        "(clipnorm, clipvalue, global_clipnorm) ran on each replica's part "
        "of the gradient; the update runs in cross-replica context on "
        "gradients all-reduced first",
        "3.10-3.16", parameters=("self", "grads", "trainable_variables"),
        backends=("tensorflow",)),
    Row("TFOptimizer.apply", (),
        "TF: the update (iteration count included) waits for the "
        "gradients, so the call that finds a dataset of unknown length "
        "exhausted changes no replica's copy", "3.10-3.16",
        parameters=("self", "grads", "trainable_variables"),
        backends=("tensorflow",)),
    Row("tf_trainer", ((_S + "backend.tensorflow.trainer", ""),),
        "TF: multi-worker fit (keras#20585) and the first uneven batch",
        "3.10-3.16", "keras#20585", backends=("tensorflow",)),
    Row("TFTrainer", ((_S + "backend.tensorflow.trainer",
                       "TensorFlowTrainer"),
                      (_S + "backend.tensorflow.trainer", "Trainer")),
        "see tf_trainer", "3.10-3.15 (TensorFlowTrainer), 3.16 (Trainer)",
        "keras#20585", backends=("tensorflow",)),
    Row("TFTrainer._maybe_symbolic_build", (), "see tf_trainer", "3.10-3.16",
        parameters=("self", "iterator", "data_batch"),
        backends=("tensorflow",)),
    Row("tf_trainer.reduce_per_replica", (), "see tf_trainer", "3.10-3.16",
        parameters=("values", "strategy", "reduction"),
        backends=("tensorflow",)),
    Row("torch_Variable", ((_S + "backend.torch.ops.core", "Variable"),
                           (_S + "backend.torch.core", "Variable")),
        "torch: new variables recorded for the rank-0 broadcast; sharded "
        "variables assigned shard-wise", "3.10-3.15 (core), 3.16 (ops.core)",
        "keras 3.16 torch distribution_lib", backends=("torch",)),
    Row("torch_Variable._initialize", (), "see torch_Variable", "3.10-3.16",
        parameters=("self", "value"), backends=("torch",)),
    Row("torch_Variable._direct_assign", (), "see torch_Variable",
        "3.10-3.16", parameters=("self", "value"), backends=("torch",)),
    Row("TorchTrainer", ((_S + "backend.torch.trainer", "TorchTrainer"),
                         (_S + "backend.torch.trainer", "Trainer")),
        "torch: the train step forwards through a held DDP (a DDP(model) "
        "that Keras bypasses syncs nothing)",
        "3.10-3.15 (TorchTrainer), 3.16 (Trainer)",
        "keras 3.16 torch distribution_lib", backends=("torch",)),
    Row("TorchTrainer.train_step", (), "see TorchTrainer", "3.10-3.16",
        parameters=("self", "data"), backends=("torch",)),
    Row("TorchTrainer.make_train_function", (),
        "torch: a model that overrides train_step (bypassing the DDP "
        "step) runs each step as a session in which the gradients given "
        "to an optimizer are the global batch's and the logs global",
        "3.10-3.16", "a public hook around a custom train_step",
        parameters=("self", "force"), backends=("torch",)),
    Row("TorchTrainer.make_test_function", (),
        "torch: see make_train_function (a test_step's logs)", "3.10-3.16",
        parameters=("self", "force"), backends=("torch",)),
    Row("BaseOptimizer.apply", (),
        "torch: the gradients a user's train_step (or a replica in "
        "strategy.run) applies are all-reduced first, as tf.distribute's "
        "optimizers do", "3.10-3.16",
        "optimizers that reduce gradients under a keras.distribution",
        parameters=("self", "grads", "trainable_variables"),
        backends=("torch",)),
    Row("LossScaleOptimizer", ((_S + "optimizers.loss_scale_optimizer",
                                "LossScaleOptimizer"),),
        "torch: see BaseOptimizer.apply (the outer optimizer reduces, so "
        "every process sees the same finite or non-finite gradients)",
        "3.10-3.16", backends=("torch",)),
    Row("LossScaleOptimizer.apply", (), "see LossScaleOptimizer",
        "3.10-3.16", parameters=("self", "grads", "trainable_variables"),
        backends=("torch",)),
    Row("TorchTrainer._initialize_ddp", (),
        "torch: Keras 3.16 wraps a model in its own DDP; the engine uses "
        "that one (one DDP, not two), and a sharded engine, whose DTensor "
        "collectives replace DDP, keeps Keras from making it; its presence "
        "says Keras distributes torch (the engines then take Keras' "
        "DataParallel, torch mesh and layouts)",
        "3.16 (absent before)", parameters=("self",), backends=("torch",),
        optional=True),
    Row("TorchTrainer.get_metrics_result", (),
        "torch: Keras 3.16 all-reduces every metric variable in every step "
        "itself; for a model a strategy owns the engine's one flat "
        "reduction, made when results are read, replaces it (not a second "
        "reduction on top)", "3.16 (inherited before)",
        parameters=("self",), backends=("torch",), optional=True),
    # torch sharded layouts (DTensor over processes); checked when the
    # first sharding engine installs them.
    Row("keras_backend", ((_S + "backend", ""),),
        "torch sharding: convert_to_numpy of a sharded variable reads it "
        "whole", "3.10-3.16", backends=("torch_sharding",)),
    Row("torch_package", ((_S + "backend.torch", ""),), "see keras_backend",
        "3.10-3.16", backends=("torch_sharding",)),
    Row("torch_core", ((_S + "backend.torch.ops.core", ""),
                       (_S + "backend.torch.core", "")),
        "see keras_backend", "3.10-3.15 (core), 3.16 (ops.core)",
        backends=("torch_sharding",)),
    Row("torch_core.convert_to_numpy", (), "see keras_backend", "3.10-3.16",
        parameters=("x",), backends=("torch_sharding",)),
    Row("torch_random", ((_S + "backend.torch.random", ""),),
        "torch sharding: a large sharded variable drawn by one of Keras' "
        "one-draw initializers is made as each process's shard (the draw "
        "replaced while its initializer runs)", "3.10-3.16",
        "a sharded initialisation in keras.distribution for torch",
        backends=("torch_sharding",)),
    Row("torch_random.normal", (), "see torch_random", "3.10-3.16",
        parameters=("shape", "mean", "stddev", "dtype", "seed"),
        backends=("torch_sharding",)),
    Row("torch_random.uniform", (), "see torch_random", "3.10-3.16",
        parameters=("shape", "minval", "maxval", "dtype", "seed"),
        backends=("torch_sharding",)),
    Row("torch_random.truncated_normal", (), "see torch_random",
        "3.10-3.16", parameters=("shape", "mean", "stddev", "dtype", "seed"),
        backends=("torch_sharding",)),
    Row("torch_random.torch_seed_generator", (), "see torch_random",
        "3.10-3.16", parameters=("seed",), backends=("torch_sharding",)),
    Row("torch_random.to_torch_dtype", (), "see torch_random", "3.10-3.16",
        parameters=("dtype",), backends=("torch_sharding",)),
    Row("torch_Variable._initialize_with_initializer", (),
        "see torch_random", "3.10-3.16", parameters=("self", "initializer"),
        backends=("torch_sharding",)),
    Row("torch_Variable.value", (), "torch sharding: a fully sharded "
        "variable another layer's call reads itself is gathered for it",
        "3.10-3.16", backends=("torch_sharding",)),
    Row("TorchLayer", ((_S + "backend.torch.layer", "TorchLayer"),),
        "torch sharding: a sharded layer's forward runs on its shards",
        "3.10-3.16", backends=("torch_sharding",)),
    Row("TorchLayer.forward", (), "see TorchLayer", "3.10-3.16",
        backends=("torch_sharding",)),
    Row("optimizers_module", ((_S + "optimizers.base_optimizer", ""),),
        "torch sharding: `global_clipnorm` over gradients that are DTensors "
        "on different meshes (Keras stacks their squared norms as one)",
        "3.10-3.16", "a global norm that reduces sharded tensors",
        backends=("torch_sharding",)),
    Row("optimizers_module.clip_by_global_norm", (), "see optimizers_module",
        "3.10-3.16", parameters=("value_list", "clip_norm"),
        backends=("torch_sharding",)),
    Row("TorchParallelOptimizer",
        ((_S + "backend.torch.optimizers.torch_parallel_optimizer",
          "TorchParallelOptimizer"),),
        "torch sharding: optimizer updates grouped by shard layout",
        "3.10-3.16", backends=("torch_sharding",)),
    Row("TorchParallelOptimizer._backend_update_step", (),
        "see TorchParallelOptimizer", "3.10-3.16",
        parameters=("self", "grads", "trainable_variables", "learning_rate"),
        backends=("torch_sharding",)),
    Row("TorchParallelOptimizer._backend_increment_gradient_accumulators",
        (), "see TorchParallelOptimizer", "3.10-3.16",
        parameters=("self", "grads", "acc_grads"),
        backends=("torch_sharding",)),
)
