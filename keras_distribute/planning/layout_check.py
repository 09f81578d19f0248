"""`kd.layouts.check_layout`: a layout map checked against a model before
the job starts, every finding with its fix.

What Keras lets pass, or raises only on the real hosts once the variables
are made: a key that matches no variable (what it meant to shard stays
replicated, keras-team/keras-hub#2806), a variable two keys match, a layout
of the wrong rank, a shard the axis does not divide, a large variable
left replicated on a mesh that could split it, a global batch the replicas
do not divide, and variables (with their gradients and optimizer slots)
over a device's memory. The model is built
without values (`kd.layouts.plan_layout` does the same), so a model far
larger than this machine is checked here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import TYPE_CHECKING
from typing import List
from typing import Optional

from keras_distribute.common.layout_picture import human_bytes
from keras_distribute.common.layout_picture import nbytes_of
from keras_distribute.common.layouts import axis_size
from keras_distribute.common.layouts import check_layout_fits
from keras_distribute.common.layouts import variable_layout
from keras_distribute.planning.layout_planner import built_model
from keras_distribute.planning.layout_planner import variables_of

if TYPE_CHECKING:
    from keras import Layer
    from keras.distribution import LayoutMap

    from keras_distribute.planning.layout_planner import ModelOrBuilder

# A replicated variable at least this large, on a mesh whose axes could
# split it, is reported (an embedding table a key missed, say).
DEFAULT_GIANT_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem `check_layout` found.

    Attributes:
        kind: `"unmatched_key"`, `"several_keys"`, `"rank"`,
            `"indivisible"`, `"replicated_giant"`, `"batch_size"`,
            `"memory"`, `"mesh"` or `"checkpoint"`.
        subject: The key, variable path or argument it is about.
        message: What is wrong and how to fix it.
    """

    kind: str
    subject: str
    message: str


@dataclasses.dataclass
class LayoutCheck:
    """What `check_layout` returns.

    Attributes:
        findings: The problems found (none: the layout fits the model).
        bytes_per_device: The variables' bytes on the most loaded device.
        training_bytes_per_device: With their gradients and optimizer slots.
    """

    findings: List[Finding]
    bytes_per_device: int
    training_bytes_per_device: int

    @property
    def ok(self) -> bool:
        """Whether nothing was found."""
        return not self.findings

    def table(self) -> str:
        """The verdict: one line per finding, then the memory line."""
        lines = [f"{f.kind:<17} {f.subject}: {f.message}"
                 for f in self.findings] or ["no problem found"]
        lines.append(
            f"per device: {human_bytes(self.bytes_per_device)} of variables, "
            f"{human_bytes(self.training_bytes_per_device)} with gradients and "
            "optimizer slots (activations not included)")
        return "\n".join(lines)

    def raise_if_any(self) -> None:
        """Raises `ValueError` listing every finding, if there is one."""
        if self.findings:
            raise ValueError("The layout does not fit the model:\n"
                             + self.table())


def check_layout(layout_map: LayoutMap, model: ModelOrBuilder, *,
                 global_batch_size: Optional[int] = None,
                 device_memory: Optional[int] = None,
                 optimizer_slots: int = 2,
                 giant_bytes: int = DEFAULT_GIANT_BYTES,
                 checkpoint_directory: Optional[str] = None,
                 checkpoint_object: str = "model",
                 devices: Optional[int] = None) -> LayoutCheck:
    """Checks a `LayoutMap` against a model, before anything is launched.

    Args:
        layout_map: A `keras.distribution.LayoutMap` (a
            `kd.layouts.fully_sharded` one included).
        model: A built Keras model, or a function that builds one (built
            without values, as `kd.layouts.plan_layout` does).
        global_batch_size: The batch `fit` will be given: checked against
            the data-parallel replicas (the mesh's first axis).
        device_memory: Bytes a device has: checked against the variables,
            their gradients and optimizer slots per device.
        optimizer_slots: The optimizer's variables per trainable variable
            (Adam: 2, SGD with momentum: 1, SGD: 0).
        giant_bytes: A replicated variable at least this large is reported
            when the mesh could split it.
        checkpoint_directory: Where the job keeps its checkpoints: it must
            be a local or mounted directory that can be created or written,
            and its latest checkpoint (if any) must hold this model's
            variables with the same shapes (it restores onto any mesh).
            A local directory is only read; in object storage (`s3://`,
            `gs://`) a probe object of a random name is written, read back
            and deleted, proving the job can list, write and delete there.
        checkpoint_object: The name the model is saved under in those
            checkpoints (`ShardedCheckpoint(model=...)`: `"model"`).
        devices: The devices the job will have (hosts x devices per
            host): the mesh must span exactly them.

    Returns:
        A `LayoutCheck`: `.findings` (each with its fix), `.ok`,
        `.table()`, `.raise_if_any()`.

    Raises:
        TypeError: if `layout_map` is not a `LayoutMap`, or `model` is
            neither a Keras layer nor a function that builds one.
        ValueError: for a negative size or count.

    Example:

    ```python
    check = kd.layouts.check_layout(layout_map, make_model,
                                    global_batch_size=256,
                                    device_memory=16 * 2**30)
    print(check.table())
    check.raise_if_any()
    ```
    """
    import keras
    from keras.distribution import LayoutMap

    if not isinstance(layout_map, LayoutMap):
        raise TypeError(
            "Expected a keras.distribution.LayoutMap. Received: layout_map="
            f"{layout_map!r} of type {type(layout_map).__name__}.")
    for name, value in (("global_batch_size", global_batch_size),
                        ("device_memory", device_memory),
                        ("optimizer_slots", optimizer_slots),
                        ("giant_bytes", giant_bytes),
                        ("devices", devices)):
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, int) or value < 0):
            raise ValueError(
                f"{name} must be a non-negative int. Received: "
                f"{name}={value!r}.")
    mesh = layout_map.device_mesh
    model = built_model(model, keras)
    variables = variables_of(model)
    findings: List[Finding] = []
    keys = list(layout_map.keys())  # (Keras refuses unknown axes)
    paths = [v.path for v in variables]
    for key in keys:
        if not any(key == p or re.search(key, p) for p in paths) and not (
                key.endswith("/output")):
            findings.append(Finding(
                "unmatched_key", key,
                "matches none of the model's variables, so it lays out "
                f"nothing. Paths look like {paths[:2]}: write the path, or "
                "a pattern that matches it (e.g. '.*dense.*kernel')."))
    sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.shape)))
    splittable = math.prod(sizes.values()) > 1
    per_device = 0
    trainable_per_device = 0
    for variable in variables:
        path, shape = variable.path, tuple(int(s) for s in variable.shape)
        nbytes = nbytes_of(shape, str(variable.dtype))
        matched = [k for k in keys if k == path or re.search(k, path)]
        if len(matched) > 1 and path not in matched:
            findings.append(Finding(
                "several_keys", path,
                f"is matched by {len(matched)} keys {matched}: Keras "
                "refuses that when the variable is made. Make the patterns "
                "exclusive (anchor them: '^...$')."))
            layout = None
        else:
            layout = variable_layout(layout_map, path, shape)
        shards = 1
        if layout is not None:
            try:
                check_layout_fits(layout, path, shape)
            except ValueError as error:
                kind = ("rank" if len(layout.axes) != len(shape)
                        else "indivisible")
                findings.append(Finding(kind, path, str(error)))
            else:
                shards = math.prod(axis_size(mesh, a) for a in layout.axes
                                   if a is not None)
        elif splittable and nbytes >= giant_bytes:
            findings.append(Finding(
                "replicated_giant", path,
                f"{human_bytes(nbytes)} {shape} is replicated on every device. "
                "Give it a layout (kd.layouts.plan_layout proposes one), or "
                "use kd.layouts.fully_sharded."))
        per_device += nbytes // shards
        if variable.trainable:
            trainable_per_device += nbytes // shards
    training = per_device + trainable_per_device * (1 + optimizer_slots)
    batch_axis = mesh.axis_names[0]
    replicas = sizes[batch_axis]
    if global_batch_size is not None and global_batch_size % replicas:
        nearest = replicas * max(1, global_batch_size // replicas)
        findings.append(Finding(
            "batch_size", "global_batch_size",
            f"{global_batch_size} does not divide over the {replicas} "
            f"replicas of mesh axis {batch_axis!r}. Use a multiple of "
            f"{replicas} (e.g. {nearest})."))
    if device_memory is not None and training > device_memory:
        findings.append(Finding(
            "memory", "device_memory",
            f"the variables with their gradients and {optimizer_slots} "
            f"optimizer slot(s) take {human_bytes(training)} per device, "
            f"over the {human_bytes(device_memory)} a device has "
            "(activations come on top). Shard more (a larger model axis, "
            "kd.layouts.fully_sharded), or use more devices."))
    mesh_size = math.prod(sizes.values())
    if devices is not None and devices != mesh_size:
        others = mesh_size // replicas  # the devices of one replica
        hint = (f" (e.g. {(devices // others, others)} over "
                f"{list(mesh.axis_names)})" if len(sizes) > 1
                and devices % others == 0 else "")
        findings.append(Finding(
            "mesh", "devices",
            f"the mesh {dict(sizes)} spans {mesh_size} devices, the job "
            f"will have {devices}: a larger mesh cannot be made there, a "
            "smaller one leaves devices unused. Reshape the mesh to "
            f"{devices} devices{hint}."))
    if checkpoint_directory is not None:
        findings += _checkpoint_findings(checkpoint_directory, model,
                                         checkpoint_object)
    return LayoutCheck(findings, per_device, training)


def _checkpoint_findings(directory: str, model: Layer,
                         object_name: str) -> List[Finding]:
    """The checkpoint directory: usable, and its latest checkpoint one this
    model can restore (keys `<object>/<position>`, shapes equal)."""
    from keras_distribute.checkpoint.storage import committed
    from keras_distribute.checkpoint.storage import paths

    try:
        directory = paths.checkpoint_path(directory, "checkpoint_directory")
    except (TypeError, ValueError) as error:
        return [Finding("checkpoint", str(directory), str(error))]
    if directory.startswith(("s3://", "gs://")):
        try:
            latest = committed.latest_checkpoint(directory)
            _probe_store(directory)
        except (ImportError, OSError) as error:
            return [Finding(
                "checkpoint", directory,
                f"the job cannot list, write and delete its objects there "
                f"({type(error).__name__}: {error}); no checkpoint could be "
                "saved there. Check the credentials, the endpoint, the "
                "bucket's name and its policy.")]
        return [] if latest is None else _checkpoint_fits(
            latest, model, object_name)
    existing = os.path.abspath(directory)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing,
                                                    os.W_OK | os.X_OK):
        return [Finding(
            "checkpoint", directory,
            f"{existing!r} is not a directory this process can write "
            "into, so no checkpoint can be saved there. Pass a writable "
            "(shared, for several hosts) directory.")]
    latest = committed.latest_checkpoint(directory) if os.path.isdir(
        directory) else None
    if latest is None:
        return []
    return _checkpoint_fits(latest, model, object_name)


def _probe_store(directory: str) -> None:
    """Proves the job can write and delete its own objects under an object
    store's `directory` (a listing alone passes a missing bucket and a
    read-only user): writes a probe object of a random name, reads it
    back and deletes it — only it.

    Raises:
        OSError: what the store answered (FileNotFoundError for a missing
            bucket, PermissionError for a refused write or delete).
    """
    import secrets

    from keras_distribute.checkpoint.storage import object_store

    store = object_store.store_for(directory)
    probe = object_store.join(
        directory, f".keras_distribute-probe-{secrets.token_hex(8)}")
    store.write_bytes(probe, b"keras_distribute dry run")
    try:
        if store.read_bytes(probe, 64) != b"keras_distribute dry run":
            raise OSError(f"{probe} reads back other bytes than written")
    finally:
        store.remove([probe])


def _checkpoint_fits(latest: str, model: Layer,
                     object_name: str) -> List[Finding]:
    """Whether `model` can restore the checkpoint `latest` (its index read
    only)."""
    from keras_distribute.checkpoint.storage import committed
    from keras_distribute.checkpoint.storage.format import CheckpointError

    try:
        saved = dict(committed.list_variables(latest))
    except CheckpointError as error:
        return [Finding(
            "checkpoint", latest,
            f"the latest checkpoint cannot be read ({error}); a resumed job "
            "would fail. Move it aside or pass another directory.")]
    differ: List[str] = []
    seen: set = set()
    for variable in model.variables:
        if id(variable) in seen:
            continue
        key = f"{object_name}/{len(seen)}"
        seen.add(id(variable))
        shape = tuple(int(s) for s in variable.shape)
        if saved.get(key) != shape:
            differ.append(f"{variable.path} {shape}: saved {key} "
                          f"{saved.get(key, 'absent')}")
    if differ:
        return [Finding(
            "checkpoint", latest,
            f"the latest checkpoint does not hold this model's variables "
            f"(e.g. {differ[:3]}): a resumed job would refuse it. Build the "
            "architecture it was saved from, or pass another directory.")]
    return []
