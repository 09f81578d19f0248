"""Object storage (`s3://`, `gs://`) as kd's checkpoints use it.

Paths with these schemes go through fsspec's `s3fs` and `gcsfs` (the
`keras-distribute[s3]` and `[gcs]` extras), imported only when such a path
is used. Credentials, regions and endpoints come from each store's standard
environment (`AWS_*` variables and `~/.aws` for S3, `AWS_ENDPOINT_URL` for an
S3-API server that is not AWS; Google's application default credentials
for GCS, and `STORAGE_EMULATOR_HOST` for an emulator, which is reached
without credentials); kd never logs or writes them.

Every call is bounded in total time: connection and read timeouts, the
store client's retries of throttling and 5xx answers (botocore's
"standard" mode for S3, gcsfs' own for GCS), around each of kd's calls a
few more tries with backoff for errors of the network (never for a
missing object or a denied request), and over all of them one deadline
per operation (`KERAS_DISTRIBUTE_STORE_TIMEOUT_S`, default 120 s; a
transfer adds a second per MiB), after which the request in flight is
cancelled and `CheckpointStorageError` names the store and the operation.
Listings are never cached: a checkpoint written by another process is seen
at once. Framework-free.
"""

import os
import random
import secrets
import threading
import time
from typing import Any
from typing import Callable
from typing import Dict
from typing import List

from keras_distribute.checkpoint.storage import store_answers
from keras_distribute.checkpoint.storage import store_limits
from keras_distribute.checkpoint.storage.urls import (
    REMOTE_SCHEMES as REMOTE_SCHEMES,
)
from keras_distribute.checkpoint.storage.urls import is_remote as is_remote
from keras_distribute.checkpoint.storage.urls import join as join
from keras_distribute.checkpoint.storage.urls import normalize as normalize
from keras_distribute.checkpoint.storage.urls import split as split

# Tries of one call when the network fails (the client retried already).
_TRIES = 4
_BACKOFF_S = 0.5
# The retries' jitter: a stream of kd's own. A draw from Python's global
# `random` would move the user's (Keras draws an unseeded initializer's seed
# from it), at moments no one can predict when a heartbeat thread retries.
_JITTER = random.Random()


class Store:
    """One object store (one scheme), through its fsspec file system.

    Args:
        scheme: `"s3"` or `"gs"`.

    Raises:
        ImportError: if the scheme's fsspec package is not installed (the
            message names the extra to install).

    Example:

    >>> store = store_for("s3://bucket/run")
    >>> store.write_bytes("s3://bucket/run/a.json", b"{}")
    """

    def __init__(self, scheme: str):
        package, extra = REMOTE_SCHEMES[scheme]
        self.scheme = scheme
        self.timeout_s = store_limits.operation_timeout_s()
        # bucket -> whether it honours conditional writes (conditional_writes)
        self.honours_conditions: Dict[str, bool] = {}
        # (one request's own bound: a stalled read is cut well before the
        # operation's deadline, leaving time for a retry)
        read_timeout = max(1.0, min(60.0, self.timeout_s / 2))
        try:
            module = __import__(package)
        except ImportError:
            raise ImportError(
                f"{scheme}:// checkpoint paths need the `{package}` package. "
                f"Install it with `pip install keras-distribute[{extra}]` "
                f"(or `pip install {package}`).") from None
        if scheme == "s3":
            self.fs = module.S3FileSystem(
                use_listings_cache=False, skip_instance_cache=True,
                config_kwargs={"retries": {"max_attempts": 8,
                                           "mode": "standard"},
                               "connect_timeout": min(20.0, read_timeout),
                               "read_timeout": read_timeout})
        else:
            # (gcsfs.core's class: the package's default one first asks a
            # gRPC service whether the bucket is hierarchical, which an
            # emulator does not serve)
            import gcsfs.core

            emulated = bool(os.environ.get("STORAGE_EMULATOR_HOST"))
            self.fs = gcsfs.core.GCSFileSystem(
                use_listings_cache=False, skip_instance_cache=True,
                requests_timeout=read_timeout,
                **({"token": "anon"} if emulated else {}))

    def call(self, what: str, fn: Callable[..., Any], *args: Any,
             transfer_bytes: int = 0, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` (an fsspec file system's method), tried
        again with backoff (up to `_TRIES` times) when the network or the
        server fails, all within one deadline: `timeout_s`, plus a second
        per MiB of `transfer_bytes`. The request in flight at the deadline
        is cancelled (where `fn` is a method of `self.fs`; another function
        is tried again only while the deadline allows).

        Raises:
            CheckpointStorageError: the network or the server failed every
                try, or the deadline passed (naming `what`; an `OSError`).
        """
        budget = store_limits.budget_s(self.timeout_s, transfer_bytes)
        deadline = time.monotonic() + budget
        # (fsspec's own methods: bound, or mirrored onto the instance as a
        # wrapper of its bound coroutine method)
        cancellable = self.fs in (
            getattr(fn, "__self__", None),
            getattr(getattr(fn, "__wrapped__", None), "__self__", None))
        for attempt in range(_TRIES):
            remaining = deadline - time.monotonic()
            if cancellable:
                # (fsspec's synchronous wrapper cancels the call at this)
                kwargs["timeout"] = max(remaining, 0.001)
            try:
                return fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - sorted below
                fix = store_answers.NAMED_REFUSALS.get(type(error))
                if fix is not None:
                    # (the same type, which callers tell apart; its message
                    # naming the URL, the operation and what to check)
                    raise type(error)(f"{what}: {error}. {fix}") from error
                retry = store_answers.retryable(error)
                pause = _BACKOFF_S * (2 ** attempt) * (0.5 + _JITTER.random())
                late = time.monotonic() + pause >= deadline
                if not retry or attempt == _TRIES - 1 or late:
                    if retry:
                        raise store_limits.unanswered(
                            self.scheme, what, attempt + 1, budget,
                            error) from error
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    def exists(self, key: str) -> bool:
        """Whether an object `key` exists."""
        try:
            self.call(f"Looking up {key}", self.fs.info, key)
            return True
        except FileNotFoundError:
            return False

    def read_bytes(self, key: str, limit: int) -> bytes:
        """The bytes of object `key`, at most `limit` + 1 read (a caller
        that gets more than `limit` refuses the object).

        Raises:
            FileNotFoundError: if there is no such object.
        """
        return bytes(self.call(f"Reading {key}", self.fs.cat_file, key,
                               start=0, end=limit + 1))

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes `[start, stop)` of object `key` (fewer where it ends).

        Raises:
            FileNotFoundError: if there is no such object.
        """
        return bytes(self.call(f"Reading {key}", self.fs.cat_file, key,
                               start=start, end=stop,
                               transfer_bytes=max(stop - start, 0)))

    def write_bytes(self, key: str, data: bytes) -> None:
        """Writes object `key` (replacing one there, atomically for a
        reader: it sees the old object or the new one)."""
        self.call(f"Writing {key}", self.fs.pipe_file, key, data,
                  transfer_bytes=len(data))

    def put(self, local: str, key: str) -> None:
        """Uploads the file `local` to `key` (multipart when large, parts
        in parallel), then checks the object's size.

        Raises:
            OSError: if the stored object is not the file's size.
        """
        self.call(f"Uploading {local} to {key}", self.fs.put_file, local,
                  key, transfer_bytes=os.path.getsize(local))
        stored, size = self.size(key), os.path.getsize(local)
        if stored != size:
            raise OSError(f"Uploading {local} to {key}: the store holds "
                          f"{stored} bytes, the file has {size}.")

    def get(self, key: str, local: str, size: int) -> None:
        """Downloads `key` to the file `local`, refused unless it is exactly
        `size` bytes (the size a checkpoint's index claims for it).

        Raises:
            ValueError: if the object's size is not `size` (nothing more
                than `size` bytes is read).
        """
        found = self.size(key)
        if found != size:
            raise ValueError(
                f"{key} is {found} bytes, but the checkpoint's index "
                f"records {size}: it was changed or replaced after the save.")
        self.call(f"Downloading {key}", self.fs.get_file, key, local,
                  transfer_bytes=size)
        if os.path.getsize(local) != size:
            raise ValueError(f"{key} changed while it was downloaded.")

    def modified(self, key: str) -> float:
        """When object `key` was last written, by the store's own clock
        (seconds since the epoch).

        Raises:
            FileNotFoundError: if there is no such object.
        """
        info = self.call(f"Looking up {key}", self.fs.info, key)
        return store_answers.epoch_seconds(info, key)

    def clock(self, prefix: str) -> float:
        """The store's clock now: the time it gives a probe object of a
        random name written under `prefix` (deleted at once; nothing else
        is touched). A writer's own clock, which may run ahead or behind,
        never enters a comparison with it."""
        probe = join(prefix, f".keras_distribute-clock-{secrets.token_hex(8)}")
        self.write_bytes(probe, b"")
        try:
            return self.modified(probe)
        finally:
            self.remove([probe])

    def size(self, key: str) -> int:
        """The size of object `key` in bytes."""
        return int(self.call(f"Looking up {key}", self.fs.info, key)["size"])

    def children(self, prefix: str) -> Dict[str, bool]:
        """`name -> is a "directory"` of the direct children of `prefix`
        (objects `prefix/name`, and `prefix/name/...` as directories);
        empty when there are none."""
        try:
            entries = self.call(f"Listing {prefix}", self.fs.ls, prefix,
                                detail=True)
        except FileNotFoundError:
            return {}
        found = {}
        stripped = prefix.split("://", 1)[-1].rstrip("/")
        for entry in entries:
            name = entry["name"].rstrip("/")
            if name == stripped:
                continue  # `prefix` is itself an object
            found[name.rpartition("/")[2]] = entry["type"] == "directory"
        return found

    def files_under(self, prefix: str) -> Dict[str, int]:
        """`relative key -> size` of every object under `prefix/`."""
        try:
            found = self.call(f"Listing {prefix}", self.fs.find, prefix,
                              detail=True)
        except FileNotFoundError:
            return {}
        stripped = prefix.split("://", 1)[-1].rstrip("/") + "/"
        return {name[len(stripped):]: int(info.get("size") or 0)
                for name, info in found.items()
                if name.startswith(stripped)}

    def is_object(self, key: str) -> bool:
        """Whether `key` itself is an object (not only a prefix)."""
        try:
            info = self.call(f"Looking up {key}", self.fs.info, key)
        except FileNotFoundError:
            return False
        return bool(info.get("type") == "file")

    def abort_uploads(self, prefix: str) -> int:
        """Aborts the unfinished multipart uploads under `prefix/` (S3: an
        upload a killed process left open holds its parts, unseen by any
        listing, until aborted). A no-op on GCS, whose unfinished uploads
        expire on their own.

        Returns:
            How many uploads were aborted.
        """
        if self.scheme != "s3":
            return 0
        bucket, key, _ = self.fs.split_path(prefix)
        listed = self.call(f"Listing the unfinished uploads of {prefix}",
                           self.fs.call_s3, "list_multipart_uploads",
                           Bucket=bucket, Prefix=key.rstrip("/") + "/",
                           MaxUploads=1000)
        aborted = 0
        for upload in listed.get("Uploads") or []:
            try:
                self.call(f"Aborting an upload of {upload['Key']}",
                          self.fs.call_s3, "abort_multipart_upload",
                          Bucket=bucket, Key=upload["Key"],
                          UploadId=upload["UploadId"])
                aborted += 1
            except FileNotFoundError:
                pass  # finished or aborted meanwhile
        return aborted

    def remove(self, keys: List[str]) -> None:
        """Deletes the objects `keys` (absent ones are no error)."""
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            try:
                self.call(f"Deleting {batch[:3]}...", self.fs.rm, batch)
            except FileNotFoundError:
                for key in batch:
                    try:
                        self.call(f"Deleting {key}", self.fs.rm_file, key)
                    except FileNotFoundError:
                        pass


_stores: Dict[str, Store] = {}
_stores_lock = threading.Lock()


def store_for(path: str) -> Store:
    """The `Store` of `path`'s scheme (one per process and scheme)."""
    scheme = path.split("://", 1)[0]
    with _stores_lock:
        if scheme not in _stores:
            _stores[scheme] = Store(scheme)
        return _stores[scheme]


def forget_stores() -> None:
    """Drops the stores made so far (a test that changes the endpoint, or a
    forked child: an fsspec client holds its parent's event loop)."""
    with _stores_lock:
        _stores.clear()


def _after_fork() -> None:
    # A forked child's fsspec client would use its parent's event loop.
    _stores.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
