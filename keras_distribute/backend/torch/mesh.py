"""The job's mesh over torch processes: one process per device.

`check_mesh` says whether a layout map's mesh fits a torch job;
`mesh_ranks` finds the rank of the process at each position of the mesh
(as Keras' torch backend names devices: `"cpu:3"` is rank 3's).
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Any

import numpy as np

from keras_distribute.common.layouts import axis_names

if TYPE_CHECKING:
    from keras.distribution import LayoutMap


def check_mesh(layout_map: LayoutMap, world_size: int) -> None:
    """Raises unless the mesh and its layouts fit a torch job of
    `world_size` processes."""
    mesh = layout_map.device_mesh
    size = math.prod(mesh.shape)
    for key, layout in layout_map.items():
        named = [name for axis in layout.axes for name in axis_names(axis)]
        twice = sorted({name for name in named if named.count(name) > 1})
        if twice:
            raise ValueError(
                f"The layout for {key!r} shards two dimensions over mesh "
                f"axis {twice[0]!r}; a mesh axis can cut one dimension of a "
                f"variable. Received: layout axes={tuple(layout.axes)}. Name "
                "each mesh axis at most once per layout.")
    if size != world_size:
        raise ValueError(
            f"On the torch backend each process is one device of the mesh, "
            f"so a mesh of shape {tuple(mesh.shape)} ({size} devices) needs "
            f"{size} processes. Received: {world_size} process(es). Launch "
            f"{size} processes (kd.launch(fn, num_processes={size}), "
            "torchrun), or build the mesh for the processes you have.")


_DEVICE_TYPES = MappingProxyType({"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"})


def mesh_ranks(device_mesh: Any, device: Any, world_size: int) -> np.ndarray:
    """The rank of the process at each position of `device_mesh`.

    A torch mesh names its processes as Keras' torch backend does: the index
    of a device name is the rank of its process (`"cpu:3"`, `"gpu:3"`: rank
    3), each rank once, of this process's device type, the ranks
    increasing along every mesh axis (torch's groups are ordered by rank).

    Args:
        device_mesh: A `keras.distribution.DeviceMesh`.
        device: This process's `torch.device`.
        world_size: The number of processes of the job.

    Returns:
        The ranks as an array of the mesh's shape.

    Raises:
        ValueError: A device name without an index, a rank outside the job
            or named twice, another device type than this process's, or
            ranks that decrease along a mesh axis.

    Example:

    >>> mesh = keras.distribution.DeviceMesh(
    ...     (2, 2), ["batch", "model"], ["cpu:0", "cpu:2", "cpu:1", "cpu:3"])
    >>> mesh_ranks(mesh, torch.device("cpu"), 4).tolist()
    [[0, 2], [1, 3]]
    """
    names = [str(d) for d in np.asarray(device_mesh.devices).flat]
    expected = device.type
    prefix = "gpu" if expected == "cuda" else expected  # Keras' spelling
    ranks = []
    for name in names:
        kind, _, index = name.lower().rpartition(":")
        if _DEVICE_TYPES.get(kind) != expected or not index.isdigit():
            raise ValueError(
                f"On the torch backend each device of the mesh is one "
                f"process, named by its device type ({expected!r}) and rank, "
                f"e.g. '{prefix}:0'. Received: device {name!r} in devices "
                f"{names}. Build the mesh with devices="
                f"{_devices_hint(prefix, world_size)}.")
        ranks.append(int(index))
    if sorted(ranks) != list(range(world_size)):
        raise ValueError(
            f"The mesh's devices must name each rank of the job "
            f"(0..{world_size - 1}) once. Received: ranks {ranks} (devices "
            f"{names}). Build the mesh with devices="
            f"{_devices_hint(prefix, world_size)}, or list each process "
            "once.")
    grid = np.asarray(ranks).reshape(tuple(device_mesh.shape))
    for dim, axis in enumerate(device_mesh.axis_names):
        if not np.all(np.diff(grid, axis=dim) > 0):
            raise ValueError(
                f"Along each mesh axis the ranks must increase: torch orders "
                f"the processes of a group by rank (`new_group` sorts them) "
                f"and DTensor's collectives follow that order, so a shard "
                f"would land on another process than its position says. "
                f"Received: ranks {grid.tolist()} along axis {axis!r} "
                f"(devices {names}). List the devices so that each axis "
                f"counts up, e.g. {_devices_hint(prefix, world_size)} in "
                "order.")
    return grid


def _devices_hint(prefix: str, world_size: int) -> str:
    """A `devices=` value that works on the Keras in use: the names spelled
    out, and Keras' `list_devices()` where its torch backend has one (Keras
    3.15's torch backend has no distribution module: the call raises
    `AttributeError`)."""
    import keras

    spelled = f"[f'{prefix}:{{r}}' for r in range({world_size})]"
    try:
        keras.distribution.list_devices()
    except AttributeError:
        return spelled
    return f"keras.distribution.list_devices() or {spelled}"


def seed_alike_in_each_replica(replica: int) -> None:
    """Seeds torch's global generator alike in the processes that compute
    one replica between them (a collective over the job).

    Keras draws from that generator where nothing seeds it (an unseeded
    `Dropout`: `torch.nn.functional.dropout`): each process of one replica
    otherwise dropped other units of one activation, and the replicated
    variables after it diverged. The seed is process 0's draw (so a program
    that seeded before is reproducible) plus the replica's position, so
    that the data-parallel replicas draw apart, as one device's rows do.

    Args:
        replica: This process's position on the mesh's batch axis.
    """
    import torch
    import torch.distributed as dist

    drawn = [int(torch.randint(0, 2**31 - 1, (1,)).item())]
    dist.broadcast_object_list(drawn, src=0)
    torch.manual_seed(drawn[0] + replica)
