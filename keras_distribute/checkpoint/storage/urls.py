"""Object-storage URLs (`s3://bucket/key`, `gs://bucket/key`): which paths
are remote, their checked form, and joining and splitting them (re-exported
by `object_store`). Framework-free; imports nothing of kd."""

import re
from types import MappingProxyType
from typing import Any
from typing import Mapping
from typing import Tuple

# scheme -> (the fsspec package serving it, the extra that installs it)
REMOTE_SCHEMES: Mapping[str, Tuple[str, str]] = MappingProxyType({
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
})
_REMOTE = re.compile(r"(s3|gs)://(.*)", re.DOTALL)
# A bucket name, as S3 and GCS allow them (3-222 characters).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]")


def is_remote(path: Any) -> bool:
    """Whether `path` names object storage kd writes to (`s3://`, `gs://`).

    Args:
        path: Anything; only a `str` can be remote.

    Returns:
        `True` for `s3://...` and `gs://...`.

    Example:

    >>> is_remote("s3://bucket/run")
    True
    >>> is_remote("/tmp/run")
    False
    """
    return isinstance(path, str) and _REMOTE.match(path) is not None


def normalize(path: str, argument: str = "path") -> str:
    """`path` as `<scheme>://<bucket>/<key>`, checked.

    Args:
        path: An `s3://` or `gs://` path.
        argument: The argument's name, for the error message.

    Returns:
        The path without a trailing `/`.

    Raises:
        ValueError: for a path with no bucket, a bucket name the stores
            refuse, or an empty, `.` or `..` segment in its key (a key
            that would name another object than it seems to).

    Example:

    >>> normalize("s3://bucket/run/")
    's3://bucket/run'
    """
    match = _REMOTE.match(path)
    if match is None:
        raise ValueError(f"{argument}={path!r} is not an s3:// or gs:// "
                         "path.")
    scheme, rest = match.group(1), match.group(2).rstrip("/")
    bucket, _, key = rest.partition("/")
    segments = key.split("/") if key else []
    if not _BUCKET.fullmatch(bucket) or any(
            s in ("", ".", "..") for s in segments) or "\\" in rest or any(
            ord(c) < 32 for c in rest):
        raise ValueError(
            f"{argument}={path!r} is not a usable {scheme}:// path: expected "
            f"{scheme}://<bucket>/<prefix>, with a bucket name of 3 to 222 "
            "lowercase letters, digits, '.', '-' or '_', and no empty, '.' "
            "or '..' segment. Received: "
            f"bucket={bucket!r}, prefix={key!r}.")
    return f"{scheme}://{rest}"


def join(base: str, *names: str) -> str:
    """`base/name/...` for object keys (always `/`)."""
    return "/".join([base.rstrip("/"), *names])


def split(path: str) -> Tuple[str, str]:
    """`(parent, name)` of a remote path (`("s3://b/run", "ckpt-1")`)."""
    parent, _, name = path.rstrip("/").rpartition("/")
    return parent, name
