"""This process's TensorFlow logical devices, by kd's device names."""

from types import MappingProxyType
from typing import Any

import tensorflow as tf

from keras_distribute.common.devices import DeviceSpec
from keras_distribute.common.devices import choose_local
from keras_distribute.common.devices import not_a_device
from keras_distribute.common.devices import parse_device_name

_TF_TYPES = MappingProxyType({
    "cpu": "CPU",
    "gpu": "GPU",
    "cuda": "GPU",
    "tpu": "TPU",
})


def default_devices() -> list:
    """All local logical GPUs, else all local logical CPU devices."""
    return tf.config.list_logical_devices("GPU") or (
        tf.config.list_logical_devices("CPU"))


def device_name(device: Any) -> str:
    """`"cpu:0"`-style name of a `tf.config.LogicalDevice`."""
    spec = parse_device_name(device.name)
    return str(spec)


def resolve_device(device: "DeviceSpec | Any") -> Any:
    """Resolves a `DeviceSpec` (or a `LogicalDevice`) to a logical device."""
    if isinstance(device, tf.config.LogicalDevice):
        device = parse_device_name(device.name)
    if not isinstance(device, DeviceSpec):
        raise not_a_device(device, "`tf.config.LogicalDevice`")
    tf_type = _TF_TYPES.get(device.device_type)
    candidates = tf.config.list_logical_devices(tf_type) if tf_type else []
    return choose_local(
        device, candidates, local_task=0,
        available=[device_name(d) for d in default_devices()],
        how_to_add="On CPU, split the CPU into N logical devices with "
        "kd.simulate_cpu_devices(N) before TensorFlow initialises its "
        "devices.")
