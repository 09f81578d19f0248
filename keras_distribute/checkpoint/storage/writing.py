"""Writing a checkpoint: its temporary directory, each process's shards,
the atomic commit, and the removal of what kd wrote (never of what it did
not: `refuse_foreign`, the temporary marker, the index's owner).

The layer above the file format (`format.py`: schema, dtypes, checksums) and
below the checkpointer (`sharded_checkpoint.py`: barriers, the chief's path,
background saves).
"""

import json
import os
import shutil
import time
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import numpy as np

from keras_distribute.checkpoint.storage import parallel_io
from keras_distribute.checkpoint.storage.format import FORMAT
from keras_distribute.checkpoint.storage.format import FORMAT_VERSION
from keras_distribute.checkpoint.storage.format import INDEX
from keras_distribute.checkpoint.storage.format import TEMPORARY_MARKER
from keras_distribute.checkpoint.storage.format import WRITTEN_CHECKSUM
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import checksum
from keras_distribute.checkpoint.storage.format import is_checkpoint
from keras_distribute.checkpoint.storage.format import load_index_json
from keras_distribute.checkpoint.storage.format import numpy_dtype
from keras_distribute.checkpoint.storage.format import storable_array

# (file offset, C-contiguous array): a piece's bytes and where they go.
Placed = Tuple[int, np.ndarray]


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
                         process_id: int, durable: bool = True) -> None:
    """Writes this process's unique pieces and its part of the index.

    Args:
        temporary: The save's temporary directory (`prepare` made it).
        entries: `key -> (global shape, dtype name, layout axes, pieces,
            variable path)`, where `pieces` lists `(global slice, numpy
            array)` unique to this process.
        process_id: This process's id; names its files.
        durable: Sync the shard file to the disk (`False` for a staging
            copy that is uploaded, then deleted).
    """
    part = _write_shards(temporary, entries, process_id, durable)
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
        commit_directory(temporary, path)
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


def _write_shards(directory: str, entries: Dict[str, tuple],
                  process_id: int, durable: bool = True) -> dict:
    """h5py lays out one contiguous dataset per piece, allocated up front
    (`lay_out_shards`); then the bytes go to their offsets (`parallel_io`)
    and one fsync."""
    full, part, placed = lay_out_shards(directory, entries, process_id)
    write_placed(full, placed, durable)
    return part


def lay_out_shards(directory: str, entries: Dict[str, tuple],
                   process_id: int) -> Tuple[str, dict, List[Placed]]:
    """Writes this process's shard file `shards-NNNNN.h5` with every piece's
    dataset allocated but its bytes not yet written, each piece hashed.

    The finished file is this one with each placed array's bytes at its
    offset (`write_placed` writes them there; an upload may send them
    straight from memory, `streamed_upload`).

    Returns:
        `(file path, part of the index, placed)`, where `placed` lists
        `(file offset, C-contiguous array)` for every piece HDF5 did not
        write itself.
    """
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
                stored = storable_array(array)
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
                    offset = created.id.get_offset()
                    if stored.nbytes:
                        placed.append((offset, stored))
                record: Dict[str, Any] = {
                    "file": name, "dataset": dataset,
                    "slice": [list(r) for r in region],
                    WRITTEN_CHECKSUM: checksum(stored),
                }
                if stored.ndim and stored.nbytes:
                    # where the bytes lie: a reader takes them from there
                    # without asking HDF5 (see `reading`)
                    record["offset"] = int(offset)
                records.append(record)
            variables[key] = {"shape": list(shape), "dtype": dtype,
                              "layout": layout, "path": var_path,
                              "pieces": records}
    return full, {"variables": variables}, placed


def write_placed(full: str, placed: List[Placed], durable: bool) -> None:
    """Writes each placed array's bytes at its offset of the laid-out file
    `full` (`lay_out_shards`), then syncs it to the disk if `durable`."""
    fd = os.open(full, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for offset, stored in placed:
            parallel_io.write_at(fd, stored, offset)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def commit_directory(temporary: str, path: str) -> None:
    """Puts `temporary` at `path`; an old `path` is removed only after.

    Between the two renames `path` is briefly absent while the old one sits
    at `<path>.old`; `recover` puts it back if the process died there.

    Args:
        temporary: A complete checkpoint directory made by
            `make_temporary(path)` (its marker removed).
        path: Where it goes.

    Raises:
        CheckpointError: if `path` holds something kd did not write.

    Example:

    >>> temporary = make_temporary(path)
    >>> ...  # write it whole
    >>> commit_directory(temporary, path)
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


def link_committed(source: str, target: str, owner: Optional[str]) -> None:
    """Puts a copy of the committed checkpoint `source` at `target`,
    atomically: its files hard-linked (copied where the file system cannot
    link), its index written anew with `owner` (so whoever deletes the copy
    is proven by the copy itself, and deleting it leaves `source` whole).

    Args:
        source: A committed checkpoint kd wrote.
        target: Where the copy goes (refused if it holds something kd did
            not write).
        owner: The owner recorded in the copy's index (`None`: none).

    Raises:
        CheckpointError: if `source` is not a committed checkpoint, holds
            anything but plain files, or `target` is not kd's.

    Example:

    >>> link_committed("/tmp/run/ckpt-30", "/tmp/run/best/ckpt-30",
    ...                owner="CheckpointManager/ckpt")
    """
    if not is_checkpoint(source):
        raise CheckpointError(
            f"Expected a committed checkpoint to link. Received: {source!r} "
            f"(it has no {INDEX}).")
    index = load_index_json(os.path.join(source, INDEX))
    if not isinstance(index, dict):
        raise CheckpointError(
            f"The index of {source!r} is not a JSON object; not linked.")
    refuse_foreign(target)
    temporary = make_temporary(target)
    try:
        for name in os.listdir(source):
            from_path = os.path.join(source, name)
            if name == INDEX:
                continue
            if os.path.islink(from_path) or not os.path.isfile(from_path):
                raise CheckpointError(
                    f"{from_path!r} is not a plain file; a checkpoint kd "
                    "wrote holds only files. Not linked.")
            to_path = os.path.join(temporary, name)
            try:
                os.link(from_path, to_path, follow_symlinks=False)
            except OSError:
                shutil.copy2(from_path, to_path, follow_symlinks=False)
        if owner is None:
            index.pop("owner", None)
        else:
            index["owner"] = owner
        _write_json(os.path.join(temporary, INDEX), index)
        os.remove(os.path.join(temporary, TEMPORARY_MARKER))
        commit_directory(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


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
