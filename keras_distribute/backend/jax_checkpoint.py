"""What the sharded checkpoint needs from JAX: unique pieces, per-device reads.

A variable is written as the distinct shards this process holds (replica 0
of each), and restored by reading, for every local device, only the global
slice that device holds under the variable's current layout.
"""

from typing import Any, Callable

import jax
import numpy as np


def _bounds(index: tuple, shape: tuple) -> tuple:
    return tuple((s.start or 0, n if s.stop is None else s.stop)
                 for s, n in zip(index, shape))


def checkpoint_pieces(variable: Any, writer: int = 0) -> list:
    """The unique pieces of a variable this process writes: a replicated
    variable whole, in process `writer` only; else replica 0 of each
    shard, by the process holding it."""
    value = variable.value
    if value.sharding.is_fully_replicated:
        if jax.process_index() != writer:
            return []
        shard = value.addressable_shards[0]
        return [(_bounds(shard.index, value.shape), np.asarray(shard.data))]
    pieces = []
    for shard in value.addressable_shards:
        if shard.replica_id == 0:  # each distinct piece once
            pieces.append((_bounds(shard.index, value.shape),
                           np.asarray(shard.data)))
    return pieces


def checkpoint_assign(variable: Any, read_regions: Callable) -> None:
    """Restores a variable by reading only each local device's slice."""
    value = variable.value
    sharding = value.sharding
    shape = tuple(value.shape)
    devices = sharding.addressable_devices_indices_map(shape)
    regions = {device: _bounds(index, shape)
               for device, index in devices.items()}
    unique = sorted(set(regions.values()))
    arrays = dict(zip(unique, read_regions(unique)))
    pieces = [jax.device_put(np.asarray(arrays[regions[device]], value.dtype),
                             device) for device in devices]
    variable.assign(jax.make_array_from_single_device_arrays(
        shape, sharding, pieces))
