"""Which strategy is current, and whether code runs per replica.

Mirrors `tf.distribute`'s contexts: outside any `scope()` the *default*
strategy (one replica) is current and code runs in its replica context;
inside `strategy.scope()` code runs in the *cross-replica* context; inside
`strategy.run(fn)`, `fn` runs in a *replica* context. The stack is
thread-local, like Keras' own global state.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Tuple

from keras_distribute.common.reduce_op import ReduceOp

if TYPE_CHECKING:
    from keras import Model

_state = threading.local()
_default_strategy_factory: Optional[Callable[[], Any]] = None
_default_strategy: Any = None
# (strategy, replica context or None): the innermost is current.
_Entry = Tuple[Any, Optional["ReplicaContext"]]


def _stack() -> List[_Entry]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    stack: List[_Entry] = _state.stack
    return stack


def _register_default_strategy_factory(factory: Callable[[], Any]) -> None:
    global _default_strategy_factory
    _default_strategy_factory = factory


def _get_default_strategy() -> Any:
    global _default_strategy
    if _default_strategy is None:
        if _default_strategy_factory is None:
            raise RuntimeError(
                "The default strategy is made by `keras_distribute.strategies"
                ".default`, which `import keras_distribute` registers. "
                "Received a request for it before that import: import "
                "keras_distribute first.")
        _default_strategy = _default_strategy_factory()
    return _default_strategy


@contextlib.contextmanager
def _enter(strategy: Any, replica_context: Optional["ReplicaContext"] = None
           ) -> Iterator[None]:
    """Pushes `(strategy, replica_context)`; pops it on exit, always."""
    stack = _stack()
    stack.append((strategy, replica_context))
    try:
        yield
    finally:
        stack.pop()


def _current_entry() -> Optional[_Entry]:
    stack = _stack()
    return stack[-1] if stack else None


def model_strategy(model: Model) -> Any:
    """The strategy `model` was created under (recorded by the Keras
    integration when the model is made inside a `scope()`), or `None`."""
    return getattr(model, "__dict__", {}).get("_kd_strategy")


_job_strategies: list = []  # weak references, oldest first


def register_job_strategy(strategy: Any) -> None:
    """Records a strategy spanning several processes (`latest_job_strategy`)."""
    _job_strategies[:] = [r for r in _job_strategies
                          if r() is not None] + [weakref.ref(strategy)]


def latest_job_strategy() -> Any:
    """The most recent live strategy spanning several processes, if any.

    A collective over the job (e.g. a checkpoint of objects that carry no
    strategy, saved outside every scope) runs on it rather than on the
    single-process default strategy, whose every process would act as the
    chief.
    """
    for reference in reversed(_job_strategies):
        strategy = reference()
        if strategy is not None:
            return strategy
    return None


def get_strategy() -> Any:
    """Returns the current strategy.

    Inside `strategy.scope()` or `strategy.run(...)` this is that strategy;
    elsewhere it is the default strategy, which has one replica and runs
    everything in place.

    Returns:
        A `kd.Strategy`.

    Example:

    >>> import keras_distribute as kd
    >>> kd.get_strategy().num_replicas_in_sync
    1
    """
    entry = _current_entry()
    return entry[0] if entry else _get_default_strategy()


def has_strategy() -> bool:
    """Returns `True` inside the scope (or `run`) of a non-default strategy.

    Example:

    >>> import keras_distribute as kd
    >>> kd.has_strategy()
    False
    """
    return _current_entry() is not None


def in_cross_replica_context() -> bool:
    """Returns `True` inside a `scope()` but outside `run`.

    Example:

    >>> import keras_distribute as kd
    >>> kd.in_cross_replica_context()
    False
    """
    entry = _current_entry()
    return entry is not None and entry[1] is None


def get_replica_context() -> Optional["ReplicaContext"]:
    """Returns the current `ReplicaContext`, or `None` in cross-replica context.

    Inside the function given to `strategy.run` this gives the replica's
    id (`replica_id_in_sync_group`), `num_replicas_in_sync` and the
    collectives `all_reduce` and `all_gather`. Outside any strategy it
    returns the default strategy's replica context (one replica); inside
    `strategy.scope()` but outside `run` it returns `None`.

    Returns:
        A `kd.ReplicaContext`, or `None`.

    Example:

    >>> import keras_distribute as kd
    >>> kd.get_replica_context().num_replicas_in_sync
    1
    """
    entry = _current_entry()
    if entry is None:
        default: ReplicaContext = (
            _get_default_strategy()._default_replica_context())
        return default
    return entry[1]


def replica_context_of(caller: str) -> "ReplicaContext":
    """The current `ReplicaContext`, for a call that runs per replica.

    Args:
        caller: What needs it, for the error (e.g. `"apply_gradients"`).

    Returns:
        The `kd.ReplicaContext` of the replica running now.

    Raises:
        RuntimeError: in cross-replica context (in `strategy.scope()` but
            outside `strategy.run`).

    Example:

    >>> import keras_distribute as kd
    >>> from keras_distribute.common import context
    >>> context.replica_context_of("example").replica_id_in_sync_group
    0
    """
    replica_context = get_replica_context()
    if replica_context is None:
        raise RuntimeError(
            f"{caller} runs once per replica: it was called in cross-replica "
            "context (inside `strategy.scope()`, outside `strategy.run`). "
            f"Call it from the function given to `strategy.run`.")
    return replica_context


class ValueContext:
    """Tells `value_fn` which replica it makes a value for.

    Passed to the `value_fn` of
    `strategy.experimental_distribute_values_from_function`.

    Args:
        replica_id_in_sync_group: The replica the value is for.
            Defaults to `0`.
        num_replicas_in_sync: The number of replicas. Defaults to `1`.

    Example:

    >>> ctx = ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    >>> ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync
    0.5
    """

    def __init__(self, replica_id_in_sync_group: int = 0,
                 num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"<ValueContext replica_id_in_sync_group="
            f"{self.replica_id_in_sync_group}, num_replicas_in_sync="
            f"{self.num_replicas_in_sync}>"
        )


class ReplicaContext:
    """What code running on one replica can ask and do.

    Get it with `kd.get_replica_context()` inside `strategy.run(fn)`.

    Args:
        strategy: The strategy running the replica.
        replica_id_in_sync_group: The replica's id, from `0` to
            `num_replicas_in_sync - 1`. Inside a compiled (SPMD) step this is
            a traced integer rather than a Python `int`.
        collectives: The backend object that performs `all_reduce` and
            `all_gather` across the replicas.

    Example:

    ```python
    def step_fn():
        ctx = kd.get_replica_context()
        return ctx.all_reduce("sum", 1.0)   # == num_replicas_in_sync
    strategy.run(step_fn)
    ```
    """

    def __init__(self, strategy: Any, replica_id_in_sync_group: Any,
                 collectives: Any):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._collectives = collectives

    @property
    def strategy(self) -> Any:
        """The strategy that runs this replica."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's id, in `[0, num_replicas_in_sync)`."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas kept in sync."""
        return int(self._strategy.num_replicas_in_sync)

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any) -> Any:
        """Combines `value` (a nested structure) across all replicas.

        Every replica must call it, with the same structure and shapes.

        Args:
            reduce_op: `kd.ReduceOp.SUM` / `MEAN`, or `"sum"` / `"mean"`.
            value: A tensor or a nested structure of tensors.

        Returns:
            The combined value, the same on every replica.

        Raises:
            ValueError: if `reduce_op` is not a reduce operation.

        Example:

        ```python
        # Replica 0: {"a": 1., "b": [40., 1.]}; replica 1: {"a": 3., ...}
        ctx.all_reduce("sum", value)   # {"a": 4., "b": [42., 99.]}
        ```
        """
        op = ReduceOp.from_value(reduce_op)
        return self._collectives.all_reduce(op, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates `value` from all replicas along `axis`.

        Args:
            value: A tensor or a nested structure of tensors; ranks must
                agree across replicas.
            axis: The dimension to concatenate along.

        Returns:
            The concatenation, the same on every replica.

        Example:

        ```python
        ctx.all_gather(np.array([1, 2, 3]), axis=0)  # [1, 2, 3, 1, 2, 3] on 2
        ```
        """
        return self._collectives.all_gather(value, axis)

    def __repr__(self) -> str:
        return (
            f"<ReplicaContext replica_id_in_sync_group={self._replica_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync}>"
        )
