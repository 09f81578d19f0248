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
4. PyTorch only: see `torch_hooks` (the rank-0 broadcast of new
   variables, the held DDP, metric states read once over all processes).
5. JAX only: Keras' trainer computes the data layout from the first batch
   of an epoch and reuses it; a short last batch then fails with
   `IndivisibleError`. The hook asks the strategy's distribution for every
   batch instead (a short batch is laid out replicated).
6. Checkpoints (installed on the first deferred restore only): after a
   layer's build or call (outside Keras' stateless symbolic build), before
   `fit` & co. start and before an optimizer's first slot is made, restores
   waiting for those variables are applied.
7. PyTorch sharded layouts (installed by the first sharding engine only):
   see `torch_hooks.install_sharding`.
"""

import functools
import threading
from types import MappingProxyType

import keras

from keras_distribute.common import context
from keras_distribute.common.context import model_strategy
from keras_distribute.input import process_data
from keras_distribute.integration import patching
from keras_distribute.integration import registry
from keras_distribute.integration import saving
from keras_distribute.integration import sharded_loading
from keras_distribute.integration import tf_hooks
from keras_distribute.integration import torch_hooks
from keras_distribute.job import peer_board

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
                  if not current.engine.owns_variable(v)]
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
    strategy.engine.adopt_variables(variables)
    object.__setattr__(model, "_kd_adopted", seen)


# Where `batch_size` comes positionally: fit(x, y, batch_size), ...
_BATCH_SIZE_POSITION = MappingProxyType({"fit": 2, "evaluate": 2, "predict": 1})


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
    from keras_distribute.input.datasets import as_trainer_input

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
            engine = strategy.engine
            return engine.call_trainer(
                process_data.with_process_rules(engine, original), self,
                args, kwargs)

    return patching.wrapping(method, original)


def _install_model_hooks() -> None:
    base_trainer = registry.resolve("BaseTrainer")
    original_init = base_trainer.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if context.has_strategy() and model_strategy(self) is None:
            object.__setattr__(self, "_kd_strategy", context.get_strategy())
            if keras.backend.backend() == "tensorflow":
                _build_in_its_scope(self)

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
    _install_loading_hooks()


def _install_loading_hooks() -> None:
    """`load_weights` of a model made in a strategy's scope reads only this
    process's regions (see `sharded_loading`)."""
    owner = next(c for c in keras.Model.__mro__ if "load_weights" in c.__dict__)
    _patch(owner, "load_weights", sharded_loading.load_weights_by_region(
        owner.__dict__["load_weights"]))
    store = registry.resolve("H5IOStore")
    _patch(store, "__getitem__", sharded_loading.lazy_getitem(
        registry.resolve("H5IOStore.__getitem__"),
        registry.resolve("saving_lib.safe_get_h5_dataset")))
    variable = registry.resolve("KerasVariable")

    def checkpoint_assign():
        from keras_distribute.backend import get_backend

        return get_backend().checkpoint_assign

    _patch(variable, "assign", sharded_loading.assign_by_region(
        registry.resolve("KerasVariable.assign"), checkpoint_assign))


def _build_in_its_scope(model) -> None:
    """A TensorFlow model made under a strategy builds under it, wherever
    `build` is called from (keras-tuner's `build_from_config` after a
    search, a first call outside the scope): tf.distribute cannot mirror a
    variable made outside its scope afterwards (JAX and torch adopt such
    variables instead). Keras wraps each layer's `build` per instance (its
    `build_wrapper`); this wraps that once more."""
    build = model.build

    @functools.wraps(build)
    def build_in_scope(*args, **kwargs):
        strategy = model_strategy(model)
        if strategy is None or (context.has_strategy()
                                and context.get_strategy() is strategy):
            return build(*args, **kwargs)
        with strategy.scope():
            return build(*args, **kwargs)

    object.__setattr__(model, "build", build_in_scope)


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


def _install_jax_init_hook() -> None:
    from keras_distribute.integration import jax_initialization

    core = registry.resolve("jax_core")
    distribution_lib = registry.resolve("distribution_lib")
    _patch(core, "should_shard_at_init", jax_initialization.born_sharded(
        core.should_shard_at_init, distribution_lib.distribution))
    variable = registry.resolve("jax_Variable")
    registry.resolve("jax_Variable._initialize_layout")
    _patch(variable, "_initialize_with_initializer",
           jax_initialization.seed_of_process_zero(
               variable._initialize_with_initializer,
               distribution_lib.distribution))


def install_torch_sharding_hooks() -> None:
    """7. Sharded layouts on torch: see `torch_hooks.install_sharding`."""
    torch_hooks.install_sharding()


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

    from keras_distribute.checkpoint import restoring

    with _lock:
        if _checkpoint_hooks_installed:
            return
        _checkpoint_hooks_installed = True
        apply = restoring.apply_deferred_restores
        waiting = restoring.waiting

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
            _install_jax_init_hook()
        elif keras.backend.backend() == "tensorflow":
            tf_hooks.install()
        elif keras.backend.backend() == "torch":
            torch_hooks.install()


def uninstall() -> None:
    """Removes every hook, restoring Keras exactly as it was."""
    global _checkpoint_hooks_installed, _jax_process_hooks_installed
    with _lock:
        _checkpoint_hooks_installed = False
        _jax_process_hooks_installed = False
        torch_hooks.forget()
        patching.restore_all()
