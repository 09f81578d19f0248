"""Where distributed input comes from: reading a dataset of any kind
(`tf.data`, `PyDataset`, an iterable, a `DataLoader`) as numpy elements,
and splitting a global batch across replicas."""

from typing import Any
from typing import Iterable
from typing import Iterator
from typing import Optional
from typing import Tuple

import numpy as np


def _to_numpy(leaf: Any) -> Any:
    if leaf is None or isinstance(leaf, (str, bytes)):
        return leaf
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):
        leaf = leaf.detach().cpu()  # a torch.Tensor, maybe on a GPU
    if hasattr(leaf, "numpy") and not isinstance(leaf, np.ndarray):
        leaf = leaf.numpy()  # tf.Tensor, torch.Tensor
    return np.asarray(leaf)


def check_source(source: Any) -> None:
    """Raises `ValueError` unless `source` is a dataset we can iterate."""
    import keras

    if not isinstance(source, (Iterable, keras.utils.PyDataset)):
        raise ValueError(
            "Expected a `tf.data.Dataset`, a `keras.utils.PyDataset` or an "
            "iterable of (nested) arrays whose leading dimension is the "
            f"batch. Received: dataset of type {type(source).__name__}."
        )


def iterate_source(source: Any) -> Iterator[Any]:
    """Yields the elements of a dataset as nested numpy arrays.

    Accepts a `tf.data.Dataset`, a `keras.utils.PyDataset`, or any iterable
    (list, generator, `torch.utils.data.DataLoader`) of nested arrays.
    """
    elements, _ = open_source(source)
    return elements


def open_source(source: Any) -> Tuple[Iterator[Any], Optional[Any]]:
    """Starts reading a dataset (see `iterate_source`).

    Returns:
        The elements as nested numpy arrays, and the `tf.data` iterator
        they come from for a `tf.data` source (else `None`): its position
        is what a checkpoint of the reading saves.
    """
    import keras

    check_source(source)
    data_iterator = None
    if _is_tf_dataset(source):
        elements = source.as_numpy_iterator()
        data_iterator = getattr(elements, "_iterator", None)
    elif isinstance(source, keras.utils.PyDataset):
        elements = (source[i] for i in range(len(source)))
    else:
        elements = iter(source)
    return ((keras.tree.map_structure(_to_numpy, element)
             for element in elements), data_iterator)


def _is_tf_dataset(source: Any) -> bool:
    return hasattr(source, "as_numpy_iterator") and hasattr(
        source, "element_spec")


def per_replica_spec(source: Any, num_local_replicas: int) -> Any:
    """The spec of each step's values from `source`, as tf.distribute gives
    it: the `tf.data` element spec with the batch dimension unknown; with
    several local replicas each leaf is a `PerReplica` of their specs.

    Raises:
        ValueError: if `source` is not a `tf.data.Dataset`.
    """
    if not _is_tf_dataset(source):
        raise ValueError(
            "element_spec is known for a distributed tf.data.Dataset only. "
            f"Received a dataset of type {type(source).__name__}; look at "
            "one element instead.")
    import tensorflow as tf

    from keras_distribute.common.values import PerReplica

    def unbatched(spec):
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
            spec = tf.TensorSpec([None] + spec.shape.as_list()[1:],
                                 spec.dtype, spec.name)
        if num_local_replicas > 1:
            return PerReplica([spec] * num_local_replicas)
        return spec

    return tf.nest.map_structure(unbatched, source.element_spec)


def batch_size_of(element: Any) -> int:
    """The leading (batch) dimension every array of `element` shares.

    Raises:
        ValueError: if the arrays disagree or none has a batch dimension.
    """
    import keras

    sizes = {
        np.shape(leaf)[0]
        for leaf in keras.tree.flatten(element)
        if leaf is not None and np.ndim(leaf) > 0
    }
    if len(sizes) != 1:
        raise ValueError(
            "Every array of a dataset element must share the same leading "
            "(batch) dimension to be split across replicas. Received "
            f"leading dimensions {sorted(sizes) or 'none (scalars only)'}. "
            "Batch the dataset (e.g. `dataset.batch(global_batch_size)`)."
        )
    return sizes.pop()


def split_batch(element: Any, num_replicas: int, per_replica: int) -> list:
    """Splits one global batch into `num_replicas` slices, in replica order.

    Replica `i` gets rows `[i * per_replica, (i + 1) * per_replica)`; on a
    short batch the last replicas get fewer rows, or none.
    """
    import keras

    slices = []
    for replica in range(num_replicas):
        start = min(replica * per_replica, batch_size_of(element))
        stop = min(start + per_replica, batch_size_of(element))
        slices.append(
            keras.tree.map_structure(
                lambda leaf: leaf if leaf is None else leaf[start:stop],
                element,
            )
        )
    return slices
