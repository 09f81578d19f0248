"""A training step's memory on TensorFlow: the step's graph, traced on
shapes, and the tensors alive at each op.

TensorFlow keeps no account of a CPU step's memory that could be read
without running it. The step as Keras' TensorFlow trainer takes it (the
model's forward pass with `training=True`, the loss and the model's own
losses, the gradients of a `GradientTape`) is traced by `tf.function` on
`tf.TensorSpec`s, the model's variables as arguments (`stateless_call`):
nothing is allocated, and a model built without values is traced too,
subclassed models included. The graph's ops are then walked in the order
they were made (the forward pass, then its gradients): an op's outputs
are alive from the op until their last reader ran, as the executor frees
a tensor once nobody needs it. The peak is the arguments (variables, the
batch) plus the most bytes alive at once. Outputs that share their
input's memory (reshapes, identities, variable reads) count nothing; the
ops inside a loop's or a condition's own functions count only through
the op's outputs. TensorFlow's optimizers have no stateless form to
trace: their state is added as resident, their in-place update as one
temporary of the largest variable (the gradients it consumes are freed as
it goes).

Against TensorFlow's own allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`: the
bytes a real step added, plus the model's variables, slots and batch), in
three runs: 0.80-0.88 of a small MLP's, 0.81-1.10 of a CNN's, 0.79-0.94 of
a keras-hub Gemma's (`tests/test_memory_estimate.py`); the real peak itself
moves by up to a fifth between runs, as the executor runs independent ops
side by side, which a walk in one order does not see.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional

from keras_distribute.backend.interface import StepMemory

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer

# Ops whose output is their input's memory (or holds none of its own).
_ALIASING = frozenset([
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims",
    "StopGradient", "Snapshot", "PreventGradient", "ReadVariableOp",
    "Placeholder", "NoOp", "Const", "Shape", "ShapeN", "Size", "Rank",
    "EnsureShape", "CheckNumerics", "Bitcast",
])


def step_memory(model: Model, optimizer: Optimizer, loss: Callable,
                inputs: Any, targets: Any,
                layout_map: LayoutMap | None) -> Optional[StepMemory]:
    """See `interface.BackendModule.step_memory`: the step's graph traced
    on shapes, the bytes alive at its peak (one device: TensorFlow's
    layout maps only replicate)."""
    import tensorflow as tf

    trainable = model.trainable_variables
    non_trainable = model.non_trainable_variables

    def spec(variable: Any) -> Any:
        return tf.TensorSpec([int(s) for s in variable.shape],
                             tf.as_dtype(str(variable.dtype)))

    accepts = inspect.signature(model.call).parameters
    call_kwargs = {"training": True} if "training" in accepts or any(
        p.kind is p.VAR_KEYWORD for p in accepts.values()) else {}

    def forward_backward(trainable_values: list, non_trainable_values: list,
                         batch: tuple) -> tuple:
        x, y = batch
        with tf.GradientTape() as tape:
            tape.watch(trainable_values)
            y_pred, new_non_trainable, losses = model.stateless_call(
                trainable_values, non_trainable_values, x,
                return_losses=True, **call_kwargs)
            value = loss(y, y_pred)
            for extra in losses:
                value = value + extra
        grads = tape.gradient(value, trainable_values)
        return grads, new_non_trainable, value

    data = tf.nest.map_structure(
        lambda tensor: tf.TensorSpec([int(s) for s in tensor.shape],
                                     tf.as_dtype(str(tensor.dtype))),
        (inputs, targets))
    try:
        graph = tf.function(forward_backward).get_concrete_function(
            [spec(v) for v in trainable], [spec(v) for v in non_trainable],
            data).graph
    except Exception:  # noqa: BLE001 - a step that does not trace on specs
        return None
    # The optimizer's state is resident; its update (TensorFlow's
    # optimizers apply in place, variable by variable, and have no
    # stateless form to trace) holds about one temporary of the variable
    # it updates beyond its gradient.
    slots = sum(_nbytes(spec(v)) for v in optimizer.variables)
    update = max([_nbytes(spec(v)) for v in trainable] or [0])
    return StepMemory(_peak_of(graph) + slots + update,
                      "TensorFlow's graph of the forward and backward pass "
                      "traced on shapes: the tensors alive at each op (the "
                      "optimizer's state and update added)")


def _nbytes(tensor: Any) -> int:
    shape = tensor.shape
    if shape.rank is None or tensor.dtype.name in ("resource", "variant"):
        return 0
    count = 1
    for dim in shape.as_list():
        count *= 1 if dim is None else int(dim)
    return count * int(tensor.dtype.size)


def _peak_of(graph: Any) -> int:
    """The arguments' bytes plus the most bytes of op outputs alive at
    once, the ops run in the order they were made."""
    operations = graph.get_operations()
    last_use: Dict[str, int] = {}
    for number, op in enumerate(operations):
        for tensor in op.inputs:
            last_use[tensor.name] = number
    for tensor in graph.outputs:
        last_use[tensor.name] = len(operations)
    # An output that is its input's memory keeps that memory alive.
    for op in reversed(operations):
        if op.type in _ALIASING and op.inputs:
            source = op.inputs[0].name
            for tensor in op.outputs:
                last_use[source] = max(last_use.get(source, -1),
                                       last_use.get(tensor.name, -1))
    arguments = sum(_nbytes(t) for t in graph.inputs)
    alive, peak = 0, 0
    ending: Dict[int, List[int]] = {}
    for number, op in enumerate(operations):
        if op.type not in _ALIASING:
            for tensor in op.outputs:
                size = _nbytes(tensor)
                if size:
                    alive += size
                    ending.setdefault(max(number, last_use.get(
                        tensor.name, number)), []).append(size)
            peak = max(peak, alive)
        alive -= sum(ending.pop(number, []))
    return arguments + peak
