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
never executes code. This module writes and commits; `reading` reads.
"""

import hashlib
import json
import os
import shutil
import time
from typing import Any, Dict, List, Tuple

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


def numpy_dtype(name: str) -> np.dtype:
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
