"""The sharded checkpoint format: a directory, a JSON index, HDF5 shards.

```
<path>/
  index.json            every variable: global shape, dtype, logical layout,
                        and which file / dataset / global slice holds each
                        unique piece, with its checksum (xxh3-128; sha256 in
                        format 1, still read); format version, step
  shards-00000.h5       the pieces written by process 0 (h5py, no pickle)
```

Every process writes its own `shards-<process>.h5` and `part-<process>.json`
into `<path>.tmp`; the chief merges the parts into `index.json` and commits
by `os.replace`. A previous checkpoint at `<path>` is moved aside first and
removed only after the new one is in place, so a failure never loses what
was saved. A directory without `index.json` is not a checkpoint, and no save
or clean-up deletes or replaces anything that is neither a checkpoint nor a
temporary directory a save marked as its own. Loading never executes code.
This module writes and commits; `reading` reads (and distrusts) them.
"""

import hashlib
import json
import os
import shutil
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from keras_distribute.checkpoint import parallel_io

FORMAT = "keras_distribute.checkpoint"
# 2: each piece carries an "xxh3_128" checksum; 1 (still read): "sha256".
FORMAT_VERSION = 2
# The checksum fields a piece may carry and their hex lengths. Saves write
# the first: XXH3-128 hashes at memory speed (sha256 at a few hundred MB/s
# on one core); it detects corruption, not tampering (a checkpoint is
# untrusted input either way: see `validation`).
CHECKSUM_FIELDS = {"xxh3_128": 32, "sha256": 64}
WRITTEN_CHECKSUM = "xxh3_128"
INDEX = "index.json"
# Written into every save's temporary directory: only a directory holding it
# (or a committed index) is ever deleted by a save or a clean-up.
TEMPORARY_MARKER = ".keras_distribute-temporary"
# A larger index.json is not read (a real one holds ~230 bytes per piece:
# this is over a million pieces).
_MAX_INDEX_BYTES = 1 << 28
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
    return digest.hexdigest()


def storable_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a shard stores for `dtype`: itself, or for bfloat16 & co
    (which HDF5 lacks) unsigned integers of the same size."""
    if dtype.kind in "biufc" and dtype.name in np.sctypeDict:
        return dtype
    return np.dtype(f"u{dtype.itemsize}")


def _storable(array: np.ndarray) -> np.ndarray:
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


def numpy_dtype(name: str) -> np.dtype:
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


def temporary_path(path: str) -> str:
    """Where every process writes a save of `path` before the commit.

    The same name in every process (they share it); the chief clears a
    stale one left by an interrupted save before anyone writes.
    """
    return f"{os.path.abspath(path)}.tmp"


def prepare(path: str) -> str:
    """Chief only: clears a stale temporary directory and makes a new one.

    Returns:
        The temporary directory.

    Raises:
        CheckpointError: if `path` (or its `.tmp` / `.old` neighbour) exists
            and is not a keras_distribute checkpoint: writing would replace
            what is not ours.
    """
    recover(path)
    refuse_foreign(path)
    return make_temporary(path)


def make_temporary(path: str) -> str:
    """A fresh temporary directory for a save of `path`, marked as ours.

    A stale one (an interrupted save) is removed first; anything else at
    that name is refused, never deleted.
    """
    temporary = temporary_path(path)
    if os.path.lexists(temporary):
        remove_ours(temporary, what="a stale temporary directory")
    os.makedirs(temporary)
    with open(os.path.join(temporary, TEMPORARY_MARKER), "w") as f:
        f.write(os.path.abspath(path))
    return temporary


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
    if len(raw) > _MAX_INDEX_BYTES:
        raise CheckpointError(
            f"The index {index_path!r} is more than the {_MAX_INDEX_BYTES} "
            "bytes this reader accepts: it is not an index keras_distribute "
            "wrote.")
    cost = parsing_cost(raw)
    if cost > _MAX_PARSE_FACTOR * len(raw) + _PARSE_ALLOWANCE:
        raise CheckpointError(
            f"The index {index_path!r} ({len(raw)} bytes) would take about "
            f"{cost} bytes of memory to parse, more than {_MAX_PARSE_FACTOR} "
            "times its size: it is dense with empty objects, lists or tiny "
            "values, not an index keras_distribute wrote. Restore an "
            "earlier checkpoint.")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(
            f"The index {index_path!r} is corrupt ({type(error).__name__}: "
            f"{str(error)[:200]}). Restore an earlier checkpoint.") from None


def _is_ours(path: str) -> bool:
    """A checkpoint, or a temporary directory one of our saves made."""
    return is_checkpoint(path) or (
        not os.path.islink(path) and os.path.isdir(path)
        and os.path.isfile(os.path.join(path, TEMPORARY_MARKER)))


def refuse_foreign(path: str) -> None:
    """Raises unless `path` and its `.old` neighbour are absent, empty
    directories or keras_distribute checkpoints: a save replaces what is at
    `path`, and must never destroy a user's files."""
    for candidate in (path, f"{path}.old"):
        if not os.path.lexists(candidate) or _is_ours(candidate) or (
                os.path.isdir(candidate) and not os.path.islink(candidate)
                and not os.listdir(candidate)):
            continue
        held = (sorted(os.listdir(candidate))[:5]
                if os.path.isdir(candidate) else "a file")
        raise CheckpointError(
            f"Not writing a checkpoint at {path!r}: {candidate!r} exists and "
            f"is not a keras_distribute checkpoint (it holds {held}), and "
            "the save would replace it. Received: "
            f"path={path!r}. Pass a path that does not exist yet (or an "
            "earlier checkpoint to overwrite), or use save(prefix) / "
            "CheckpointManager, which number new checkpoint directories.")


def remove_ours(path: str, what: str = "a checkpoint") -> None:
    """Deletes `path` if it is a checkpoint or one of our temporaries.

    Raises:
        CheckpointError: if it is something else; nothing is deleted.
    """
    if not os.path.lexists(path):
        return
    if not _is_ours(path):
        raise CheckpointError(
            f"Not deleting {path!r}: it was expected to be {what} of "
            "keras_distribute, but it is not (no index.json of this format "
            "and no temporary marker). Move it away, or pick another "
            "checkpoint path.")
    shutil.rmtree(path, ignore_errors=True)


def write_process_shards(temporary: str, entries: Dict[str, tuple],
                         process_id: int) -> None:
    """Writes this process's unique pieces and its part of the index.

    Args:
        temporary: The save's temporary directory (`prepare` made it).
        entries: `key -> (global shape, dtype name, layout axes, pieces,
            variable path)`, where `pieces` lists `(global slice, numpy
            array)` unique to this process.
        process_id: This process's id; names its files.
    """
    part = _write_shards(temporary, entries, process_id)
    _write_json(os.path.join(temporary, f"part-{process_id:05d}.json"), part)


def commit(path: str, process_count: int, metadata: Dict[str, Any],
           timeout_s: float = 600.0) -> None:
    """Chief only: merges every process's part and commits `path`.

    Waits (up to `timeout_s`) until every process wrote its part, writes
    `index.json`, then renames the temporary directory to `path`; a previous
    checkpoint at `path` is removed only once the new one is in place. On
    any failure the temporary directory is removed and `path` is untouched.

    Raises:
        CheckpointError: if a process's part did not arrive in time.
    """
    path = os.path.abspath(path)
    temporary = temporary_path(path)
    try:
        parts = [os.path.join(temporary, f"part-{i:05d}.json")
                 for i in range(process_count)]
        deadline = time.monotonic() + timeout_s
        while not all(os.path.isfile(p) for p in parts):
            _raise_reported_failures(temporary, path)
            if time.monotonic() > deadline:
                missing = [i for i, p in enumerate(parts)
                           if not os.path.isfile(p)]
                raise CheckpointError(
                    f"Saving {path!r}: processes {missing} did not write "
                    f"their shards within {timeout_s:.0f} s (a process may "
                    "have failed, or the directory is not on a file system "
                    "every process shares). The previous checkpoint is kept.")
            time.sleep(0.02)
        variables: Dict[str, Any] = {}
        for part in parts:
            with open(part) as f:
                for key, record in json.load(f)["variables"].items():
                    if key in variables:
                        variables[key]["pieces"] += record["pieces"]
                    else:
                        variables[key] = record
        index = dict(metadata, variables=variables, format=FORMAT,
                     format_version=FORMAT_VERSION,
                     num_processes=process_count)
        _write_json(os.path.join(temporary, INDEX), index)
        for part in parts:
            os.remove(part)
        os.remove(os.path.join(temporary, TEMPORARY_MARKER))
        _commit(temporary, path)
    except BaseException:
        _remove_if_ours(temporary)
        raise


def wait_committed(path: str, timeout_s: float = 600.0) -> None:
    """Non-chief processes: waits until the chief committed (or gave up)."""
    temporary = temporary_path(path)
    deadline = time.monotonic() + timeout_s
    while os.path.exists(temporary) and time.monotonic() < deadline:
        time.sleep(0.02)


def report_failure(temporary: str, process_id: int,
                   error: BaseException) -> None:
    """Leaves a note for the chief that this process's write failed."""
    try:
        _write_atomically(
            os.path.join(temporary, f"failed-{process_id:05d}.txt"),
            f"{type(error).__name__}: {error}")
    except OSError:
        pass  # the chief then times out instead


def _raise_reported_failures(temporary: str, path: str) -> None:
    for name in sorted(os.listdir(temporary)):
        if name.startswith("failed-") and name.endswith(".txt"):
            with open(os.path.join(temporary, name)) as f:
                reason = f.read()
            raise CheckpointError(
                f"Saving {path!r} failed in process {int(name[7:12])}: "
                f"{reason}. The previous checkpoint is kept.")


def abandon(path: str) -> None:
    """Chief only: removes an unfinished save's temporary directory."""
    _remove_if_ours(temporary_path(path))


def _remove_if_ours(path: str) -> None:
    if _is_ours(path):
        shutil.rmtree(path, ignore_errors=True)


def _write_json(file_path: str, content: dict) -> None:
    # Written under another name and renamed: the chief polls for the parts
    # by name and must never open one that is still being written.
    _write_atomically(file_path, json.dumps(content, indent=1, sort_keys=True))


def _write_atomically(file_path: str, text: str) -> None:
    writing = file_path + ".writing"
    with open(writing, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(writing, file_path)


def _write_shards(directory: str, entries, process_id: int) -> dict:
    """h5py lays out one contiguous dataset per piece, allocated up front;
    then the bytes go to their offsets in parallel (`parallel_io`), each
    piece hashed on the way, and one fsync."""
    import h5py

    name = f"shards-{process_id:05d}.h5"
    full = os.path.join(directory, name)
    variables, placed = {}, []
    with h5py.File(full, "w") as h5:
        for number, (key, (shape, dtype, layout, pieces, var_path)) in (
                enumerate(sorted(entries.items()))):
            numpy_dtype(dtype)  # refuses what a reader would refuse
            records = []
            for part, (region, array) in enumerate(pieces):
                dataset = f"v{number}/p{part}"
                stored = _storable(array)
                if not stored.flags.c_contiguous:  # (keeps 0-d arrays 0-d)
                    stored = stored.copy(order="C")
                if stored.ndim == 0:  # (HDF5 places no scalar up front)
                    h5.create_dataset(dataset, data=stored)
                else:
                    placement = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                    placement.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                    created = h5.create_dataset(
                        dataset, shape=stored.shape, dtype=stored.dtype,
                        dcpl=placement, fill_time="never")
                    if stored.nbytes:
                        placed.append((created.id.get_offset(), stored))
                records.append({
                    "file": name, "dataset": dataset,
                    "slice": [list(r) for r in region],
                    WRITTEN_CHECKSUM: checksum(stored),
                })
            variables[key] = {"shape": list(shape), "dtype": dtype,
                              "layout": layout, "path": var_path,
                              "pieces": records}
    fd = os.open(full, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for offset, stored in placed:
            parallel_io.write_at(fd, stored, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"variables": variables}


def _commit(temporary: str, path: str) -> None:
    """Puts `temporary` at `path`; an old `path` is removed only after.

    Between the two renames `path` is briefly absent while the old one sits
    at `<path>.old`; `recover` puts it back if the process died there.
    """
    refuse_foreign(path)  # checked again: the save may have taken long
    old = None
    if os.path.lexists(path):
        old = f"{path}.old"
        if os.path.lexists(old):
            remove_ours(old, what="a previous checkpoint")
        os.replace(path, old)
    os.replace(temporary, path)
    if old is not None:
        _remove_if_ours(old)
        if os.path.isdir(old) and not os.listdir(old):
            os.rmdir(old)  # an empty directory the checkpoint replaced


def recover(path: str) -> None:
    """Undoes a commit that died between its two renames."""
    old = f"{os.path.abspath(path)}.old"
    if os.path.isfile(os.path.join(old, INDEX)) and not os.path.exists(path):
        try:
            os.replace(old, path)
        except OSError:
            # Another process (every worker looks for the latest
            # checkpoint) put it back first.
            if not os.path.isfile(os.path.join(path, INDEX)):
                raise


def remove(path: str) -> None:
    """Deletes a checkpoint: first its index (so it is no longer one).

    Raises:
        CheckpointError: if `path` exists and is not a checkpoint.
    """
    if not os.path.lexists(path):
        return
    if not is_checkpoint(path):
        remove_ours(path)  # a marked temporary; raises for what is not ours
        return
    os.remove(os.path.join(path, INDEX))  # no longer a checkpoint first
    shutil.rmtree(path, ignore_errors=True)


def move_aside(path: str, suffix: str) -> str:
    """Renames `path` to the first free `<path><suffix>[-N]`; returns it."""
    target, number = f"{path}{suffix}", 0
    while os.path.lexists(target):
        number += 1
        target = f"{path}{suffix}-{number}"
    os.replace(path, target)
    return target


def clean_unfinished(directory: str) -> List[str]:
    """Removes the temporary directories of saves that never finished.

    Only call this when no save into `directory` is running.

    Returns:
        The paths removed.
    """
    removed: List[str] = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        full = os.path.join(directory, name)
        if name.endswith(".old"):
            recover(full[:-len(".old")])
        if not (name.endswith(".tmp") or name.endswith(".old")):
            continue
        if _is_ours(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
        elif os.path.isdir(full) and not os.path.islink(full) and not (
                os.listdir(full)):
            os.rmdir(full)  # empty: nothing to lose
            removed.append(full)
    return removed
