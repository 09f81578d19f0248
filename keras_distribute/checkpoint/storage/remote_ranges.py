"""A checkpoint's shard files in object storage, read by byte ranges
straight into memory: large pieces in large ranges with read-ahead, small
ones from blocks kept for their neighbours (`remote_reading` makes one per
local copy of an index; `reading.read_remotely`). Framework-free."""

import bisect
import concurrent.futures
import contextlib
import os
import threading
from collections import OrderedDict
from typing import Dict
from typing import Iterator
from typing import List
from typing import Optional
from typing import Tuple

from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import parallel_io
from keras_distribute.checkpoint.storage.format import CheckpointError

# A piece of at least `RANGE_CHUNK_BYTES` is read in ranges of about that
# size, up to `CONCURRENT_RANGES` at once. A smaller piece is read from
# blocks of `RANGE_BLOCK_BYTES`, the last `_KEPT_BLOCKS` of them kept for
# the pieces beside it (a model's small variables lie side by side).
# Large ranges: an S3 request has a fixed cost (moto's server even reads
# the whole object for each range), so a 256 MB restore took 2.2 s in
# 16 MiB ranges and 1.45 s in 32 MiB ones, s3fs's own get 1.3-1.5 s.
RANGE_CHUNK_BYTES = 32 << 20
CONCURRENT_RANGES = 4
RANGE_BLOCK_BYTES = 8 << 20
_KEPT_BLOCKS = 4
# Once a file's large pieces are read one after the other, the next ones
# are fetched ahead in the background, this many (refilled when half were
# read), neighbours in one range of at most `READAHEAD_RANGE_BYTES` (a
# restore reads a process's pieces in the order they were written; fewer,
# larger requests: see above).
READAHEAD_PIECES = 4
READAHEAD_RANGE_BYTES = 128 << 20


class RemoteShardFiles:
    """The shard files of one committed checkpoint in object storage, read
    by byte ranges (`reading.read_remotely`).

    A piece's bytes go straight from the store into its memory (a large
    piece in ranges of about `RANGE_CHUNK_BYTES`, `CONCURRENT_RANGES` at
    a time; a small one from a block of `RANGE_BLOCK_BYTES`, kept for its
    neighbours): a process reads only the bytes of the pieces it restores
    (a resharded restore reads parts of the writers' files), and nothing
    is written to a local file. Before its first read, each file's
    size in the store must be the size the index records (else it was
    replaced by a newer save); every piece is then checked against its
    checksum by the reader.

    Args:
        path: The checkpoint (`s3://...`, `gs://...`).
        generation: Its committed generation.
        local: The local copy's directory (whole files go there).
        sizes: `file name -> size` for every file the index's pieces name
            (checked against what the pieces justify).
        placed: `file name -> [(offset, bytes)]` of its pieces whose offset
            the index records.
    """

    def __init__(self, path: str, generation: str, local: str,
                 sizes: Dict[str, int],
                 placed: Optional[Dict[str, List[Tuple[int, int]]]] = None):
        self._path, self._generation, self._local = path, generation, local
        self._sizes = dict(sizes)
        self._store = object_store.store_for(path)
        self._lock = threading.Lock()
        self._checked: set = set()  # files whose stored size was checked
        self._blocks: "OrderedDict[Tuple[str, int], bytes]" = OrderedDict()
        # file -> its large pieces in file order; the last one read
        self._large = {name: sorted(p for p in pieces
                                    if p[1] >= RANGE_CHUNK_BYTES)
                       for name, pieces in (placed or {}).items()}
        self._last_read: Dict[str, int] = {}
        # (file, offset, bytes) -> (the range being read, where it starts)
        self._ahead: Dict[Tuple[str, int, int], Tuple[
            "concurrent.futures.Future[bytes]", int]] = {}
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def url(self, name: str) -> str:
        """Where file `name` of the checkpoint lies in the store."""
        return self._key(name)

    def _key(self, name: str) -> str:
        if name not in self._sizes:
            raise CheckpointError(
                f"The index of {self._path!r} names no file {name!r}; not "
                "read.")
        return object_store.join(self._path, self._generation, name)

    def size(self, name: str) -> int:
        """The size the index records for file `name`, once the store's
        object was found to be that size.

        Raises:
            CheckpointError: if the index names no such file, or the
                object is not the recorded size (replaced after the save).
        """
        key, size = self._key(name), self._sizes[name]
        if name not in self._checked:
            with self._replaced_is_an_error(name):
                found = self._store.size(key)
            if found != size:
                raise CheckpointError(
                    f"Not reading {self._path!r}: {key} is {found} bytes, "
                    f"but the checkpoint's index records {size}: it was "
                    "changed or replaced after the save.")
            self._checked.add(name)
        return size

    def fetch(self, name: str) -> None:
        """Downloads the whole file `name` into the local copy (once)."""
        key = self._key(name)
        target = os.path.join(self._local, name)
        with self._lock:
            if os.path.exists(target):
                return
            partial = target + ".part"
            with self._replaced_is_an_error(name):
                self._store.get(key, partial, self._sizes[name])
            os.replace(partial, target)

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        """Fills `buffer` with file `name`'s bytes from `offset`.

        Raises:
            CheckpointError: for a range outside the file, a file that a
                newer save replaced, or a store that answers short.
        """
        key, size = self._key(name), self.size(name)
        stop = offset + len(buffer)
        if offset < 0 or stop > size:
            raise CheckpointError(
                f"Refusing bytes {offset}-{stop} of {key}: the file has "
                f"{size} bytes.")
        if len(buffer) >= RANGE_CHUNK_BYTES:
            with self._lock:
                ahead = self._ahead.pop((name, offset, len(buffer)), None)
            if ahead is not None:
                future, start = ahead
                buffer[:] = memoryview(future.result())[
                    offset - start:offset - start + len(buffer)]
            else:
                self._read_large(name, key, offset, buffer)
            self._read_ahead(name, key, offset, len(buffer))
            return
        block = RANGE_BLOCK_BYTES
        numbers = range(offset // block, (stop - 1) // block + 1)

        def copy(number: int) -> None:
            block_start = number * block
            data = self._block(name, key, number, block_start,
                               min(size, block_start + block))
            start, end = max(offset, block_start), min(stop,
                                                       block_start + block)
            buffer[start - offset:end - offset] = memoryview(data)[
                start - block_start:end - block_start]

        parallel_io.in_threads(copy, list(numbers), CONCURRENT_RANGES,
                               "kd-range")

    def _read_large(self, name: str, key: str, offset: int,
                    buffer: memoryview) -> None:
        """A large piece's bytes, in ranges of about `RANGE_CHUNK_BYTES`
        read side by side."""
        count = len(buffer) // RANGE_CHUNK_BYTES
        edges = [offset + len(buffer) * i // count
                 for i in range(count + 1)]
        spans = list(zip(edges[:-1], edges[1:]))

        def read(span: Tuple[int, int]) -> None:
            start, end = span
            buffer[start - offset:end - offset] = self._read(
                name, key, start, end)

        parallel_io.in_threads(read, spans, CONCURRENT_RANGES, "kd-range")

    def _read_ahead(self, name: str, key: str, offset: int,
                    nbytes: int) -> None:
        """After the large piece at `offset` of `name`, when it follows the
        one read before it: fetches the next `READAHEAD_PIECES` large
        pieces in the background, neighbours in one range (`release`
        drops what was not read)."""
        pieces = self._large.get(name, [])
        number = bisect.bisect_left(pieces, (offset, nbytes))
        if number == len(pieces) or pieces[number] != (offset, nbytes):
            return
        with self._lock:
            sequential = self._last_read.get(name) == number - 1
            self._last_read[name] = number
            waiting = sum(1 for ahead in self._ahead if ahead[0] == name)
            if not sequential or waiting > READAHEAD_PIECES // 2:
                return
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    CONCURRENT_RANGES, thread_name_prefix="kd-readahead")
            runs: List[List[Tuple[int, int]]] = []
            for start, length in pieces[number + 1:
                                        number + 1 + READAHEAD_PIECES]:
                if start < 0 or start + length > self._sizes[name]:
                    break  # past the file (a crafted index): never read
                if (name, start, length) in self._ahead:
                    continue
                if runs and start >= sum(runs[-1][-1]) and (
                        start + length - runs[-1][0][0]
                        <= READAHEAD_RANGE_BYTES):
                    runs[-1].append((start, length))
                else:
                    runs.append([(start, length)])
            for run in runs:
                first, end = run[0][0], sum(run[-1])
                future = self._pool.submit(self._read, name, key, first, end)
                for start, length in run:
                    self._ahead[(name, start, length)] = (future, first)

    def release(self) -> None:
        """Drops the blocks kept for neighbouring pieces and the pieces
        read ahead (a restore ended)."""
        with self._lock:
            self._blocks.clear()
            self._ahead.clear()
            self._last_read.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _block(self, name: str, key: str, number: int, start: int,
               stop: int) -> bytes:
        with self._lock:
            data = self._blocks.get((name, number))
            if data is not None:
                self._blocks.move_to_end((name, number))
                return data
        data = self._read(name, key, start, stop)
        with self._lock:
            self._blocks[(name, number)] = data
            while len(self._blocks) > _KEPT_BLOCKS:
                self._blocks.popitem(last=False)
        return data

    def _read(self, name: str, key: str, start: int, stop: int) -> bytes:
        with self._replaced_is_an_error(name):
            data = self._store.read_range(key, start, stop)
        if len(data) != stop - start:
            raise CheckpointError(
                f"Reading bytes {start}-{stop} of {key}: the store answered "
                f"{len(data)} bytes. It was changed or replaced after the "
                "save; read the checkpoint again.")
        return data

    @contextlib.contextmanager
    def _replaced_is_an_error(self, name: str) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise CheckpointError(
                f"{self._path!r} was replaced by a newer save while it was "
                f"read (its {name} is gone); read it again.") from None
        except ValueError as error:
            raise CheckpointError(
                f"Not reading {self._path!r}: {error}") from None
