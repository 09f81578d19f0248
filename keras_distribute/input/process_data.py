"""Per-process slices of every global batch, for Keras `fit` in N processes.

Every process sees the whole input; this module hands Keras, in each process,
only that process's rows of every global batch (as a `keras.utils.PyDataset`)
and puts `predict` outputs back together in input order. The engine decides
how a batch is split (`engine.rows_to_feed(batch)` gives this process's
`(start, stop)` of the batch it feeds next, or the whole batch when it is
given whole to every process; `engine.split_rows` answers the same for any
pipeline and changes nothing), holds the settings of the call in progress
(`engine.trainer_call(...)`), shares the shuffling seed
(`engine.shared_seed()`) and gathers rows (`engine.gather_rows(array)`). No
framework is imported here.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Iterator
from typing import List
from typing import Optional

import keras
import numpy as np

from keras_distribute.backend import interface
from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.input.data_sources import iterate_source
from keras_distribute.job import peer_board
from keras_distribute.training import config as training_config
from keras_distribute.training import divergence
from keras_distribute.training import model_state

if TYPE_CHECKING:
    from keras import Model


def _is_arrays(x: Any) -> bool:
    leaves = keras.tree.flatten(x) if x is not None else []
    return bool(leaves) and all(
        isinstance(leaf, np.ndarray) or (
            hasattr(leaf, "__array__") and hasattr(leaf, "shape")
            and not hasattr(leaf, "element_spec"))
        for leaf in leaves)


def _take(structure: Any, index: Any) -> Any:
    return keras.tree.map_structure(
        lambda a: None if a is None else np.asarray(a)[index], structure)


def _pack(x, y, sample_weight):
    if sample_weight is not None:
        return (x, y, sample_weight)
    return (x,) if y is None else (x, y)


def check_cardinality(x: Any, y: Any = None, sample_weight: Any = None,
                      what: str = "") -> None:
    """Raises Keras' `ValueError` unless every array of `x`, `y` and
    `sample_weight` has the same number of rows.

    Keras checks this in `fit`; kd hands Keras each process's rows instead,
    so it checks first, in every process alike (every process sees the
    whole input): a mismatch otherwise failed in one process only, and the
    others aborted in their next collective.
    """
    sizes = {}
    for name, part in (("x", x), ("y", y), ("sample_weight", sample_weight)):
        leaves = [leaf for leaf in keras.tree.flatten(part)
                  if leaf is not None] if part is not None else []
        if leaves:
            sizes[name] = [int(np.shape(leaf)[0]) for leaf in leaves]
    if len({n for found in sizes.values() for n in found}) > 1:
        listed = "\n".join(f"'{name}' sizes: {', '.join(map(str, found))}"
                           for name, found in sizes.items())
        raise ValueError(
            f"Data cardinality is ambiguous{what}. Make sure all arrays "
            f"contain the same number of samples.\n{listed}")


class ArrayShards(keras.utils.PyDataset):
    """This process's slice of each global batch of in-memory arrays."""

    def __init__(self, engine, x, y, sample_weight, batch_size: int,
                 shuffle: bool):
        check_cardinality(x, y, sample_weight)
        super().__init__()
        self._engine = engine
        self._data = (x, y, sample_weight)
        self._num = keras.tree.flatten(x)[0].shape[0]
        self._batch = batch_size
        self._shuffle = shuffle
        self._order = np.arange(self._num)
        # Keras hands a step `x` itself when there is no `y` (its array
        # adapter); a PyDataset can only yield `(x,)`.
        self.bare_inputs = y is None and sample_weight is None and (
            not isinstance(x, (tuple, list)))
        self.batch_sizes = [
            min(batch_size, self._num - i * batch_size)
            for i in range(len(self))]

    def __len__(self) -> int:
        return math.ceil(self._num / self._batch)

    def __getitem__(self, index: int):
        if index == 0 and self._shuffle:
            # A new order each time an epoch starts, drawn (as Keras draws
            # its own) from the global numpy RNG, so `set_random_seed` and
            # a restored RNG state decide it; process 0's draw wins.
            seed = self._engine.shared_seed()
            self._order = np.random.default_rng(seed).permutation(self._num)
        rows = self._order[index * self._batch:(index + 1) * self._batch]
        start, stop = self._engine.rows_to_feed(len(rows))
        rows = rows[start:stop]
        x, y, sample_weight = (_take(part, rows) for part in self._data)
        return _pack(x, y, sample_weight)

    def splits_evenly(self) -> bool:
        n = self._engine.num_replicas
        return all(size % n == 0 for size in self.batch_sizes)


class SourceShards(keras.utils.PyDataset):
    """This process's slice of each global batch of a dataset or iterable."""

    def __init__(self, engine, source: Any):
        super().__init__()
        self._engine = engine
        self._source = source
        self._iterator: Optional[Iterator[Any]] = None
        self._next_index = 0
        self.batch_sizes: List[int] = []
        self._length = _length(source)
        # Whether the source yields `x` alone (not a tuple): Keras then
        # hands it to a step as it is; a PyDataset can only yield `(x,)`.
        self.bare_inputs = False

    @property
    def num_batches(self):
        return self._length

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this dataset has no known length")
        return self._length

    def __getitem__(self, index: int):
        iterator = self._iterator
        if index == 0 or iterator is None or index != self._next_index:
            iterator = self._iterator = iterate_source(self._source)
            self.batch_sizes = []
            for _ in range(index):
                next(iterator)
        element = next(iterator)
        self._next_index = index + 1
        leaves = [a for a in keras.tree.flatten(element) if a is not None]
        batch = leaves[0].shape[0]
        self.batch_sizes.append(batch)
        start, stop = self._engine.rows_to_feed(batch)
        local = _take(element, slice(start, stop))
        self.bare_inputs = not isinstance(local, (tuple, list))
        return tuple(local) if isinstance(local, (tuple, list)) else (local,)


def _length(source: Any):
    """The number of batches of `source`; a `tf.data` dataset whose
    cardinality tf.data does not know (after a `filter`, a keras-hub
    preprocessing `map` with ragged steps, `from_generator`) is counted once:
    Keras reads a `PyDataset` of unknown length as infinite, and ended the
    epoch with 'generator raised StopIteration' (torch's DataLoader)."""
    if hasattr(source, "cardinality"):
        count = int(source.cardinality())
        if count == -1:  # infinite: `steps_per_epoch` says where to stop
            return None
        if count < 0:
            import numpy

            count = int(source.reduce(numpy.int64(0), lambda n, _: n + 1))
        return count
    try:
        return len(source)
    except TypeError:
        return None


def _shard(engine, params: dict, shuffle: bool):
    x, y = params.get("x"), params.get("y")
    sample_weight = params.get("sample_weight")
    if _is_arrays(x):
        return ArrayShards(engine, x, y, sample_weight,
                           params.get("batch_size") or 32, shuffle)
    if y is not None or sample_weight is not None:
        raise ValueError(
            "`y` and `sample_weight` must be omitted when `x` is a dataset; "
            f"received y of type {type(y).__name__}. Put the targets in the "
            "dataset's elements.")
    return SourceShards(engine, x)


def _bind(method, model, args, kwargs) -> dict:
    bound = inspect.signature(method).bind(model, *args, **kwargs)
    params = dict(bound.arguments)
    params.pop(next(iter(params)))  # self
    params.update(params.pop("kwargs", {}))
    return params


def with_process_rules(engine: ReplicaEngine, method: Callable) -> Callable:
    """`method` (a Keras trainer method: `fit`, `evaluate`, ...) with what
    keeps a job's processes alike around it, for `engine.call_trainer`.

    Where `fit` runs in each process on its own rows (`engine
    .fit_per_process`: torch, JAX over several processes), each process is
    handed its share of the data (`call_sharded`). Where the framework feeds
    the replicas itself (TensorFlow, JAX in one process), every process
    trains the same model, takes the chief's non-trainable state after
    `fit` and before `evaluate`/`predict`, and only the chief's callbacks
    write files. In a single process both come to calling `method`.

    Args:
        engine: The strategy's engine.
        method: The unbound Keras method (`keras.Model.fit`, ...).

    Returns:
        A callable with `method`'s name and signature.

    Example:

    ```python
    fit = process_data.with_process_rules(strategy.engine, keras.Model.fit)
    strategy.engine.call_trainer(fit, model, (x, y), {"epochs": 2})
    ```
    """
    if engine.fit_per_process:
        def call(model: Model, *args: Any, **kwargs: Any) -> Any:
            return call_sharded(engine, method, model, args, kwargs)
    else:
        def call(model: Model, *args: Any, **kwargs: Any) -> Any:
            return _call_in_every_process(engine, method, model, args,
                                          kwargs)
    functools.update_wrapper(call, method)
    return call


def _call_in_every_process(engine: ReplicaEngine, method: Callable,
                           model: Model, args: tuple, kwargs: dict) -> Any:
    """`method` on the whole data in every process (the framework splits
    it), with one model state and the chief's files."""
    name = method.__name__
    callbacks = kwargs.get("callbacks", args[5] if len(args) > 5 else None)
    if name == "fit":
        training_config.check_same_training(engine, model)
    if name == "fit" and len(args) <= 5:
        kwargs = dict(kwargs, callbacks=model_state.with_chief_state(
            engine, divergence.with_divergence_check(
                engine, peer_board.counting_epochs(callbacks))))
    if name in ("evaluate", "predict"):
        model_state.take_chief_values(engine, model)
    with engine.keras_services.chief_only_writes(
            callbacks if name == "fit" else None, engine.process_id == 0):
        result = method(model, *args, **kwargs)
    if name == "fit":
        model_state.take_chief_values(engine, model)
    return result


def call_sharded(engine, method, model, args, kwargs) -> Any:
    """Calls a Keras trainer method with this process's share of the data."""
    name = method.__name__
    if name == "compile":
        return method(model, *args, **kwargs)
    params = _bind(method, model, args, kwargs)
    if name == "fit":
        return _fit(engine, method, model, params)
    if name in ("evaluate", "predict"):
        model_state.take_chief_values(engine, model)
    if name == "evaluate":
        params.pop("_use_cached_eval_dataset", None)
        data = _shard(engine, params, False)
        params.update(x=data, y=None, sample_weight=None, batch_size=None)
        with engine.trainer_call(step_inputs=data):
            return method(model, **params)
    if name == "predict":
        data = _shard(engine, params, False)
        params.update(x=data, batch_size=None)
        return _unshard(engine, method(model, **params), data.batch_sizes)
    if name in ("train_on_batch", "test_on_batch", "predict_on_batch"):
        return _on_batch(engine, method, model, params)
    return method(model, **params)


def _fit(engine, method, model, params: dict) -> Any:
    training_config.check_same_training(engine, model)
    x, y, sample_weight = (params.get(k) for k in ("x", "y", "sample_weight"))
    validation = params.get("validation_data")
    if isinstance(validation, (tuple, list)) and _is_arrays(validation):
        x_val, y_val, w_val = (list(validation[:3]) + [None, None])[:3]
        check_cardinality(x_val, y_val, w_val, what=" in `validation_data`")
    split = params.get("validation_split") or 0.0
    if split and params.get("validation_data") is None and _is_arrays(x):
        (x, y, sample_weight), params["validation_data"] = (
            _train_validation_split((x, y, sample_weight), split))
        params.update(x=x, y=y, sample_weight=sample_weight)
    data = _shard(engine, params, bool(params.get("shuffle", True)))
    params.update(x=data, y=None, sample_weight=None, batch_size=None,
                  shuffle=False, validation_split=0.0)
    # Collective: callback lists may differ by process (a chief-only
    # ModelCheckpoint), and one process all-reducing metrics every step
    # while another does not would hang both.
    sync_metrics_each_step = engine.any_process(_batch_logs_are_read(params))
    params["callbacks"] = model_state.with_chief_state(
        engine, divergence.with_divergence_check(
            engine, peer_board.counting_epochs(params.get("callbacks"))))
    with engine.trainer_call(
            even_batches=isinstance(data, ArrayShards)
            and data.splits_evenly(),
            step_inputs=data, sync_metrics_each_step=sync_metrics_each_step):
        with engine.keras_services.chief_only_writes(
                params.get("callbacks"), engine.process_id == 0,
                isinstance(engine, interface.ShardedForwardEngine)
                and engine.collective_reads):
            history = method(model, **params)
        model_state.take_chief_values(engine, model)
        # The chief's callback files (ModelCheckpoint & co.) are complete
        # before any process goes on to read them.
        engine.barrier("keras_distribute.fit_end")
        return history


def _train_validation_split(arrays, split: float):
    """The last `split` of the rows is validation data, as Keras' `fit`
    splits it (a deterministic cut, before any shuffling)."""
    rows = next(int(a.shape[0]) for a in keras.tree.flatten(arrays)
                if a is not None)
    cut = int(math.floor(rows * (1.0 - split)))
    if cut in (0, rows):
        raise ValueError(
            f"`validation_split={split}` leaves no training or no validation "
            f"rows of the {rows} samples. Received: validation_split={split}."
            " Pass more data or another split.")
    head = keras.tree.map_structure(
        lambda a: None if a is None else a[:cut], arrays)
    tail = keras.tree.map_structure(
        lambda a: None if a is None else a[cut:], arrays)
    return head, tail


def _is_default(method) -> bool:
    # Keras marks the base callbacks' no-op hooks `_is_default`.
    return getattr(method, "_is_default", False)


def _batch_logs_are_read(params: dict) -> bool:
    """Whether anything reads per-batch training logs (Keras' own test)."""

    if params.get("verbose", "auto") in (1, "auto"):
        return True  # the progress bar shows running values every batch
    callbacks = params.get("callbacks") or []
    if not isinstance(callbacks, (list, tuple)):
        return True  # a prepared CallbackList: assume the worst
    return any(
        not _is_default(callback.on_batch_end)
        or not _is_default(callback.on_train_batch_end)
        for callback in callbacks)


def _on_batch(engine, method, model, params: dict) -> Any:
    x = params["x"]
    check_cardinality(x, params.get("y"), params.get("sample_weight"))
    batch = keras.tree.flatten(x)[0].shape[0]
    start, stop = engine.rows_to_feed(batch)
    for key in ("x", "y", "sample_weight"):
        if params.get(key) is not None:
            params[key] = _take(params[key], slice(start, stop))
    if method.__name__ != "predict_on_batch":
        with engine.trainer_call(
                even_batches=batch % engine.num_replicas == 0):
            return method(model, **params)
    return _unshard(engine, method(model, **params), [batch])


def _given_whole(engine, batch: int) -> bool:
    """Whether every input pipeline gets the whole of a `batch`-row batch."""
    return engine.num_input_pipelines > 1 and all(
        engine.split_rows(batch, pipeline) == (0, batch)
        for pipeline in range(engine.num_input_pipelines))


def _unshard(engine, outputs: Any, batch_sizes: List[int]) -> Any:
    """Puts every input pipeline's predictions back in input order.

    A batch given whole to every pipeline (see `engine.split_rows`) is taken
    once, from pipeline 0. `engine.gather_rows` gives each pipeline's rows
    once, in pipeline order.
    """
    pipelines = engine.num_input_pipelines

    def sizes_of(pipeline: int) -> List[int]:
        sizes = []
        for batch in batch_sizes:
            start, stop = engine.split_rows(batch, pipeline)
            sizes.append(stop - start)
        return sizes

    def gather(local):
        everyone = engine.gather_rows(np.ascontiguousarray(local))
        per_pipeline, offset = [], 0
        for pipeline in range(pipelines):
            sizes = sizes_of(pipeline)
            per_pipeline.append(np.split(
                everyone[offset:offset + sum(sizes)], np.cumsum(sizes)[:-1]))
            offset += sum(sizes)
        pieces = []
        for index, batch in enumerate(batch_sizes):
            if _given_whole(engine, batch):
                pieces.append(per_pipeline[0][index])  # the same everywhere
            else:
                pieces += [per_pipeline[p][index] for p in range(pipelines)]
        return np.concatenate(pieces, axis=0)

    return keras.tree.map_structure(gather, outputs)
