"""Reading the sharded checkpoint format (see `format`): the index, and
the global regions of a variable, each stored piece verified against its
checksum (XXH3-128, or sha256 in format 1) as it is read.

A checkpoint is untrusted input (see the threat model in
docs/checkpointing.md). The index is validated as a whole when it is read
(`validate`), so nothing downstream meets a malformed record; shard files
are opened only by the names this format writes, inside the checkpoint
directory, never through a symlink; a piece is read from the byte range
the index records for it (kd writes one for every piece but scalars) once
that range lies inside its file, else only after its HDF5 links, layout,
storage and dtype were checked; and only once every piece a read needs was
checked against the bytes its file really holds, its checksum verified
before it is used — so no read touches a file outside the directory, runs
code, or allocates more than the files justify. Every refusal is a
`CheckpointError`.
"""

import math
import os
import stat
from types import MappingProxyType
from typing import Any
from typing import Dict
from typing import Iterable
from typing import List
from typing import NamedTuple
from typing import Optional
from typing import Protocol
from typing import Tuple

import numpy as np

from keras_distribute.backend.interface import whole_region
from keras_distribute.checkpoint.storage import parallel_io
from keras_distribute.checkpoint.storage import validation
from keras_distribute.checkpoint.storage.format import CHECKSUM_FIELDS
from keras_distribute.checkpoint.storage.format import INDEX
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.format import CheckpointStorageError
from keras_distribute.checkpoint.storage.format import Slice
from keras_distribute.checkpoint.storage.format import load_index_json
from keras_distribute.checkpoint.storage.format import new_digest
from keras_distribute.checkpoint.storage.format import numpy_dtype
from keras_distribute.checkpoint.storage.format import storable_dtype


def locate(path: str) -> str:
    """Where the committed checkpoint `path` lies now: `path`, or
    `<path>.old` when a commit died between its two renames (the writer or
    the manager puts it back, `writing.recover`; a read changes nothing on
    disk).

    Args:
        path: A checkpoint directory.

    Returns:
        `<path>.old` when `path` is absent and `<path>.old` holds a
        committed checkpoint; else `path` (`read_index` then explains).

    Example:

    ```python
    index = read_index(locate(path))
    ```
    """
    old = f"{os.path.abspath(path)}.old"
    # Only a directory the commit left: never a link put there.
    if (not os.path.lexists(path) and not os.path.islink(old)
            and os.path.isfile(os.path.join(old, INDEX))):
        return old
    return path


def read_index(path: str) -> dict:
    """Reads and checks the index of the committed checkpoint at `path`
    (`locate` first, for one a commit left at `<path>.old`).

    Raises:
        CheckpointError: if `path` is not a committed checkpoint, its index
            is unreadable or malformed, or its format version is newer than
            this library.
    """
    index_path = os.path.join(path, INDEX)
    if not os.path.isfile(index_path):
        raise CheckpointError(
            f"{path!r} is not a committed keras_distribute checkpoint (no "
            f"{INDEX}): it may not exist, or a save did not finish. Use "
            "kd.checkpoint.latest_checkpoint(directory) to find the last "
            "complete one.")
    _check_regular_file(path, INDEX, INDEX)
    index: dict = load_index_json(index_path)
    validation.validate_index(index, index_path)
    return index


def read_whole(path: str, record: dict,
               shards: Optional["OpenShards"] = None) -> np.ndarray:
    """The whole of one saved variable (see `read_regions`)."""
    (value,) = read_regions(path, record, [whole_region(record["shape"])],
                            shards=shards)
    return value


class OpenShards:
    """The shard files of one checkpoint, opened once for many reads.

    A restore reads thousands of variables from a few shard files: opening
    and checking each file once, rather than once per variable, is what
    makes restoring many small variables as fast as saving them. Each file
    is still checked (a regular file inside the checkpoint directory, never
    through a symlink) before it is first opened, and every dataset before
    it is read. Use as a context manager; everything is closed on exit.

    Args:
        path: The committed checkpoint directory.

    Example:

    ```python
    with reading.OpenShards(path) as shards:
        values = [reading.read_whole(path, record, shards)
                  for record in index["variables"].values()]
    ```
    """

    def __init__(self, path: str):
        self.path = path
        self.files: Dict[str, Any] = {}  # name -> h5py.File
        self.descriptors: Dict[str, int] = {}  # name -> raw descriptor
        self.checked: Dict[str, str] = {}  # name -> checked full path
        self.sizes: Dict[str, int] = {}  # name -> bytes, when first opened
        self.roots: Dict[str, Any] = {}  # name -> its root group's id
        # files in object storage, read by byte ranges (`read_remotely`)
        self.remote = _remote.get(os.path.realpath(path))

    def __enter__(self) -> "OpenShards":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Closes every file opened so far (it may be used again)."""
        files, descriptors = self.files, self.descriptors
        self.files, self.descriptors = {}, {}
        self.checked, self.sizes, self.roots = {}, {}, {}
        for h5 in files.values():
            h5.close()
        for descriptor in descriptors.values():
            os.close(descriptor)
        if self.remote is not None:
            self.remote.release()


def _overlap(a: Slice, b: Slice) -> Optional[Slice]:
    region = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1)
                   in zip(a, b))
    return region if all(lo < hi for lo, hi in region) or not region else None


def read_regions(path: str, record: dict, regions: Iterable[Slice],
                 into: Optional[List[Optional[np.ndarray]]] = None,
                 shards: Optional[OpenShards] = None) -> List[np.ndarray]:
    """Reads the global `regions` of one variable, verifying every piece.

    `record` comes from an index `read_index` validated: its pieces tile
    the variable exactly. Every piece the regions need is first checked
    against its shard file (a dataset of that size, stored in the file);
    then each is read once, checked against its checksum, copied into the
    regions it overlaps and dropped: no more than one stored piece and the
    requested regions are in memory at a time.

    `into` may give, per region, the array to fill in place (C-contiguous,
    writable, of the region's shape; e.g. a variable's own memory): of the
    saved dtype, a piece that is the whole region is read straight into
    it; of another, the values are cast into it. A piece whose checksum
    fails leaves it holding those bytes (the restore fails).

    `shards` keeps the shard files open across the reads of one restore
    (see `OpenShards`); without it they are opened for this call only.

    Raises:
        CheckpointError: on a missing, truncated, corrupted or hostile
            shard file, or a region outside the variable.
        ValueError: for an `into` array that does not fit its region.
    """
    shape = tuple(record["shape"])
    regions = [tuple((int(lo), int(hi)) for lo, hi in region)
               for region in regions]
    for region in regions:
        if len(region) != len(shape) or any(
                not 0 <= lo <= hi <= n for (lo, hi), n in zip(region, shape)):
            raise CheckpointError(
                f"Region {region} is outside the saved variable of shape "
                f"{shape} in {path!r}.")
    dtype = numpy_dtype(record["dtype"])
    # (piece, stored slice, [(region number, overlap)])
    plan: List[Tuple[dict, Slice, List[Tuple[int, Slice]]]] = []
    for piece in record["pieces"]:
        stored = tuple((int(lo), int(hi)) for lo, hi in piece["slice"])
        wanted = []
        for i, region in enumerate(regions):
            overlap = _overlap(stored, region)
            if overlap is not None:
                wanted.append((i, overlap))
        if wanted:
            plan.append((piece, stored, wanted))
    out: List[Any] = [np.empty([hi - lo for lo, hi in region], dtype)
           if any(hi == lo for lo, hi in region) else None  # empty
           for region in regions]
    cast_into = {}  # region -> an `into` array of another dtype
    for i, target in enumerate(into or ()):
        if target is None:
            continue
        wanted_shape = tuple(hi - lo for lo, hi in regions[i])
        if (target.shape != wanted_shape or not target.flags.c_contiguous
                or not target.flags.writeable):
            raise ValueError(
                f"Expected `into[{i}]` to be a writable C-contiguous array "
                f"of shape {wanted_shape}. Received: {target.dtype} of shape "
                f"{target.shape}.")
        if target.dtype == dtype:
            out[i] = target
        else:  # read as saved, then cast into it
            cast_into[i] = target
    filled = [False] * len(regions)
    own_shards = shards is None
    opened = OpenShards(path) if shards is None else shards
    try:
        # Every dataset is checked before anything is allocated or read.
        datasets = [_checked_dataset(opened, piece, dtype)
                    for piece, _, _ in plan]
        for (piece, stored, wanted), dataset in zip(plan, datasets):
            whole = [i for i, overlap in wanted
                     if overlap == stored == regions[i]]
            destination = next((out[i] for i in whole if out[i] is not None),
                               None)
            data = _read_verified(
                path, piece, dataset, dtype, None if dataset.remote
                else _descriptor(opened, piece), destination)
            for i, overlap in wanted:
                if i in whole:  # the whole piece
                    if out[i] is None:
                        out[i] = data
                    elif out[i] is not data:
                        out[i][...] = data
                    filled[i] = True
                    continue
                filled[i] = True
                source = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _)
                               in zip(overlap, stored))
                target = tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _)
                               in zip(overlap, regions[i]))
                if out[i] is None:
                    out[i] = parallel_io.aligned_empty(
                        [hi - lo for lo, hi in regions[i]], dtype)
                out[i][target] = data[source]
    finally:
        if own_shards:
            opened.close()
    for i, region in enumerate(regions):
        if out[i] is None or not (filled[i] or out[i].size == 0):
            # cannot happen with a validated index
            raise CheckpointError(
                f"The checkpoint at {path!r} does not cover region {region} "
                "of a variable: its pieces are incomplete.")
    for i, target in cast_into.items():
        target[...] = out[i]
        out[i] = target
    return out


class RemoteFiles(Protocol):
    """The files of a checkpoint in object storage, as its local copy reads
    them (`remote_reading.RemoteShardFiles`)."""

    def fetch(self, name: str) -> None:
        """Puts the whole file `name` into the local copy (once)."""

    def size(self, name: str) -> int:
        """The size the index records for file `name`."""

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        """Fills `buffer` with the bytes of file `name` from `offset`."""

    def release(self) -> None:
        """Drops what the reads kept in memory (a restore ended)."""

    def url(self, name: str) -> str:
        """Where file `name` lies in the store."""


# Local copies of checkpoints in object storage: real directory -> files.
_remote: Dict[str, RemoteFiles] = {}


def read_remotely(directory: str, files: Optional[RemoteFiles]) -> None:
    """Makes the reads of `directory`'s shard files go to `files`; `None`
    ends that.

    A piece whose byte offset the index records is read as a byte range
    straight into its memory; anything else (a scalar, a checkpoint
    written before offsets were recorded) first fetches its whole file
    into `directory`.

    Args:
        directory: A local copy of a checkpoint, its index already there.
        files: Its files; its methods raise `CheckpointError` for a name
            the index does not give.
    """
    key = os.path.realpath(directory)
    if files is None:
        _remote.pop(key, None)
    else:
        _remote[key] = files


def _check_regular_file(path: str, name: str, entry: str) -> str:
    """`path/name`, refused unless it is a regular file inside `path` (no
    symlink, no path separator: the names come from the index)."""
    remote = _remote.get(os.path.realpath(path))
    if remote is not None and name != INDEX:
        remote.fetch(name)
    full = os.path.join(path, name)
    try:
        mode = os.lstat(full).st_mode
    except OSError as error:
        raise CheckpointError(
            f"The shard file {full!r} (entry {entry!r}) is missing ("
            f"{error.strerror}). Restore an earlier checkpoint.") from None
    if not stat.S_ISREG(mode) or os.path.dirname(os.path.realpath(full)) != (
            os.path.realpath(path)):
        raise CheckpointError(
            f"Refusing {full!r} (entry {entry!r}): a checkpoint file must be "
            "a regular file inside the checkpoint directory, not a symlink "
            "or special file. Copy the real files into the checkpoint "
            "directory if you trust them.")
    return full


class _Stored(NamedTuple):
    """Where a checked piece's bytes lie: `offset` in its file, as `dtype`
    of `shape`; `scalar` is the h5py dataset id of a 0-d piece (HDF5 may
    keep a scalar anywhere: it is read through h5py)."""
    shape: Tuple[int, ...]
    dtype: np.dtype
    offset: int
    scalar: Any = None
    remote: Optional[RemoteFiles] = None  # read as a byte range from there


# h5py.h5l.TYPE_SOFT and TYPE_EXTERNAL, named as h5py's link classes
_LINK_KINDS = MappingProxyType({1: "SoftLink", 64: "ExternalLink"})


def _checked_dataset(shards: OpenShards, piece: dict,
                     dtype: np.dtype) -> _Stored:
    """Where `piece`'s bytes lie, once it is known that its file holds
    them.

    A piece the writer recorded the byte `offset` of (kd writes it for
    every piece that is neither a scalar nor empty) is checked against the
    file's size only: its bytes are read from there and verified by their
    checksum, without parsing the file's HDF5 metadata (which cost ~0.2 ms per
    piece: most of the time of restoring thousands of small variables).
    Others (checkpoints written before, scalars) are looked up in the HDF5
    file: hard links only; contiguous storage in the file, no external
    storage, no virtual dataset, no filters; a numeric dtype of the
    declared size."""
    import h5py

    path, name, entry = shards.path, piece["file"], piece["dataset"]
    expected = tuple(hi - lo for lo, hi in piece["slice"])
    nbytes = math.prod(expected) * dtype.itemsize
    ranged = shards.remote is not None and "offset" in piece
    full = shards.checked.get(name)
    if full is None and not (ranged and expected and nbytes):
        full = shards.checked[name] = _check_regular_file(path, name, entry)
    if "offset" in piece and expected and nbytes:
        offset = piece["offset"]
        size = (shards.remote.size(name) if ranged and shards.remote
                else _file_size(shards, piece))
        if offset + nbytes > size:
            raise CheckpointError(
                f"Refusing piece {entry!r} of {os.path.join(path, name)!r}: "
                f"its {nbytes} bytes at offset {offset} lie beyond the end "
                f"of the file ({size} bytes). The file is truncated or the "
                "index was crafted. Restore an earlier checkpoint.")
        return _Stored(expected, storable_dtype(dtype), offset,
                       remote=shards.remote if ranged else None)

    def refuse(reason: str) -> CheckpointError:
        return CheckpointError(
            f"Refusing dataset {entry!r} of {full!r}: {reason}. A "
            "keras_distribute checkpoint holds only plain contiguous numeric "
            "datasets; this file is corrupt or was crafted. Restore an "
            "earlier checkpoint.")

    try:
        from h5py import h5d
        from h5py import h5i
        from h5py import h5l
        from h5py import h5o

        node = shards.roots.get(name)
        if node is None:
            h5 = shards.files[name] = h5py.File(full, "r")
            node = shards.roots[name] = h5o.open(h5.id, b"/")
        parts = entry.split("/")
        for number, part in enumerate(parts):
            raw = part.encode()
            if not node.links.exists(raw):
                raise refuse(f"{part!r} is missing")
            kind = node.links.get_info(raw).type
            if kind != h5l.TYPE_HARD:
                link_kind = _LINK_KINDS.get(kind, "UserLink")
                raise refuse(f"{part!r} is a {link_kind} "
                             "(only hard links are followed)")
            node = h5o.open(node, raw)
            wanted = h5i.DATASET if number == len(parts) - 1 else h5i.GROUP
            if h5i.get_type(node) != wanted:
                wanted_kind = "dataset" if wanted == h5i.DATASET else "group"
                raise refuse(f"{part!r} is not a {wanted_kind}")
        plist = node.get_create_plist()
        if plist.get_layout() != h5d.CONTIGUOUS:
            raise refuse("its storage is virtual, chunked or compact")
        if plist.get_external_count() or plist.get_nfilters():
            raise refuse("it uses external raw storage or filters")
        stored_dtype = node.dtype
        if stored_dtype.hasobject or stored_dtype != storable_dtype(dtype):
            raise refuse(f"its dtype {stored_dtype} is not what the declared "
                         f"{dtype.name} is stored as")
        if tuple(node.shape) != expected:
            raise refuse(f"its shape {tuple(node.shape)} is not the "
                         f"index's {expected}")
        offset = node.get_offset()
        if nbytes and (offset is None or node.get_storage_size() != nbytes
                       or offset + nbytes > _file_size(shards, piece)):
            raise refuse(f"the file does not hold its {nbytes} bytes")
        return _Stored(expected, stored_dtype, offset or 0,
                       node if not expected else None)
    except CheckpointError:
        raise
    except Exception as error:  # h5py: OSError, KeyError, ValueError...
        raise CheckpointError(
            f"The shard file {full!r} (entry {entry!r}) is missing, truncated "
            f"or corrupt ({type(error).__name__}: {str(error)[:200]}). "
            "Restore an earlier checkpoint.") from None


def _descriptor(shards: OpenShards, piece: dict) -> int:
    """The open file of `piece` (its name was checked by `_checked_dataset`:
    a regular file inside the directory), never through a symlink."""
    path, descriptors, name = shards.path, shards.descriptors, piece["file"]
    if name not in descriptors:
        full = os.path.join(path, name)
        try:
            descriptor = os.open(full, os.O_RDONLY | getattr(
                os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as error:
            raise CheckpointError(
                f"The shard file {full!r} cannot be opened "
                f"({error.strerror}). Restore an earlier checkpoint.") from None
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise CheckpointError(
                f"Refusing {full!r}: not a regular file.")
        descriptors[name] = descriptor
    return descriptors[name]


def _file_size(shards: OpenShards, piece: dict) -> int:
    """The size of `piece`'s file, as the descriptor it is read through
    sees it."""
    name = piece["file"]
    if name not in shards.sizes:
        shards.sizes[name] = os.fstat(_descriptor(shards, piece)).st_size
    return shards.sizes[name]


def _read_verified(path: str, piece: dict, stored: _Stored, dtype: np.dtype,
                   descriptor: Optional[int],
                   destination: Optional[np.ndarray] = None) -> np.ndarray:
    """A piece's data, read straight from its place in the file (or, in
    object storage, its byte range) into `destination` (else new aligned
    memory), in parallel blocks, and checked against its checksum.
    `_checked_dataset` made sure the file holds it there, stored as `dtype`
    in this machine's byte order."""
    full = os.path.join(path, piece["file"])
    field = next(f for f in CHECKSUM_FIELDS if f in piece)
    data = (parallel_io.aligned_empty(stored.shape, stored.dtype)
            if destination is None else destination.view(stored.dtype))
    try:
        if stored.scalar is not None:  # a scalar: through h5py
            from h5py import h5s

            stored.scalar.read(h5s.ALL, h5s.ALL, data)
        elif stored.remote is not None and data.nbytes:
            stored.remote.read_into(piece["file"], stored.offset, memoryview(
                data.reshape(-1).view(np.uint8)))
        elif data.nbytes and descriptor is not None:
            parallel_io.read_at(descriptor, data, stored.offset)
    except (CheckpointError, CheckpointStorageError):
        raise
    except Exception as error:  # OSError, EOFError; h5py's
        if stored.remote is not None:  # (its bytes never arrived)
            raise CheckpointStorageError(
                f"Reading {piece['dataset']!r} of "
                f"{stored.remote.url(piece['file'])!r} from its store "
                f"failed ({type(error).__name__}: {str(error)[:200]}): the "
                "store did not answer; the checkpoint was not found corrupt. "
                "Check the network and the endpoint, then try again.") from (
                    error)
        raise CheckpointError(
            f"The shard file {full!r} (entry {piece['dataset']!r}) is "
            f"truncated or corrupt ({type(error).__name__}: "
            f"{str(error)[:200]}). Restore an earlier checkpoint.") from None
    digest = new_digest(field)
    digest.update(data.reshape(-1).view(np.uint8))
    if digest.hexdigest() != piece[field]:
        raise CheckpointError(
            f"The data of {piece['dataset']!r} in {full!r} does not "
            "match its checksum: the file is corrupt. Restore an earlier "
            "checkpoint.")
    if destination is not None:
        return destination
    return data.view(dtype) if data.dtype != dtype else data
