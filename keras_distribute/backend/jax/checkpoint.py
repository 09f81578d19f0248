"""What the sharded checkpoint needs from JAX: unique pieces, per-device reads.

A variable is written as the distinct shards this process holds (replica 0
of each), and restored by reading, for every local device, only the global
slice that device holds under the variable's current layout.
"""


from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable

import jax
import numpy as np

if TYPE_CHECKING:
    from keras import Variable


def _bounds(index: tuple, shape: tuple) -> tuple:
    return tuple((s.start or 0, n if s.stop is None else s.stop)
                 for s, n in zip(index, shape))


def checkpoint_pieces(variable: Variable, writer: int, process_id: int) -> list:
    """The unique pieces of a variable this process (`process_id`) writes:
    a replicated variable whole, in process `writer` only; else replica 0
    of each shard, by the process holding it."""
    value = variable.value
    if value.sharding.is_fully_replicated:
        if process_id != writer:
            return []
        shard = value.addressable_shards[0]
        return [(_bounds(shard.index, value.shape), np.asarray(shard.data))]
    pieces = []
    for shard in value.addressable_shards:
        if shard.replica_id == 0:  # each distinct piece once
            pieces.append((_bounds(shard.index, value.shape),
                           np.asarray(shard.data)))
    return pieces


def _held_as(array: np.ndarray, dtype: Any, path: str) -> np.ndarray:
    """`array` as the dtype JAX holds the variable in. Without x64, JAX
    holds int64 as int32 (and float64 as float32: rounded, the documented
    rule); an integer that does not fit is refused, never wrapped."""
    held = np.asarray(array, dtype)
    if (held.dtype != array.dtype and held.dtype.kind in "iu"
            and not np.array_equal(held.astype(array.dtype), array)):
        raise ValueError(
            f"The saved values of {path!r} ({array.dtype}) do not fit the "
            f"{held.dtype} JAX holds this variable in (64-bit types are "
            "narrowed unless jax_enable_x64 is on). Received values from "
            f"{array.min()} to {array.max()}. Enable x64 "
            "(jax.config.update('jax_enable_x64', True)) before creating "
            "the model to restore them.")
    return held


def checkpoint_snapshot(variable: Variable) -> Callable[[], None]:
    """`put_back()` for a variable's current value: a JAX array is never
    changed in place, so holding it costs nothing."""
    value = variable.value
    return lambda: variable.assign(value)


def checkpoint_assign(variable: Variable, read_regions: Callable) -> None:
    """Restores a variable by reading only each local device's slice."""
    value = variable.value
    sharding = value.sharding
    shape = tuple(value.shape)
    devices = sharding.addressable_devices_indices_map(shape)
    regions = {device: _bounds(index, shape)
               for device, index in devices.items()}
    unique = sorted(set(regions.values()))
    arrays = dict(zip(unique, read_regions(unique)))
    held = {region: _held_as(array, value.dtype, variable.path)
            for region, array in arrays.items()}
    if (len(held) == 1 and sharding.is_fully_replicated
            and sharding.is_fully_addressable):
        # every device holds the whole: one batched transfer
        variable.assign(jax.device_put(held[unique[0]], sharding))
        return
    pieces = jax.device_put([held[regions[device]] for device in devices],
                            list(devices))
    variable.assign(jax.make_array_from_single_device_arrays(
        shape, sharding, pieces))
