"""`model.load_weights()` under a strategy: each process reads only its part.

Keras loads a `.weights.h5` file (and the shards of a `.weights.json`) one
layer at a time, each variable as a whole NumPy array that is then laid
out: under a sharded layout every process reads, and holds for a moment,
every variable whole. For a model created in a kd strategy's scope, kd
reads them the way it restores its own checkpoints instead: while such a
model's `load_weights` runs, Keras' weights store hands out each dataset
as a `LazyH5Array` (its file, its name, its shape and dtype; no values),
and a variable assigned one reads through the backend's
`checkpoint_assign` only the regions this process holds (HDF5 hyperslabs:
a shard of an FSDP variable, one device's slice of a tensor-parallel
one), straight into the variable's own memory where it can. Only loaders
known to assign what they read get such arrays (Keras' default
`load_own_variables`, which most layers and keras-hub's use, and those of
`Dense`, `EinsumDense`, `Embedding`, the convolutions and the optimizer);
one that keeps or transforms what it reads (a preprocessing layer's
statistics, a wrapped torch module) gets Keras' whole arrays.

Keras-private names used: `saving_lib.H5IOStore.__getitem__` (wrapped; the
loader asking is the frame above it),
its `_h5_entry_group` (read; where absent, Keras' own path runs),
`saving_lib.safe_get_h5_dataset` and `Variable.assign` (wrapped); rows in
`registry.py`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any
from typing import Callable
from typing import Iterator
from typing import List
from typing import Optional
from typing import Sequence

from keras_distribute.common.context import model_strategy
from keras_distribute.integration import patching

_loading = threading.local()
_WEIGHTS_FILES = (".weights.h5", ".weights.json")


class LazyH5Array:
    """A dataset of a Keras weights file, read region by region.

    It reads from the dataset Keras opened and checked (no external links,
    external storage or virtual datasets: `safe_get_h5_dataset`), never
    from the file's path again: a file replaced while it loads (an atomic
    save's `os.replace`) is not read unchecked, and every variable comes
    from the one file Keras opened.

    Attributes:
        filename: The HDF5 file holding it.
        name: Its path in that file.
        shape: Its shape.
        dtype: The dtype Keras loads it as: `bfloat16` where the dataset is
            marked so (Keras stores bfloat16 as 2-byte opaque values; older
            writers as float32).
    """

    __slots__ = ("filename", "name", "shape", "dtype", "_dataset",
                 "_decode")

    def __init__(self, dataset: Any) -> None:
        import numpy as np

        self._dataset = dataset
        self.filename = dataset.file.filename
        self.name = dataset.name
        self.shape = tuple(int(n) for n in dataset.shape)
        stored = np.dtype(dataset.dtype)
        self._decode: Optional[str] = None
        self.dtype = stored
        if dataset.attrs.get("dtype") == "bfloat16":
            import ml_dtypes

            self.dtype = np.dtype(ml_dtypes.bfloat16)
            if stored.kind == "V":
                if stored.itemsize != 2:
                    raise ValueError(
                        f"{self.name!r} in {self.filename!r} is marked "
                        f"bfloat16 but holds {stored.itemsize}-byte opaque "
                        "values (bfloat16 takes 2). Received: "
                        f"dtype={stored}. Save the weights again with "
                        "Keras' `save_weights`.")
                self._decode = "view"  # (Keras' own bfloat16 bytes)
            else:
                self._decode = "cast"

    def read_regions(self, regions: Sequence[tuple],
                     into: Optional[Sequence[Any]] = None) -> List[Any]:
        """The arrays of `regions` (`((start, stop), ...)` per dimension),
        read as hyperslabs; written into the arrays `into` where given."""
        import numpy as np

        dataset = self._dataset
        if not dataset.id.valid:
            raise ValueError(
                f"The weights file {self.filename!r} was closed before "
                f"{self.name!r} was read. Read a weights file's arrays "
                "while Keras' `load_weights` holds it open.")
        arrays = []
        for i, region in enumerate(regions):
            if len(region) != len(self.shape) or any(
                    not 0 <= start <= stop <= size
                    for (start, stop), size in zip(region, self.shape)):
                raise ValueError(
                    f"A region {region} outside {self.name!r} of shape "
                    f"{self.shape} was asked for.")
            selection = tuple(slice(start, stop) for start, stop in region)
            target = into[i] if into is not None else None
            if target is not None and self._decode != "cast" and (
                    target.dtype == self.dtype) and target.flags[
                        "C_CONTIGUOUS"] and dataset.shape != ():
                dataset.read_direct(target.view(dataset.dtype), selection)
                arrays.append(target)
                continue
            array = np.asarray(dataset[selection] if selection
                               else dataset[()])
            if self._decode == "view":
                array = array.view(self.dtype)
            elif self._decode == "cast":
                array = array.astype(self.dtype)
            if target is not None:
                target[...] = array
                array = target
            arrays.append(array)
        return arrays

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        (whole,) = self.read_regions([tuple((0, n) for n in self.shape)])
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return (f"LazyH5Array({self.filename!r}, {self.name!r}, "
                f"shape={self.shape}, dtype={self.dtype})")


@contextlib.contextmanager
def lazy_reads() -> Iterator[None]:
    """Keras' weights store hands out `LazyH5Array`s in this block (this
    thread only)."""
    _loading.depth = getattr(_loading, "depth", 0) + 1
    try:
        yield
    finally:
        _loading.depth -= 1


def load_weights_by_region(original: Callable) -> Callable:
    """Wraps `Model.load_weights`: a model made in a strategy's scope
    loads a local `.weights.h5` / `.weights.json` region by region."""

    @functools.wraps(original)
    def load_weights(self, filepath, *args, **kwargs):
        if model_strategy(self) is None or not isinstance(
                filepath, (str, os.PathLike)) or not str(filepath).endswith(
                    _WEIGHTS_FILES) or "://" in str(filepath):
            return original(self, filepath, *args, **kwargs)
        with lazy_reads():
            return original(self, filepath, *args, **kwargs)

    return patching.wrapping(load_weights, original)


def _assigning_loaders() -> frozenset:
    """The code of the `load_own_variables` methods known to do nothing
    with a value but assign it to a variable: Keras' default (most layers,
    keras-hub's among them), `Dense`, `EinsumDense`, `Embedding`, the
    convolutions' and the optimizer's. A loader that keeps or transforms
    what it reads (preprocessing layers' vocabularies and statistics, a
    wrapped torch module) gets Keras' arrays."""
    import keras

    from keras_distribute.integration import registry

    owners = (keras.layers.Layer, keras.layers.Dense,
              keras.layers.EinsumDense, keras.layers.Embedding,
              keras.layers.Conv1D, keras.optimizers.Optimizer)
    loaders = [owner.load_own_variables for owner in owners]
    shared = registry.resolve("Layer._load_serialized_variables")
    if shared is not None:  # (Keras 3.16: what Dense & co. call)
        loaders.append(shared)
    return frozenset(loader.__code__ for loader in loaders)


def _asked_by_an_assigning_loader() -> bool:
    frame: Optional[Any] = sys._getframe(2)  # (above the wrapped __getitem__)
    while frame is not None and frame.f_code.co_name == "__getitem__":
        frame = frame.f_back  # a store's own lookup (sharded files)
    if frame is None:
        return False
    if not hasattr(_loading, "loaders"):
        _loading.loaders = _assigning_loaders()
    return frame.f_code in _loading.loaders


def lazy_getitem(original: Callable, safe_get_h5_dataset: Callable
                 ) -> Callable:
    """Wraps `H5IOStore.__getitem__`: a `LazyH5Array` in `lazy_reads()`,
    for a loader that only assigns it (`_assigning_loaders`) and a dataset
    of a file on disk; Keras' array otherwise."""

    @functools.wraps(original)
    def __getitem__(self, key):
        group = getattr(self, "_h5_entry_group", None)
        if not getattr(_loading, "depth", 0) or group is None or (
                not _asked_by_an_assigning_loader()):
            return original(self, key)
        dataset = safe_get_h5_dataset(group, key)
        filename = getattr(getattr(dataset, "file", None), "filename", "")
        if not isinstance(filename, str) or not os.path.isfile(filename):
            return original(self, key)  # (in a .keras archive's memory)
        return LazyH5Array(dataset)

    return patching.wrapping(__getitem__, original)


def assign_by_region(original: Callable,
                     checkpoint_assign: Callable[[], Callable]) -> Callable:
    """Wraps `Variable.assign`: a `LazyH5Array` of the variable's shape is
    read through the backend's `checkpoint_assign()` (only this process's
    regions); anything else is Keras' assign."""

    @functools.wraps(original)
    def assign(self, value):
        if value.__class__ is not LazyH5Array:
            return original(self, value)
        if value.shape != tuple(int(n) for n in self.shape):
            return original(self, value.__array__())  # Keras' own error
        checkpoint_assign()(self, value.read_regions)
        return self

    return patching.wrapping(assign, original)
