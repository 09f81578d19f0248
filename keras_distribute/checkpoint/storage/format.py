"""The sharded checkpoint format: a directory, a JSON index, HDF5 shards.

```
<path>/
  index.json            every variable: global shape, dtype, logical layout,
                        and which file / dataset / global slice holds each
                        unique piece, with its checksum (xxh3-128; sha256 in
                        format 1, still read) and the byte offset of its
                        data in the file (optional); format version, step
  shards-00000.h5       the pieces written by process 0 (h5py, no pickle)
```

Every process writes its own `shards-<process>.h5` and `part-<process>.json`
into `<path>.tmp`; the chief merges the parts into `index.json` and commits
by `os.replace`. A previous checkpoint at `<path>` is moved aside first and
removed only after the new one is in place, so a failure never loses what
was saved. A directory without `index.json` is not a checkpoint, and no save
or clean-up deletes or replaces anything that is neither a checkpoint nor a
temporary directory a save marked as its own. Loading never executes code.
`writing` writes and commits; `reading` reads (and distrusts) them.
"""

import hashlib
import json
import os
from types import MappingProxyType
from typing import Any
from typing import Tuple

import numpy as np

FORMAT = "keras_distribute.checkpoint"
# 2: each piece carries an "xxh3_128" checksum; 1 (still read): "sha256".
FORMAT_VERSION = 2
# The checksum fields a piece may carry and their hex lengths. Saves write
# the first: XXH3-128 hashes at memory speed (sha256 at a few hundred MB/s
# on one core); it detects corruption, not tampering (a checkpoint is
# untrusted input either way: see `validation`).
CHECKSUM_FIELDS = MappingProxyType({"xxh3_128": 32, "sha256": 64})
WRITTEN_CHECKSUM = "xxh3_128"
INDEX = "index.json"
# Written into every save's temporary directory: only a directory holding it
# (or a committed index) is ever deleted by a save or a clean-up.
TEMPORARY_MARKER = ".keras_distribute-temporary"
# A larger index.json is not read (a real one holds ~230 bytes per piece:
# this is over a million pieces).
_MAX_INDEX_BYTES = 1 << 28
MAX_INDEX_BYTES = _MAX_INDEX_BYTES  # (the bound, for readers of bytes)
# Parsing may take at most this many times the index's bytes, plus a little
# (`parsing_cost`); kd's own indexes take about 6 (12 written compactly).
_MAX_PARSE_FACTOR = 16
_PARSE_ALLOWANCE = 1 << 22


def parsing_cost(raw: bytes) -> int:
    """An upper bound of the bytes Python's `json.loads(raw)` allocates
    (measured: 1.2 to 5.6 times the real peak, for kd's indexes and for
    indexes of many empty objects, lists, strings or numbers): 120 per
    object or list, 64 per value separator, plus the text itself."""
    return (120 * (raw.count(b"{") + raw.count(b"["))
            + 64 * (raw.count(b",") + raw.count(b":")) + len(raw))


Slice = Tuple[Tuple[int, int], ...]


class CheckpointError(ValueError):
    """A checkpoint that is missing, unfinished, corrupt or does not fit."""


class CheckpointStorageError(OSError):
    """The store holding a checkpoint did not answer (a network error that
    outlasted the retries). Not corruption: the checkpoint's bytes were
    never read, so it may be intact; nothing is moved aside or deleted
    because of it. Try again once the store answers."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint that does not fit the objects restored into it
    (another architecture: a variable's shape differs). Not corruption:
    nothing is renamed or deleted because of it."""


_JSON_SCALARS = (str, int, float, bool, type(None))


def check_metadata(metadata: Any) -> None:
    """Raises `ValueError` unless `metadata` is a dict of JSON values with
    string keys (what the index can hold and give back unchanged); checked
    before anything is written.

    Raises:
        ValueError: naming the first entry that is not JSON-able.
    """
    def check(value: Any, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValueError(
                        f"metadata keys must be strings. Received: a "
                        f"{type(key).__name__} key {key!r} in {where}. Use "
                        "str(key).")
                check(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for number, item in enumerate(value):
                check(item, f"{where}[{number}]")
        elif not isinstance(value, _JSON_SCALARS):
            hint = (" (a numpy scalar: use .item())"
                    if hasattr(value, "item") and hasattr(value, "dtype")
                    else "")
            raise ValueError(
                "metadata must hold JSON values (dicts with string keys, "
                "lists, strings, numbers, booleans, None). Received: "
                f"{where}={value!r} of type {type(value).__name__}{hint}. "
                "Nothing was written.")

    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise ValueError(
            "metadata must be a dict of JSON values. Received: "
            f"metadata={type(metadata).__name__}.")
    check(metadata, "metadata")


def new_digest(field: str) -> Any:
    """A streaming hash (`update`, `hexdigest`) for a piece's checksum
    `field` ("xxh3_128" or "sha256")."""
    if field == "sha256":
        return hashlib.sha256()
    import xxhash

    return xxhash.xxh3_128()


def checksum(array: np.ndarray, field: str = WRITTEN_CHECKSUM) -> str:
    """The checksum of an array's bytes, read in place (no copy when it is
    C-contiguous)."""
    digest = new_digest(field)
    digest.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return str(digest.hexdigest())


def storable_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a shard stores for `dtype`: itself, or for bfloat16 & co
    (which HDF5 lacks) unsigned integers of the same size."""
    if dtype.kind in "biufc" and dtype.name in np.sctypeDict:
        return dtype
    return np.dtype(f"u{dtype.itemsize}")


def storable_array(array: np.ndarray) -> np.ndarray:
    return array.view(storable_dtype(array.dtype))


# The only dtypes a checkpoint may declare: numbers (no objects, strings or
# records, which could carry pickles or unbounded data).
_NUMPY_DTYPES = frozenset([
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "float32", "float64", "complex64", "complex128"])
_ML_DTYPES = frozenset([
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3",
    "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn",
    "int2", "int4", "uint2", "uint4"])


def numpy_dtype(name: object) -> np.dtype:
    """The numpy dtype a checkpoint's dtype name stands for.

    Raises:
        CheckpointError: for a name that is not a numeric dtype this format
            stores (e.g. `object`, a string or record dtype).
    """
    if isinstance(name, str) and name in _NUMPY_DTYPES:
        return np.dtype(name)
    if isinstance(name, str) and name in _ML_DTYPES:
        import ml_dtypes  # bfloat16, float8_*: shipped with JAX and Keras

        if hasattr(ml_dtypes, name):
            return np.dtype(getattr(ml_dtypes, name))
    raise CheckpointError(
        f"The checkpoint declares dtype {name!r}, which is not a numeric "
        "dtype a keras_distribute checkpoint stores. Expected one of "
        f"{sorted(_NUMPY_DTYPES | _ML_DTYPES)}. The checkpoint is corrupt or "
        "was not written by keras_distribute.")


def is_checkpoint(path: str) -> bool:
    """Whether `path` is a committed keras_distribute checkpoint (a real
    directory whose `index.json` names this format)."""
    index = os.path.join(path, INDEX)
    if os.path.islink(path) or not os.path.isdir(path) or os.path.islink(
            index) or not os.path.isfile(index):
        return False
    try:
        content = load_index_json(index)
    except CheckpointError:
        return False
    return isinstance(content, dict) and content.get("format") == FORMAT


def load_index_json(index_path: str) -> Any:
    """The parsed JSON of an index file, read only within bounds: at most
    `_MAX_INDEX_BYTES`, and only if parsing it takes at most
    `_MAX_PARSE_FACTOR` times its size (`parsing_cost`).

    Raises:
        CheckpointError: for an index that is unreadable, too large, too
            dense to parse within those bounds, or not JSON.
    """
    try:
        with open(index_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # (read(n) allocates n bytes up front: the size, not the limit)
            raw = f.read(min(size, _MAX_INDEX_BYTES) + 1)
    except OSError as error:
        raise CheckpointError(
            f"The index {index_path!r} cannot be read ({error.strerror}). "
            "Restore an earlier checkpoint.") from None
    return parse_index_bytes(raw, index_path)


def parse_index_bytes(raw: bytes, where: str) -> Any:
    """The parsed JSON of an index's bytes `raw` (read from `where`, at
    most `_MAX_INDEX_BYTES` + 1 of them), within `load_index_json`'s bounds.

    Raises:
        CheckpointError: for bytes that are too many, too dense to parse
            within those bounds, or not JSON.
    """
    if len(raw) > _MAX_INDEX_BYTES:
        raise CheckpointError(
            f"The index {where!r} is more than the {_MAX_INDEX_BYTES} "
            "bytes this reader accepts: it is not an index keras_distribute "
            "wrote.")
    cost = parsing_cost(raw)
    if cost > _MAX_PARSE_FACTOR * len(raw) + _PARSE_ALLOWANCE:
        raise CheckpointError(
            f"The index {where!r} ({len(raw)} bytes) would take about "
            f"{cost} bytes of memory to parse, more than {_MAX_PARSE_FACTOR} "
            "times its size: it is dense with empty objects, lists or tiny "
            "values, not an index keras_distribute wrote. Restore an "
            "earlier checkpoint.")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(
            f"The index {where!r} is corrupt ({type(error).__name__}: "
            f"{str(error)[:200]}). Restore an earlier checkpoint.") from None
