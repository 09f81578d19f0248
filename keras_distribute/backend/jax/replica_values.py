"""The JAX engine's per-replica values and cross-replica operations.

`put_per_replica` places one structure per replica on its device;
`reduce` and `gather` combine per-replica components (a global array
stacked over the replicas, reduced by XLA; gathered rows cross processes
on the host). `ReplicaValues` is a base of `JaxEngine` (`engine.py`),
which supplies the attributes it declares.
"""

from __future__ import annotations

from typing import Any
from typing import Callable
from typing import Dict
from typing import Optional
from typing import Sequence

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_distribute.backend.jax.collectives import as_array
from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.values import PerReplica


class ReplicaValues:
    """Per-replica values and cross-replica operations of `JaxEngine` (see
    the module docstring)."""

    mesh: Any
    batch_axis: str
    num_replicas: int
    local_replica_ids: Sequence[int]
    local_replica_devices: Sequence[Any]
    multi_process: bool
    _replica_of_device: Dict[Any, int]
    _local_position: Dict[int, int]
    _device_set: Any
    _replicated: Any
    gather_rows: Callable[[np.ndarray], np.ndarray]

    def put_per_replica(self, structures: Sequence[Any],
                        on_device: bool = True) -> Any:
        def put(*leaves):
            if leaves[0] is None:
                return None
            if not on_device:
                return PerReplica([np.asarray(leaf) for leaf in leaves])
            return PerReplica([
                jax.device_put(as_array(leaf), device)
                for leaf, device in zip(leaves, self.local_replica_devices)
            ])

        return keras.tree.map_structure(put, *structures)

    def _per_replica_shards(self, array: Any) -> tuple:
        """This process's replicas' parts of a global array, in order."""
        parts = [None] * len(self.local_replica_ids)
        for shard in array.addressable_shards:
            replica = self._replica_of_device.get(shard.device)
            position = (None if replica is None
                        else self._local_position.get(replica))
            if position is not None and parts[position] is None:
                parts[position] = shard.data
        return tuple(parts)

    def _stack(self, values: Sequence[Any]) -> jax.Array:
        """One global array `(num_replicas, *shape)` from per-replica parts."""
        first = as_array(values[0])
        shape = (self.num_replicas,) + tuple(np.shape(first))
        sharding = NamedSharding(self.mesh, PartitionSpec(self.batch_axis))
        pieces = []
        for device in sharding.addressable_devices_indices_map(shape):
            position = self._local_position[self._replica_of_device[device]]
            pieces.append(
                jax.device_put(as_array(values[position])[None], device)
            )
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

    def _replicate(self, value: Any) -> Any:
        if isinstance(value, jax.Array) and (
                value.sharding.device_set != self._device_set):
            return jax.device_put(value, self._replicated)
        return value

    # -------------------------------------------------- cross-replica ops
    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        values = [as_array(v) for v in values]
        if axis is None:
            shapes = {tuple(np.shape(v)) for v in values}
            if len(shapes) > 1:
                raise ValueError(
                    "Cannot reduce per-replica values of different shapes "
                    f"{sorted(shapes)} with axis=None. Pass the batch "
                    "dimension as `axis` (usually `axis=0`)."
                )
            stacked = self._stack(values)
            result = _sum0(stacked) if op is ReduceOp.SUM else _mean0(stacked)
            return self._local(result)
        rank = np.ndim(values[0])
        if not -rank <= axis < rank:
            raise ValueError(
                f"`axis`={axis} is out of range for per-replica values of "
                f"rank {rank}. Use an axis in [{-rank}, {rank})."
            )
        partial_sums = [jnp.sum(v, axis=axis) for v in values]
        total = self._local(_sum0(self._stack(partial_sums)))
        if op is ReduceOp.SUM:
            return total
        counts = [np.float32(np.shape(v)[axis]) for v in values]
        return total / self._local(_sum0(self._stack(counts)))

    def _local(self, replicated: Any) -> Any:
        """A replicated global array as an array this process can read."""
        if self.multi_process:
            return replicated.addressable_data(0)
        return replicated

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        values = [as_array(v) for v in values]
        rank = np.ndim(values[0])
        if rank == 0:
            raise ValueError(
                "`gather` needs per-replica values of rank >= 1 to "
                "concatenate. Received scalars. Use `reduce` for scalars, or "
                "give each replica's value a leading dimension."
            )
        if not -rank <= axis < rank:
            raise ValueError(
                f"`axis`={axis} is out of range for per-replica values of "
                f"rank {rank}. Use an axis in [{-rank}, {rank})."
            )
        # Concatenated on the host: an uncommitted array, which combines
        # with arrays on any device (a metric's replicated variables: a
        # result committed to one device failed with "incompatible devices").
        local = np.concatenate([np.asarray(v) for v in values], axis=axis)
        if self.multi_process:
            local = np.moveaxis(
                self.gather_rows(np.moveaxis(local, axis, 0)), 0, axis)
        return jnp.asarray(local)


@jax.jit
def _sum0(stacked):
    return jnp.sum(stacked, axis=0)


@jax.jit
def _mean0(stacked):
    return jnp.mean(stacked, axis=0)
