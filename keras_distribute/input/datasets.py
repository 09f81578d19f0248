"""Input pipelines for distributed training.

A distributed dataset turns each element of a global-batch dataset into one
`PerReplica` value per leaf, each replica getting its slice of the batch. A
short last batch is split in replica order with the per-replica batch size
(e.g. 6 rows over 2 replicas of 4 become 4 + 2), exactly as `tf.distribute`
splits it.
"""

import dataclasses
import enum
import math
from typing import Any
from typing import Callable
from typing import Dict
from typing import Iterator
from typing import Optional

from keras_distribute.common.input_context import InputContext
from keras_distribute.input.data_sources import batch_size_of
from keras_distribute.input.data_sources import check_source
from keras_distribute.input.data_sources import open_source
from keras_distribute.input.data_sources import per_replica_spec
from keras_distribute.input.data_sources import split_batch
from keras_distribute.input.iterator import DistributedIterator


class AutoShardPolicy(enum.IntEnum):
    """How a dataset is split between workers (input pipelines).

    - `AUTO`: by file where the dataset reads files, else by element.
    - `FILE`: each worker reads its own subset of files.
    - `DATA`: each worker reads everything and keeps every N-th element.
    - `OFF`: no sharding; every worker sees the whole dataset.

    With a single worker every policy reads the whole dataset.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class InputReplicationMode(enum.Enum):
    """Whether each worker (`PER_WORKER`) or replica gets a pipeline."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for `experimental_distribute_dataset` and friends.

    Args:
        experimental_fetch_to_device: Whether per-replica values are placed
            on the replica's device (`True`) or stay on the host (`False`).
            Defaults to `True`.
        experimental_replication_mode: `InputReplicationMode.PER_WORKER`
            (one pipeline per worker, the default) or `PER_REPLICA`.
        experimental_place_dataset_on_device: Kept for compatibility with
            `tf.distribute`; requires `PER_REPLICA` and no fetch to device.
            Defaults to `False`.
        experimental_per_replica_buffer_size: How many elements are prepared
            ahead per replica. Defaults to `1`.

    Raises:
        ValueError: on a combination that `tf.distribute` also refuses.

    Example:

    >>> InputOptions(experimental_fetch_to_device=False)
    InputOptions(experimental_fetch_to_device=False, ...)  # doctest: +ELLIPSIS
    """

    experimental_fetch_to_device: Optional[bool] = None
    experimental_replication_mode: InputReplicationMode = (
        InputReplicationMode.PER_WORKER
    )
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self):
        mode = self.experimental_replication_mode
        if not isinstance(mode, InputReplicationMode):
            raise ValueError(
                "Expected `experimental_replication_mode` to be a "
                "`kd.InputReplicationMode`. Received: "
                f"experimental_replication_mode={mode!r}."
            )
        if self.experimental_place_dataset_on_device and (
            mode is not InputReplicationMode.PER_REPLICA
            or self.experimental_fetch_to_device
        ):
            raise ValueError(
                "`experimental_place_dataset_on_device=True` requires "
                "`experimental_replication_mode=InputReplicationMode."
                "PER_REPLICA` and `experimental_fetch_to_device=False`. "
                f"Received: experimental_replication_mode={mode}, "
                "experimental_fetch_to_device="
                f"{self.experimental_fetch_to_device}."
            )
        size = self.experimental_per_replica_buffer_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(
                "Expected `experimental_per_replica_buffer_size` to be a "
                f"positive int. Received: {size!r}."
            )

    @property
    def fetch_to_device(self) -> bool:
        return self.experimental_fetch_to_device is not False


def shard_policy(dataset: Any) -> AutoShardPolicy:
    """The `AutoShardPolicy` a `tf.data` dataset's options ask for (else
    AUTO)."""
    if hasattr(dataset, "options") and hasattr(dataset, "element_spec"):
        policy = dataset.options().experimental_distribute.auto_shard_policy
        return AutoShardPolicy(int(policy))
    return AutoShardPolicy.AUTO


def _files_of_this_worker(dataset: Any, num_workers: int, index: int) -> Any:
    """tf.data's own FILE sharding: this worker reads only its files."""
    from tensorflow.python.data.experimental.ops import distribute

    return distribute._AutoShardDataset(dataset, num_workers, index)


class DistributedDataset:
    """A dataset whose elements are split across the replicas.

    Made by `strategy.experimental_distribute_dataset`; iterate it and pass
    each element to `strategy.run`.

    With several workers (input pipelines) the dataset's `AutoShardPolicy`
    (`tf.data.Options().experimental_distribute.auto_shard_policy`) decides
    what each worker reads:

    - `AUTO`, `DATA`: every worker reads the dataset; each global batch is
      split across all replicas of all workers, so a step equals one device
      on that batch.
    - `FILE` (`tf.data` reading files): each worker reads only its files
      and splits its own batches across its replicas.
    - `OFF`: every worker reads the whole dataset and splits each batch
      across its own replicas.

    Args:
        strategy: The strategy whose replicas receive the data.
        dataset: The global-batch dataset.
        options: Optional `kd.InputOptions`.
    """

    def __init__(self, strategy: Any, dataset: Any,
                 options: Optional[InputOptions] = None):
        check_source(dataset)
        self._strategy = strategy
        self._dataset = dataset
        self._options = options or InputOptions()

    @property
    def element_spec(self) -> Any:
        """The spec of each step's values: the `tf.data` element spec with
        an unknown batch dimension, each leaf a `PerReplica` of the local
        replicas' specs when there are several (as tf.distribute's
        `PerReplicaSpec`).

        Raises:
            ValueError: if the dataset is not a `tf.data.Dataset`.
        """
        return per_replica_spec(
            self._dataset, len(self._strategy.engine.local_replica_ids))

    def __iter__(self) -> "DistributedIterator":
        engine = self._strategy.engine
        dataset, local_ids = self._dataset, engine.local_replica_ids
        per_worker = False
        if engine.num_input_pipelines > 1:
            policy = shard_policy(dataset)
            if policy is AutoShardPolicy.FILE:
                dataset = _files_of_this_worker(
                    dataset, engine.num_input_pipelines,
                    engine.input_pipeline_id)
            per_worker = policy in (AutoShardPolicy.FILE, AutoShardPolicy.OFF)
        # A worker's own batches go to its replicas only.
        num_replicas = len(local_ids) if per_worker else (
            self._strategy.num_replicas_in_sync)
        positions = range(len(local_ids)) if per_worker else local_ids
        elements, data_iterator = open_source(dataset)
        # The per-replica batch size a short last batch is split with: kept
        # in a dict a checkpoint of the iterator saves and restores.
        split: Dict[str, Optional[int]] = {"per_replica": None}

        def steps():
            for element in elements:
                batch = batch_size_of(element)
                per_replica = split["per_replica"]
                if per_replica is None or batch > per_replica * num_replicas:
                    per_replica = split["per_replica"] = math.ceil(
                        batch / num_replicas)
                slices = split_batch(element, num_replicas, per_replica)
                yield engine.put_per_replica(
                    [slices[i] for i in positions],
                    on_device=self._options.fetch_to_device,
                )

        return DistributedIterator(self._strategy, steps(), data_iterator,
                                   split, lambda: self.element_spec)

    def __repr__(self) -> str:
        return (
            f"<DistributedDataset num_replicas="
            f"{self._strategy.num_replicas_in_sync}>"
        )


class DistributedDatasetsFromFunction:
    """Per-replica batches from a `dataset_fn`, one element per replica.

    Made by `strategy.distribute_datasets_from_function`. `dataset_fn` is
    called once per input pipeline with a `kd.InputContext`, and its dataset
    must already be batched with the per-replica batch size. Consecutive
    elements go to consecutive replicas; when the dataset runs out part-way
    through a step, the remaining replicas get empty batches.
    """

    def __init__(self, strategy, dataset_fn: Callable[[InputContext], Any],
                 input_context: InputContext,
                 options: Optional[InputOptions] = None):
        if not callable(dataset_fn):
            raise ValueError(
                "Expected `dataset_fn` to be a callable taking a "
                "`kd.InputContext` and returning a dataset. Received: "
                f"dataset_fn={dataset_fn!r}."
            )
        self._strategy = strategy
        self._dataset = dataset_fn(input_context)
        check_source(self._dataset)
        self._options = options or InputOptions()

    @property
    def element_spec(self) -> Any:
        """The spec of each step's values (see
        `DistributedDataset.element_spec`)."""
        return per_replica_spec(
            self._dataset, len(self._strategy.engine.local_replica_ids))

    def __iter__(self) -> "DistributedIterator":
        elements, data_iterator = open_source(self._dataset)
        return DistributedIterator(self._strategy, self._steps(elements),
                                   data_iterator, {},
                                   lambda: self.element_spec)

    def _steps(self, elements: Iterator[Any]) -> Iterator[Any]:
        import keras

        num_replicas = len(self._strategy.engine.local_replica_ids)
        group = []
        for element in elements:
            group.append(element)
            if len(group) == num_replicas:
                yield self._strategy.engine.put_per_replica(
                    group, on_device=self._options.fetch_to_device
                )
                group = []
        if group:
            empty = keras.tree.map_structure(
                lambda leaf: leaf if leaf is None else leaf[:0], group[0]
            )
            group += [empty] * (num_replicas - len(group))
            yield self._strategy.engine.put_per_replica(
                group, on_device=self._options.fetch_to_device
            )


def as_trainer_input(strategy: Any, data: Any, argument: str) -> Any:
    """What `fit` / `evaluate` / `predict` take for a distributed dataset
    of `strategy` (tf.distribute's Keras accepts one): the global batches it
    was made from. Other data is returned as it is.

    Args:
        strategy: The strategy of the model being trained.
        data: The `x` (or `validation_data`) given.
        argument: Its name, for errors.

    Returns:
        The dataset of global batches, or `data` itself.

    Raises:
        ValueError: for a distributed dataset of another strategy, or one
            from `distribute_datasets_from_function` that has several
            input pipelines or is not a `tf.data.Dataset`.
    """
    if not isinstance(data, (DistributedDataset,
                             DistributedDatasetsFromFunction)):
        return data
    if data._strategy is not strategy:
        raise ValueError(
            f"`{argument}` is a distributed dataset of another strategy "
            f"({data._strategy!r}) than the model's ({strategy!r}). "
            "Distribute it with the strategy the model was created under, "
            "or pass the dataset itself.")
    if isinstance(data, DistributedDataset):
        return data._dataset  # global batches, split by the strategy
    engine = strategy.engine
    num_replicas = len(engine.local_replica_ids)
    if engine.num_input_pipelines > 1 or not hasattr(data._dataset,
                                                     "rebatch"):
        raise ValueError(
            f"`{argument}` comes from `distribute_datasets_from_function`, "
            "whose batches are per replica; `fit`, `evaluate` and `predict` "
            "take global batches and split them themselves. Received one "
            f"with {engine.num_input_pipelines} input pipeline(s) over a "
            f"{type(data._dataset).__name__}. Pass the dataset batched with "
            "the global batch size (each process's `fit` reads it whole and "
            "takes its slice), or iterate the distributed dataset in a "
            "`strategy.run` loop.")
    per_replica = batch_size_of(next(iter(data._dataset.take(1))))
    # Consecutive per-replica batches make one step's global batch.
    return data._dataset.rebatch(per_replica * num_replicas)

