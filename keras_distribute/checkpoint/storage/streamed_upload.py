"""Uploading a laid-out shard file with its pieces sent from memory.

`writing.lay_out_shards` leaves a local file holding HDF5's metadata, with
each piece's bytes still unwritten at its offset. The object a save
uploads is that file with the pieces in place: the very bytes a local save
has on its disk. To S3 it goes as a multipart upload whose parts are
assembled in memory from the layout file's bytes and the pieces' arrays,
a few parts at a time, each sent while the next ones are assembled — the
pieces are never written to a local file and read back (a 256 MB save:
the file write was a tenth of its time). Peak extra memory: the parts in
flight (`CONCURRENT_PARTS` x `PART_BYTES`).

To GCS the same parts feed the store's own streaming upload (a resumable
upload in chunks of `PART_BYTES`), one after the other. Small files get
the pieces written into the layout file, which is then uploaded whole
(`Store.put`).

A save killed during the upload leaves an unfinished multipart upload,
which no listing shows as an object (the store's lifecycle rule or
`abort` removes it); the save's generation is never committed
(`remote_writing`). Framework-free.
"""

import bisect
import os
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import numpy as np

from keras_distribute.checkpoint.storage import parallel_io
from keras_distribute.checkpoint.storage import writing
from keras_distribute.checkpoint.storage.object_store import Store

# S3 parts: at least 5 MiB each but the last, at most 10,000 per object.
PART_BYTES = 16 << 20
CONCURRENT_PARTS = 4
_MAX_PARTS = 10_000
# GCS takes a resumable upload's chunks in multiples of 256 KiB.
_CHUNK_UNIT = 256 << 10


def upload(store: Store, layout_file: str, placed: List[writing.Placed],
           key: str) -> int:
    """Uploads the shard file `layout_file` completed by `placed` to `key`.

    Args:
        store: The object store of `key`.
        layout_file: A file `writing.lay_out_shards` wrote.
        placed: Its `(offset, array)` pieces, not yet in the file.
        key: The object to write (`s3://bucket/...`).

    Returns:
        The object's size in bytes (checked against the store's).

    Raises:
        OSError: if the upload fails (after the store's retries) or the
            stored object is not the expected size.
    """
    size = os.path.getsize(layout_file)
    part_bytes = max(PART_BYTES, -(-size // _MAX_PARTS))
    part_bytes = -(-part_bytes // _CHUNK_UNIT) * _CHUNK_UNIT
    if size < 2 * part_bytes:
        writing.write_placed(layout_file, placed, durable=False)
        store.put(layout_file, key)
        return size
    sources = _Sources(layout_file, size, placed)
    try:
        if store.scheme == "s3":
            _multipart(store, sources, key, size, part_bytes)
        else:
            store.call(f"Uploading {key}", _streamed, store, sources, key,
                       size, part_bytes, transfer_bytes=size)
    finally:
        sources.close()
    stored = store.size(key)
    if stored != size:
        raise OSError(f"Uploading {layout_file} to {key}: the store holds "
                      f"{stored} bytes, the file has {size}.")
    return size


class _Sources:
    """The bytes of the finished file, by range: the placed arrays where
    they lie, the layout file's bytes between them."""

    def __init__(self, layout_file: str, size: int,
                 placed: List[writing.Placed]):
        self._fd = os.open(layout_file, os.O_RDONLY | getattr(
            os, "O_CLOEXEC", 0))
        # (start, stop, bytes of the array or None for the file's own)
        spans: List[Tuple[int, int, Optional[memoryview]]] = []
        position = 0
        for offset, array in sorted(placed, key=lambda p: p[0]):
            data = memoryview(np.ascontiguousarray(array).reshape(-1)
                              .view(np.uint8))
            if offset < position or offset + len(data) > size:
                raise ValueError(
                    f"Pieces overlap or run past the end of {layout_file} "
                    f"(a piece of {len(data)} bytes at offset {offset}).")
            if offset > position:
                spans.append((position, offset, None))
            spans.append((offset, offset + len(data), data))
            position = offset + len(data)
        if position < size:
            spans.append((position, size, None))
        self._spans = spans
        self._starts = [span[0] for span in spans]

    def read(self, start: int, stop: int) -> bytearray:
        """The finished file's bytes `[start, stop)`."""
        buffer = bytearray(stop - start)
        view, origin = memoryview(buffer), start
        number = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            span_start, span_stop, data = self._spans[number]
            end = min(stop, span_stop)
            target = view[start - origin:end - origin]
            if data is None:
                if os.preadv(self._fd, [target], start) != end - start:
                    raise EOFError(f"the layout file ends at byte {start}")
            else:
                target[:] = data[start - span_start:end - span_start]
            start, number = end, number + 1
        return buffer

    def close(self) -> None:
        os.close(self._fd)


def _streamed(store: Store, sources: _Sources, key: str, size: int,
              part_bytes: int) -> None:
    """The store's own streaming upload (GCS: a resumable upload in
    chunks of `part_bytes`), fed part by part; discarded on any failure,
    so no partial object is left."""
    target = store.fs.open(key, "wb", block_size=part_bytes)
    try:
        for start in range(0, size, part_bytes):
            target.write(sources.read(start, min(size, start + part_bytes)))
    except BaseException:
        target.discard()
        raise
    target.close()


def _multipart(store: Store, sources: _Sources, key: str, size: int,
               part_bytes: int) -> None:
    """One S3 multipart upload of `sources` to `key`, its parts assembled
    and sent `CONCURRENT_PARTS` at a time; aborted on any failure."""
    fs = store.fs
    bucket, object_key, _ = fs.split_path(key)
    started = store.call(f"Starting the upload of {key}", fs.call_s3,
                         "create_multipart_upload", Bucket=bucket,
                         Key=object_key)
    upload_id = started["UploadId"]

    def send(number: int) -> Dict[str, Any]:
        start = (number - 1) * part_bytes
        body = bytes(sources.read(start, min(size, start + part_bytes)))
        answer = store.call(
            f"Uploading part {number} of {key}", fs.call_s3, "upload_part",
            Bucket=bucket, Key=object_key, UploadId=upload_id,
            PartNumber=number, Body=body, transfer_bytes=len(body))
        return {"PartNumber": number, "ETag": answer["ETag"]}

    count = -(-size // part_bytes)
    try:
        parts = parallel_io.in_threads(send, range(1, count + 1),
                                       CONCURRENT_PARTS, "kd-upload")
        store.call(f"Finishing the upload of {key}", fs.call_s3,
                   "complete_multipart_upload", Bucket=bucket,
                   Key=object_key, UploadId=upload_id,
                   MultipartUpload={"Parts": parts})
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket,
                       Key=object_key, UploadId=upload_id)
        except Exception:  # noqa: BLE001 - the lifecycle rule ends it
            pass
        raise
