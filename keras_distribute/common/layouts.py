"""Checks of a `keras.distribution.LayoutMap`, shared by every backend.

Keras lays variables out from a `LayoutMap` but lets mistakes pass silently
(a key that matches nothing replicates what was meant to be sharded); these
make them errors that name the variable, the layout and the fix. Imports no
framework.
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING
from typing import Any
from typing import List
from typing import Tuple

if TYPE_CHECKING:
    from keras import Model
    from keras.distribution import LayoutMap
    from keras.layers import Layer


def axis_names(axis: Any) -> Tuple[str, ...]:
    """The mesh axes one dimension's entry of a layout names: `None` is
    none, a name one, a tuple of names several."""
    names = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(name for name in names if name is not None)


def layout_axes(layout: Any) -> List[str]:
    """The mesh axes a layout shards over, in order (none: `[]`)."""
    axes = []
    for axis in layout.axes:
        axes += [name for name in axis_names(axis) if name not in axes]
    return axes


def sharded_axes(layout_map: LayoutMap) -> List[str]:
    """The mesh axes any layout of `layout_map` shards over (none: `[]`)."""
    axes = []
    for layout in layout_map.values():
        axes += [name for name in layout_axes(layout) if name not in axes]
    # A map that shards by a rule rather than by entries
    # (`kd.layouts.fully_sharded`) names the axes it shards over.
    for name in getattr(layout_map, "shards_over", ()):
        if name not in axes:
            axes.append(name)
    return axes


def variable_layout(layout_map: LayoutMap, path: str, shape: Any) -> Any:
    """The layout `layout_map` gives the variable `path` of `shape`: its
    entry, or what a rule-based map (`kd.layouts.fully_sharded`) computes
    from the shape; None for replicated."""
    layout_for = getattr(layout_map, "layout_for", None)
    if layout_for is not None:
        return layout_for(path, shape)
    return layout_map[path]


def slot_owner(slot: Any, trainable: List[Any]) -> Any:
    """The trainable variable an optimizer slot belongs to (Keras names a
    slot `<optimizer>/<variable path, '/' -> '_'>_<slot>` and gives it its
    variable's shape; one built on stand-ins of the variables may name
    it after their `graph_safe` paths), or None (a counter, a factored slot)."""
    name = slot.path.split("/", 1)[-1]
    shape = tuple(slot.shape)
    return next((v for v in trainable
                 if tuple(v.shape) == shape and any(
                     name.startswith(path.replace("/", "_") + "_")
                     for path in (v.path, graph_safe(v.path)))), None)


def graph_safe(path: str) -> str:
    """`path` with every character a TensorFlow graph refuses in a name
    (all but letters, digits and `_.-/>`) written `_`."""
    return _GRAPH_REFUSES.sub("_", path)


_GRAPH_REFUSES = re.compile(r"[^A-Za-z0-9_.\-/>]")


def axis_size(mesh: Any, axis: Any) -> int:
    size = 1
    for name in axis_names(axis):
        size *= mesh.shape[mesh.axis_names.index(name)]
    return size


def check_layout_fits(layout: Any, path: str, shape: Any) -> None:
    """Raises `ValueError` unless `layout` can lay out a `shape` tensor."""
    if len(layout.axes) != len(shape):
        raise ValueError(
            f"The layout for variable '{path}' has rank "
            f"{len(layout.axes)} but the variable has shape "
            f"{tuple(shape)} (rank {len(shape)}). "
            f"Received: layout axes={tuple(layout.axes)}. Give one "
            "mesh axis name (or None) per variable dimension.")
    mesh = layout.device_mesh
    for dim, (size, axis) in enumerate(zip(shape, layout.axes)):
        if axis is None or mesh is None:
            continue
        parts = axis_size(mesh, axis)
        if size % parts:
            raise ValueError(
                f"Dimension {dim} of variable '{path}' (shape "
                f"{tuple(shape)}) has size {size}, which does not divide "
                f"into the {parts} devices of mesh axis {axis!r}. Received: "
                f"layout axes={tuple(layout.axes)}. Shard another dimension, "
                "or pick sizes divisible by the axis.")


def nested_layers(layer: Layer) -> List[Any]:
    """`layer` and the layers it holds (`.layers`, as a Sequential or
    functional model has), at every depth, in order."""
    found = [layer]
    for inner in getattr(layer, "layers", None) or []:
        found += nested_layers(inner)
    return found


def warn_unmatched_keys(layout_map: LayoutMap, model: Model) -> None:
    """Warns, naming the key, for each layout key that matches none of
    `model`'s variables. As in Keras, such a key lays out nothing (a model
    may simply lack that variable: the keras-io distribution guide maps
    `"d1/bias"` of a `use_bias=False` layer), but a mistyped path would
    otherwise leave what it meant to shard replicated without a word."""
    paths = [v.path for v in model.weights]
    # A key may also lay out a layer's output ("d2/output"), as in Keras.
    outputs = {f"{getattr(layer, 'path', layer.name)}/output"
               for layer in nested_layers(model)} | {
        f"{path.rpartition('/')[0]}/output" for path in paths}
    for key in layout_map:
        if not any(key == p or re.fullmatch(key, p)
                   for p in (*paths, *outputs)):
            warnings.warn(
                f"The layout_map key {key!r} matches none of the variables of "
                f"model '{model.name}', so it lays out nothing (as in Keras, "
                "it is ignored). Keys are regular expressions matched "
                f"against the whole `variable.path`, e.g. {paths[:3]}. If it "
                "was meant to shard a variable, write the full path, or a "
                "pattern such as '.*dense.*kernel'.", UserWarning,
                stacklevel=4)


def check_layout_map(layout_map: LayoutMap) -> None:
    """Raises `ValueError` for a layout naming an axis the mesh lacks."""
    mesh = layout_map.device_mesh
    for key, layout in layout_map.items():
        for axis in layout.axes:
            unknown = [n for n in axis_names(axis)
                       if n not in mesh.axis_names]
            if unknown:
                raise ValueError(
                    f"The layout for {key!r} names mesh axis {unknown[0]!r}, "
                    f"but the mesh has axes {list(mesh.axis_names)}. "
                    f"Received: layout axes={tuple(layout.axes)}. Use the "
                    "mesh's axis names (or None).")
