"""Device names as users write them, parsed once for every backend.

Accepted forms: tf-style (`"GPU:0"`, `"/gpu:1"`, `"/device:CPU:0"`,
`"/job:localhost/replica:0/task:0/device:CPU:0"`) and Keras-style (`"gpu:0"`,
`"cpu"`). Backend device objects (a `jax.Device`, ...) are resolved by the
backend module.
"""

import dataclasses
import re
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

_KNOWN_TYPES = ("cpu", "gpu", "tpu", "cuda", "mps")
_FIELD = re.compile(r"^(job|replica|task|device):(.*)$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A parsed device name: type (lower case), index and optional task."""

    device_type: str
    index: int
    task: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.device_type}:{self.index}"


def _bad_name(name: Any, why: str) -> ValueError:
    return ValueError(
        f"Cannot parse the device name {name!r}: {why}. Expected a name such "
        "as 'GPU:0', '/gpu:1', 'cpu:0' or "
        "'/job:localhost/replica:0/task:0/device:CPU:0'. "
        f"Received: device={name!r}."
    )


def _parse_type_and_index(name: Any, text: str) -> Tuple[str, int]:
    parts = text.split(":")
    if len(parts) > 2 or not parts[0]:
        raise _bad_name(name, "expected 'TYPE:INDEX'")
    device_type = parts[0].lower()
    if device_type not in _KNOWN_TYPES:
        raise _bad_name(
            name, f"unknown device type {parts[0]!r} (known: "
            f"{', '.join(t.upper() for t in _KNOWN_TYPES)})"
        )
    if len(parts) == 1 or parts[1] == "":
        return device_type, 0
    if not parts[1].isdigit():
        raise _bad_name(name, f"the index {parts[1]!r} is not a number")
    return device_type, int(parts[1])


def parse_device_name(name: str) -> DeviceSpec:
    """Parses a device name into a `DeviceSpec`.

    Args:
        name: A tf-style or Keras-style device name.

    Returns:
        The `DeviceSpec` it names.

    Raises:
        ValueError: if `name` is not a device name.

    Example:

    >>> parse_device_name("/job:localhost/replica:0/task:0/device:CPU:3")
    DeviceSpec(device_type='cpu', index=3, task=0)
    >>> parse_device_name("GPU:1")
    DeviceSpec(device_type='gpu', index=1, task=None)
    """
    if not isinstance(name, str) or not name.strip():
        raise _bad_name(name, "it is not a non-empty string")
    text = name.strip()
    if not text.startswith("/"):
        return DeviceSpec(*_parse_type_and_index(name, text))
    task = None
    device_part = None
    fields = text[1:].split("/")
    for field in fields:
        match = _FIELD.match(field)
        if match is None:
            # Short tf form: "/gpu:1".
            if len(fields) == 1:
                device_part = field
                continue
            raise _bad_name(name, f"unexpected component {field!r}")
        key, value = match.group(1).lower(), match.group(2)
        if key == "device":
            device_part = value
        elif key in ("task", "replica") and not value.isdigit():
            raise _bad_name(name, f"{key} {value!r} is not a number")
        elif key == "task":
            task = int(value)
    if device_part is None:
        raise _bad_name(name, "it names no device")
    device_type, index = _parse_type_and_index(name, device_part)
    return DeviceSpec(device_type, index, task=task)


def not_a_device(device: Any, native: str) -> ValueError:
    """The error for a device that is neither a name nor `native`.

    Args:
        device: What was received.
        native: The backend's own device type, e.g. "`jax.Device`".

    Returns:
        The `ValueError` to raise.

    Example:

    >>> raise not_a_device(3, "`jax.Device`")
    Traceback (most recent call last):
    ValueError: Expected a device name (e.g. 'GPU:0', 'cpu:1') or a ...
    """
    return ValueError(
        f"Expected a device name (e.g. 'GPU:0', 'cpu:1') or a {native}. "
        f"Received: device={device!r} of type {type(device).__name__}.")


def choose_local(spec: DeviceSpec, candidates: Sequence[Any], *,
                 local_task: int, available: List[str],
                 how_to_add: str) -> Any:
    """Picks device `spec.index` among this process's devices of its type.

    Args:
        spec: The parsed device name.
        candidates: This process's devices of `spec.device_type`, in order.
        local_task: This process's task (process) index.
        available: Names of every local device, for the error message.
        how_to_add: How to get more devices on this backend.

    Returns:
        The chosen backend device.

    Raises:
        ValueError: if `spec` names another task or a device that is not
            there.
    """
    if spec.task not in (None, local_task):
        raise ValueError(
            f"The device {spec} of task {spec.task} is not local to this "
            f"process (task {local_task}). MirroredStrategy uses local "
            "devices only; use kd.MultiWorkerMirroredStrategy for several "
            "processes.")
    if spec.index >= len(candidates):
        raise ValueError(
            f"Unknown device {str(spec).upper()!r}: this process has "
            f"{len(candidates)} {spec.device_type.upper()} device(s). "
            f"Available devices: {available}. {how_to_add}")
    return candidates[spec.index]
