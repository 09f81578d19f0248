"""Every place where keras_distribute hooks into Keras, in one module.

Keras has no hook for "a model remembers the strategy it was created
under", nor (on JAX) for laying out a short last batch. This module adds
them, on first use (the first strategy created, never at import), and
`uninstall()` removes them again. Every Keras-private name comes from
`registry` (its rows say why and on which Keras versions), and
`install()` checks them all before it patches anything. Tested on Keras
3.15.1 and keras-nightly 3.16.0.dev2026102704.

1. `Trainer.__init__` records the current strategy on every model created
   inside a `scope()` (`model._kd_strategy`).
2. `Model.compile/fit/evaluate/predict/*_on_batch` re-enter that strategy's
   scope wherever they are called, lay out stray optimizer / metric /
   lazily-built variables, and refuse a model created outside any scope
   whose variables the strategy does not own, or mixing two strategies.
3. TensorFlow only: see `tf_hooks` (uneven last batch, scalar variables,
   multi-worker fit, optimizer slots, updates inside `ops.cond`).
4. PyTorch only (in a process group): new variables are recorded for the
   rank-0 broadcast; `TorchTrainer.train_step` forwards through a held
   `DistributedDataParallel` (a `DDP(model)` that Keras bypasses would sync
   nothing); `Trainer.get_metrics_result` reads all-process metric states
   with one flat all-reduce. On Keras 3.16, whose torch Trainer makes its
   own DDP and reduces metrics itself, the engine holds Keras' DDP (a
   sharded engine prevents it) and its reduction replaces Keras'.
5. JAX only: Keras' trainer computes the data layout from the first batch
   of an epoch and reuses it; a short last batch then fails with
   `IndivisibleError`. The hook asks the strategy's distribution for every
   batch instead (a short batch is laid out replicated).
6. Checkpoints (installed on the first deferred restore only): after a
   layer's build or call (outside Keras' stateless symbolic build), before
   `fit` & co. start and before an optimizer's first slot is made, restores
   waiting for those variables are applied.
7. PyTorch sharded layouts (installed by the first sharding engine only):
   see `install_torch_sharding_hooks`.
"""

import functools
import threading

import keras

from keras_distribute import context
from keras_distribute import peer_board
from keras_distribute.integration import registry
from keras_distribute.integration import patching
from keras_distribute.integration import saving
from keras_distribute.integration import tf_hooks
from keras_distribute.context import model_strategy

_TRAINER_METHODS = (
    "compile", "fit", "evaluate", "predict",
    "train_on_batch", "test_on_batch", "predict_on_batch",
)
_lock = threading.Lock()
_originals = patching.originals
_patch = patching.patch


def _strategy_for(model, method_name: str):
    owner = model_strategy(model)
    current = context.get_strategy() if context.has_strategy() else None
    if owner is None:
        if current is None:
            return None
        strays = [v.path for v in model.variables
                  if not current._engine.owns_variable(v)]
        if strays:
            raise ValueError(
                f"`{method_name}` was called inside {current!r}.scope() on a "
                "model whose variables were created outside any strategy "
                f"scope (e.g. {strays[:3]}). Received: model "
                f"'{model.name}' with {len(strays)} such variable(s). Create "
                "the model inside the scope:\n\n"
                "    with strategy.scope():\n"
                "        model = ...\n"
                "        model.compile(...)\n"
            )
        object.__setattr__(model, "_kd_strategy", current)
        return current
    if current is not None and current is not owner:
        raise ValueError(
            f"`{method_name}` was called inside the scope of {current!r} on a "
            f"model created under {owner!r}. Mixing strategies is not "
            f"allowed. Received: model '{model.name}'. Call it outside the "
            "other scope (the model remembers its strategy), or rebuild the "
            "model under the new strategy."
        )
    return owner


def _adopt_strays(model, strategy) -> None:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "variables"):
        variables += list(optimizer.variables)
    variables += list(getattr(model, "metrics_variables", []))
    # Strays appear only when something is built or compile swaps objects:
    # when the same variables were adopted already, skip the per-variable
    # ownership checks (keeps `*_on_batch` loops cheap).
    seen = (strategy, tuple(map(id, variables)))
    if model.__dict__.get("_kd_adopted") == seen:
        return
    strategy._engine.adopt_variables(variables)
    object.__setattr__(model, "_kd_adopted", seen)


# Where `batch_size` comes positionally: fit(x, y, batch_size), ...
_BATCH_SIZE_POSITION = {"fit": 2, "evaluate": 2, "predict": 1}


def _check_batch_size(name: str, args: tuple, kwargs: dict) -> None:
    position = _BATCH_SIZE_POSITION.get(name)
    if position is None:
        return
    batch_size = kwargs.get("batch_size", args[position] if len(args) > (
        position) else None)
    if batch_size is None or (isinstance(batch_size, int) and not isinstance(
            batch_size, bool) and batch_size > 0):
        return
    raise ValueError(
        f"`{name}` expects `batch_size` to be a positive integer: the global "
        "batch, split across the strategy's replicas. Received: "
        f"batch_size={batch_size!r}. Pass e.g. batch_size=64 (or leave it "
        "None for the default of 32).")


def _global_batches(strategy, name: str, args: tuple, kwargs: dict):
    """`fit(strategy.experimental_distribute_dataset(ds))` & co. train on
    `ds` (as with tf.distribute's Keras): the distributed datasets among
    the arguments replaced by their global batches."""
    from keras_distribute.input_lib import as_trainer_input

    if name not in _BATCH_SIZE_POSITION:
        return args, kwargs
    if args:
        args = (as_trainer_input(strategy, args[0], "x"),) + args[1:]
    for key in ("x", "validation_data"):
        if key in kwargs:
            kwargs = {**kwargs, key: as_trainer_input(strategy, kwargs[key],
                                                      key)}
    return args, kwargs


def _wrap_trainer_method(name: str, original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        strategy = _strategy_for(self, name)
        if strategy is None:
            return original(self, *args, **kwargs)
        _check_batch_size(name, args, kwargs)
        args, kwargs = _global_batches(strategy, name, args, kwargs)
        with strategy.scope():
            _adopt_strays(self, strategy)
            return strategy._engine.call_trainer(original, self, args, kwargs)

    method._kd_original = original
    return method


def _install_model_hooks() -> None:
    base_trainer = registry.resolve("BaseTrainer")
    original_init = base_trainer.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if context.has_strategy() and model_strategy(self) is None:
            object.__setattr__(self, "_kd_strategy", context.get_strategy())

    _patch(base_trainer, "__init__", __init__)
    for name in _TRAINER_METHODS:
        # Patch where the method is defined, so that Keras' own override
        # checks (`cls.compile != Trainer.compile`) still see the default.
        owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
        _patch(owner, name, _wrap_trainer_method(name, owner.__dict__[name]))
    for name in ("save", "save_weights"):
        owner = next(c for c in keras.Model.__mro__ if name in c.__dict__)
        _patch(owner, name, saving.atomic_save(owner.__dict__[name]))
    saving_lib = registry.resolve("saving_lib")
    _patch(saving_lib, "get_attr_skipset",
           saving.outside_every_strategy(saving_lib.get_attr_skipset))


def _host_array_unless_jax(value):
    import jax
    import numpy as np

    if value is None or isinstance(value, (np.ndarray, jax.Array)) or (
            not hasattr(value, "__array__")):
        return value
    return np.asarray(value)


def _install_jax_data_hook() -> None:
    jax_trainer = registry.resolve("jax_trainer")
    distribution_lib = registry.resolve("distribution_lib")

    original = jax_trainer._distribute_data

    @functools.wraps(original)
    def _distribute_data(data, layouts=None, *args, **kwargs):
        # Keras 3.16 adds `is_super_batch`: passed on as given.
        distribution = distribution_lib.distribution()
        if getattr(distribution, "_kd_strategy_distribution", False):
            peer_board.advance()  # a step begins (names a peer that lags)
            layouts = None  # per batch: a short batch gets its own layout
            # `train_on_batch(x, y)` with a tf.data batch (tf.Tensors, as
            # the TF checkpoint guide's loop feeds): Keras lays out only
            # numpy and JAX arrays ("Cannot interpret 'tf.float32'").
            data = keras.tree.map_structure(_host_array_unless_jax, data)
        return original(data, layouts, *args, **kwargs)

    _patch(jax_trainer, "_distribute_data", _distribute_data)


def _torch_engine(model):
    strategy = model_strategy(model)
    engine = getattr(strategy, "_engine", None)
    return engine if getattr(engine, "in_group", False) else None


def _install_torch_hooks() -> None:
    torch_variable = registry.resolve("torch_Variable")
    torch_trainer = registry.resolve("TorchTrainer")
    base_trainer = registry.resolve("BaseTrainer")

    from keras_distribute.backend import torch as torch_backend

    original_initialize = torch_variable._initialize

    @functools.wraps(original_initialize)
    def _initialize(self, value):
        original_initialize(self, value)
        torch_backend.on_variable_created(self)

    original_train_step = torch_trainer.train_step

    @functools.wraps(original_train_step)
    def train_step(self, data):
        engine = _torch_engine(self)
        if engine is None:
            return original_train_step(self, data)
        return engine.train_step(self, data)

    # Keras 3.16's torch Trainer all-reduces metric variables itself; for a
    # model a strategy owns, the engine's one flat reduction replaces it.
    base_results = base_trainer.get_metrics_result  # reduces nothing
    owner = torch_trainer if "get_metrics_result" in vars(
        torch_trainer) else base_trainer
    original_results = owner.get_metrics_result

    @functools.wraps(original_results)
    def get_metrics_result(self):
        engine = _torch_engine(self)
        if engine is None:
            return original_results(self)
        with engine.global_metric_states(self.metrics_variables):
            results = base_results(self)
            # A result can be a view of a metric variable (TruePositives'
            # `accumulator[0]`), and the local values return on exit.
            return keras.tree.map_structure(
                lambda v: v.clone() if hasattr(v, "clone") else v, results)

    _patch(torch_variable, "_initialize", _initialize)
    _patch(torch_trainer, "train_step", train_step)
    _patch(owner, "get_metrics_result", get_metrics_result)

    initialize_ddp = registry.resolve("TorchTrainer._initialize_ddp")
    if initialize_ddp is not None:  # Keras 3.16 makes its own DDP
        @functools.wraps(initialize_ddp)
        def _initialize_ddp(self):
            engine = _torch_engine(self)
            if engine is None:
                return initialize_ddp(self)
            if not engine.uses_keras_ddp:
                return None  # DTensor collectives replace DDP's
            engine.broadcast_new_variables()
            result = initialize_ddp(self)
            engine.hold_ddp(self, self.ddp_model)  # one DDP: Keras' own
            return result

        _patch(torch_trainer, "_initialize_ddp", _initialize_ddp)


_torch_sharding_hooks_installed = False


def install_torch_sharding_hooks() -> None:
    """7. Sharded layouts on torch (`backend/torch_sharding.py`; installed
    when the first sharding engine is made, so plain torch runs pay
    nothing): a built layer's variables become DTensors, an optimizer slot
    takes its variable's placement, a sharded layer is called with
    replicated inputs and returns whole outputs, reading or assigning a
    sharded variable whole works (`get_weights`, `set_weights`), and Keras'
    torch optimizers update DTensors and tensors in separate `_foreach`
    groups. `uninstall()` removes them."""
    global _torch_sharding_hooks_installed
    with _lock:
        if _torch_sharding_hooks_installed:
            return
        _torch_sharding_hooks_installed = True
        _install_torch_sharding_hooks()


def _install_torch_sharding_hooks() -> None:
    registry.check("torch_sharding", [
        row.key for row in registry.ROWS
        if "torch_sharding" in row.backends])
    keras_backend = registry.resolve("keras_backend")
    torch_package = registry.resolve("torch_package")
    in_stateless_scope = registry.resolve(
        "stateless_scope").in_stateless_scope
    torch_core = registry.resolve("torch_core")
    layer_class = registry.resolve("Layer")
    optimizer_class = registry.resolve("BaseOptimizer")
    torch_variable = registry.resolve("torch_Variable")

    from keras_distribute.backend import torch_variables

    original_post_build = layer_class._post_build

    @functools.wraps(original_post_build)
    def _post_build(self):
        original_post_build(self)
        if not in_stateless_scope():
            torch_variables.on_layer_built(self)

    original_forward = registry.resolve("TorchLayer").forward

    def forward(self, *args, **kwargs):
        engine = self.__dict__.get("_kd_sharded_engine")
        if engine is None:
            return original_forward(self, *args, **kwargs)
        return engine.sharded_forward(original_forward, self, args, kwargs)

    original_slot = optimizer_class.add_variable_from_reference

    @functools.wraps(original_slot)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        variable = original_slot(self, reference_variable, *args, **kwargs)
        torch_variables.on_slot_created(variable, reference_variable)
        return variable

    original_numpy = torch_core.convert_to_numpy

    @functools.wraps(original_numpy)
    def convert_to_numpy(x):
        return original_numpy(torch_variables.whole_value(x))

    original_assign = torch_variable._direct_assign

    @functools.wraps(original_assign)
    def _direct_assign(self, value):
        if not torch_variables.assign_sharded(self, value):
            original_assign(self, value)

    parallel = registry.resolve("TorchParallelOptimizer")
    original_update = parallel._backend_update_step
    original_increment = parallel._backend_increment_gradient_accumulators

    def _backend_update_step(self, grads, trainable_variables,
                             learning_rate):
        for variables, group in torch_variables.split_sharded(
                trainable_variables, grads):
            original_update(self, group, variables, learning_rate)

    def _backend_reset_gradient_accumulators(self):
        torch_variables.zero_variables(
            [v for v in self._accumulated_gradients if v is not None])

    def _backend_increment_gradient_accumulators(self, grads, acc_grads):
        for accumulators, group in torch_variables.split_sharded(acc_grads,
                                                               grads):
            original_increment(self, group, accumulators)

    _patch(parallel, "_backend_update_step", _backend_update_step)
    _patch(parallel, "_backend_reset_gradient_accumulators",
           _backend_reset_gradient_accumulators)
    _patch(parallel, "_backend_increment_gradient_accumulators",
           _backend_increment_gradient_accumulators)
    _patch(layer_class, "_post_build", _post_build)
    _patch(registry.resolve("TorchLayer"), "forward", forward)
    _patch(optimizer_class, "add_variable_from_reference",
           add_variable_from_reference)
    for module in (torch_core, torch_package, keras_backend):
        _patch(module, "convert_to_numpy", convert_to_numpy)
    _patch(torch_variable, "_direct_assign", _direct_assign)


_checkpoint_hooks_installed = False


def install_checkpoint_hooks() -> None:
    """6. Deferred checkpoint restores: once a layer, a model (before
    `fit` & co.) or an optimizer has created its variables, restores that
    waited for them are applied (`ShardedCheckpoint.read` before build).
    The check is a count: an object is restored once it holds as many
    variables as the checkpoint saved for it.
    Installed on the first deferred restore; `uninstall()` removes it.
    """
    global _checkpoint_hooks_installed
    registry.check(keras.backend.backend(), [
        "stateless_scope", "Layer", "Layer._post_build", "BaseTrainer",
        "BaseTrainer._symbolic_build", "BaseOptimizer",
        "BaseOptimizer.add_variable_from_reference"])
    stateless_scope = registry.resolve("stateless_scope")
    layer_class = registry.resolve("Layer")
    optimizer_class = registry.resolve("BaseOptimizer")
    base_trainer = registry.resolve("BaseTrainer")

    from keras_distribute.checkpoint import sharded_checkpoint

    with _lock:
        if _checkpoint_hooks_installed:
            return
        _checkpoint_hooks_installed = True
        apply = sharded_checkpoint.apply_deferred_restores
        waiting = sharded_checkpoint._waiting

        def after(original):
            @functools.wraps(original)
            def method(self, *args, **kwargs):
                result = original(self, *args, **kwargs)
                # A subclassed model's first call builds its layers under a
                # stateless scope (Keras' symbolic build): assignments made
                # there are discarded, so wait until the call returns.
                if waiting and not stateless_scope.in_stateless_scope():
                    apply()
                return result
            return method

        _patch(layer_class, "_post_build", after(layer_class._post_build))
        _patch(layer_class, "__call__", after(layer_class.__call__))
        _patch(base_trainer, "_symbolic_build",
               after(base_trainer._symbolic_build))
        for name in ("add_variable", "add_variable_from_reference"):
            _patch(optimizer_class, name,
                   after(getattr(optimizer_class, name)))


_jax_process_hooks_installed = False


def install_jax_process_hooks() -> None:
    """Several JAX processes: new variables take process 0's values."""
    global _jax_process_hooks_installed
    from keras_distribute.integration import jax_processes

    with _lock:
        if _jax_process_hooks_installed:
            return
        key = "jax_distribution_lib.distribute_tensor"
        registry.check("jax", ["jax_distribution_lib", key])
        library = registry.resolve("jax_distribution_lib")
        _patch(library, "distribute_tensor",
               jax_processes.chief_values(library.distribute_tensor))
        _jax_process_hooks_installed = True


def install() -> None:
    """Installs the hooks once; later calls do nothing."""
    with _lock:
        if any(name == "__init__" for _, name, _, _ in _originals):
            return
        # Every row this backend uses, before anything is patched.
        registry.check(keras.backend.backend())
        _install_model_hooks()
        if keras.backend.backend() == "jax":
            _install_jax_data_hook()
        elif keras.backend.backend() == "tensorflow":
            tf_hooks.install()
        elif keras.backend.backend() == "torch":
            _install_torch_hooks()


def uninstall() -> None:
    """Removes every hook, restoring Keras exactly as it was."""
    global _checkpoint_hooks_installed, _torch_sharding_hooks_installed
    global _jax_process_hooks_installed
    with _lock:
        _checkpoint_hooks_installed = False
        _jax_process_hooks_installed = False
        _torch_sharding_hooks_installed = False
        patching.restore_all()
