"""`python -m keras_distribute.planning`: a dry run of the job, on one machine.

    python -m keras_distribute.planning train.py --hosts 4 \\
        --devices-per-host 8 --mesh 4,8 --layout-map make_layout_map \\
        --batch-size 256 --device-memory 16GB --checkpoint-dir gs://run

`train.py` (a file, or a module name) is imported, not run — its
`if __name__ == "__main__":` block does not run — and must define the
function that builds the model (`--model`; by default the first of
`make_model`, `build_model`, `create_model`, `get_model` it defines). The
model is built without values, the layout map (`--layout-map`: a
`LayoutMap` the file defines, or a function returning one, given the mesh
when it takes an argument; `--plan`: `kd.layouts.plan_layout` on the mesh)
is checked against it and against the cluster, and the verdict table is
printed (`kd.layouts.dry_run`). Exit status: 0 ready to launch, 1 findings,
2 a command line that cannot be used, 3 the model could not be built (the
model function's error is shown). On JAX the process's CPU platform is
given as many devices as the mesh has before JAX starts, so the memory
estimate is XLA's analysis of the step compiled for the job's mesh.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import re
import runpy
import sys
import traceback
from types import MappingProxyType
from typing import Any
from typing import Dict
from typing import List
from typing import Optional

_MODEL_FUNCTIONS = ("make_model", "build_model", "create_model", "get_model")
_UNITS = MappingProxyType({
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
})


class UsageError(Exception):
    """A command line that cannot be used (exit status 2)."""


READY, FINDINGS, UNUSABLE_COMMAND_LINE, MODEL_NOT_BUILT = 0, 1, 2, 3
# The most CPU devices XLA compiles one program for here: from 4,096 its
# CPU client refuses ("Multiprocess computations aren't implemented on the
# CPU backend"); 2,048 compile.
MAX_SIMULATED_DEVICES = 2048


def parse_bytes(text: str) -> int:
    """`"16GB"`, `"16GiB"`, `"512MB"`, `"1024"` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*",
                         text.upper())
    if not match or match.group(2) not in _UNITS or float(
            match.group(1)) <= 0:
        raise UsageError(
            f"--device-memory takes a size such as 16GB, 80GiB or 512MB. "
            f"Received: {text!r}.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_ints(text: str, flag: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        raise UsageError(f"{flag} takes positive integers separated by "
                         f"commas, e.g. 2,4. Received: {text!r}.")
    return values


def parse_input_shape(given: Optional[List[str]]) -> Any:
    """`--input-shape` as `estimate_memory` takes it: `["28,28,1"]` ->
    `(28, 28, 1)`; `["token_ids=512", "padding_mask=512"]` ->
    `{"token_ids": (512,), "padding_mask": (512,)}`; None when not given."""
    if not given:
        return None
    named = [text.partition("=") for text in given]
    if all(sep for _, sep, _ in named):
        shapes = {name.strip(): parse_ints(dims, "--input-shape")
                  for name, _, dims in named}
        if len(shapes) != len(given) or not all(shapes):
            raise UsageError(
                "--input-shape: each named input once, as name=dims. "
                f"Received: {given!r}.")
        return shapes
    if len(given) == 1 and not named[0][1]:
        return parse_ints(given[0], "--input-shape")
    raise UsageError(
        "--input-shape takes one shape (e.g. 28,28,1), or one name=dims per "
        "named input (e.g. --input-shape token_ids=512 --input-shape "
        f"padding_mask=512). Received: {given!r}.")


def load_definitions(target: str) -> Dict[str, Any]:
    """The names `target` (a .py file or a module name) defines, imported
    without running its `__main__` block."""
    if target.endswith(".py") or os.path.isfile(target):
        if not os.path.isfile(target):
            raise UsageError(f"No such file: {target!r}. Pass the script "
                             "that defines the function building the model.")
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        return runpy.run_path(target, run_name="__kd_plan__")
    sys.path.insert(0, os.getcwd())
    try:
        return vars(importlib.import_module(target))
    except ImportError as error:
        raise UsageError(f"Cannot import {target!r} ({error}). Pass a .py "
                         "file or an importable module.") from None


def _pick(definitions: Dict[str, Any], name: Optional[str], what: str,
          defaults: tuple) -> Any:
    names = (name,) if name else defaults
    for candidate in names:
        if candidate in definitions:
            return definitions[candidate]
    raise UsageError(
        f"The script defines no {what} named {' or '.join(names)}. "
        f"Name it with --{what.split()[0]}.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_distribute.planning",
        description="A dry run of a keras_distribute job on this machine: "
                    "the model built without values, the layout map, the "
                    "cluster, the batch, memory and checkpoints checked.")
    parser.add_argument("script", help="the .py file (or module) that "
                        "defines the function building the model")
    parser.add_argument("--model", help="that function's name (default: "
                        + ", ".join(_MODEL_FUNCTIONS) + ")")
    parser.add_argument("--layout-map", help="a LayoutMap the script "
                        "defines, or a function returning one")
    parser.add_argument("--plan", action="store_true",
                        help="plan the layout (kd.layouts.plan_layout)")
    parser.add_argument("--mesh", help="the mesh's shape, e.g. 4,8 "
                        "(default: every device on the batch axis)")
    parser.add_argument("--axes", help="the mesh's axis names (default: "
                        "batch,model)")
    parser.add_argument("--hosts", type=int, help="hosts of the job")
    parser.add_argument("--devices-per-host", type=int,
                        help="devices (torch: processes) per host")
    parser.add_argument("--batch-size", type=int,
                        help="the global batch fit is given")
    parser.add_argument("--device-memory", help="memory of one device, "
                        "e.g. 16GB or 80GiB")
    parser.add_argument("--checkpoint-dir", help="the job's checkpoint "
                        "directory (local, s3:// or gs://; read only)")
    parser.add_argument("--optimizer", help="optimizer name (default: the "
                        "model's compiled one, else adam)")
    parser.add_argument("--loss", help="loss name (default: the model's "
                        "compiled one, else mean_squared_error)")
    parser.add_argument("--input-shape", action="append",
                        help="one example's input shape, e.g. 28,28,1 (a "
                        "model without keras.Input); for named inputs one "
                        "flag per input, e.g. --input-shape token_ids=512 "
                        "--input-shape padding_mask=512")
    return parser


def simulate_mesh_devices(args: argparse.Namespace) -> None:
    """On JAX, before JAX starts in this process: its CPU platform is given
    as many devices as the job's mesh has (XLA's
    `--xla_force_host_platform_device_count`, added to `XLA_FLAGS`), so
    the memory estimate is XLA's analysis of the step compiled for that
    mesh rather than a shape trace. The dry run compiles; it never runs a
    step. Nothing when JAX has started, when the backend is not JAX, or
    when `XLA_FLAGS` gives as many devices already."""
    if "jax" in sys.modules or _keras_backend() != "jax":
        return
    size = None
    try:
        if args.mesh:
            size = math.prod(parse_ints(args.mesh, "--mesh"))
        elif args.hosts and args.devices_per_host:
            size = args.hosts * args.devices_per_host
    except UsageError:
        return  # (said once the command line is read: `_mesh`)
    if not size or size < 2:
        return
    if size > MAX_SIMULATED_DEVICES:
        print(f"python -m keras_distribute.planning: the mesh's {size} "
              f"devices are more than XLA's CPU compiles one program for "
              f"here (at most {MAX_SIMULATED_DEVICES}): the layout, cluster, "
              "batch and checkpoint are checked for the whole mesh, the "
              "memory from a shape trace of one replica's step (the "
              "table's 'from:' line says so).")
        return
    flags = os.environ.get("XLA_FLAGS", "")
    given = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if given and int(given.group(1)) >= size:
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = " ".join(
        flags.split() + [f"--xla_force_host_platform_device_count={size}"])


def _keras_backend() -> str:
    """The backend Keras will start with: `KERAS_BACKEND`, else the
    `backend` of its `keras.json` (`KERAS_HOME`, else `~/.keras`), else
    TensorFlow, Keras' default — read without importing Keras."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            return str(json.load(file).get("backend", "tensorflow"))
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def _mesh(args: argparse.Namespace, keras: Any) -> Optional[Any]:
    devices = (args.hosts * args.devices_per_host
               if args.hosts and args.devices_per_host else None)
    if args.mesh:
        shape = parse_ints(args.mesh, "--mesh")
    elif devices:
        shape = (devices,)
    else:
        return None
    names = (args.axes.split(",") if args.axes
             else ["batch", "model", "model2", "model3"][:len(shape)])
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise UsageError(f"--axes needs {len(shape)} distinct names for the "
                         f"mesh {shape}. Received: {args.axes!r}.")
    size = 1
    for s in shape:
        size *= s
    return keras.distribution.DeviceMesh(
        shape, names, [f"cpu:{i}" for i in range(size)])


def _layout_map(args: argparse.Namespace, definitions: Dict[str, Any],
                model: Any, mesh: Any, keras: Any) -> Optional[Any]:
    from keras_distribute.planning.layout_planner import plan_layout

    if args.plan:
        if mesh is None:
            raise UsageError("--plan needs a mesh: give --mesh (or --hosts "
                             "and --devices-per-host).")
        return plan_layout(model, mesh).layout_map
    if not args.layout_map:
        if mesh is None:
            return None
        return keras.distribution.LayoutMap(mesh)  # data parallel
    found = _pick(definitions, args.layout_map, "layout-map object", ())
    if callable(found) and not isinstance(found,
                                          keras.distribution.LayoutMap):
        wants_mesh = bool(inspect.signature(found).parameters)
        if wants_mesh and mesh is None:
            raise UsageError(f"{args.layout_map}() takes a mesh: give --mesh "
                             "(or --hosts and --devices-per-host).")
        found = found(mesh) if wants_mesh else found()
    if not isinstance(found, keras.distribution.LayoutMap):
        raise UsageError(f"{args.layout_map} is not a keras.distribution."
                         f"LayoutMap (it is {type(found).__name__}), nor a "
                         "function returning one.")
    return found


def _build(builder: Any, name: str, keras: Any) -> Optional[Any]:
    """The model `builder` builds without values, or None after printing
    its error (the model function's own code failed)."""
    from keras_distribute.planning.layout_planner import built_model

    try:
        return built_model(builder, keras)
    except Exception as error:  # (the user's code: shown, exit status 3)
        frames = traceback.format_exception(error)
        print(f"python -m keras_distribute.planning: the model could not be "
              f"built: {name}() raised {type(error).__name__}: {error}\n"
              "Fix the model function (it must build a Keras model; it is "
              "called without values, so it must not read variable values "
              "while it builds). Its traceback:\n" + "".join(frames[-12:]),
              file=sys.stderr)
        return None


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the dry run the command line asks for; returns the exit
    status (0: ready to launch, 1: findings, 2: unusable command line, 3:
    the model could not be built)."""
    args = build_parser().parse_args(argv)
    simulate_mesh_devices(args)
    try:
        import keras

        from keras_distribute.planning.dry_run import dry_run

        definitions = load_definitions(args.script)
        builder = _pick(definitions, args.model, "model function",
                        _MODEL_FUNCTIONS)
        mesh = _mesh(args, keras)
        model = _build(builder, getattr(builder, "__name__", "model"), keras)
        if model is None:
            return MODEL_NOT_BUILT
        layout_map = _layout_map(args, definitions, model, mesh, keras)
        verdict = dry_run(
            model, layout_map, hosts=args.hosts,
            devices_per_host=args.devices_per_host,
            global_batch_size=args.batch_size,
            device_memory=(parse_bytes(args.device_memory)
                           if args.device_memory else None),
            checkpoint_directory=args.checkpoint_dir,
            optimizer=args.optimizer, loss=args.loss,
            input_shape=parse_input_shape(args.input_shape))
    except (UsageError, TypeError, ValueError) as error:
        print(f"python -m keras_distribute.planning: {error}", file=sys.stderr)
        return UNUSABLE_COMMAND_LINE
    print(verdict.table())
    return READY if verdict.ok else FINDINGS

