"""JAX, one process: a large variable a layout shards is made as its shards.

Keras' JAX variable runs its initializer under `jax.jit` with the layout as
`out_shardings` (each device computes only its shard; JAX's counter-based
random numbers give the values an unsharded model gets from the same seed)
only from 250 MB x the mesh's devices (`should_shard_at_init`); below that
the whole value is made on one device and then cut. In a kd strategy's
scope, in a job of one process, every variable the layout shards from
`BORN_SHARDED_MIN_BYTES` is made as its shards. Several JAX processes keep
Keras' rule: there a new variable takes process 0's value
(`jax_processes`), which a jitted per-process initializer would bypass.
"""

import functools
import math
from typing import Any
from typing import Callable

from keras_distribute.integration import patching

# A sharded variable at least this large (as float32, whole) is initialised
# shard by shard: each costs one small compiled program, so the smallest,
# which a device holds whole without harm, keep Keras' eager path.
BORN_SHARDED_MIN_BYTES = 4 << 20


def born_sharded(should_shard_at_init: Callable,
                 current_distribution: Callable[[], Any]) -> Callable:
    """Wraps Keras' JAX `should_shard_at_init(init_layout, shape)`."""

    @functools.wraps(should_shard_at_init)
    def wrapper(init_layout, shape, *args, **kwargs):
        if should_shard_at_init(init_layout, shape, *args, **kwargs):
            return True
        import jax

        if jax.process_count() > 1 or not getattr(
                current_distribution(), "_kd_strategy_distribution", False):
            return False
        spec = getattr(init_layout, "spec", None)
        sizes = dict(getattr(getattr(init_layout, "mesh", None), "shape",
                             {}) or {})
        axes = [name for entry in (spec or ()) for name in (
            entry if isinstance(entry, tuple) else (entry,))]
        sharded = any(isinstance(axis, str) and sizes.get(axis, 1) > 1
                      for axis in axes)
        return sharded and math.prod(shape) * 4 >= BORN_SHARDED_MIN_BYTES

    return patching.wrapping(wrapper, should_shard_at_init)
