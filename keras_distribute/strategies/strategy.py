"""`Strategy`: the backend-neutral half of every distribution strategy."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Iterator
from typing import Optional

from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.common import context
from keras_distribute.common.input_context import InputContext
from keras_distribute.common.layout_picture import LayoutDescription
from keras_distribute.common.layout_picture import human_bytes
from keras_distribute.common.layout_picture import nbytes_of
from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.reduce_op import check_reduce_axis
from keras_distribute.common.values import PerReplica
from keras_distribute.input import datasets
from keras_distribute.strategies.extended import StrategyExtended

if TYPE_CHECKING:
    from keras import Model


def _tree():
    import keras

    return keras.tree


class Strategy:
    """Distributes a Keras program over several replicas.

    The backend-neutral base of `kd.MirroredStrategy` and friends: it keeps
    the `tf.distribute` semantics (contexts, nested structures, reduce
    ops, input splitting) and hands the framework work to its engine (see
    `keras_distribute.backend.interface.ReplicaEngine`).

    Args:
        engine: The backend engine that owns devices and collectives.
    """

    # Whether making the strategy installs kd's Keras hooks (the default
    # strategy changes nothing in Keras).
    _installs_keras_hooks = True

    def __init__(self, engine: ReplicaEngine):
        self._engine = engine
        if self._installs_keras_hooks:
            from keras_distribute import integration

            integration.install()
        if engine.process_count > 1:
            context.register_job_strategy(self)

    @property
    def engine(self) -> ReplicaEngine:
        """The backend engine that runs this strategy (see
        `keras_distribute.backend.interface.ReplicaEngine`).

        For code built on kd (checkpoints, callbacks, collectives) that
        needs the engine's devices, process index or collectives; a Keras
        program needs none of it. Check an optional capability with
        `isinstance(strategy.engine, interface.<Protocol>)`.

        Returns:
            The engine, the same object for the strategy's whole life.

        Example:

        >>> strategy = kd.MirroredStrategy()
        >>> strategy.engine.process_id
        0
        """
        return self._engine

    def _set_communication_options(self, options: Any) -> None:
        """Checks `options` (a `kd.CommunicationOptions` or None) and hands
        the engine what it honours (the gradient compression)."""
        from keras_distribute.common.cross_device_ops import (
            checked_communication_options,
        )

        options = checked_communication_options(options)
        if options.compression is not None:
            self._engine.set_gradient_compression(options.compression)
        self._communication_options = options

    @property
    def communication_options(self):
        """The `kd.CommunicationOptions` this strategy runs with."""
        return getattr(self, "_communication_options", None)

    # ------------------------------------------------------------------ info
    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas that are kept in sync."""
        return self._engine.num_replicas

    @property
    def device_mesh(self):
        """The `keras.distribution.DeviceMesh` of this strategy."""
        return self._engine.device_mesh

    @property
    def distribution(self):
        """The `keras.distribution.Distribution` this strategy drives.

        `None` on backends where Keras has no distribution implementation.
        """
        return self._engine.distribution

    @property
    def cluster_resolver(self):
        """The cluster resolver; `None` for single-process strategies."""
        return None

    @property
    def extended(self) -> "StrategyExtended":
        """Less common operations, as `tf.distribute.StrategyExtended`."""
        return StrategyExtended(self)

    def __repr__(self) -> str:
        from keras_distribute.backend import get_backend

        names = [get_backend().device_name(d) for d in self._engine.devices]
        return f"<{type(self).__name__} devices={names}>"

    def describe_layout(self, model: Model,
                        print_fn: Optional[Callable] = print
                        ) -> LayoutDescription:
        """Prints how each variable of `model` is laid out over the devices.

        Args:
            model: A built Keras model (or layer).
            print_fn: Where the table goes. Defaults to `print`; `None`
                prints nothing (the table is returned).

        Returns:
            The table (a `str`): each variable's path, shape, layout (one
            mesh axis or `None` per dimension) and bytes per device, then
            the total. It also draws itself: `.to_html()` gives the mesh
            with the bytes each device holds and the heaviest variables
            (in Jupyter, a cell that ends with it shows that picture).

        Raises:
            TypeError: if `model` has no `weights` (not a Keras layer).

        Example:

        ```python
        strategy.describe_layout(model)
        # sequential/dense/kernel  (16, 32)  (None, 'model')  1.0 KiB
        ```
        """
        if not hasattr(model, "weights"):
            raise TypeError(
                "Expected `model` to be a built Keras model or layer. "
                f"Received: {type(model).__name__}. Pass the model whose "
                "variables to describe.")
        rows, table = [], []
        replicated = 0
        for variable in model.weights:
            axes, nbytes = self._engine.variable_layout(variable)
            shape = tuple(variable.shape)
            replicated += nbytes_of(shape, str(variable.dtype))
            rows.append((variable.path, tuple(axes), nbytes))
            table.append((variable.path, str(shape), str(tuple(axes)),
                          human_bytes(nbytes)))
        total = sum(row[2] for row in rows)
        header = ("variable", "shape", "layout", "bytes/device")
        widths = [max(len(r[i]) for r in table + [header]) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                 for row in [header] + table]
        mesh = self.device_mesh
        lines.append(f"total per device: {human_bytes(total)} over "
                     f"{self.num_replicas_in_sync} replica(s), mesh "
                     f"{getattr(mesh, 'shape', None)}")
        description = LayoutDescription(
            "\n".join(lines), rows,
            getattr(mesh, "axis_names", None) or ["batch"],
            getattr(mesh, "shape", None) or [self.num_replicas_in_sync],
            replicated)
        if print_fn is not None:
            print_fn(str(description))
        return description

    # ----------------------------------------------------------------- scope
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Makes this strategy current and distributes variables made inside.

        Every variable created in the scope (model, optimizer, metrics, and
        layers built later on first call) is laid out over the strategy's
        devices. A model created in the scope remembers the strategy:
        `compile`, `fit`, `evaluate` and `predict` distribute wherever they
        are called. Re-entering the scope of the same strategy is fine.

        Yields:
            This strategy.

        Raises:
            ValueError: when entered inside another strategy's scope.

        Example:

        ```python
        strategy = kd.MirroredStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.layers.Dense(10)])
            model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=64)   # 64 is the global batch size
        ```
        """
        current = context.get_strategy() if context.has_strategy() else None
        if current is not None and current is not self:
            raise ValueError(
                "Mixing different strategies is not allowed: "
                f"{self!r}.scope() was entered inside the scope of "
                f"{current!r}. Leave the first scope before entering the "
                "second one, or use one strategy."
            )
        if context.get_replica_context() is not None and current is self:
            # Inside `run`: keep the replica context, nothing to set up.
            yield self
            return
        with context._enter(self), self._engine.scope():
            yield self

    @contextlib.contextmanager
    def enter_replica(self, replica_id_in_sync_group: Any, collectives: Any
                      ) -> Iterator[context.ReplicaContext]:
        """Makes this strategy's replica context for one replica and enters
        it: what `kd.get_replica_context()` returns while a replica's `fn`
        runs. Engines call it inside `run`, around each replica's call; the
        context is left on exit, also on an error.

        Args:
            replica_id_in_sync_group: The replica's id (a traced integer
                inside a compiled step).
            collectives: The engine's object that performs the replica's
                `all_reduce` and `all_gather`.

        Returns:
            A context manager giving the `kd.ReplicaContext`.

        Example:

        ```python
        with strategy.enter_replica(0, collectives) as ctx:
            fn()  # kd.get_replica_context() is ctx
        ```
        """
        replica_context = context.ReplicaContext(
            self, replica_id_in_sync_group, collectives)
        with context._enter(self, replica_context):
            yield replica_context

    # ------------------------------------------------------------------- run
    def run(self, fn: Callable, args: tuple = (),
            kwargs: Optional[dict] = None) -> Any:
        """Runs `fn` once per replica, each on its slice of the inputs.

        `PerReplica` leaves of `args`/`kwargs` (from a distributed dataset or
        `experimental_distribute_values_from_function`) give each replica its
        own component; any other value is passed to every replica. Inside
        `fn`, `kd.get_replica_context()` gives the replica id and the
        collectives.

        Args:
            fn: The function to run on each replica.
            args: Positional arguments for `fn`. Defaults to `()`.
            kwargs: Keyword arguments for `fn`. Defaults to `None`.

        Returns:
            `fn`'s result with every tensor leaf a `kd.PerReplica`; where this
            process has one replica (every PyTorch process, a one-device
            strategy), the plain values, as tf.distribute returns them there
            (`loss.item()` works; `reduce`, `gather` and
            `experimental_local_results` take them as that replica's).

        Raises:
            RuntimeError: if called inside another `run`.

        Example:

        ```python
        dist_dataset = strategy.experimental_distribute_dataset(dataset)
        for x in dist_dataset:
            per_replica = strategy.run(lambda x: x * 2, args=(x,))
        ```
        """
        if context.get_replica_context() is not None and context.has_strategy():
            raise RuntimeError(
                "`strategy.run` was called inside `strategy.run` (replica "
                "context). Call the inner function directly instead."
            )
        if not callable(fn):
            raise ValueError(
                f"Expected `fn` to be callable. Received: fn={fn!r}."
            )
        if not isinstance(args, (tuple, list)):
            raise ValueError(
                "Expected `args` to be a tuple of positional arguments. "
                f"Received: args of type {type(args).__name__}. Wrap a "
                "single argument as `args=(x,)`."
            )
        with self.scope():
            result = self._engine.run(self, fn, tuple(args),
                                      dict(kwargs or {}))
        if not self._one_local_replica():
            return result
        return _tree().map_structure(
            lambda leaf: leaf.values[0] if isinstance(leaf, PerReplica)
            else leaf, result)

    def _one_local_replica(self) -> bool:
        """Whether this process holds one replica: its plain values are
        that replica's components (tf.distribute's rule)."""
        return len(self._engine.local_replica_ids) == 1

    # ---------------------------------------------------- cross-replica ops
    def _check_cross_replica(self, name: str) -> None:
        if context.get_replica_context() is not None and context.has_strategy():
            raise RuntimeError(
                f"`strategy.{name}` must be called in cross-replica context "
                "(outside `strategy.run`). Inside `run`, use "
                f"`kd.get_replica_context().all_reduce` or `.all_gather`."
            )

    def reduce(self, reduce_op: "ReduceOp | str", value: Any,
               axis: Optional[int] = None) -> Any:
        """Combines a per-replica value across replicas.

        With `axis=None` the replicas' values are combined element-wise; with
        `axis=0` the batch dimension is reduced as well, and `MEAN` divides by
        the true number of examples, also for an unevenly split last batch.

        Args:
            reduce_op: `kd.ReduceOp.SUM` / `MEAN`, or `"sum"` / `"mean"`.
            value: A `PerReplica` (or nested structure of them) from `run`.
                A plain value is this process's replica's value where the
                process has one replica (what `run` returns there), else the
                same value on every replica.
            axis: The dimension to reduce within each replica's value, or
                `None`. Defaults to `None`.

        Returns:
            The reduced value (same structure as `value`).

        Raises:
            ValueError: on an unknown `reduce_op`, or `SUM` of a plain value
                over several replicas (its per-replica parts are unknown).
            RuntimeError: if called inside `run`.

        Example:

        ```python
        per_replica = strategy.run(
            lambda: kd.get_replica_context().replica_id_in_sync_group)
        strategy.reduce("SUM", per_replica, axis=None)   # 0 + 1 = 1 on 2
        ```
        """
        op = ReduceOp.from_value(reduce_op)
        self._check_cross_replica("reduce")
        check_reduce_axis(axis)
        value = self._engine.from_native(value)

        def reduce_leaf(leaf):
            if isinstance(leaf, PerReplica):
                return self._engine.reduce(op, leaf.values, axis)
            return self._reduce_plain(op, leaf, axis)

        return _tree().map_structure(reduce_leaf, value)

    def _reduce_plain(self, op: ReduceOp, value: Any, axis: Optional[int]):
        if self._one_local_replica():  # this replica's value (as `run`'s)
            return self._engine.reduce(op, [value], axis)
        if axis is not None:
            # The same value on every replica: one copy per local replica.
            return self._engine.reduce(
                op, [value] * len(self._engine.local_replica_ids), axis
            )
        if op is ReduceOp.MEAN or self.num_replicas_in_sync == 1:
            return value
        raise ValueError(
            "Cannot SUM a value that is not per-replica across "
            f"{self.num_replicas_in_sync} replicas: its per-replica parts are "
            f"unknown. Received: value of type {type(value).__name__}. Pass "
            "the `PerReplica` result of `strategy.run`, or use `MEAN`."
        )

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates a per-replica value along `axis`, on this host.

        Args:
            value: A `PerReplica` (or nested structure of them); components
                may differ in size along `axis` only. Where this process has
                one replica, a plain value is that replica's.
            axis: The dimension to concatenate along.

        Returns:
            The concatenation (same structure as `value`); a plain value is
            returned unchanged where this process has several replicas.

        Raises:
            RuntimeError: if called inside `run`.

        Example:

        ```python
        values = strategy.experimental_distribute_values_from_function(
            lambda _: np.array([[1], [2]]))
        strategy.gather(values, axis=0).shape   # (2 * num_replicas, 1)
        ```
        """
        self._check_cross_replica("gather")
        value = self._engine.from_native(value)

        one = self._one_local_replica()

        def gather_leaf(leaf):
            if isinstance(leaf, PerReplica):
                return self._engine.gather(leaf.values, axis)
            return self._engine.gather([leaf], axis) if one and (
                leaf is not None) else leaf

        return _tree().map_structure(gather_leaf, value)

    def check_replicas_agree(self, model: Model) -> None:
        """Checks that every replica holds the same trainable state.

        Compares every copy of `model`'s trainable variables and of its
        optimizer's variables, on every replica of every process (a
        fingerprint of each copy's bytes; one small all-gather across
        processes). A distributed `fit` runs the same check at the end of
        every epoch (see `kd.set_divergence_check`). Call it in every
        process at the same point, e.g. after a custom training loop.

        Args:
            model: A built Keras model created under this strategy.

        Raises:
            kd.ReplicasDivergedError: naming the first variable whose
                copies differ, in every process alike.

        Example:

        ```python
        for x, y in dataset:
            strategy.run(step, args=(x, y))
        strategy.check_replicas_agree(model)
        ```
        """
        from keras_distribute.training import divergence

        divergence.check_replicas_agree(self._engine, model)

    def experimental_local_results(self, value: Any) -> tuple:
        """Returns this process's per-replica components, as a tuple.

        Args:
            value: A `PerReplica` or nested structure of them, a variable
                created in the scope, or a plain value.

        Returns:
            A tuple with one entry per local replica (a nested structure is
            returned once per replica); `(value,)` for a plain value.

        Example:

        ```python
        result = strategy.run(lambda: 1.0)
        strategy.experimental_local_results(result)   # (1.0, 1.0) on 2
        ```
        """
        value = self._engine.from_native(value)
        if isinstance(value, PerReplica):
            return value.values
        tree = _tree()
        leaves = tree.flatten(value)
        if any(isinstance(leaf, PerReplica) for leaf in leaves):
            return tuple(
                tree.map_structure(
                    lambda leaf, i=i: leaf.values[i]
                    if isinstance(leaf, PerReplica) else leaf,
                    value,
                )
                for i in range(self.num_replicas_in_sync)
            )
        copies = self._engine.variable_local_results(value)
        return copies if copies is not None else (value,)

    # ------------------------------------------------------------------ input
    def experimental_distribute_dataset(self, dataset: Any,
                                        options: Optional[
                                            datasets.InputOptions] = None
                                        ) -> Any:
        """Splits each global batch of `dataset` across the replicas.

        Args:
            dataset: A `tf.data.Dataset`, a `keras.utils.PyDataset` or any
                iterable of nested arrays whose leading dimension is the
                global batch.
            options: Optional `kd.InputOptions`.

        Returns:
            A `kd.DistributedDataset`; each element is the dataset's element
            with every array leaf a `PerReplica` of per-replica slices.

        Raises:
            ValueError: if `options` is not a `kd.InputOptions`.

        Example:

        ```python
        dataset = tf.data.Dataset.range(4).batch(2)
        for x in strategy.experimental_distribute_dataset(dataset):
            strategy.run(lambda x: x * 2, args=(x,))
        # on 2 replicas: ([0], [2]) then ([4], [6])
        ```
        """
        options = self._check_options(options)
        native = self._engine.distribute_dataset(dataset, options)
        if native is not None:
            return native
        return datasets.DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable,
                                          options: Optional[
                                              datasets.InputOptions] = None
                                          ) -> Any:
        """Builds the input pipeline(s) with `dataset_fn(input_context)`.

        Args:
            dataset_fn: Called once per input pipeline with a
                `kd.InputContext`; returns a dataset batched with the
                per-replica batch size.
            options: Optional `kd.InputOptions`.

        Returns:
            A distributed dataset; consecutive elements go to consecutive
            replicas.

        Raises:
            ValueError: if `dataset_fn` is not callable.

        Example:

        ```python
        def dataset_fn(ctx):
            batch = ctx.get_per_replica_batch_size(64)
            return dataset.shard(ctx.num_input_pipelines,
                                 ctx.input_pipeline_id).batch(batch)
        dist = strategy.distribute_datasets_from_function(dataset_fn)
        ```
        """
        if not callable(dataset_fn):
            raise ValueError(
                "Expected `dataset_fn` to be a callable taking a "
                "`kd.InputContext` and returning a dataset. Received: "
                f"dataset_fn={dataset_fn!r}."
            )
        options = self._check_options(options)
        input_context = InputContext(
            num_input_pipelines=self._num_input_pipelines(),
            input_pipeline_id=self._input_pipeline_id(),
            num_replicas_in_sync=self.num_replicas_in_sync,
        )
        made = {}

        def dataset_fn_once(ctx):
            # An engine may look at what `dataset_fn` makes before choosing
            # its own pipeline (TF: a tf.data.Dataset) or this one (arrays,
            # lists of batches): `dataset_fn` still runs once per pipeline.
            if ctx.input_pipeline_id not in made:
                made[ctx.input_pipeline_id] = dataset_fn(ctx)
            return made[ctx.input_pipeline_id]

        native = self._engine.distribute_datasets_from_function(
            dataset_fn_once, options, input_context)
        if native is not None:
            return native
        return datasets.DistributedDatasetsFromFunction(
            self, dataset_fn_once, input_context, options
        )

    def experimental_distribute_datasets_from_function(
            self, dataset_fn: Callable,
            options: Optional[datasets.InputOptions] = None) -> Any:
        """The former name of `distribute_datasets_from_function` (TF 2.3),
        which tf.distribute still accepts; the same call.

        Example:

        ```python
        dist = strategy.experimental_distribute_datasets_from_function(
            dataset_fn)
        ```
        """
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable
                                                     ) -> Any:
        """Builds a `PerReplica` from `value_fn(kd.ValueContext)` per replica.

        Args:
            value_fn: Called once per replica with a `kd.ValueContext`;
                returns that replica's value (a tensor, array, number or
                nested structure of them).

        Returns:
            The values, with every leaf a `PerReplica`.

        Raises:
            ValueError: if `value_fn` is not callable.

        Example:

        ```python
        array_value = np.array([3., 2., 1.])
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: array_value[ctx.replica_id_in_sync_group])
        strategy.experimental_local_results(values)   # (3.0, 2.0) on 2
        ```
        """
        if not callable(value_fn):
            raise ValueError(
                "Expected `value_fn` to be a callable taking a "
                f"`kd.ValueContext`. Received: value_fn={value_fn!r}."
            )
        structures = [
            value_fn(context.ValueContext(i, self.num_replicas_in_sync))
            for i in self._engine.local_replica_ids
        ]
        return self._engine.put_per_replica(structures, on_device=True)

    def _check_options(self, options):
        if options is not None and not isinstance(options,
                                                  datasets.InputOptions):
            raise ValueError(
                "Expected `options` to be a `kd.InputOptions`. Received: "
                f"options of type {type(options).__name__}."
            )
        return options

    def _num_input_pipelines(self) -> int:
        return self._engine.num_input_pipelines

    def _input_pipeline_id(self) -> int:
        return self._engine.input_pipeline_id

    def _default_replica_context(self):
        raise NotImplementedError
