"""`kd.layouts.dry_run`: the whole job checked on one machine before the
launch, one verdict table with the fix for each finding.

What reaches the cluster only to fail there, or worse to run badly: a mesh
that is not the cluster's devices, a model-parallel group split across
hosts, a layout map that misses, doubles or cannot cut the model's
variables, a backend that cannot shard them, a global batch the replicas
or hosts do not divide, a step over a device's memory (variables,
gradients, optimizer slots and activations: `estimate_memory`), and a
checkpoint directory no checkpoint can be written in or whose latest
checkpoint this model cannot restore. The model is built without values
(`plan_layout` builds it the same way). `python -m keras_distribute.planning`
is its command line.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING
from typing import Any
from typing import List
from typing import Optional
from typing import Union

from keras_distribute.common.layout_picture import human_bytes
from keras_distribute.planning.layout_check import DEFAULT_GIANT_BYTES
from keras_distribute.planning.layout_check import Finding
from keras_distribute.planning.layout_check import check_layout
from keras_distribute.planning.layout_planner import built_model
from keras_distribute.planning.memory_estimate import MemoryEstimate
from keras_distribute.planning.memory_estimate import estimate_memory

if TYPE_CHECKING:
    from keras.distribution import LayoutMap
    from keras.optimizers import Optimizer

    from keras_distribute.planning.layout_planner import ModelOrBuilder

# The verdict table's rows: what was checked, and the finding kinds of each.
_CHECKS = (
    ("cluster", "mesh against the cluster", ("mesh", "hosts")),
    ("layout", "layout map against the model",
     ("unmatched_key", "several_keys", "rank", "indivisible",
      "replicated_giant", "backend")),
    ("batch", "global batch against the replicas", ("batch_size",)),
    ("memory", "memory per device", ("memory",)),
    ("checkpoint", "checkpoint directory", ("checkpoint",)),
)


# Findings after which the variables cannot be laid out (no estimate).
_UNUSABLE_LAYOUT = ("several_keys", "rank", "indivisible")


@dataclasses.dataclass
class DryRun:
    """What `dry_run` returns.

    Attributes:
        findings: The problems found, each with its fix (none: launch).
        estimate: The memory a device holds at the peak of a step.
        checked: The checks that ran (`"cluster"`, `"layout"`,
            `"batch"`, `"memory"`, `"checkpoint"`); one not given what it
            needs (no `device_memory`, say) did not run.
    """

    findings: List[Finding]
    estimate: Optional[MemoryEstimate]
    checked: List[str]

    @property
    def ok(self) -> bool:
        """Whether nothing was found."""
        return not self.findings

    def table(self) -> str:
        """The verdict: each check with `ok`, `FAIL` and its findings'
        fixes, or `not checked` (and what it needs), then the memory."""
        needs = {"cluster": "hosts and devices_per_host",
                 "batch": "global_batch_size",
                 "memory": "device_memory",
                 "checkpoint": "checkpoint_directory"}
        lines = []
        for name, title, kinds in _CHECKS:
            found = [f for f in self.findings if f.kind in kinds]
            if name not in self.checked:
                lines.append(f"{title:<36} not checked (give {needs[name]})")
                continue
            lines.append(f"{title:<36} {'FAIL' if found else 'ok'}")
            lines += [f"    {f.kind}: {f.subject}: {f.message}"
                      for f in found]
        if self.estimate is not None:
            lines.append("")
            lines.append(self.estimate.table())
        lines.append("")
        lines.append("verdict: " + ("ready to launch" if self.ok else
                                    f"{len(self.findings)} finding(s) to fix"))
        return "\n".join(lines)

    def raise_if_any(self) -> None:
        """Raises `ValueError` with the table, if anything was found."""
        if self.findings:
            raise ValueError("The dry run found problems:\n" + self.table())


def dry_run(model: ModelOrBuilder, layout_map: Optional[LayoutMap] = None,
            *, hosts: Optional[int] = None,
            devices_per_host: Optional[int] = None,
            global_batch_size: Optional[int] = None,
            device_memory: Optional[int] = None,
            checkpoint_directory: Optional[str] = None,
            checkpoint_object: str = "model",
            optimizer: Union[str, Optimizer, None] = None,
            loss: Any = None, input_shape: Any = None,
            input_dtype: str = "float32",
            giant_bytes: int = DEFAULT_GIANT_BYTES) -> DryRun:
    """Checks a whole job on this machine before it is launched.

    Args:
        model: A built Keras model, or a function that builds one (built
            without values: a model larger than this machine is checked).
        layout_map: The job's `keras.distribution.LayoutMap` (its mesh's
            first axis is the batch axis), or None for one device.
        hosts: The hosts (machines) of the job.
        devices_per_host: The devices (processes, on torch) of each host.
        global_batch_size: The batch `fit` is given.
        device_memory: The bytes a device has: the step's peak (variables,
            gradients, optimizer slots, activations) must fit.
        checkpoint_directory: Where the job keeps its checkpoints (local,
            mounted, `s3://` or `gs://`); a local one is only read, in
            object storage a probe object is written and deleted.
        checkpoint_object: The name the model is saved under there.
        optimizer: The optimizer (or its name) the job trains with; by
            default the model's compiled one, else Adam.
        loss: The loss (or its name); by default the model's compiled one,
            else mean squared error.
        input_shape: One example's input shape, for a model without
            `keras.Input` or with unknown dimensions in it.
        input_dtype: The dtype of inputs given by `input_shape`.
        giant_bytes: A replicated variable at least this large is reported
            when the mesh could split it.

    Returns:
        A `DryRun`: `.findings` (each with its fix), `.estimate`, `.ok`,
        `.table()` (the verdict), `.raise_if_any()`.

    Raises:
        TypeError, ValueError: for arguments of the wrong type or value
            (what `check_layout` and `estimate_memory` refuse).

    Example:

    ```python
    verdict = kd.layouts.dry_run(make_model, layout_map, hosts=4,
                                 devices_per_host=8, global_batch_size=256,
                                 device_memory=16 * 2**30)
    print(verdict.table())
    ```
    """
    import keras

    from keras_distribute.backend import get_backend

    for name, value in (("hosts", hosts),
                        ("devices_per_host", devices_per_host)):
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, int) or value <= 0):
            raise ValueError(f"{name} must be a positive int. Received: "
                             f"{name}={value!r}.")
    if (hosts is None) != (devices_per_host is None):
        raise ValueError(
            "Give hosts and devices_per_host together (the cluster is "
            f"hosts x devices per host). Received: hosts={hosts!r}, "
            f"devices_per_host={devices_per_host!r}.")
    if device_memory is not None and (isinstance(device_memory, bool) or (
            not isinstance(device_memory, int)) or device_memory <= 0):
        raise ValueError("device_memory must be a positive int (bytes). "
                         f"Received: device_memory={device_memory!r}.")
    devices = (hosts * devices_per_host if hosts is not None
               and devices_per_host is not None else None)
    if layout_map is None:  # data parallel over every device of the job
        mesh_size = devices or 1
        check_map = keras.distribution.LayoutMap(
            keras.distribution.DeviceMesh(
                (mesh_size,), ["batch"],
                [f"cpu:{i}" for i in range(mesh_size)]))
    else:
        check_map = layout_map
        mesh_size = math.prod(int(s) for s in layout_map.device_mesh.shape)
    built = built_model(model, keras)
    check = check_layout(check_map, built,
                         global_batch_size=global_batch_size,
                         giant_bytes=giant_bytes,
                         checkpoint_directory=checkpoint_directory,
                         checkpoint_object=checkpoint_object,
                         devices=devices)
    findings = list(check.findings)
    checked = ["layout"]
    if devices is not None and devices_per_host is not None:
        checked.append("cluster")
        findings += _host_findings(check_map, devices_per_host)
    if global_batch_size is not None:
        checked.append("batch")
        if hosts is not None and global_batch_size % hosts and not any(
                f.kind == "batch_size" for f in findings):
            findings.append(Finding(
                "batch_size", "global_batch_size",
                f"{global_batch_size} does not divide over the {hosts} hosts "
                "(each host's input pipeline reads an equal share). Use a "
                f"multiple of {math.lcm(hosts, _replicas(check_map))}."))
    if layout_map is not None:
        try:
            get_backend().refuse_unsupported_layouts(layout_map)
        except NotImplementedError as error:
            findings.append(Finding("backend", keras.backend.backend(),
                                    str(error)))
    estimate = None
    replicas = _replicas(check_map)
    # (at the nearest batch the replicas divide, where the batch is a
    # finding; not where a layout cannot be made at all)
    batch = replicas * max(1, (global_batch_size or replicas) // replicas)
    if not any(f.kind in _UNUSABLE_LAYOUT for f in findings):
        estimate = estimate_memory(
            built, check_map, batch_size=batch, optimizer=optimizer,
            loss=loss, input_shape=input_shape, input_dtype=input_dtype)
    if device_memory is not None:
        checked.append("memory")
        findings += _memory_findings(estimate, check.training_bytes_per_device,
                                     device_memory, mesh_size)
    if checkpoint_directory is not None:
        checked.append("checkpoint")
    return DryRun(findings, estimate, checked)


def _replicas(layout_map: LayoutMap) -> int:
    return int(layout_map.device_mesh.shape[0])


def _host_findings(layout_map: LayoutMap,
                   devices_per_host: int) -> List[Finding]:
    """A replica's devices (the model axes: consecutive devices) must lie
    on one host, or whole hosts: else its every layer talks across the
    network, and a host holds parts of two replicas."""
    mesh = layout_map.device_mesh
    group = math.prod(int(s) for s in mesh.shape) // _replicas(layout_map)
    if group <= 1 or devices_per_host % group == 0 or (
            group % devices_per_host == 0):
        return []
    return [Finding(
        "hosts", "devices_per_host",
        f"a replica's {group} devices (the mesh's axes after the batch "
        f"axis, {dict(zip(mesh.axis_names[1:], mesh.shape[1:]))}) do not "
        f"fit the hosts' {devices_per_host} devices: one replica's "
        "model-parallel traffic would cross hosts mid-group and a host "
        "would hold parts of two replicas. Make the model axes a divisor "
        f"(or a multiple) of {devices_per_host}.")]


def _memory_findings(estimate: Optional[MemoryEstimate], training: int,
                     device_memory: int, devices: int) -> List[Finding]:
    if estimate is None:  # (the layout cannot be made: found already)
        if training <= device_memory:
            return []
        peak, what = training, ("the variables with their gradients and "
                                "optimizer slots")
    else:
        activations = ("untraced" if estimate.activations is None
                       else human_bytes(estimate.activations))
        peak, what = estimate.peak, (
            f"a step's peak ({human_bytes(estimate.parameters)} parameters, "
            f"{human_bytes(estimate.gradients)} gradients, "
            f"{human_bytes(estimate.optimizer)} optimizer state, "
            f"{activations} activations and workspace)")
    if peak <= device_memory:
        return []
    return [Finding(
        "memory", "device_memory",
        f"{what} takes {human_bytes(peak)} per device, over the "
        f"{human_bytes(device_memory)} a device has. Shard more (a larger "
        "model axis, kd.layouts.fully_sharded or plan_layout), a smaller "
        f"batch per replica, or more than {devices} device(s).")]
