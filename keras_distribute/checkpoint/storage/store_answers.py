"""What an object store answers, sorted: a failure worth another try, a
refusal raised again naming what to check, the time it stamped an object.
Framework-free; imports nothing of kd."""

from types import MappingProxyType
from typing import Any
from typing import Dict
from typing import Mapping


def precondition_failed(error: BaseException) -> bool:
    """Whether the store refused a conditional request because its
    condition did not hold (HTTP 412, S3's `PreconditionFailed`), as the
    client raised it (s3fs: an `OSError` caused by botocore's error)."""
    for cause in (error, error.__cause__, error.__context__):
        response = getattr(cause, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get(
                "Code") in ("PreconditionFailed", "412"):
            return True
    return False


def retryable(error: BaseException) -> bool:
    """A failure of the network or the server, worth another try; never a
    missing object, a refused request, a condition that did not hold or
    kd's own error."""
    if precondition_failed(error):
        return False
    if isinstance(error, (FileNotFoundError, PermissionError,
                          FileExistsError, IsADirectoryError,
                          NotADirectoryError, ValueError, TypeError)):
        return False
    name = type(error).__name__
    return isinstance(error, (OSError, TimeoutError, ConnectionError)) or (
        name in ("ClientError", "ClientOSError", "ServerDisconnectedError",
                 "EndpointConnectionError", "ReadTimeoutError",
                 "ConnectTimeoutError", "HttpError"))


def epoch_seconds(info: Dict[str, Any], key: str) -> float:
    """An object's last write, as the store stamped it: S3's
    `LastModified` (a datetime), GCS' `updated` (an RFC 3339 string)."""
    import datetime

    stamp = info.get("LastModified") or info.get("mtime") or info.get(
        "updated")
    if isinstance(stamp, str):
        stamp = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    if not isinstance(stamp, datetime.datetime):
        raise OSError(f"The store gives no time of last write for {key}: "
                      f"{sorted(info)}.")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.timezone.utc)
    return stamp.timestamp()


# Refusals of a store, raised as their own type with what to check.
NAMED_REFUSALS: Mapping[type, str] = MappingProxyType({
    FileNotFoundError: (
        "No such object or bucket: check the bucket's name, that it exists, "
        "and the endpoint (AWS_ENDPOINT_URL for an S3-API server that is not "
        "AWS)."),
    PermissionError: (
        "The store refused it: check the credentials (the AWS_* variables "
        "or ~/.aws for S3; Google's application default credentials for "
        "GCS) and that the bucket's policy allows this operation."),
})
