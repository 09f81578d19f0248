"""`kd.layouts.estimate_memory`: the bytes one device holds at the peak of
a training step, before anything is launched.

Variables, gradients and optimizer slots are counted from their shapes and
the layout each takes. The peak of the step — with the activations the
backward pass keeps and the workspace — comes from the framework's own
accounting where it has one that needs no memory: on JAX, XLA's memory
analysis of the compiled step on the mesh; on torch, the step run on fake
tensors, counting every storage it makes and frees (sharded variables
held as their shards and gathered while their layer computes); on
TensorFlow, its graph of the step traced on shapes. Elsewhere (a JAX mesh
larger than this machine's devices) the activations are traced from the
model's layer outputs.
The model is built without values (as `plan_layout` builds it), so a model
far larger than this machine is estimated here. Imports Keras' public API
only, and only when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Union

from keras_distribute.common.layout_picture import human_bytes
from keras_distribute.common.layout_picture import nbytes_of
from keras_distribute.common.layouts import axis_size
from keras_distribute.common.layouts import graph_safe
from keras_distribute.common.layouts import slot_owner
from keras_distribute.common.layouts import variable_layout
from keras_distribute.integration.builds import keras_global_state_kept
from keras_distribute.integration.builds import optimizer_config
from keras_distribute.planning.layout_planner import build_without_values
from keras_distribute.planning.layout_planner import built_model
from keras_distribute.planning.layout_planner import variables_of
from keras_distribute.planning.step_specs import input_specs
from keras_distribute.planning.step_specs import symbolic_tensors
from keras_distribute.planning.step_specs import target_specs
from keras_distribute.planning.step_specs import unknown_dimension

if TYPE_CHECKING:
    from keras import Layer
    from keras import Variable
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer

    from keras_distribute.planning.layout_planner import ModelOrBuilder

_SPARSE_LOSSES = ("sparse_categorical_crossentropy", "SparseCategorical")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What `estimate_memory` returns: bytes on the most loaded device.

    Attributes:
        parameters: The model's variables (trainable or not).
        gradients: The trainable variables' gradients.
        optimizer: The optimizer's variables (its slots and counters).
        batch: The device's share of one batch (inputs and targets).
        activations: The rest of the step's peak: what the forward pass
            keeps for the backward pass, and workspace. None where it
            could not be traced (`method` says why).
        peak: The most the device holds during a step: the parts above
            as they coexist at the step's peak.
        method: How the peak was found.
        devices: The devices of the mesh.
    """

    parameters: int
    gradients: int
    optimizer: int
    batch: int
    activations: Optional[int]
    peak: int
    method: str
    devices: int

    def table(self) -> str:
        """One line per part, then the peak and how it was found."""
        rows = [("parameters", self.parameters),
                ("gradients", self.gradients),
                ("optimizer state", self.optimizer),
                ("batch", self.batch),
                ("activations and workspace", self.activations)]
        lines = [f"{name:<26} "
                 + ("not traced" if value is None else human_bytes(value))
                 for name, value in rows]
        lines.append(f"{'peak of a step':<26} {human_bytes(self.peak)} per "
                     f"device ({self.devices} device(s))")
        lines.append(f"from: {self.method}")
        return "\n".join(lines)


def estimate_memory(model: ModelOrBuilder,
                    layout_map: Optional[LayoutMap] = None, *,
                    batch_size: int,
                    optimizer: Union[str, Optimizer, None] = None,
                    loss: Union[str, Callable, None] = None,
                    input_shape: Any = None,
                    input_dtype: str = "float32") -> MemoryEstimate:
    """Estimates the memory one device holds at the peak of a train step.

    Args:
        model: A built Keras model, or a function that builds one (built
            without values, so a model larger than this machine works).
        layout_map: The `keras.distribution.LayoutMap` the job trains
            with (its mesh's first axis is the batch axis), or None for
            one device.
        batch_size: The global batch `fit` is given; each replica (a
            position on the batch axis) gets its share.
        optimizer: An optimizer or its name; by default the model's
            compiled one, else `"adam"`. The model's own is not built:
            a fresh one of the same configuration is.
        loss: A loss or its name; by default the model's compiled loss,
            else `"mean_squared_error"` on the model's output.
        input_shape: One example's input shape (no batch dimension), or a
            list / dict of them for several inputs. Needed only when the
            model has no `keras.Input` (a subclassed model).
        input_dtype: The dtype of inputs given by `input_shape`.

    Returns:
        A `MemoryEstimate`: `parameters`, `gradients`, `optimizer`,
        `batch`, `activations` and `peak` bytes per device, `method`,
        `devices`, and `.table()`.

    Raises:
        TypeError: if `layout_map` is not a `LayoutMap`, `model` is not
            a Keras model or a function that builds one, or `optimizer`
            / `loss` is not one Keras knows.
        ValueError: if `batch_size` is not a positive int that the
            replicas divide, or the model's inputs are unknown.

    Example:

    ```python
    estimate = kd.layouts.estimate_memory(
        make_model, layout_map, batch_size=256, optimizer="adam")
    print(estimate.table())
    ```
    """
    import keras

    from keras_distribute.backend import get_backend

    if layout_map is not None and not isinstance(
            layout_map, keras.distribution.LayoutMap):
        raise TypeError(
            "Expected a keras.distribution.LayoutMap or None. Received: "
            f"layout_map={layout_map!r} of type {type(layout_map).__name__}.")
    replicas, devices = 1, 1
    if layout_map is not None:
        mesh = layout_map.device_mesh
        replicas = int(mesh.shape[0])
        devices = math.prod(int(s) for s in mesh.shape)
    if isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size <= 0 or batch_size % replicas:
        raise ValueError(
            f"batch_size must be a positive int that the {replicas} "
            "replica(s) of the mesh's batch axis divide. Received: "
            f"batch_size={batch_size!r}. Pass the global batch fit is given "
            f"(a multiple of {replicas}).")
    if input_dtype is not None and not isinstance(input_dtype, str):
        raise TypeError(f"input_dtype must be a dtype name such as "
                        f"'float32'. Received: {input_dtype!r}.")
    backend = get_backend()
    model = built_model(model, keras)
    variables = variables_of(model)
    optimizer = _fresh_optimizer(optimizer, model, keras)
    loss_fn, sparse = _loss(loss, model, keras)
    inputs = input_specs(model, input_shape, input_dtype, batch_size, keras)
    targets = target_specs(model, inputs, sparse, batch_size, keras)
    _build_on_stand_ins(optimizer, model.trainable_variables, keras)

    def per_device(path: str, shape: tuple, dtype: str) -> int:
        nbytes = nbytes_of(shape, dtype)
        layout = (variable_layout(layout_map, path, shape)
                  if layout_map is not None else None)
        if layout is None:
            return nbytes
        return nbytes // math.prod(axis_size(layout_map.device_mesh, a)
                                   for a in layout.axes if a is not None)

    def shape_of(v: Any) -> tuple:
        return tuple(int(s) for s in v.shape)

    parameters = sum(per_device(v.path, shape_of(v), str(v.dtype))
                     for v in variables)
    trainable = [v for v in variables if v.trainable]
    gradients = sum(per_device(v.path, shape_of(v), str(v.dtype))
                    for v in trainable)
    optimizer_bytes = 0
    for slot in optimizer.variables:  # (a slot: its variable's layout)
        owner = slot_owner(slot, trainable)
        optimizer_bytes += per_device(
            owner.path if owner is not None else slot.path, shape_of(slot),
            str(slot.dtype))
    batch = sum(nbytes_of(spec.shape, str(spec.dtype)) for spec in
                keras.tree.flatten((inputs, targets))) // replicas
    resident = parameters + gradients + optimizer_bytes + batch
    with keras_global_state_kept():  # (a step traced in a TF graph too)
        step = backend.step_memory(model, optimizer, loss_fn, inputs,
                                   targets, layout_map)
    if step is not None:
        return MemoryEstimate(parameters, gradients, optimizer_bytes, batch,
                              max(0, step.peak - resident),
                              max(step.peak, resident), step.method,
                              devices)
    unknown = unknown_dimension(model, inputs, keras)
    activations = _layer_outputs_bytes(model, batch_size // replicas,
                                       unknown)
    if activations is None:
        return MemoryEstimate(
            parameters, gradients, optimizer_bytes, batch, None, resident,
            "variables and batch only: the model is not a graph of layers "
            "(a subclassed model), so its activations were not traced "
            "here; estimate it on JAX or torch", devices)
    return MemoryEstimate(
        parameters, gradients, optimizer_bytes, batch, activations,
        resident + activations,
        "every layer's output at one replica's batch (a shape trace"
        + (f"; unknown dimensions at {unknown}, as input_shape gave them"
           if unknown > 1 else "") + ")", devices)


def _fresh_optimizer(optimizer: Any, model: Layer, keras: Any) -> Any:
    """A new, unbuilt optimizer: of `optimizer`'s configuration, else the
    model's compiled one's, else Adam."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None) or "adam"
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer_config(optimizer))
    if not isinstance(optimizer, (str, dict)):
        raise TypeError(
            "optimizer must be a keras.optimizers.Optimizer, its name or "
            f"its config. Received: optimizer={optimizer!r} of type "
            f"{type(optimizer).__name__}.")
    try:
        return keras.optimizers.get(optimizer)
    except ValueError as error:
        raise TypeError(
            f"optimizer={optimizer!r} is not an optimizer Keras knows "
            f"({error}). Pass e.g. 'adam', 'sgd' or an instance.") from None


def _build_on_stand_ins(optimizer: Any, trainable: List[Variable],
                        keras: Any) -> None:
    """Builds `optimizer` without values on stand-ins of `trainable` of
    their shapes, dtypes and paths (`graph_safe`), so that its slots are
    named and shaped as the real step's. Not on the variables themselves:
    an optimizer ties its slots to them (TensorFlow colocates each with its
    variable, which a graph cannot do with a variable that has a value)."""
    def build() -> None:
        stand_ins = []
        for variable in trainable:
            *scopes, name = graph_safe(variable.path).split("/")
            with contextlib.ExitStack() as stack:
                for scope in filter(None, scopes):
                    stack.enter_context(keras.name_scope(scope))
                stand_ins.append(keras.Variable(
                    initializer="zeros", shape=tuple(variable.shape),
                    dtype=variable.dtype, trainable=True, name=name))
        optimizer.build(stand_ins)

    build_without_values(build)


def _loss(loss: Any, model: Layer, keras: Any) -> tuple:
    """`(loss function, whether its targets are class indices)`."""
    if loss is None:
        compiled = getattr(model, "loss", None)
        loss = compiled if isinstance(compiled, str) or (
            callable(compiled)) else "mean_squared_error"
    if isinstance(loss, str):
        try:
            function = keras.losses.get(loss)
        except ValueError as error:
            raise TypeError(
                f"loss={loss!r} is not a loss Keras knows ({error}). Pass "
                "e.g. 'mean_squared_error' or a loss instance.") from None
    elif callable(loss):
        function = loss
    else:
        raise TypeError(
            "loss must be a loss name or a callable `loss(y_true, y_pred)`. "
            f"Received: loss={loss!r} of type {type(loss).__name__}.")
    name = loss if isinstance(loss, str) else type(loss).__name__
    if getattr(function, "__name__", "") in _SPARSE_LOSSES:
        name = function.__name__
    if not isinstance(function, keras.losses.Loss):
        per_example = function  # a function returns a value per example

        def function(y_true: Any, y_pred: Any) -> Any:
            return keras.ops.mean(per_example(y_true, y_pred))

    return function, any(s in name for s in _SPARSE_LOSSES)


def _layer_outputs_bytes(model: Layer, replica_batch: int,
                         unknown: int = 1) -> Optional[int]:
    """The bytes of every layer's output at one replica's batch (unknown
    dimensions at `unknown`), for a model that is a graph of layers
    (functional, Sequential); None for one that is not."""
    import keras

    if symbolic_tensors(model, "output") is None:
        return None
    total = 0
    layers: List[Any] = list(model.layers)
    while layers:
        layer = layers.pop()
        try:
            output = layer.output
        except (AttributeError, ValueError):
            continue  # a layer used several times, or never called
        if hasattr(layer, "layers") and layer is not model:
            layers.extend(layer.layers)
            continue
        for tensor in keras.tree.flatten(output):
            shape = (replica_batch,) + tuple(
                int(d) if d is not None else unknown
                for d in tensor.shape[1:])
            total += nbytes_of(shape, str(tensor.dtype))
    return total
