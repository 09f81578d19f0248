"""The PyTorch backend's hooks into Keras (installed by `hooks.install`).

4. In a process group: new variables are recorded for the rank-0
   broadcast (made when a layer built in the user's scope is built);
   `TorchTrainer.train_step` forwards through a held
   `DistributedDataParallel` (a `DDP(model)` that Keras bypasses would sync
   nothing); `Trainer.get_metrics_result` reads all-process metric states
   with one flat all-reduce. On Keras 3.16, whose torch Trainer makes its
   own DDP and reduces metrics itself, the engine holds Keras' DDP (a
   sharded engine prevents it) and its reduction replaces Keras'.
7. Sharded layouts (`install_sharding`, by the first sharding engine only).

Every Keras-private name comes from `registry`.
"""

import functools
import threading
from typing import Dict

import keras

from keras_distribute.backend import interface
from keras_distribute.common.context import model_strategy
from keras_distribute.integration import patching
from keras_distribute.integration import registry

_lock = threading.Lock()
_patch = patching.patch
_sharding_installed = False


# engine class -> whether it is a `TorchDdpEngine` (asked once per class:
# `_torch_engine` runs at every training step, and a runtime protocol check
# reads each of the protocol's ~30 members)
_ddp_engine_classes: Dict[type, bool] = {}


def _torch_engine(model):
    strategy = model_strategy(model)
    engine = None if strategy is None else strategy.engine
    if engine is None:
        return None
    kind = type(engine)
    if kind not in _ddp_engine_classes:
        _ddp_engine_classes[kind] = isinstance(engine,
                                               interface.TorchDdpEngine)
    return engine if _ddp_engine_classes[kind] and engine.in_group else None


def install() -> None:
    """4. The torch hooks every torch strategy needs (see `hooks`)."""
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

    layer_class = registry.resolve("Layer")
    in_stateless_scope = registry.resolve(
        "stateless_scope").in_stateless_scope
    original_post_build = layer_class._post_build

    @functools.wraps(original_post_build)
    def _post_build(self):
        original_post_build(self)
        if not in_stateless_scope():
            torch_backend.on_layer_built(self)

    _patch(torch_variable, "_initialize", _initialize)
    _patch(layer_class, "_post_build", _post_build)
    _patch(torch_trainer, "train_step", train_step)
    _install_user_steps(torch_trainer)
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


def _install_user_steps(torch_trainer) -> None:
    """A model's own `train_step`/`test_step` under a torch strategy: each
    step a session whose optimizer calls get global gradients and whose
    logs are global (`backend/torch/user_steps.py`)."""
    from keras_distribute.backend.torch import user_steps

    def wrapping_make(name: str, step_name: str, is_train: bool):
        original_make = getattr(torch_trainer, name)
        function_name = name.replace("make_", "")

        @functools.wraps(original_make)
        def make(self, force=False):
            result = original_make(self, force)
            engine = _torch_engine(self)
            function = getattr(self, function_name, None)
            overridden = getattr(type(self), step_name) is not getattr(
                torch_trainer, step_name)
            if engine is None or function is None or not overridden or (
                    getattr(function, "_kd_user_step", False)):
                return result
            setattr(self, function_name, engine.wrap_step_function(
                self, function, is_train))
            return getattr(self, function_name)

        _patch(torch_trainer, name, make)

    wrapping_make("make_train_function", "train_step", True)
    wrapping_make("make_test_function", "test_step", False)
    for key in ("BaseOptimizer", "LossScaleOptimizer"):
        owner = registry.resolve(key)
        original_apply = owner.apply

        def apply(self, grads, trainable_variables=None,
                  _original=original_apply):
            return user_steps.apply_with_global_gradients(
                _original, self, grads, trainable_variables)

        _patch(owner, "apply", functools.wraps(original_apply)(apply))


def install_sharding() -> None:
    """7. Sharded layouts on torch (`backend/torch/sharding.py`; installed
    when the first sharding engine is made, so plain torch runs pay
    nothing): a built layer's variables become DTensors, an optimizer slot
    takes its variable's placement, a sharded layer is called with
    replicated inputs and returns whole outputs, reading or assigning a
    sharded variable whole works (`get_weights`, `set_weights`), and Keras'
    torch optimizers update DTensors and tensors in separate `_foreach`
    groups. `uninstall()` removes them."""
    global _sharding_installed
    with _lock:
        if _sharding_installed:
            return
        _sharding_installed = True
        _install_sharding()


def forget() -> None:
    """Called by `hooks.uninstall` (which restores what was patched): the
    sharding hooks install again on the next sharding engine."""
    global _sharding_installed
    with _lock:
        _sharding_installed = False


def _install_sharding() -> None:
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

    from keras_distribute.backend import torch as torch_backend
    from keras_distribute.backend.torch import variables as torch_variables

    original_post_build = layer_class._post_build

    @functools.wraps(original_post_build)
    def _post_build(self):
        original_post_build(self)
        if not in_stateless_scope():
            torch_variables.on_layer_built(self)

    original_add_weight = registry.resolve("Layer.add_weight")

    @functools.wraps(original_add_weight)
    def add_weight(self, *args, **kwargs):
        variable = original_add_weight(self, *args, **kwargs)
        if self.built and not in_stateless_scope():
            # (a variable added to a built layer, e.g. LoRA's adapters:
            # laid out now, as its layer's were at its build)
            torch_variables.on_layer_built(self)
        return variable

    original_forward = registry.resolve("TorchLayer").forward

    from keras_distribute.backend.torch import fully_sharded
    from keras_distribute.backend.torch import layer_calls

    def forward(self, *args, **kwargs):
        engine = self.__dict__.get("_kd_sharded_engine")
        if engine is not None:
            return engine.sharded_forward(original_forward, self, args,
                                          kwargs)
        engine = self.__dict__.get("_kd_reads_sharded")
        if engine is not None:
            return engine.calling_forward(original_forward, self, args,
                                          kwargs)
        return layer_calls.call_plain(original_forward, self, args, kwargs)

    saving_lib = registry.resolve("saving_lib")
    original_save_state = registry.resolve("saving_lib._save_state")

    @functools.wraps(original_save_state)
    def _save_state(saveable, *args, **kwargs):
        if not isinstance(saveable, layer_class):
            return original_save_state(saveable, *args, **kwargs)
        with layer_calls.reading_whole(saveable):
            return original_save_state(saveable, *args, **kwargs)

    original_value = registry.resolve("torch_Variable.value")

    def value(self):
        value = original_value.fget(self)
        if self.__dict__.get("_kd_engine") is None:
            return value
        read = fully_sharded.on_read(self, value.device.type == "meta")
        if read is None:
            return value
        stored, self._value = self._value, read  # (Keras' autocast of it)
        try:
            return original_value.fget(self)
        finally:
            self._value = stored

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

    optimizers_module = registry.resolve("optimizers_module")
    original_clip = optimizers_module.clip_by_global_norm

    @functools.wraps(original_clip)
    def clip_by_global_norm(value_list, clip_norm):
        return torch_variables.clip_by_global_norm(value_list, clip_norm,
                                                   original_clip)

    _patch(optimizers_module, "clip_by_global_norm", clip_by_global_norm)
    _patch(parallel, "_backend_update_step", _backend_update_step)
    _patch(parallel, "_backend_reset_gradient_accumulators",
           _backend_reset_gradient_accumulators)
    _patch(parallel, "_backend_increment_gradient_accumulators",
           _backend_increment_gradient_accumulators)
    _patch(layer_class, "_post_build", _post_build)
    _patch(layer_class, "add_weight", add_weight)
    _patch(registry.resolve("TorchLayer"), "forward", forward)
    _patch(optimizer_class, "add_variable_from_reference",
           add_variable_from_reference)
    for module in (torch_core, torch_package, keras_backend):
        _patch(module, "convert_to_numpy", convert_to_numpy)
    _patch(torch_variable, "_direct_assign", _direct_assign)
    _patch(saving_lib, "_save_state", _save_state)
    _patch(torch_variable, "value",
           property(value, doc=original_value.__doc__))

    torch_random = registry.resolve("torch_random")
    original_with_initializer = torch_variable._initialize_with_initializer

    @functools.wraps(original_with_initializer)
    def _initialize_with_initializer(self, initializer):
        value = torch_backend.born_sharded_value(self, initializer,
                                                 torch_random)
        if value is None:
            return original_with_initializer(self, initializer)
        self._initialize(value)  # (a Parameter: Keras keeps it as it is)
        return None

    _patch(torch_variable, "_initialize_with_initializer",
           _initialize_with_initializer)
