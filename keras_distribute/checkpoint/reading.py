"""Reading the sharded checkpoint format (see `format`): the index, and
the global regions of a variable, each stored piece verified against its
sha256 as it is read."""

import hashlib
import json
import os
from typing import Any, Iterable, List, Optional, Tuple

import numpy as np

from keras_distribute.checkpoint.format import FORMAT
from keras_distribute.checkpoint.format import FORMAT_VERSION
from keras_distribute.checkpoint.format import INDEX
from keras_distribute.checkpoint.format import CheckpointError
from keras_distribute.checkpoint.format import Slice
from keras_distribute.checkpoint.format import numpy_dtype
from keras_distribute.checkpoint.format import recover


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
    dtype = numpy_dtype(record["dtype"])
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
