"""Conditional writes of an object store: create only where nothing is,
replace or delete only what is still the version read, each decided by the
store in the one request (S3's `If-None-Match: *` and `If-Match: <ETag>`).

The lease (`remote_lease`) is taken, renewed, fenced and let go with them
where the store honours them, which `honoured` finds out once per bucket
with a probe object of a random name (deleted at once; nothing else is
touched). AWS S3 and moto honour them; gcsfs exposes no generation
precondition for a replace, and some S3-API servers ignore the headers:
there the lease falls back to writing and reading back. Framework-free.
"""

import secrets
from typing import Optional
from typing import Tuple

from keras_distribute.checkpoint.storage import store_answers
from keras_distribute.checkpoint.storage.format import CheckpointStorageError
from keras_distribute.checkpoint.storage.object_store import Store
from keras_distribute.checkpoint.storage.object_store import join


class VersionChanged(Exception):
    """The object is no longer the version a conditional write named (a
    precondition the store refused)."""


def honoured(store: Store, prefix: str) -> bool:
    """Whether the store refuses a create over an existing object and a
    replace of a version that is not the current one, under `prefix`'s
    bucket (probed once per bucket and store).

    Args:
        store: The store of `prefix`.
        prefix: A directory in the bucket (the probe is written there).

    Returns:
        `True` when both conditions are honoured.

    Raises:
        CheckpointStorageError, PermissionError, FileNotFoundError: the
            store did not answer, or refused the probe.
    """
    if store.scheme != "s3":
        return False
    bucket = prefix.split("://", 1)[1].split("/", 1)[0]
    known = store.honours_conditions.get(bucket)
    if known is not None:
        return known
    probe = join(prefix, f".keras_distribute-probe-{secrets.token_hex(8)}")
    try:
        create(store, probe, b"")
        try:
            create(store, probe, b"")
            answer = False  # a second create was not refused
        except FileExistsError:
            try:
                replace(store, probe, b"", '"' + "0" * 32 + '"')
                answer = False  # a replace of a wrong version went through
            except VersionChanged:
                answer = True
    except (CheckpointStorageError, PermissionError, FileNotFoundError):
        raise
    except Exception:  # noqa: BLE001 - a server that rejects the headers
        answer = False
    finally:
        store.remove([probe])
    store.honours_conditions[bucket] = answer
    return answer


def _split(store: Store, key: str) -> Tuple[str, str]:
    bucket, name, _ = store.fs.split_path(key)
    return bucket, name


def _put(store: Store, what: str, key: str, data: bytes,
         **condition: str) -> str:
    bucket, name = _split(store, key)
    try:
        answer = store.call(what, store.fs.call_s3, "put_object",
                            Bucket=bucket, Key=name, Body=data,
                            transfer_bytes=len(data), **condition)
    except FileExistsError:
        raise  # (s3fs' name for a refused If-None-Match)
    except OSError as error:
        _raise_if_changed(error, key)
        raise
    return str(answer.get("ETag", ""))


def _raise_if_changed(error: OSError, key: str) -> None:
    """Raises `VersionChanged` where the store refused a condition (412)."""
    if store_answers.precondition_failed(error):
        raise VersionChanged(f"{key} changed since it was read.") from error


def create(store: Store, key: str, data: bytes) -> str:
    """Writes object `key` only if there is none.

    Returns:
        The new object's version (its ETag).

    Raises:
        FileExistsError: if an object `key` exists.
    """
    return _put(store, f"Creating {key}", key, data, IfNoneMatch="*")


def replace(store: Store, key: str, data: bytes, version: str) -> str:
    """Replaces object `key` only if it is still `version`.

    Returns:
        The new object's version.

    Raises:
        VersionChanged: if `key` is another version now.
        FileNotFoundError: if there is no object `key`.
    """
    try:
        return _put(store, f"Replacing {key}", key, data, IfMatch=version)
    except FileExistsError as error:  # (how some clients name a 412)
        raise VersionChanged(f"{key} changed since it was read.") from error


def remove(store: Store, key: str, version: str) -> None:
    """Deletes object `key` only if it is still `version`.

    Raises:
        VersionChanged: if `key` is another version now.
        FileNotFoundError: if there is no object `key`.
    """
    bucket, name = _split(store, key)
    try:
        store.call(f"Deleting {key}", store.fs.call_s3, "delete_object",
                   Bucket=bucket, Key=name, IfMatch=version)
    except OSError as error:
        _raise_if_changed(error, key)
        raise


def read(store: Store, key: str, limit: int) -> Optional[Tuple[bytes, str]]:
    """The bytes of object `key` (at most `limit` + 1) and the version they
    are, or `None` if there is no such object. The version is looked up
    first: a write in between makes a conditional write that names it
    fail, never succeed over bytes this did not read."""
    try:
        info = store.call(f"Looking up {key}", store.fs.info, key)
        data = store.read_bytes(key, limit)
    except FileNotFoundError:
        return None
    return data, str(info.get("ETag", ""))
