"""Reading a checkpoint in object storage: a local copy of its index,
then each piece's byte range read from the store straight into memory,
only within what the index may claim, and checked as a checkpoint on disk
is (`reading`, `validation`). Framework-free."""

import atexit
import json
import os
import shutil
import tempfile
import threading
from typing import Dict
from typing import List
from typing import Tuple

from keras_distribute.checkpoint.storage import reading
from keras_distribute.checkpoint.storage import validation
from keras_distribute.checkpoint.storage.format import INDEX
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import numpy_dtype
from keras_distribute.checkpoint.storage.remote_checkpoints import generation_of
from keras_distribute.checkpoint.storage.remote_checkpoints import read_index
from keras_distribute.checkpoint.storage.remote_ranges import RemoteShardFiles

_downloads: Dict[str, Tuple[str, str]] = {}  # path -> (generation, local)
_downloads_lock = threading.Lock()
_KEPT_DOWNLOADS = 2


def download(path: str) -> str:
    """A local copy of the committed checkpoint at `path`, to read.

    Downloads the index into a private temporary directory (removed when
    the process exits; the last `_KEPT_DOWNLOADS` are kept for reads of the
    same checkpoint); the local reader then reads each piece's byte range
    from the store (`RemoteShardFiles`), so a process fetches only the
    bytes of the pieces it reads (a scalar's whole file, once). A file is
    read only if its size is the one the index records and its pieces can
    justify; the reader checks the rest (format, checksums).

    Returns:
        The local directory.

    Raises:
        CheckpointError: if `path` holds no committed checkpoint, or it
            is malformed; a read of a file that a newer save replaced
            meanwhile raises it too (read the checkpoint again).
    """
    index = read_index(path)
    generation = generation_of(index, path)
    with _downloads_lock:
        cached = _downloads.get(path)
    if cached is not None and cached[0] == generation and os.path.isdir(
            cached[1]):
        return cached[1]
    local = _local_copy(path, index, generation)
    with _downloads_lock:
        _downloads[path] = (generation, local)
        while len(_downloads) > _KEPT_DOWNLOADS:
            oldest = _downloads.pop(next(iter(_downloads)))[1]
            reading.read_remotely(oldest, None)
            shutil.rmtree(oldest, ignore_errors=True)
    return local


# What a shard file may hold beyond its pieces' bytes: HDF5's superblock,
# heaps and one object header per piece (kd's files: ~2 KiB + ~0.7 KiB per
# piece).
_FILE_ALLOWANCE = 1 << 16
_PIECE_ALLOWANCE = 1 << 13


def _justified_sizes(index: dict) -> Dict[str, int]:
    """`file -> the most bytes it may have`: the bytes of the pieces the
    (validated) index puts in it, plus HDF5's bookkeeping."""
    sizes: Dict[str, int] = {}
    for record in index["variables"].values():
        itemsize = numpy_dtype(record["dtype"]).itemsize
        for piece in record["pieces"]:
            count = 1
            for start, stop in piece["slice"]:
                count *= max(0, int(stop) - int(start))
            name = piece["file"]
            sizes[name] = (sizes.get(name, _FILE_ALLOWANCE) + _PIECE_ALLOWANCE
                           + count * itemsize)
    return sizes


def _local_copy(path: str, index: dict, generation: str) -> str:
    """The checked index in a new private directory, its files fetched
    when first read."""
    files = index["object_store"].get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and validation.SHARD_FILE.fullmatch(name)
            and isinstance(size, int) and not isinstance(size, bool)
            and size >= 0 for name, size in files.items()):
        raise CheckpointError(
            f"The index of {path!r} lists its files wrongly (expected "
            "'shards-NNNNN.h5' -> a size in bytes); not read.")
    # (`read_index` validated the variables and their pieces)
    named = {piece["file"] for record in index["variables"].values()
             for piece in record["pieces"]}
    unlisted = sorted(named - set(files))
    if unlisted:
        raise CheckpointError(
            f"The index of {path!r} names files it does not list with a "
            f"size ({unlisted[:3]}); not read.")
    justified = _justified_sizes(index)
    for name in named:
        if files[name] > justified.get(name, 0):
            raise CheckpointError(
                f"The index of {path!r} lists {name} at {files[name]} bytes, "
                f"more than the {justified.get(name, 0)} its pieces (and "
                "HDF5's bookkeeping) can take; not downloaded.")
    local = tempfile.mkdtemp(prefix="kd-checkpoint-")
    with open(os.path.join(local, INDEX), "w") as f:
        json.dump(index, f)
    placed: Dict[str, List[Tuple[int, int]]] = {}
    for record in index["variables"].values():
        itemsize = numpy_dtype(record["dtype"]).itemsize
        for piece in record["pieces"]:
            if "offset" in piece:
                count = 1
                for start, stop in piece["slice"]:
                    count *= int(stop) - int(start)
                placed.setdefault(piece["file"], []).append(
                    (int(piece["offset"]), count * itemsize))
    reading.read_remotely(local, RemoteShardFiles(
        path, generation, local, {name: files[name] for name in named},
        placed))
    return local


def _forget_downloads_after_fork() -> None:
    # The parent's copies are the parent's: a child's exit leaves them.
    global _downloads_lock
    _downloads.clear()
    _downloads_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_downloads_after_fork)


@atexit.register
def _remove_downloads() -> None:
    with _downloads_lock:
        for _, local in _downloads.values():
            reading.read_remotely(local, None)
            shutil.rmtree(local, ignore_errors=True)
        _downloads.clear()
