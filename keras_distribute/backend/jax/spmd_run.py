"""`strategy.run` on the JAX engine: `fn` compiled once per replica with
`jax.shard_map` over the batch axis (`jax_run` supplies the Keras variables
it touches); per-replica inputs of unequal shape (a short last batch) run
one thread per replica instead (`jax_collectives.run_in_threads`).
"""

from typing import Any
from typing import Callable

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import PartitionSpec

from keras_distribute.backend.jax import collectives as jax_collectives
from keras_distribute.backend.jax import run as jax_run
from keras_distribute.backend.jax.collectives import as_array
from keras_distribute.backend.jax.collectives import unwrap
from keras_distribute.backend.jax.replica_values import ReplicaValues
from keras_distribute.common.values import PerReplica

_RUN_CACHE_SIZE = 64


class SpmdRun(ReplicaValues):
    """The `run` of `JaxEngine`, over its per-replica values
    (`ReplicaValues`: `_stack`, `_replicate`, `_per_replica_shards`); the
    engine supplies `_run_cache` and the attributes `ReplicaValues`
    declares."""

    _run_cache: dict

    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if not self.multi_process:
            return self._run(strategy, fn, args, kwargs)
        from keras_distribute.job import peer_board

        peer_board.advance()
        with peer_board.busy():
            return self._run(strategy, fn, args, kwargs)

    def _run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda x: isinstance(x, PerReplica)
        )
        kinds = tuple(_leaf_kind(leaf) for leaf in leaves)
        local = len(self.local_replica_ids)
        for leaf in leaves:
            if isinstance(leaf, PerReplica) and len(leaf) != local:
                raise ValueError(
                    f"A per-replica argument has {len(leaf)} components but "
                    f"this process runs {local} of the strategy's replicas. "
                    "Make it with this strategy's distributed dataset or "
                    "`experimental_distribute_values_from_function`."
                )
        if all(_even(leaf) for leaf, k in zip(leaves, kinds) if k == "split"):
            return self._run_spmd(strategy, fn, leaves, kinds, treedef)
        if self.multi_process:
            raise ValueError(
                "Per-replica inputs of different shapes (a short last batch) "
                "cannot run across several JAX processes: SPMD needs equal "
                "shapes. Batch the dataset with `drop_remainder=True`, or "
                "pad the last batch.")
        return jax_collectives.run_in_threads(self, strategy, fn, leaves,
                                              kinds, treedef)

    def _run_spmd(self, strategy, fn, leaves, kinds, treedef):
        statics = tuple(
            leaf if kind == "static" else None
            for leaf, kind in zip(leaves, kinds)
        )
        dynamic = [
            self._stack(leaf.values) if kind == "split" else self._replicate(
                as_array(leaf))
            for leaf, kind in zip(leaves, kinds) if kind != "static"
        ]
        compiled, variables, written = self._compiled_run(
            strategy, fn, treedef, kinds, statics, dynamic)
        # Read now, not when compiled: the weights a run sees are current.
        values = [v.value for v in variables]
        value_of = {id(v): value for v, value in zip(variables, values)}
        before = [value_of[id(v)] for v in written]
        outputs, updates = compiled(values, *dynamic)
        jax_run.apply_updates(written, before, updates)
        return jax.tree_util.tree_map(
            lambda out: PerReplica(
                [part[0] for part in self._per_replica_shards(out)]
            ),
            outputs,
        )

    def _compiled_run(self, strategy, fn, treedef, kinds, statics, dynamic):
        """`(compiled, variables it reads, variables it assigns)`.

        The variables are found by abstract traces (see `jax_run`): each
        trace passes the ones found so far as inputs, until no new one is
        read.
        """
        key = (fn, treedef, kinds, tuple(_static_key(s) for s in statics))
        cached = self._run_cache.get(key)
        if cached is not None:
            return cached[0]
        variables: list = []
        for _ in range(8):
            found: dict = {}
            program = self._run_program(strategy, fn, treedef, kinds,
                                        statics, variables, [], found)
            jax.eval_shape(program, [v.value for v in variables], *dynamic)
            new = [v for key_, v in found["read"].items()
                   if key_ not in {id(known) for known in variables}]
            jax_run.check_initialized(new)
            if not new:
                break
            variables += new
        written = list(found["written"].values())
        compiled = jax.jit(self._run_program(
            strategy, fn, treedef, kinds, statics, variables, written, {}))
        if len(self._run_cache) >= _RUN_CACHE_SIZE:
            self._run_cache.pop(next(iter(self._run_cache)))
        # Keep `statics` alive so their ids in the key stay unique.
        entry = (compiled, variables, written)
        self._run_cache[key] = (entry, statics)
        return entry

    def _run_program(self, strategy, fn, treedef, kinds, statics, variables,
                     written, found):
        """`fn` per replica under `shard_map`: `(variable values, *inputs)
        -> (outputs, new values of `written`)`; `found` receives the
        variables the trace read and wrote."""
        axis = self.batch_axis
        collectives = jax_collectives.SpmdCollectives(axis)

        def per_replica(values, *dynamic):
            inputs = iter(dynamic)
            full = [
                static if kind == "static" else (
                    next(inputs)[0] if kind == "split" else next(inputs))
                for kind, static in zip(kinds, statics)
            ]
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            given = {id(v): value for v, value in zip(variables, values)}
            scope = jax_run.VariableScope(lambda v: given.get(id(v)))
            with scope, strategy.enter_replica(jax.lax.axis_index(axis),
                                               collectives):
                result = fn(*call_args, **call_kwargs)
            found.update(read=scope.read, written=scope.written)
            updates = [
                scope.state_mapping[id(v)] for v in written]
            return (
                jax.tree_util.tree_map(
                    lambda out: jnp.asarray(unwrap(out))[None], result),
                [jnp.asarray(u)[None] if jax_run.is_stacked(v) else
                 jnp.asarray(u) for v, u in zip(written, updates)],
            )

        in_specs = (
            [PartitionSpec()] * len(variables),
        ) + tuple(
            PartitionSpec(axis) if kind == "split" else PartitionSpec()
            for kind in kinds if kind != "static"
        )
        out_specs = (
            PartitionSpec(axis),
            [PartitionSpec(axis) if jax_run.is_stacked(v) else
             PartitionSpec() for v in written],
        )
        return jax.shard_map(
            per_replica, mesh=self.mesh, in_specs=in_specs,
            out_specs=out_specs, check_vma=False,
            # Only the replica axis is manual: a model axis stays with
            # XLA, so layouts and logical-device constraints apply.
            axis_names=frozenset({axis}),
        )


def _leaf_kind(leaf: Any) -> str:
    if isinstance(leaf, PerReplica):
        return "split"
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(leaf, "numpy") and hasattr(leaf, "shape")
        and not isinstance(leaf, keras.Variable)
    ):
        return "replicated"
    return "static"


def _even(leaf: PerReplica) -> bool:
    shapes = {(tuple(np.shape(v)), str(getattr(v, "dtype", type(v))))
              for v in leaf.values}
    return len(shapes) == 1


def _static_key(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return (type(value), value)
    return ("id", id(value))
