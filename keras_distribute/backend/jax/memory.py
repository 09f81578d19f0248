"""A training step's memory per device on JAX: XLA's own buffer assignment.

The step (forward, loss, gradients, the optimizer's update: what Keras'
JAX trainer jits, with the state donated as Keras donates it) is lowered
on abstract arrays (`jax.ShapeDtypeStruct`s carrying each variable's
sharding) and compiled for the mesh; `memory_analysis()` of the compiled
program says what one device holds: its arguments, its outputs less those
aliased to donated arguments, and the temporaries (gradients, activations,
workspace) at their peak. For a step that runs on this machine's CPU, the
most one kernel takes outside XLA's buffers is added (`cpu_scratch`).
Nothing is allocated: the model may be built without values
(`build_without_values`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Tuple

from keras_distribute.backend.interface import StepMemory
from keras_distribute.backend.jax.cpu_scratch import largest_kernel_scratch
from keras_distribute.common.layouts import slot_owner
from keras_distribute.common.layouts import variable_layout

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer


def step_memory(model: Model, optimizer: Optimizer, loss: Callable,
                inputs: Any, targets: Any,
                layout_map: LayoutMap | None) -> Optional[StepMemory]:
    """See `interface.BackendModule.step_memory`: XLA's memory analysis
    of the compiled step; None when the mesh has more devices than JAX
    sees here, on its default platform or on CPU (the caller then traces
    shapes)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec

    shape: Tuple[int, ...] = (1,)
    names: Tuple[str, ...] = ("batch",)
    if layout_map is not None:
        mesh = layout_map.device_mesh
        shape = tuple(int(s) for s in mesh.shape)
        names = tuple(mesh.axis_names)
    devices, where = jax.devices(), ""
    if math.prod(shape) > len(devices):
        # More devices than the default platform's (one GPU, say): XLA
        # compiles the step for the CPU platform's, when it has as many
        # (`python -m keras_distribute.planning` gives it the mesh's).
        try:
            devices = jax.devices("cpu")
        except RuntimeError:  # (no CPU platform: JAX_PLATFORMS=gpu)
            return None
        if math.prod(shape) > len(devices):
            return None
        where = f" (compiled for {math.prod(shape)} CPU devices here)"
    jax_mesh = Mesh(np.array(devices[:math.prod(shape)]).reshape(shape),
                    names)
    replicated = NamedSharding(jax_mesh, PartitionSpec())

    def sharding_of(path: str, var_shape: tuple) -> Any:
        layout = (variable_layout(layout_map, path, var_shape)
                  if layout_map is not None else None)
        if layout is None:
            return replicated
        return NamedSharding(jax_mesh, PartitionSpec(*layout.axes))

    def abstract(variable: Any, sharding: Any) -> Any:
        return jax.ShapeDtypeStruct(
            tuple(int(s) for s in variable.shape), variable.dtype,
            sharding=sharding)

    trainable = model.trainable_variables

    def slot_sharding(slot: Any) -> Any:  # (a slot: its variable's layout)
        owner = slot_owner(slot, trainable)
        if owner is None:
            return replicated
        return sharding_of(owner.path, tuple(int(s) for s in owner.shape))

    state = (
        [abstract(v, sharding_of(v.path, tuple(int(s) for s in v.shape)))
         for v in trainable],
        [abstract(v, sharding_of(v.path, tuple(int(s) for s in v.shape)))
         for v in model.non_trainable_variables],
        [abstract(v, slot_sharding(v)) for v in optimizer.variables])
    batch_sharding = NamedSharding(jax_mesh, PartitionSpec(names[0]))
    data = jax.tree_util.tree_map(
        lambda spec: jax.ShapeDtypeStruct(
            tuple(spec.shape), spec.dtype,
            sharding=batch_sharding if len(spec.shape) else replicated),
        (inputs, targets))

    import inspect

    accepts = inspect.signature(model.call).parameters
    call_kwargs = {"training": True} if "training" in accepts or any(
        p.kind is p.VAR_KEYWORD for p in accepts.values()) else {}

    def train_step(trainable_values: list, non_trainable_values: list,
                   optimizer_values: list, batch: tuple) -> tuple:
        x, y = batch

        def loss_of(values: list) -> tuple:
            y_pred, new_non_trainable, losses = model.stateless_call(
                values, non_trainable_values, x, return_losses=True,
                **call_kwargs)
            value = loss(y, y_pred)
            for extra in losses:
                value = value + extra
            return value, new_non_trainable

        (value, new_non_trainable), grads = jax.value_and_grad(
            loss_of, has_aux=True)(trainable_values)
        new_trainable, new_optimizer = optimizer.stateless_apply(
            optimizer_values, grads, trainable_values)
        return new_trainable, new_non_trainable, new_optimizer, value

    # The new state keeps each variable's layout, as Keras' trainer does.
    out_shardings = tuple([a.sharding for a in part] for part in state) + (
        replicated,)
    try:
        compiled = jax.jit(train_step, donate_argnums=(0, 1, 2),
                           out_shardings=out_shardings).lower(
            *state, data).compile()
    except jax.errors.JaxRuntimeError as error:
        if where and "Multiprocess computations" in str(error):
            return None  # (XLA's CPU stops at thousands: the caller traces)
        raise
    stats = compiled.memory_analysis()
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    method = "XLA's memory analysis of the compiled step" + where
    if devices[0].platform == "cpu" and not where:
        # (a step that runs on this CPU; not one compiled here for CPU
        # devices standing in for a mesh of another platform's)
        scratch, what = largest_kernel_scratch(compiled.as_text())
        if scratch:
            peak += scratch
            method += (", plus the most one CPU kernel takes outside "
                       f"XLA's buffers ({what}: {scratch / 2**20:,.1f} MiB)")
    return StepMemory(peak, method)
