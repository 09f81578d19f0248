"""This process's JAX devices, by kd's device names."""

from types import MappingProxyType
from typing import Any
from typing import Optional

import jax

from keras_distribute.common.devices import DeviceSpec
from keras_distribute.common.devices import choose_local
from keras_distribute.common.devices import not_a_device

_PLATFORMS = MappingProxyType({
    "cpu": "cpu",
    "gpu": "gpu",
    "cuda": "gpu",
    "tpu": "tpu",
})


def default_devices() -> list:
    """All local devices of JAX's default platform (GPU/TPU, else CPU)."""
    return list(jax.local_devices())


def device_name(device: Any) -> str:
    """`"cpu:0"`-style name of a `jax.Device`."""
    return f"{device.platform}:{device.id}"


def _available_names(platform: Optional[str] = None) -> list:
    try:
        devices = jax.local_devices(backend=platform) if platform else (
            jax.local_devices())
    except RuntimeError:
        devices = jax.local_devices()
    return [device_name(d) for d in devices]


def resolve_device(device: "DeviceSpec | Any") -> Any:
    """Resolves a `DeviceSpec` (or a `jax.Device`) to a local `jax.Device`."""
    if isinstance(device, jax.Device):
        if device not in jax.local_devices(backend=device.platform):
            raise ValueError(
                f"The device {device} is not local to this process. "
                f"Received: device={device!r}. Local devices: "
                f"{_available_names(device.platform)}."
            )
        return device
    if not isinstance(device, DeviceSpec):
        raise not_a_device(device, "`jax.Device`")
    platform = _PLATFORMS.get(device.device_type)
    try:
        candidates = jax.local_devices(backend=platform) if platform else []
    except RuntimeError:
        candidates = []
    return choose_local(
        device, candidates, local_task=jax.process_index(),
        available=_available_names(),
        how_to_add="On CPU, simulate more devices with XLA_FLAGS=--xla_force_"
        "host_platform_device_count=N (set before importing JAX).")
