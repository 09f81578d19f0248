"""JAX, one process: a large variable a layout shards is made as its shards.

Keras' JAX variable runs its initializer under `jax.jit` with the layout as
`out_shardings` (each device computes only its shard; JAX's counter-based
random numbers give the values an unsharded model gets from the same seed)
only from 250 MB x the mesh's devices (`should_shard_at_init`); below that
the whole value is made on one device and then cut. In a kd strategy's
scope every variable the layout shards from `BORN_SHARDED_MIN_BYTES` is
made as its shards.

With several JAX processes a new variable takes process 0's value
(`jax_processes`: the whole value is made and broadcast), since the
processes' random states may differ. A jitted initializer computes each
process's shards from that process's own seed, so there a variable is made
as its shards only when its values cannot depend on the process: its
initializer has an int seed, and process 0's seed is broadcast first (one
small collective) and given to a copy of the initializer (the layer's own
keeps its seed); or its initializer draws nothing (zeros, ones, a
constant). Any other initializer keeps the whole value and the broadcast.

An initializer that cannot be traced (one that branches on a drawn value,
`float(x) > 0`, or converts a draw to NumPy) fails under `jax.jit`; where
kd's rule (not Keras' own, from 250 MB x devices) chose to make it as its
shards, it is made again as Keras' `ModelParallel` makes it below that
size: whole on one device, then cut. That costs the whole variable's
bytes on one device for a moment (`_whole_if_not_traceable`).
"""

import contextvars
import copy
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

        if _WHOLE_FIRST.get() or not getattr(
                current_distribution(), "_kd_strategy_distribution", False):
            return False
        if jax.process_count() > 1 and not _SAME_IN_EVERY_PROCESS.get():
            return False
        return _large_and_sharded(init_layout, shape)

    return patching.wrapping(wrapper, should_shard_at_init)


def _large_and_sharded(init_layout: Any, shape: Any) -> bool:
    """Whether the JAX sharding `init_layout` cuts a `shape` variable of
    `BORN_SHARDED_MIN_BYTES` or more."""
    spec = getattr(init_layout, "spec", None)
    sizes = dict(getattr(getattr(init_layout, "mesh", None), "shape",
                         {}) or {})
    axes = [name for entry in (spec or ()) for name in (
        entry if isinstance(entry, tuple) else (entry,))]
    sharded = any(isinstance(axis, str) and sizes.get(axis, 1) > 1
                  for axis in axes)
    return sharded and math.prod(shape) * 4 >= BORN_SHARDED_MIN_BYTES


# Set while a variable is initialised whose values are the same in every
# process (`seed_of_process_zero`): `born_sharded` may then cut it.
_SAME_IN_EVERY_PROCESS = contextvars.ContextVar(
    "kd_same_in_every_process", default=False)

# Set while a variable whose initializer could not be traced is made again
# whole, then cut (`_whole_if_not_traceable`): `born_sharded` leaves it to
# Keras' own rule.
_WHOLE_FIRST = contextvars.ContextVar("kd_whole_first", default=False)


def _whole_if_not_traceable(initialize: Callable[[], Any]) -> Any:
    """`initialize()`; if the initializer cannot be traced under `jax.jit`
    (a Python branch on a drawn value, a draw converted to NumPy), once
    more with kd's born-sharded rule off: the value made whole, then cut."""
    import jax

    untraceable = (jax.errors.ConcretizationTypeError,
                   jax.errors.TracerArrayConversionError,
                   jax.errors.TracerIntegerConversionError)
    try:
        return initialize()
    except untraceable:
        if _WHOLE_FIRST.get():
            raise
    token = _WHOLE_FIRST.set(True)
    try:
        return initialize()
    finally:
        _WHOLE_FIRST.reset(token)


# Keras' initializers that draw no random numbers.
_DRAWING_NOTHING = ("Zeros", "Ones", "Constant")


def seed_of_process_zero(initialize_with_initializer: Callable,
                         current_distribution: Callable[[], Any]) -> Callable:
    """Wraps Keras' JAX `Variable._initialize_with_initializer(self,
    initializer)`: with several processes, in a kd strategy's scope, a
    variable `born_sharded` would cut is made from process 0's seed."""
    import numpy as np

    @functools.wraps(initialize_with_initializer)
    def wrapper(self, initializer, *args, **kwargs):
        import jax

        def keras_own() -> Any:
            return _whole_if_not_traceable(
                lambda: initialize_with_initializer(self, initializer, *args,
                                                    **kwargs))

        if jax.process_count() <= 1 or not getattr(
                current_distribution(), "_kd_strategy_distribution", False):
            return keras_own()
        self._initialize_layout()
        layout = getattr(self._layout, "backend_layout", self._layout)
        if layout is None or not _large_and_sharded(layout, self._shape):
            return keras_own()
        seed = getattr(initializer, "seed", None)
        if type(initializer).__name__ in _DRAWING_NOTHING and type(
                initializer).__module__.startswith("keras."):
            chosen = initializer
        elif isinstance(seed, int) and not isinstance(seed, bool) and (
                -(1 << 63) <= seed < 1 << 63):
            from jax.experimental import multihost_utils

            # (as two 32-bit halves: JAX keeps 64-bit ints only with x64)
            halves = np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF],
                              dtype=np.uint32)
            high, low = (int(v) for v in np.asarray(
                multihost_utils.broadcast_one_to_all(halves)))
            agreed = (high << 32) | low
            if agreed >= 1 << 63:  # (a negative seed)
                agreed -= 1 << 64
            chosen = copy.copy(initializer)
            chosen.seed = agreed
        else:  # a seed generator, a custom initializer: Keras' rule
            return keras_own()
        token = _SAME_IN_EVERY_PROCESS.set(True)
        try:
            return _whole_if_not_traceable(
                lambda: initialize_with_initializer(self, chosen, *args,
                                                    **kwargs))
        finally:
            _SAME_IN_EVERY_PROCESS.reset(token)

    return patching.wrapping(wrapper, initialize_with_initializer)
