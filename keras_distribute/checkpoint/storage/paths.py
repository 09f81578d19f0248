"""The checkpoint paths kd takes: local (or mounted) directories only.

A path such as `s3://bucket/run` names object storage. Handed to `os`, it
is a relative path: a save would "succeed" into a local directory named
`s3:` in the working directory, a checkpoint that vanishes with the
machine. Until kd writes to object stores, such a path is refused where a
checkpoint path enters (`local_path`). Framework-free.
"""

import os
import re
from typing import Union

# `<scheme>:/`, as RFC 3986 spells a scheme (`s3`, `gs`, `hdfs`, `file`;
# `pathlib` turns `s3://b` into `s3:/b`); one letter is a Windows drive.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):/")


def local_path(path: Union[str, "os.PathLike[str]"],
               argument: str = "path") -> str:
    """`path` as a `str`, refused if it names a storage scheme.

    Args:
        path: A `str` or `os.PathLike` naming a local (or mounted) path.
        argument: The argument's name, for the error message.

    Returns:
        The path, as given (not made absolute).

    Raises:
        TypeError: if `path` is not a `str` or `os.PathLike`.
        ValueError: if it starts with `<scheme>://` (`s3://`, `gs://`,
            `file://`, ...; or `<scheme>:/`, as `pathlib` writes them).

    Example:

    >>> local_path("/tmp/run")
    '/tmp/run'
    >>> local_path("s3://bucket/run")
    Traceback (most recent call last):
    ValueError: path='s3://bucket/run' names s3:// storage, ...
    """
    try:
        given = os.fspath(path)
    except TypeError:
        raise TypeError(
            f"{argument} must be a path (a str or os.PathLike). Received: "
            f"{argument}={path!r} of type {type(path).__name__}.") from None
    text = os.fsdecode(given) if isinstance(given, bytes) else str(given)
    match = _SCHEME.match(text)
    if match:
        scheme = match.group(1)
        raise ValueError(
            f"{argument}={text!r} names {scheme}:// storage, which kd "
            "checkpoints cannot use yet (they need a file system: os would "
            f"take it for a local directory named '{scheme}:' in the "
            "working directory). Pass a local or mounted directory: a "
            "shared file system, or the bucket mounted (gcsfuse, "
            "mountpoint-s3, s3fs-fuse); or save locally and copy the "
            "committed checkpoint to the bucket.")
    return text
