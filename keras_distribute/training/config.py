"""Every process of a job trains the same model: checked before `fit`.

Processes that build or compile different models would train one
"replicated" model with different settings: keras-tuner's
`distribution_strategy=` on PyTorch runs one oracle per process, which
picks other hyperparameters in each (other layer sizes made DDP fail with
"Rank 1 has 4 params, while rank 0 has 8"; another learning rate or dropout
rate would have trained silently). Before each `fit` of a job of several
processes, each process describes its model — every layer's class and
configuration, every variable's shape, dtype and trainability, in order,
and the compile configuration (optimizer and its hyperparameters, loss,
metrics) — and compares it with the chief's; if any process differs, every
process raises, naming the first difference and the processes. Names that
Keras numbers automatically (`dense_3`) are left out: a chief that built an
extra model first still trains the same one.

One broadcast and one all-gather per `fit` (not per step). No framework is
imported here.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING
from typing import Any
from typing import List
from typing import Optional

import numpy as np

from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.common.layouts import nested_layers

if TYPE_CHECKING:
    from keras import Model


def _without_names(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_names(v) for k, v in value.items()
                if k != "name"}
    if isinstance(value, (list, tuple)):
        return [_without_names(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """`value` as JSON values, without the names Keras numbers."""
    return json.loads(json.dumps(_without_names(value), sort_keys=True,
                                 default=str))


def describe(model: Model) -> List[list]:
    """What must be equal in every process, in order: `[what, value]` per
    layer (its class and configuration), variable (shape, dtype,
    trainable) and the compile configuration."""
    lines = []
    for number, layer in enumerate(nested_layers(model)):
        config = None  # a container: its layers are listed one by one
        if not getattr(layer, "layers", None):
            try:
                config = layer.get_config()
            except Exception:  # a custom layer without a config: its class
                config = None
        lines.append([f"layer {number} ({type(layer).__name__})",
                      _plain(config)])
    for number, variable in enumerate(model.variables):
        lines.append([f"variable {number}", [
            list(variable.shape), str(variable.dtype), variable.trainable]])
    try:
        compiled = model.get_compile_config()
    except Exception:
        compiled = None
    lines.append(["compile configuration", _plain(compiled)])
    return lines


def _differing_field(a: Any, b: Any, path: str = "") -> tuple:
    """The first `(path, a's value, b's value)` where `a` and `b` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key, "(absent)") != b.get(key, "(absent)"):
                return _differing_field(a.get(key, "(absent)"),
                                        b.get(key, "(absent)"),
                                        f"{path}/{key}")
    return path or "/", a, b


def _first_difference(mine: List[list], chief: List[list]) -> Optional[str]:
    for number in range(max(len(mine), len(chief))):
        a = chief[number] if number < len(chief) else ["(nothing)", None]
        b = mine[number] if number < len(mine) else ["(nothing)", None]
        if a != b:
            if a[0] != b[0]:
                return (f"process 0 has {a[0]} where this process has "
                        f"{b[0]}")
            field, chief_value, my_value = _differing_field(a[1], b[1])
            return (f"{a[0]}, {field}: {json.dumps(chief_value)[:200]} in "
                    f"process 0, {json.dumps(my_value)[:200]} in this "
                    "process")
    return None


def check_same_training(engine: ReplicaEngine, model: Model) -> None:
    """Raises, in every process, unless every process would train the same
    model (a collective: every process calls it before `fit`).

    Args:
        engine: The strategy's engine (`process_count`, `process_id`,
            `broadcast_text`, `process_all_gather`).
        model: The compiled Keras model about to be trained.

    Raises:
        ValueError: naming the processes that differ from the chief and, in
            each of those, the first difference.
    """
    if engine.process_count == 1:
        return
    # (Keras' serialization would import TensorFlow in a torch or JAX job
    # to ask whether an object is a TensorFlow type: not for this.)
    with engine.keras_services.configs_read_without_tensorflow():
        mine = describe(model)
    chief = json.loads(engine.broadcast_text(json.dumps(mine)))
    difference = _first_difference(mine, chief)
    flags = np.asarray(engine.process_all_gather(
        np.array([difference is not None], np.int32))).reshape(-1)
    differing = [rank for rank, flag in enumerate(flags) if flag]
    if not differing:
        return
    here = (f" The first difference: {difference}." if difference
            else " This process matches process 0; see the error of "
            f"process {differing[0]}.")
    raise ValueError(
        f"The processes of this job would train different models: process"
        f"{'es' if len(differing) > 1 else ''} {differing} built or "
        f"compiled another model than process 0.{here} Every process must "
        "build and compile the same model with the same settings. With "
        "keras-tuner, give the tuner a seed (every process then draws the "
        "same hyperparameters) or tune in one process; otherwise seed or "
        "broadcast what each process chooses (kd.broadcast).")
