"""Collectives of the JAX engine, and the fallback that runs replicas in
threads.

Inside `shard_map` (equal per-replica shapes) collectives are XLA's
all-reduce / all-gather over the replica axis. When per-replica inputs differ
in shape (a short last batch split unevenly), SPMD cannot run them; each
replica then runs in its own thread and collectives meet at a barrier.
"""

import threading
from typing import Any
from typing import List
from typing import Optional

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.values import PerReplica

# A replica that never reaches a collective must not hang the others.
_COLLECTIVE_TIMEOUT_S = 300.0


def as_array(value: Any) -> Any:
    if isinstance(value, (jax.Array, np.ndarray)):
        return value
    if isinstance(value, keras.Variable):
        return value.value
    if hasattr(value, "numpy") and not isinstance(value, np.generic):
        return np.asarray(value.numpy())
    return np.asarray(value)


def unwrap(value: Any) -> Any:
    return value.value if isinstance(value, keras.Variable) else value


class SpmdCollectives:
    """Collectives inside `shard_map`: XLA all-reduce / all-gather."""

    def __init__(self, axis: str):
        self._axis = axis

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        reduce = jax.lax.psum if op is ReduceOp.SUM else jax.lax.pmean
        return jax.tree_util.tree_map(
            lambda v: reduce(jnp.asarray(unwrap(v)), self._axis), value
        )

    def all_gather(self, value: Any, axis: int) -> Any:
        return jax.tree_util.tree_map(
            lambda v: jax.lax.all_gather(
                jnp.asarray(unwrap(v)), self._axis, axis=axis, tiled=True
            ),
            value,
        )


class _Rendezvous:
    """Lets replica threads swap values; a failed replica breaks it."""

    def __init__(self, n: int):
        self._barrier = threading.Barrier(n, timeout=_COLLECTIVE_TIMEOUT_S)
        self._slots = [None] * n

    def exchange(self, replica: int, value: Any) -> list:
        self._slots[replica] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before all read
        return values

    def abort(self) -> None:
        self._barrier.abort()


class ThreadCollectives:
    """Collectives between replica threads (per-replica shapes differ)."""

    def __init__(self, rendezvous: _Rendezvous, replica: int, device: Any):
        self._rendezvous = rendezvous
        self._replica = replica
        self._device = device

    def _local(self, values: list) -> list:
        return [jax.device_put(as_array(unwrap(v)), self._device)
                for v in values]

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        everyone = self._rendezvous.exchange(self._replica, value)

        def combine(*parts):
            local = self._local(list(parts))
            total = local[0]
            for part in local[1:]:
                total = total + part
            return total / len(local) if op is ReduceOp.MEAN else total

        return keras.tree.map_structure(combine, *everyone)

    def all_gather(self, value: Any, axis: int) -> Any:
        everyone = self._rendezvous.exchange(self._replica, value)
        return keras.tree.map_structure(
            lambda *parts: jnp.concatenate(self._local(list(parts)), axis=axis),
            *everyone,
        )


def run_in_threads(engine, strategy, fn, leaves, kinds, treedef):
    """Runs `fn` in one thread per replica (per-replica shapes differ).

    Each thread holds its replica's own arrays on its device; collectives
    meet at a barrier. The first replica's error is re-raised.
    """
    from keras_distribute.backend.jax import run as jax_run

    n = engine.num_replicas
    rendezvous = _Rendezvous(n)
    results: list = [None] * n
    errors: List[Optional[BaseException]] = [None] * n
    scopes: list = [None] * n

    def replica_main(replica):
        device = engine.replica_devices[replica]
        try:
            full = [
                leaf.values[replica] if kind == "split" else leaf
                for leaf, kind in zip(leaves, kinds)
            ]
            full = [
                jax.device_put(as_array(v), device)
                if kind != "static" and v is not None else v
                for v, kind in zip(full, kinds)
            ]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(
                treedef, full
            )
            collectives = ThreadCollectives(rendezvous, replica, device)
            # Each replica reads its device's copy of the variables, and
            # its assignments are combined after every replica finished.
            scope = scopes[replica] = jax_run.VariableScope(
                lambda v: jax_run.local_copy(v, device))
            with jax.default_device(device), engine.scope(), scope, (
                    strategy.enter_replica(replica, collectives)):
                results[replica] = fn(*call_args, **call_kwargs)
        except BaseException as error:  # re-raised in the caller
            errors[replica] = error
            rendezvous.abort()

    threads = [
        threading.Thread(target=replica_main, args=(i,), daemon=True)
        for i in range(n)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    real = [e for e in errors if e is not None and not isinstance(
        e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    _apply_replica_updates(engine, scopes)
    return keras.tree.map_structure(
        lambda *parts: PerReplica(list(parts)), *results
    )


def _apply_replica_updates(engine, scopes) -> None:
    """Assigns the variables the replicas' threads wrote (see `jax_run`)."""
    from keras_distribute.backend.jax import run as jax_run

    written = list(scopes[0].written.values())
    if not written:
        return
    first = engine.replica_devices[0]
    before = [jax_run.local_copy(v, first) for v in written]
    updates = [
        jax_run.stack_replica_values([
            jax.device_put(s.state_mapping[id(v)], first) for s in scopes])
        if jax_run.is_stacked(v) else scopes[0].state_mapping[id(v)]
        for v in written]
    jax_run.apply_updates(written, before, updates)
