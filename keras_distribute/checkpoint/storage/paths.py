"""The checkpoint paths kd takes: local (or mounted) directories, and
`s3://` / `gs://` object storage where a checkpoint path enters
(`checkpoint_path`).

Any other scheme (`hdfs://`, `file://`, ...) is refused, and so is object
storage where an argument takes only a local path (`local_path`): handed to
`os`, `s3://bucket/run` is a relative path, and a save would "succeed" into
a local directory named `s3:` in the working directory, a checkpoint that
vanishes with the machine. Framework-free.
"""

import os
import re
from typing import Union

from keras_distribute.checkpoint.storage import object_store

# `<scheme>:/`, as RFC 3986 spells a scheme (`s3`, `gs`, `hdfs`, `file`;
# `pathlib` turns `s3://b` into `s3:/b`); one letter is a Windows drive.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):/")
# The number of a `<name>-<number>` checkpoint: an exact integer of any
# size a name can hold (a 19-digit timestamp used as the step included),
# bounded only below Python's limit on parsing digits (4,300).
NUMBER = r"\d{1,1000}"


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
        where = ("kd checkpoints take s3:// and gs:// paths, but this "
                 "argument needs a file system" if scheme in
                 object_store.REMOTE_SCHEMES else
                 "kd checkpoints take local or mounted directories and "
                 "s3:// or gs:// paths")
        raise ValueError(
            f"{argument}={text!r} names {scheme}:// storage, which is not "
            f"usable here ({where}: os would take it for a local directory "
            f"named '{scheme}:' in the working directory). Pass a local or "
            "mounted directory (a shared file system, or the bucket mounted "
            "with gcsfuse, mountpoint-s3 or s3fs-fuse).")
    return text


def checkpoint_path(path: Union[str, "os.PathLike[str]"],
                    argument: str = "path") -> str:
    """A checkpoint path: `s3://` / `gs://` (checked, see
    `object_store.normalize`), or a local path as `local_path` takes it.

    Args:
        path: A `str` or `os.PathLike`.
        argument: The argument's name, for the error message.

    Returns:
        The path as a `str` (a remote one without a trailing `/`).

    Raises:
        TypeError: if `path` is not a `str` or `os.PathLike`.
        ValueError: for another scheme, or a malformed bucket path.

    Example:

    >>> checkpoint_path("s3://bucket/run/")
    's3://bucket/run'
    """
    if object_store.is_remote(path):
        return object_store.normalize(str(path), argument)
    return local_path(path, argument)
