"""Layouts of a strategy's `keras.distribution`, with kd's own checks.

Keras lays variables out from a `LayoutMap` but lets mistakes pass silently
(a key that matches nothing replicates what was meant to be sharded). These
classes and checks make them errors, and lay out a short last batch
replicated so that it never fails to divide over the replicas.
"""

import re

from keras.distribution import DataParallel
from keras.distribution import ModelParallel
from keras.distribution import TensorLayout


class StrategyLayouts:
    """What a strategy's `keras.distribution` adds to Keras' own.

    A batch that does not divide by the replica count (a short last batch)
    is laid out replicated: every device computes the whole short batch,
    which gives exactly the single-device result with no padding to mask.
    A `layout_map` entry whose rank differs from its variable's is an error.
    """

    _kd_strategy_distribution = True

    def _init_layout_cache(self, batch_shards: int):
        self._batch_shards = batch_shards
        self._data_layouts = {}
        # Several processes: set by the engine for each batch it splits.
        self.batch_given_whole = None

    def get_data_layout(self, data_shape):
        rank = len(data_shape)
        if self.batch_given_whole is not None:
            divisible = rank > 0 and not self.batch_given_whole
        else:
            divisible = rank > 0 and data_shape[0] % self._batch_shards == 0
        key = (rank, divisible)
        if key not in self._data_layouts:
            axes = [None] * rank
            if divisible:
                axes[0] = self.batch_dim_name
            self._data_layouts[key] = TensorLayout(axes, self.device_mesh)
        return self._data_layouts[key]

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        if layout is not None:
            check_layout_fits(layout, variable.path, variable.shape)
        return layout


def _axis_size(mesh, axis) -> int:
    names = axis if isinstance(axis, (tuple, list)) else (axis,)
    size = 1
    for name in names:
        size *= mesh.shape[mesh.axis_names.index(name)]
    return size


def check_layout_fits(layout, path: str, shape) -> None:
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
        parts = _axis_size(mesh, axis)
        if size % parts:
            raise ValueError(
                f"Dimension {dim} of variable '{path}' (shape "
                f"{tuple(shape)}) has size {size}, which does not divide "
                f"into the {parts} devices of mesh axis {axis!r}. Received: "
                f"layout axes={tuple(layout.axes)}. Shard another dimension, "
                "or pick sizes divisible by the axis.")


def check_keys_match(layout_map, model) -> None:
    """Raises `ValueError` for a layout key that matches none of `model`'s
    variables (Keras would silently replicate what it meant to shard)."""
    paths = [v.path for v in model.weights]
    for key in layout_map:
        if not any(key == p or re.fullmatch(key, p) for p in paths):
            raise ValueError(
                f"The layout_map key {key!r} matches none of the variables of "
                f"model '{model.name}', so nothing would be sharded by it. "
                "Keys are regular expressions matched against the whole "
                f"`variable.path`, e.g. {paths[:3]}. Received: key={key!r}. "
                "Write the full path, or a pattern such as '.*dense.*kernel'.")


def check_layout_map(layout_map) -> None:
    """Raises `ValueError` for a layout naming an axis the mesh lacks."""
    mesh = layout_map.device_mesh
    for key, layout in layout_map.items():
        for axis in layout.axes:
            names = axis if isinstance(axis, (tuple, list)) else (axis,)
            unknown = [n for n in names if n is not None and n not in
                       mesh.axis_names]
            if unknown:
                raise ValueError(
                    f"The layout for {key!r} names mesh axis {unknown[0]!r}, "
                    f"but the mesh has axes {list(mesh.axis_names)}. "
                    f"Received: layout axes={tuple(layout.axes)}. Use the "
                    "mesh's axis names (or None).")


class StrategyDataParallel(StrategyLayouts, DataParallel):
    def __init__(self, device_mesh):
        super().__init__(device_mesh=device_mesh)
        self._init_layout_cache(device_mesh.shape[0])


class StrategyModelParallel(StrategyLayouts, ModelParallel):
    def __init__(self, layout_map, batch_dim_name):
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name)
        axis = layout_map.device_mesh.axis_names.index(batch_dim_name)
        self._init_layout_cache(layout_map.device_mesh.shape[axis])


