"""The sharded checkpoint format: a directory, a JSON index, HDF5 shards.

```
<path>/
  index.json            every variable: global shape, dtype, logical layout,
                        and which file / dataset / global slice holds each
                        unique piece, with its sha256; format version, step
  shards-00000.h5       the pieces written by process 0 (h5py, no pickle)
```

Every process writes its own `shards-<process>.h5` and `part-<process>.json`
into `<path>.tmp`; the chief merges the parts into `index.json` and commits
by `os.replace`. A previous checkpoint at `<path>` is moved aside first and
removed only after the new one is in place, so a failure never loses what
was saved. A directory without `index.json` is not a checkpoint. Loading
never executes code.
"""

import hashlib
import json
import os
import shutil
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

FORMAT = "keras_distribute.checkpoint"
FORMAT_VERSION = 1
INDEX = "index.json"

Slice = Tuple[Tuple[int, int], ...]


class CheckpointError(ValueError):
    """A checkpoint that is missing, unfinished, corrupt or does not fit."""


def _sha256(array: np.ndarray) -> str:
    """The sha256 of an array's bytes, read in place (no copy when it is
    C-contiguous)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return hashlib.sha256(flat.view(np.uint8)).hexdigest()


def _storable(array: np.ndarray) -> np.ndarray:
    """HDF5 lacks bfloat16 & co: store their bits as unsigned integers."""
    if array.dtype.kind in "biufc" and array.dtype.name in np.sctypeDict:
        return array
    return array.view(f"u{array.dtype.itemsize}")


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16, float8_*: shipped with JAX and Keras

        return np.dtype(getattr(ml_dtypes, name))


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
    """
    recover(path)
    temporary = temporary_path(path)
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    return temporary


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
        variables = {}
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
        _commit(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
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
    shutil.rmtree(temporary_path(path), ignore_errors=True)


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
    import h5py

    name = f"shards-{process_id:05d}.h5"
    variables = {}
    with h5py.File(os.path.join(directory, name), "w") as h5:
        for number, (key, (shape, dtype, layout, pieces, var_path)) in (
                enumerate(sorted(entries.items()))):
            records = []
            for part, (region, array) in enumerate(pieces):
                dataset = f"v{number}/p{part}"
                h5.create_dataset(dataset, data=_storable(array))
                records.append({
                    "file": name, "dataset": dataset,
                    "slice": [list(r) for r in region],
                    "sha256": _sha256(array),
                })
            variables[key] = {"shape": list(shape), "dtype": dtype,
                              "layout": layout, "path": var_path,
                              "pieces": records}
        h5.flush()
    with open(os.path.join(directory, name), "rb+") as f:
        os.fsync(f.fileno())
    return {"variables": variables}


def _commit(temporary: str, path: str) -> None:
    """Puts `temporary` at `path`; an old `path` is removed only after.

    Between the two renames `path` is briefly absent while the old one sits
    at `<path>.old`; `recover` puts it back if the process died there.
    """
    old = None
    if os.path.exists(path):
        old = f"{path}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(temporary, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    """Deletes a checkpoint: first its index (so it is no longer one)."""
    try:
        os.remove(os.path.join(path, INDEX))
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def clean_unfinished(directory: str) -> List[str]:
    """Removes the temporary directories of saves that never finished.

    Only call this when no save into `directory` is running.

    Returns:
        The paths removed.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        full = os.path.join(directory, name)
        if name.endswith(".old"):
            recover(full[:-len(".old")])
        if (name.endswith(".tmp") or name.endswith(".old")) and os.path.isdir(
                full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed


def read_index(path: str) -> dict:
    """Reads and checks the index of the committed checkpoint at `path`.

    Raises:
        CheckpointError: if `path` is not a committed checkpoint, its index
            is unreadable, or its format version is newer than this library.
    """
    recover(path)
    index_path = os.path.join(path, INDEX)
    if not os.path.isfile(index_path):
        raise CheckpointError(
            f"{path!r} is not a committed keras_distribute checkpoint (no "
            f"{INDEX}): it may not exist, or a save did not finish. Use "
            "kd.checkpoint.latest_checkpoint(directory) to find the last "
            "complete one.")
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"The index {index_path!r} is corrupt ({error}). Restore an "
            "earlier checkpoint.") from None
    if index.get("format") != FORMAT or not isinstance(
            index.get("variables"), dict):
        raise CheckpointError(
            f"{index_path!r} is not a keras_distribute checkpoint index. "
            f"Received format={index.get('format')!r}.")
    if index.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} has format version {index['format_version']}, newer "
            f"than this keras_distribute reads ({FORMAT_VERSION}). Upgrade "
            "keras_distribute.")
    return index


def whole_region(shape) -> Slice:
    """The global slice covering a whole array of `shape`."""
    return tuple((0, int(n)) for n in shape)


def read_whole(path: str, record: dict) -> np.ndarray:
    """The whole of one saved variable (see `read_regions`)."""
    (value,) = read_regions(path, record, [whole_region(record["shape"])])
    return value


def _overlap(a: Slice, b: Slice) -> Optional[Slice]:
    region = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1)
                   in zip(a, b))
    return region if all(lo < hi for lo, hi in region) or not region else None


def read_regions(path: str, record: dict,
                 regions: Iterable[Slice]) -> List[np.ndarray]:
    """Reads the global `regions` of one variable, verifying every piece.

    Each stored piece is read once, checked against its sha256, copied into
    the regions it overlaps and dropped: no more than one stored piece and
    the requested regions are in memory at a time.

    Raises:
        CheckpointError: on a missing, truncated or corrupted shard file.
    """

    regions = [tuple(tuple(r) for r in region) for region in regions]
    dtype = _dtype(record["dtype"])
    out = [None] * len(regions)  # allocated on first use (or the piece)
    filled = [0] * len(regions)
    for piece in record["pieces"]:
        stored = tuple(tuple(r) for r in piece["slice"])
        wanted = [(i, _overlap(stored, region))
                  for i, region in enumerate(regions)]
        wanted = [(i, o) for i, o in wanted if o is not None]
        if not wanted:
            continue
        data = _read_piece(path, piece, dtype)
        for i, overlap in wanted:
            if overlap == stored == regions[i]:  # the whole piece: no copy
                out[i] = data
                filled[i] += data.size
                continue
            source = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _)
                           in zip(overlap, stored))
            target = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _)
                           in zip(overlap, regions[i]))
            if out[i] is None:
                out[i] = np.empty([hi - lo for lo, hi in regions[i]], dtype)
            out[i][target] = data[source]
            filled[i] += int(np.prod([hi - lo for lo, hi in overlap]))
    for i, region in enumerate(regions):
        if filled[i] != int(np.prod([hi - lo for lo, hi in region])):
            raise CheckpointError(
                f"The checkpoint at {path!r} does not cover region {region} "
                "of a variable: its pieces are incomplete.")
        if out[i] is None:  # an empty region
            out[i] = np.empty([hi - lo for lo, hi in region], dtype)
    return out


# Large pieces are read in blocks of about this size; each block is hashed
# in a thread while the next one is read (sha256 releases the GIL).
_READ_BLOCK_BYTES = 16 << 20
_hasher_thread: List[Any] = []


def _read_and_hash(dataset: Any) -> Tuple[np.ndarray, str]:
    """A dataset's data and the sha256 of its bytes, reading and hashing
    overlapped block by block (in row order: the same digest as hashing the
    whole array)."""
    import concurrent.futures

    data = np.empty(dataset.shape, dataset.dtype)
    digest = hashlib.sha256()
    rows = dataset.shape[0] if dataset.ndim else 0
    if rows == 0 or data.nbytes <= _READ_BLOCK_BYTES:
        if data.size:
            dataset.read_direct(data)
        digest.update(data.reshape(-1).view(np.uint8))
        return data, digest.hexdigest()
    if not _hasher_thread:
        _hasher_thread.append(concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kd-checkpoint-hash"))
    row_bytes = data.nbytes // rows
    step = max(1, _READ_BLOCK_BYTES // row_bytes)
    flat = data.reshape(-1).view(np.uint8)
    hashing = None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        dataset.read_direct(data, np.s_[start:stop], np.s_[start:stop])
        if hashing is not None:
            hashing.result()
        hashing = _hasher_thread[0].submit(
            digest.update, flat[start * row_bytes:stop * row_bytes])
    hashing.result()
    return data, digest.hexdigest()


def _read_piece(path: str, piece: dict, dtype: np.dtype) -> np.ndarray:
    import h5py

    file_path = os.path.join(path, piece["file"])
    try:
        with h5py.File(file_path, "r") as h5:
            data, checksum = _read_and_hash(h5[piece["dataset"]])
    except (OSError, KeyError) as error:
        raise CheckpointError(
            f"The shard file {file_path!r} is missing, truncated or corrupt "
            f"({error}). Restore an earlier checkpoint.") from None
    data = data.view(dtype) if data.dtype != dtype else data
    if checksum != piece["sha256"]:
        raise CheckpointError(
            f"The data of {piece['dataset']!r} in {file_path!r} does not "
            "match its checksum: the file is corrupt. Restore an earlier "
            "checkpoint.")
    return data
