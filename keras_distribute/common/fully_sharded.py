"""Layout maps kd writes for you: `kd.layouts.fully_sharded` (the public
name; `keras_distribute/layouts.py` exports it).

FSDP / ZeRO-3 in one line: every variable of at least `min_size` elements is
sharded over the batch axis of the mesh on its largest dimension that the
axis divides, the rest replicated, and a `LayoutMap` of your own (model-axis
sharding, say) is kept where it says something. Each replica then holds
1/N of those variables, of their gradients and of their optimizer slots;
the engine gathers a variable for the step that uses it (XLA SPMD on JAX,
DTensor on torch). TensorFlow refuses it as it refuses any sharded layout.

Imports Keras' public `keras.distribution` only.
"""

import numbers
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence

from keras.distribution import DeviceMesh
from keras.distribution import LayoutMap
from keras.distribution import TensorLayout

from keras_distribute.common.layouts import axis_names

# Variables smaller than this many elements stay replicated by default:
# gathering them costs a collective each for little memory (DeepSpeed's
# `stage3_param_persistence_threshold` makes the same trade, at 1e5).
DEFAULT_MIN_SIZE = 2**16


class FullyShardedLayoutMap(LayoutMap):
    """A `LayoutMap` that also shards every large variable over the batch
    axis (FSDP-style). Build it with `kd.layouts.fully_sharded`.

    Its own entries (copied from the `layout_map` it was given) are looked
    up as in any `LayoutMap`; `layout_for(path, shape)` is the layout a
    strategy gives a variable: that entry (or none), plus the batch axis
    on the largest dimension it leaves unsharded and the batch axis
    divides, when the variable has at least `min_size` elements.
    """

    def __init__(self, device_mesh: Any, min_size: int = DEFAULT_MIN_SIZE,
                 layout_map: Optional[Any] = None):
        super().__init__(device_mesh)
        self.min_size = min_size
        self.batch_axis = device_mesh.axis_names[0]
        self._batch_size = int(device_mesh.shape[0])
        if layout_map is not None:
            for key, layout in layout_map.items():
                self[key] = layout

    @property
    def shards_over(self) -> List[str]:
        """The mesh axis this map shards over whatever its entries say."""
        return [self.batch_axis] if self._batch_size > 1 else []

    def layout_for(self, path: str, shape: Sequence[int]) -> Optional[Any]:
        """The layout of the variable `path` of `shape`.

        Args:
            path: The variable's path (`variable.path`).
            shape: The variable's shape.

        Returns:
            A `TensorLayout`, or None (replicated) when neither an entry
            nor the size rule says anything.

        Example:

        >>> mesh = keras.distribution.DeviceMesh((8,), ["batch"])
        >>> kd.layouts.fully_sharded(mesh, min_size=0).layout_for(
        ...     "dense/kernel", (16, 64)).axes
        (None, 'batch')
        """
        shape = tuple(int(size) for size in shape)
        entry = self[path]
        axes = list(entry.axes) if entry is not None else [None] * len(shape)
        if (self._batch_size <= 1 or len(axes) != len(shape)
                or int(_product(shape)) < self.min_size
                or any(self.batch_axis in axis_names(axis) for axis in axes)):
            return entry
        dim = largest_free_dimension(shape, axes, self._batch_size)
        if dim is None:
            return entry
        axes[dim] = self.batch_axis
        return TensorLayout(axes, self.device_mesh)


def fully_sharded(mesh_or_layout_map: Any, *,
                  min_size: int = DEFAULT_MIN_SIZE) -> FullyShardedLayoutMap:
    """A layout map that shards every large variable over the batch axis.

    FSDP / ZeRO-3 without writing a map: pass it as a strategy's
    `layout_map`. Each variable of at least `min_size` elements is sharded
    over the first (batch) axis of the mesh on its largest dimension that
    the axis divides and that no entry of yours already shards; smaller
    ones, and ones no dimension of which the axis divides, keep your
    entry's layout or are replicated. Given a `LayoutMap` of your own (a
    model-axis map), its entries are kept and the batch axis is added.

    Args:
        mesh_or_layout_map: A `keras.distribution.DeviceMesh` whose first
            axis is the batch (data-parallel) axis, or a `LayoutMap` over
            such a mesh whose entries are kept.
        min_size: Variables with fewer elements stay as their entry says
            (replicated without one). Defaults to 65536.

    Returns:
        A `FullyShardedLayoutMap` (a `keras.distribution.LayoutMap`).

    Raises:
        TypeError: if `mesh_or_layout_map` is neither a `DeviceMesh` nor a
            `LayoutMap`.
        ValueError: if `min_size` is not a non-negative int.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh((8,), ["batch"])   # JAX: 8 devices
    strategy = kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(mesh))
    with strategy.scope():
        model = make_model()          # its large kernels: 1/8 per device
    ```
    """
    if isinstance(min_size, bool) or not isinstance(
            min_size, numbers.Integral) or min_size < 0:
        raise ValueError(
            f"Expected `min_size` to be a non-negative int (a variable's "
            f"number of elements). Received: min_size={min_size!r}. Pass 0 "
            "to shard every variable a dimension of which the batch axis "
            "divides.")
    if isinstance(mesh_or_layout_map, LayoutMap):
        return FullyShardedLayoutMap(mesh_or_layout_map.device_mesh,
                                     int(min_size), mesh_or_layout_map)
    if isinstance(mesh_or_layout_map, DeviceMesh):
        return FullyShardedLayoutMap(mesh_or_layout_map, int(min_size))
    raise TypeError(
        "Expected a keras.distribution.DeviceMesh (its first axis the batch "
        "axis) or a keras.distribution.LayoutMap over one. Received: "
        f"{mesh_or_layout_map!r} of type {type(mesh_or_layout_map).__name__}"
        ". Build one with keras.distribution.DeviceMesh((n,), ['batch'], "
        "devices).")


def largest_free_dimension(shape: Sequence[int],
                           axes: Sequence[Any], size: int) -> Optional[int]:
    """The dimension FSDP shards over an axis of `size` devices: the
    largest (then the first) that `axes` leaves unsharded and `size`
    divides; `None` when there is none."""
    free = [dim for dim, extent in enumerate(shape)
            if axes[dim] is None and extent % size == 0]
    return max(free, key=lambda d: (shape[d], -d)) if free else None


def _product(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
