"""This process's torch device, and torch's host random state.

On the torch backend each process is one replica on one device:
`cuda:LOCAL_RANK` in a launched group on GPUs, else the CPU.
"""

import logging
import os
from typing import Any

import torch

from keras_distribute.backend.torch.groups import ensure_process_group
from keras_distribute.common.devices import DeviceSpec
from keras_distribute.common.devices import not_a_device

_log = logging.getLogger("keras_distribute")


def host_rng_state() -> list:
    """torch's global CPU RNG state (it orders Keras' shuffled batches)."""
    return torch.random.get_rng_state().tolist()


def set_host_rng_state(state: list) -> None:
    torch.random.set_rng_state(torch.tensor(state, dtype=torch.uint8))


def default_devices() -> list:
    """This process's device: `cuda:LOCAL_RANK`, else the CPU."""
    in_group = ensure_process_group()
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0")) if in_group else 0
        return [torch.device("cuda", index)]
    if not in_group:
        _log.info(
            "kd.MirroredStrategy on the torch backend: one process is one "
            "replica, so this single process has 1 replica. Run N processes "
            "with kd.launch(fn, num_processes=N), `python -m "
            "keras_distribute.launch --nproc N script.py` or torchrun.")
    return [torch.device("cpu")]


def device_name(device: Any) -> str:
    """`"cpu:0"`-style name of a `torch.device`."""
    return f"{device.type}:{device.index or 0}"


def resolve_device(device: "DeviceSpec | Any") -> Any:
    """Checks that `device` is this process's own device."""
    own = default_devices()[0]
    if isinstance(device, torch.device):
        spec_type, index = device.type, device.index or 0
    elif isinstance(device, DeviceSpec):
        spec_type = "cuda" if device.device_type in ("gpu", "cuda") else (
            device.device_type)
        index = device.index
    else:
        raise not_a_device(device, "`torch.device`")
    own_index = own.index or 0
    if spec_type != own.type or index != own_index:
        raise ValueError(
            f"On the torch backend each process is one replica on its own "
            f"device ({device_name(own)}). Received: device={device!r}. Run "
            "one process per device (kd.launch / torchrun) instead of listing "
            "several devices.")
    return own
