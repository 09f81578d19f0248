"""Validation of a checkpoint index read from disk (untrusted input).

`validate_index` checks the whole structure once, when the index is read,
so the readers never meet a malformed record: every variable has a shape of
non-negative integers, a numeric dtype, and pieces that name a shard file of
this format, a dataset name of this format, a checksum, and global slices
that lie inside the shape and tile it exactly (no gap a read would leave
uninitialised, no overlap). Every refusal is a `CheckpointError` naming the
index file and the entry.
"""

import re
from types import MappingProxyType
from typing import Any
from typing import NoReturn
from typing import Sequence

from keras_distribute.checkpoint.storage.format import CHECKSUM_FIELDS
from keras_distribute.checkpoint.storage.format import FORMAT
from keras_distribute.checkpoint.storage.format import FORMAT_VERSION
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import numpy_dtype

# The names this format writes (format.write_process_shards): nothing else
# is ever opened, so an index cannot point outside its directory.
SHARD_FILE = re.compile(r"shards-\d{5}\.h5")
DATASET = re.compile(r"v\d{1,9}/p\d{1,9}")
CHECKSUMS = MappingProxyType({field: re.compile(f"[0-9a-f]{{{length}}}")
             for field, length in CHECKSUM_FIELDS.items()})
_MAX_RANK = 64
_MAX_PIECES = 1 << 16
# No array of more elements can be allocated (numpy refuses 2**63 bytes).
_MAX_ELEMENTS = 1 << 56


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(index_path: str, entry: str, expected: str,
          received: Any) -> NoReturn:
    text = repr(received)
    raise CheckpointError(
        f"The index {index_path!r} is malformed at {entry!r}: expected "
        f"{expected}, received {text[:120]}{'...' if len(text) > 120 else ''}."
        " The checkpoint is corrupt or was not written by keras_distribute; "
        "restore an earlier checkpoint.")


def validate_index(index: Any, index_path: str) -> None:
    """Raises `CheckpointError` unless `index` is a well-formed index.

    Args:
        index: The parsed JSON of an `index.json`.
        index_path: Its path, named in every error.
    """
    if not isinstance(index, dict):
        _fail(index_path, "(top level)", "a JSON object", type(index).__name__)
    if index.get("format") != FORMAT or not isinstance(
            index.get("variables"), dict):
        raise CheckpointError(
            f"{index_path!r} is not a keras_distribute checkpoint index. "
            f"Expected format={FORMAT!r} and a 'variables' object; received "
            f"format={index.get('format')!r}.")
    version = index.get("format_version", 0)
    if not _is_int(version):
        _fail(index_path, "format_version", "an integer", version)
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{index_path!r} has format version {version}, newer than this "
            f"keras_distribute reads ({FORMAT_VERSION}). Upgrade "
            "keras_distribute.")
    for field in ("save_counter", "num_processes"):
        value = index.get(field, 0)
        if not _is_int(value) or value < 0:
            _fail(index_path, field, "a non-negative integer", value)
    if not isinstance(index.get("metadata", {}), dict):
        _fail(index_path, "metadata", "a JSON object", index["metadata"])
    mesh = index.get("mesh_shape")
    if mesh is not None and not (isinstance(mesh, list) and all(
            _is_int(n) and n >= 0 for n in mesh)):
        _fail(index_path, "mesh_shape", "a list of integers or null", mesh)
    for field in ("backend", "owner"):
        if not isinstance(index.get(field), (str, type(None))):
            _fail(index_path, field, "a string", index[field])
    for key, record in index["variables"].items():
        validate_record(record, index_path, f"variables/{key}")
    paths = index.get("object_paths", {})
    if not isinstance(paths, dict):
        _fail(index_path, "object_paths", "a JSON object", paths)
    for path, key in paths.items():
        if not isinstance(key, str) or key not in index["variables"]:
            _fail(index_path, f"object_paths/{path}",
                  "the key of a saved variable", key)


# A piece's "offset" (where its bytes lie in its shard file) is below this.
_MAX_OFFSET = 1 << 62


def validate_record(record: Any, index_path: str, entry: str) -> None:
    """Raises `CheckpointError` unless `record` is a well-formed variable."""
    if not isinstance(record, dict):
        _fail(index_path, entry, "an object", record)
    shape = record.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(
            _is_int(n) and n >= 0 for n in shape):
        _fail(index_path, f"{entry}/shape",
              "a list of non-negative integers", shape)
    extent = 1  # what numpy must address, zero-sized dimensions aside
    for n in shape:
        extent *= max(n, 1)
    if extent > _MAX_ELEMENTS:
        _fail(index_path, f"{entry}/shape",
              f"at most {_MAX_ELEMENTS} elements (zero-sized dimensions "
              "aside)", shape)
    try:
        numpy_dtype(record.get("dtype"))
    except CheckpointError as error:
        raise CheckpointError(f"{index_path!r}, {entry!r}: {error}") from None
    if not isinstance(record.get("path", ""), (str, type(None))):
        _fail(index_path, f"{entry}/path", "a string", record["path"])
    layout = record.get("layout")
    if layout is not None and not isinstance(layout, list):
        _fail(index_path, f"{entry}/layout", "a list", layout)
    pieces = record.get("pieces")
    if not isinstance(pieces, list) or len(pieces) > _MAX_PIECES:
        _fail(index_path, f"{entry}/pieces",
              f"a list of at most {_MAX_PIECES} pieces", pieces)
    slices = []
    for number, piece in enumerate(pieces):
        where = f"{entry}/pieces/{number}"
        if not isinstance(piece, dict):
            _fail(index_path, where, "an object", piece)
        for field, pattern, meaning in (
                ("file", SHARD_FILE, "a shard file name 'shards-NNNNN.h5'"),
                ("dataset", DATASET, "a dataset name 'v<N>/p<N>'")):
            value = piece.get(field)
            if not isinstance(value, str) or not pattern.fullmatch(value):
                _fail(index_path, f"{where}/{field}", meaning, value)
        sums = [field for field in CHECKSUMS if field in piece]
        for field in sums:
            value = piece[field]
            if not isinstance(value, str) or not CHECKSUMS[field].fullmatch(
                    value):
                _fail(index_path, f"{where}/{field}",
                      f"a {field} hex digest of {CHECKSUM_FIELDS[field]} "
                      "characters", value)
        if len(sums) != 1:
            _fail(index_path, where, "exactly one checksum field, "
                  f"{' or '.join(map(repr, CHECKSUMS))}", sorted(piece))
        offset = piece.get("offset", 0)
        if not _is_int(offset) or not 0 <= offset < _MAX_OFFSET:
            _fail(index_path, f"{where}/offset",
                  f"a byte offset from 0 to {_MAX_OFFSET - 1}", offset)
        region = piece.get("slice")
        if not isinstance(region, list) or len(region) != len(shape) or not all(
                isinstance(r, list) and len(r) == 2 and _is_int(r[0])
                and _is_int(r[1]) and 0 <= r[0] <= r[1] <= n
                for r, n in zip(region, shape)):
            _fail(index_path, f"{where}/slice",
                  f"{len(shape)} [start, stop] pairs inside shape {shape}",
                  region)
        slices.append(tuple(tuple(r) for r in region))
    _check_tiling(slices, shape, index_path, entry)


def _volume(region: Sequence[Sequence[int]]) -> int:
    total = 1
    for lo, hi in region:
        total *= hi - lo
    return total


# At most this many pieces are checked pairwise when they do not form a
# grid (kd writes grids: the pieces of a layout are a product of per-axis
# intervals); more is refused rather than checked in quadratic time.
_MAX_PAIRWISE = 256


def _check_tiling(slices: Sequence[Any], shape: Sequence[int],
                  index_path: str, entry: str) -> None:
    """The pieces cover the shape exactly once, in time linear in the
    pieces (n log n for the sort): their volumes add up to the whole, and
    each non-empty piece is one distinct cell of the grid their own
    boundaries make on every axis (disjoint cells whose volumes add up to
    the whole tile it). A few pieces that do not form such a grid are
    checked pairwise; many are refused."""
    total = 1
    for n in shape:
        total *= n
    covered = sum(_volume(s) for s in slices)
    if covered != total:
        _fail(index_path, f"{entry}/pieces",
              f"pieces covering shape {shape} exactly",
              f"{len(slices)} pieces of {covered} "
              f"elements for {total}")
    if not shape:
        if len(slices) != 1:
            _fail(index_path, f"{entry}/pieces", "one piece of a scalar",
                  f"{len(slices)} pieces")
        return
    pieces = [s for s in slices if _volume(s)]
    next_boundary = []  # per axis: boundary -> the next one
    for axis in range(len(shape)):
        bounds = sorted({b for s in pieces for b in s[axis]})
        next_boundary.append(dict(zip(bounds, bounds[1:])))
    is_grid = all(next_boundary[axis].get(lo) == hi
                  for s in pieces for axis, (lo, hi) in enumerate(s))
    if is_grid:
        corners = {tuple(lo for lo, _ in s) for s in pieces}
        if len(corners) != len(pieces):
            _fail(index_path, f"{entry}/pieces", "disjoint pieces",
                  "two pieces covering the same part of the variable")
        return
    if len(pieces) > _MAX_PAIRWISE:
        _fail(index_path, f"{entry}/pieces",
              f"pieces on a grid (or at most {_MAX_PAIRWISE} pieces)",
              f"{len(pieces)} pieces that do not form a grid")
    for number, region in enumerate(pieces):
        for other in pieces[:number]:
            if all(max(a0, b0) < min(a1, b1)
                   for (a0, a1), (b0, b1) in zip(region, other)):
                _fail(index_path, f"{entry}/pieces", "disjoint pieces",
                      f"{list(region)} overlaps {list(other)}")
