"""`kd.layouts.plan_layout`: a `LayoutMap` planned from a model's variable
shapes, with a report of each variable's layout, bytes per device and why.

The rules are the known good patterns of tensor parallelism (Megatron's
paired column- and row-parallel layers, as keras-hub's hand-written
`get_layout_map`s lay them out) plus FSDP for what stays large:

- an embedding table: its vocabulary over the model axis (else its width);
- a projection that widens (`Dense` up, attention query/key/value): column
  parallel, its output dimension (the heads of an `EinsumDense` kernel)
  over the model axis, its bias with it; one that narrows (`Dense` down,
  attention output): row parallel, its input dimension (the heads) over
  the model axis, its bias replicated. A square `Dense` is row parallel
  when its name says it is an output projection (`out`, `o_proj`,
  `output`, `down`, `fc2`, ...), column parallel otherwise;
- with `fsdp=True` (the default), every variable of at least
  `fsdp_min_size` elements
  is also sharded over the batch axis on its largest dimension still free
  that the axis divides;
- everything else (norm scales, small variables) is replicated.

A dimension is sharded only when the axis size divides it: a plan never
holds an indivisible shard (the report says where a rule gave way).

It plans from shapes: a function that builds the model is run without
values (`jax.eval_shape` on JAX, torch's fake tensors, a TensorFlow graph:
the backend's `build_without_values`), so a model far larger than this
machine's memory is planned in its memory.
Imports Keras' public API only, and only when called.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

from keras_distribute.common.layout_picture import human_bytes
from keras_distribute.common.layout_picture import layout_html
from keras_distribute.common.layout_picture import nbytes_of

if TYPE_CHECKING:
    from types import ModuleType

    from keras import Layer
    from keras import Variable
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    # A built model or layer, or a function that builds one.
    ModelOrBuilder = Union[Layer, Callable[[], Layer]]

# A square projection whose layer name says it is an output projection is
# row parallel (its input is what the column-parallel one before it split).
_OUTPUT_NAMES = re.compile(
    r"(^|[/_])(out|output|o_proj|out_proj|down|down_proj|fc2|wo|"
    r"attention_output|ffw_linear|c_proj)(_\d+)?(/|$)")
_EMBEDDING_NAMES = ("embeddings", "embedding")
_KERNEL_NAMES = ("kernel",)
_BIAS_NAMES = ("bias",)
# Variables smaller than this stay replicated on the model axis: splitting
# them saves little memory for a collective each.
DEFAULT_MIN_SHARD_SIZE = 2**14


@dataclasses.dataclass(frozen=True)
class PlannedVariable:
    """One variable of a plan.

    Attributes:
        path: The variable's path (`variable.path`), the layout map's key.
        shape: Its shape.
        dtype: Its dtype name.
        axes: The mesh axis of each dimension (`None`: not sharded).
        bytes_per_device: What one device holds of it.
        reason: Which rule laid it out, in words.
    """

    path: str
    shape: Tuple[int, ...]
    dtype: str
    axes: Tuple[Optional[str], ...]
    bytes_per_device: int
    reason: str


@dataclasses.dataclass
class LayoutPlan:
    """What `plan_layout` returns: the map and its report.

    Attributes:
        layout_map: A `keras.distribution.LayoutMap` (pass it as a
            strategy's `layout_map=`); one exact key per variable.
        variables: A `PlannedVariable` per variable, in model order.
        mesh: The `DeviceMesh` planned for.
    """

    layout_map: LayoutMap
    variables: List[PlannedVariable]
    mesh: DeviceMesh

    @property
    def bytes_per_device(self) -> int:
        """The bytes of variables one device holds under this plan."""
        return sum(row.bytes_per_device for row in self.variables)

    @property
    def replicated_bytes(self) -> int:
        """The bytes one device would hold with every variable replicated."""
        return sum(nbytes_of(row.shape, row.dtype) for row in self.variables)

    def table(self) -> str:
        """The report as a text table, heaviest variables first."""
        rows = [(row.path, str(row.shape), str(row.axes),
                 human_bytes(row.bytes_per_device), row.reason)
                for row in sorted(self.variables,
                                  key=lambda r: -r.bytes_per_device)]
        header = ("variable", "shape", "layout", "bytes/device", "why")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
        lines = ["  ".join([c.ljust(w) for c, w in zip(row[:4], widths)]
                           + [row[4]]).rstrip()
                 for row in [header] + rows]
        lines.append(
            f"per device: {human_bytes(self.bytes_per_device)} of variables "
            f"(replicated: {human_bytes(self.replicated_bytes)}), mesh "
            f"{dict(zip(self.mesh.axis_names, self.mesh.shape))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_html(self, top: int = 8) -> str:
        """The plan drawn as HTML: the mesh, one cell per device with the
        bytes it holds, and the `top` heaviest variables as bars of their
        bytes per device with their layout (Jupyter shows it for a plan
        that ends a cell).

        Args:
            top: How many variables to draw.

        Returns:
            A self-contained HTML fragment (names escaped).

        Example:

        ```python
        with open("plan.html", "w") as f:
            f.write(plan.to_html())
        ```
        """
        return layout_html(
            "Layout plan", self.mesh.axis_names, self.mesh.shape,
            [(v.path, v.axes, v.bytes_per_device) for v in self.variables],
            self.replicated_bytes, top)

    def _repr_html_(self) -> str:
        return self.to_html()


def plan_layout(model: ModelOrBuilder, mesh: DeviceMesh, *,
                model_axis: Optional[str] = None,
                batch_axis: Optional[str] = None,
                fsdp: bool = True,
                fsdp_min_size: int = 2**16,
                min_shard_size: int = DEFAULT_MIN_SHARD_SIZE) -> LayoutPlan:
    """Plans a `LayoutMap` for `model` on `mesh`, with a report.

    Args:
        model: A built Keras model or layer, or a function of no arguments
            that builds one: it is called without values (under
            `jax.eval_shape`, torch's fake tensors or a TensorFlow graph;
            `compile()` may be part of it), so the variables get shapes
            but no memory (a model larger than this machine's memory is
            planned within it). Its variable
            paths are the map's keys: build the model you train with the
            same layer names (explicitly named layers, keras-hub models,
            or the same function after `keras.backend.clear_session()`).
        mesh: A `keras.distribution.DeviceMesh`.
        model_axis: The mesh axis for tensor parallelism; by default the
            mesh's second axis (none on a one-axis mesh).
        batch_axis: The data-parallel axis; by default the mesh's first.
        fsdp: Also shard every large variable over `batch_axis` on its
            largest dimension still free (FSDP, as keras-hub's layout maps
            do); `False` keeps the batch axis for data only.
        fsdp_min_size: With `fsdp`, the fewest elements a variable needs
            to be sharded over `batch_axis`.
        min_shard_size: The fewest elements a variable needs to be
            sharded over `model_axis`.

    Returns:
        A `LayoutPlan`: `.layout_map` for a strategy, `.variables` (each
        one's layout, bytes per device and why), `.table()`.

    Raises:
        TypeError: if `model` is neither a Keras layer nor a function, or
            `mesh` is not a `DeviceMesh`.
        ValueError: for an axis the mesh does not have, the same axis for
            both, a model without variables, or a negative size.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    plan = kd.layouts.plan_layout(lambda: make_model(), mesh)
    print(plan.table())
    keras.backend.clear_session()   # the same layer names again
    strategy = kd.MirroredStrategy(layout_map=plan.layout_map)
    with strategy.scope():
        model = make_model()
    ```
    """
    import keras
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "Expected a keras.distribution.DeviceMesh. Received: "
            f"mesh={mesh!r} of type {type(mesh).__name__}. Make one with "
            "keras.distribution.DeviceMesh((2, 4), ['batch', 'model']).")
    for name, value in (("fsdp_min_size", fsdp_min_size),
                        ("min_shard_size", min_shard_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name} must be a non-negative int (a number of elements)."
                f" Received: {name}={value!r}.")
    names = list(mesh.axis_names)
    batch_axis = names[0] if batch_axis is None else batch_axis
    if model_axis is None:
        model_axis = names[1] if len(names) > 1 else None
    for name, axis in (("batch_axis", batch_axis),
                       ("model_axis", model_axis)):
        if axis is not None and axis not in names:
            raise ValueError(
                f"{name}={axis!r} is not an axis of the mesh. Received a "
                f"mesh with axes {names}. Pass one of them.")
    if model_axis is not None and model_axis == batch_axis:
        raise ValueError(
            "model_axis and batch_axis must differ (one splits variables, "
            f"the other the batch). Received: both {model_axis!r}.")
    variables = variables_of(built_model(model, keras))
    sizes = dict(zip(names, (int(s) for s in mesh.shape)))
    rules = _Rules(model_axis, sizes.get(model_axis, 1) if model_axis
                   else 1, min_shard_size)
    planned = []
    layout_map = LayoutMap(mesh)
    column_parallel: set = set()  # layers whose kernel splits the output
    for variable in variables:
        path, shape = variable.path, tuple(int(s) for s in variable.shape)
        dtype = str(variable.dtype)
        axes, reason = rules.plan(path, shape, column_parallel)
        if fsdp and batch_axis is not None and sizes[batch_axis] > 1:
            axes, reason = _add_batch_axis(axes, reason, shape, batch_axis,
                                           sizes[batch_axis], fsdp_min_size)
        shards = math.prod(sizes[a] for a in axes if a is not None)
        planned.append(PlannedVariable(
            path, shape, dtype, tuple(axes),
            nbytes_of(shape, dtype) // shards, reason))
        if any(a is not None for a in axes):
            layout_map["^" + re.escape(path) + "$"] = tuple(axes)
    return LayoutPlan(layout_map, planned, mesh)


def built_model(model: ModelOrBuilder, keras: ModuleType) -> Layer:
    """`model`, or what the function `model` builds, built without values
    (the backend's `build_without_values`)."""
    if not isinstance(model, keras.layers.Layer):
        if not callable(model):
            raise TypeError(
                "Expected a built Keras model or layer, or a function that "
                f"builds one. Received: model={model!r} of type "
                f"{type(model).__name__}.")
        built = build_without_values(model)
        if not isinstance(built, keras.layers.Layer):
            raise TypeError(
                "The function given as `model` must return a Keras model "
                f"or layer. It returned {type(built).__name__}.")
        model = built
    return model


def build_without_values(build: Callable[[], object]) -> object:
    """Runs `build()` as the backend builds without values, Keras' global
    state kept (`keras_global_state_kept`); returns what it returned."""
    from keras_distribute.backend import get_backend
    from keras_distribute.integration.builds import keras_global_state_kept

    with keras_global_state_kept():
        return get_backend().build_without_values(build)


def variables_of(model: Layer) -> List[Variable]:
    """The weights of a built `model`, each once."""
    seen, variables = set(), []
    for variable in model.weights:
        if id(variable) not in seen:
            seen.add(id(variable))
            variables.append(variable)
    if not variables:
        raise ValueError(
            "The model has no variables to plan: build it first (call it "
            "on data, model.build(input_shape), or give it a keras.Input).")
    return variables


class _Rules:
    """The model-axis rules, one variable at a time (model order: a bias
    follows its kernel)."""

    def __init__(self, axis: Optional[str], size: int, min_size: int):
        self.axis, self.size, self.min_size = axis, size, min_size

    def plan(self, path: str, shape: Tuple[int, ...],
             column_parallel: set) -> Tuple[List[Optional[str]], str]:
        axes: List[Optional[str]] = [None] * len(shape)
        if self.axis is None or self.size <= 1:
            return axes, "replicated (no model axis)"
        layer, _, name = path.rpartition("/")
        if math.prod(shape) < self.min_size and not (
                name in _BIAS_NAMES and layer in column_parallel):
            return axes, (f"replicated: under {self.min_size} elements")
        if name in _EMBEDDING_NAMES and len(shape) == 2:
            return self._first_divisible(
                axes, shape, [0, 1],
                ["embedding: vocabulary over {a}",
                 "embedding: width over {a} (vocabulary {s0} indivisible)"])
        if name in _KERNEL_NAMES and len(shape) >= 2:
            return self._kernel(axes, layer, shape, column_parallel)
        if name in _BIAS_NAMES and len(shape) == 1 and (
                layer in column_parallel):
            if shape[0] % self.size == 0:
                axes[0] = self.axis
                return axes, ("bias of a column-parallel kernel: over "
                              f"{self.axis}")
            return axes, "bias: replicated (indivisible)"
        return axes, "replicated: no rule for it"

    def _kernel(self, axes: List[Optional[str]], layer: str,
                shape: Tuple[int, ...], column_parallel: set
                ) -> Tuple[List[Optional[str]], str]:
        if len(shape) == 2:  # Dense: (in, out)
            row = shape[0] > shape[1] or (
                shape[0] == shape[1] and bool(_OUTPUT_NAMES.search(layer)))
            order = [0, 1] if row else [1, 0]
            kinds = ["row", "column"] if row else ["column", "row"]
        elif len(shape) == 3:  # EinsumDense: (in, heads, d) / (heads, d, out)
            row = not (shape[0] >= shape[2] and shape[0] > shape[1])
            order = [0, 2] if row else [1, 0]
            kinds = ["row", "column"] if row else ["column", "row"]
        else:  # a convolution: (..., in, out)
            order = [len(shape) - 1, len(shape) - 2]
            kinds = ["column", "row"]
        for dim, kind in zip(order, kinds):
            if shape[dim] % self.size == 0:
                axes[dim] = self.axis
                if kind == "column":
                    column_parallel.add(layer)
                note = "" if dim == order[0] else (
                    f" (dimension {order[0]} indivisible by {self.size})")
                return axes, (f"{kind} parallel: dimension {dim} over "
                              f"{self.axis}{note}")
        return axes, (f"replicated: no dimension divisible by "
                      f"{self.axis}={self.size}")

    def _first_divisible(self, axes: List[Optional[str]],
                         shape: Tuple[int, ...], dims: Sequence[int],
                         reasons: Sequence[str]
                         ) -> Tuple[List[Optional[str]], str]:
        for dim, reason in zip(dims, reasons):
            if shape[dim] % self.size == 0:
                axes[dim] = self.axis
                return axes, reason.format(a=self.axis, s0=shape[0])
        return axes, (f"replicated: no dimension divisible by "
                      f"{self.axis}={self.size}")


def _add_batch_axis(axes: List[Optional[str]], reason: str,
                    shape: Tuple[int, ...], axis: str, size: int,
                    min_size: int) -> Tuple[List[Optional[str]], str]:
    """FSDP: the batch axis on the largest free dimension it divides."""
    if math.prod(shape) < min_size:
        return axes, reason
    from keras_distribute.common.fully_sharded import largest_free_dimension

    dim = largest_free_dimension(shape, axes, size)
    if dim is None:
        return axes, reason
    axes = list(axes)
    axes[dim] = axis
    return axes, f"{reason}; FSDP: dimension {dim} over {axis}"
