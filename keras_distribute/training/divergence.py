"""The guard against silent divergence: every replica holds one state.

Replicas that apply different updates train different models, and nothing
else tells: each process's logs look fine. At the end of every epoch of a
distributed `fit` (and on demand, `strategy.check_replicas_agree(model)`)
every process fingerprints each copy it holds of the model's trainable
variables and of its optimizer's variables (a 63-bit xxh3 digest of the
bytes), copies of one region are compared within the process (the replicas
of one process: JAX's devices, TensorFlow's mirrored copies) and copies of
one region across processes (whole copies, and every piece of a sharded
variable that several processes hold; keys and digests exactly, as 21-bit
pieces, through two small all-gathers). A difference raises
`kd.ReplicasDivergedError` in every process alike, naming the first variable
that differs and the likely causes; `set_divergence_check("warn")` (or
`KERAS_DISTRIBUTE_DIVERGENCE_CHECK=warn`) warns instead, `"off"` skips it.

The engine gives the copies (`ReplicaEngine.replica_copies`); no framework
is imported here. Collective: every process calls it at the same points.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from keras_distribute.backend.interface import ReplicaEngine
from keras_distribute.common.errors import ReplicasDivergedError

if TYPE_CHECKING:
    from keras import Model

MODES = ("raise", "warn", "off")
ENVIRONMENT_VARIABLE = "KERAS_DISTRIBUTE_DIVERGENCE_CHECK"
_chosen: List[Optional[str]] = [None]


def _checked_mode(mode: Any, source: str) -> str:
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ValueError(
            f"The divergence check's mode must be one of {list(MODES)}. "
            f"Received: {source}={mode!r}. Use 'raise' (the default), "
            "'warn' to only warn, or 'off' to skip the check.")
    return mode.lower()


def set_divergence_check(mode: str) -> None:
    """Chooses what a distributed `fit` does when replicas diverge.

    At the end of every epoch of a `fit` over several replicas or processes,
    kd compares every copy of the model's trainable and optimizer variables
    (see `Strategy.check_replicas_agree`).

    Args:
        mode: `"raise"` (the default) raises `kd.ReplicasDivergedError`,
            `"warn"` warns and trains on, `"off"` skips the check. The
            environment variable `KERAS_DISTRIBUTE_DIVERGENCE_CHECK` sets
            the default for a process.

    Raises:
        ValueError: for another mode.

    Example:

    ```python
    kd.set_divergence_check("warn")
    ```
    """
    _chosen[0] = _checked_mode(mode, "mode")


def divergence_check_mode() -> str:
    """The mode in force (`set_divergence_check`, else the environment
    variable, else `"raise"`)."""
    if _chosen[0] is not None:
        return _chosen[0]
    value = os.environ.get(ENVIRONMENT_VARIABLE)
    if value is None or value == "":
        return "raise"
    return _checked_mode(value, ENVIRONMENT_VARIABLE)


def checked_variables(model: Model) -> List[Tuple[str, Any]]:
    """`[(name, variable)]` the check compares: the model's trainable
    variables, then its optimizer's (slots, iteration count)."""
    named = [(f"{getattr(v, 'path', v.name)}", v)
             for v in model.trainable_variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        named += [(f"{getattr(v, 'path', v.name)}", v)
                  for v in optimizer.variables]
    return named


def fingerprint(array: np.ndarray) -> int:
    """A 63-bit fingerprint of `array`'s bytes (xxh3: ~10 GB/s, so the
    check costs little next to an epoch; it detects, not authenticates)."""
    import xxhash

    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return xxhash.xxh3_64_intdigest(data) & ((1 << 63) - 1)


def _region_key(region: tuple) -> int:
    """A 63-bit key of a region (`((start, stop), ...)`), equal in every
    process for one region."""
    return fingerprint(np.asarray(region, np.int64))


def _fingerprints(engine: ReplicaEngine, named: Sequence[Tuple[str, Any]],
                  within_process: bool = True
                  ) -> Tuple[List[Tuple[int, int, int]], int]:
    """`([(variable index, region key, digest)], index of the first
    variable whose copies differ inside this process (-1: none))`: one row
    for every region this process holds of every variable (its whole copy,
    or each piece of a sharded one: processes holding the same piece
    compare it). `within_process=False` reads one copy of each region (the
    comparison across processes only)."""
    rows = []
    local_difference = -1
    for index, (_, variable) in enumerate(named):
        seen, differ = copy_digests(engine, variable,
                                    every_copy=within_process)
        if differ:
            # Read once more before calling it a divergence: a copy read
            # while the runtime still wrote it must not fail a fit. (The
            # TF difference once blamed on that was a real one: an
            # iteration count run on some replicas only, now fixed in
            # integration/tf_hooks.py.)
            seen, differ = copy_digests(engine, variable,
                                        every_copy=within_process)
        if differ and local_difference < 0:
            local_difference = index
        rows += [(index, _region_key(region), digest)
                 for region, digest in sorted(seen.items())]
    return rows, local_difference


# 63-bit keys and digests cross the processes as three 21-bit pieces in
# int32 (JAX without 64-bit types truncates int64 to int32: keys read as
# negative, digests compared on their low half, divergences unseen).
_PIECE_BITS = 21
_PIECES = 3


def _in_pieces(values: Sequence[int]) -> List[int]:
    mask = (1 << _PIECE_BITS) - 1
    return [(value >> (_PIECE_BITS * piece)) & mask
            for value in values for piece in range(_PIECES)]


def _from_pieces(pieces: Sequence[int]) -> int:
    return sum(int(piece) << (_PIECE_BITS * position)
               for position, piece in enumerate(pieces))


def _gathered_rows(engine: ReplicaEngine, rows: List[Tuple[int, int, int]],
                   local: int) -> Tuple[List[int], List[List[Tuple]]]:
    """Every process's `local` and rows (a collective): the rows padded to
    the longest process's, as int32 pieces, decoded exactly."""
    longest = int(np.max(np.asarray(engine.process_all_gather(
        np.array([len(rows)], np.int32)))))
    width = 1 + 2 * _PIECES
    table = np.full((longest, width), -1, np.int32)
    for position, (index, key, digest) in enumerate(rows):
        table[position] = [index] + _in_pieces([key, digest])
    everyone = np.asarray(engine.process_all_gather(
        np.concatenate([[local], table.reshape(-1)]).astype(np.int32)))
    locals_ = everyone[:, 0].tolist()
    by_process = []
    for gathered in everyone[:, 1:].reshape(len(everyone), longest, width):
        by_process.append([
            (int(row[0]), _from_pieces(row[1:1 + _PIECES]),
             _from_pieces(row[1 + _PIECES:])) for row in gathered.tolist()
            if row[0] >= 0])
    return locals_, by_process


def copy_digests(engine: ReplicaEngine, variable: Any,
                 every_copy: bool = True) -> Tuple[dict, bool]:
    """`({region: digest}, whether two copies of one region differ)` of
    this process's copies of `variable` (`engine.replica_copies`; with
    `every_copy=False` the first of each region's only)."""
    seen: dict = {}
    differ = False
    for region, array in engine.replica_copies(
            variable, one_per_region=not every_copy):
        digest = fingerprint(np.asarray(array))
        if seen.setdefault(tuple(region), digest) != digest:
            differ = True
    return seen, differ


def _small_values(engine: ReplicaEngine, variable: Any) -> str:
    """The copies' values of a variable of at most 4 numbers (e.g. an
    optimizer's step count), for the message; "" for larger ones."""
    if int(np.prod(variable.shape)) > 4:
        return ""
    values = [np.asarray(array).reshape(-1).tolist()
              for _, array in engine.replica_copies(variable)]
    return f" (this process's copies hold {values})"


def find_divergence(engine: ReplicaEngine,
                    named: Sequence[Tuple[str, Any]],
                    within_process: bool = True
                    ) -> Optional[Tuple[str, str]]:
    """`(variable name, where)` of the first variable whose copies differ
    (the same answer in every process), or `None` (a collective).

    Args:
        engine: The strategy's engine.
        named: `[(name, variable)]` to compare, in the same order in every
            process (`checked_variables(model)`).
        within_process: Also compare the copies inside each process (its
            replicas'); `False` reads one copy of each region and compares
            across processes only.

    Returns:
        `None` when every copy agrees; else the variable's name and where
        its copies differ.
    """
    counts = np.asarray(engine.process_all_gather(
        np.array([len(named)], np.int32)))[:, 0]
    if len(set(counts.tolist())) > 1:
        return ("(the variable lists)",
                "the processes hold different numbers of trainable and "
                f"optimizer variables: {counts.tolist()} by process")
    rows, local = _fingerprints(engine, named, within_process)
    locals_, by_process = _gathered_rows(engine, rows, local)
    first_holder: dict = {}  # (variable, region key) -> (process, digest)
    differ: dict = {}  # variable index -> (first process, other process)
    for process, process_rows in enumerate(by_process):
        for index, key, digest in process_rows:
            holder = first_holder.setdefault((index, key), (process, digest))
            if holder[1] != digest:
                differ.setdefault(index, (holder[0], process))
    for index, (name, _) in enumerate(named):
        if index in locals_:
            process = locals_.index(index)
            values = (_small_values(engine, named[index][1])
                      if process == engine.process_id else "")
            return name, (f"between the replicas of process {process}"
                          f"{values}")
        if index in differ:
            first, other = differ[index]
            return name, f"between process {first} and process {other}"
    return None


def divergence_message(name: str, where: str, when: str) -> str:
    """The three-part message of a divergence."""
    return (
        f"The replicas diverged: {when}, the copies of `{name}` differ "
        f"{where}. Every replica must hold the same trainable and optimizer "
        "state after each step; these trained different models. Likely "
        "causes: a step that changes variables without a Keras optimizer "
        "(e.g. `variable.assign_sub(lr * grad)` with this replica's own "
        "gradients), gradients all-reduced by hand twice or not at all, or "
        "an update that depends on random numbers drawn differently per "
        "replica. Fix: apply gradients with `optimizer.apply(grads, "
        "variables)` or `apply_gradients` (under a kd strategy they are the "
        "global batch's), or in a custom loop all-reduce them with "
        "`kd.get_replica_context().all_reduce('sum', grads)`. To warn "
        "instead: kd.set_divergence_check('warn') (or "
        f"{ENVIRONMENT_VARIABLE}=warn).")


def check_replicas_agree(engine: ReplicaEngine, model: Model,
                         when: str = "at this check",
                         mode: str = "raise") -> None:
    """Raises (or warns, per `mode`) when `model`'s copies differ (a
    collective; see the module docstring)."""
    if mode == "off" or not getattr(model, "built", False) or (
            engine.num_replicas == 1 and engine.process_count == 1):
        return
    found = find_divergence(engine, checked_variables(model))
    if found is None:
        return
    message = divergence_message(found[0], found[1], when)
    if mode == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise ReplicasDivergedError(message, variable=found[0])


def check_before_writing(
        engine: ReplicaEngine,
        named_variables: Callable[[], Sequence[Tuple[str, Any]]],
        path: str) -> None:
    """In a job of several processes, raises (or warns, per the mode in
    force) before a checkpoint of `named_variables()` is written when their
    copies differ: the chief would write its own model as the job's, and the
    others' training would be lost unseen (a loop of the user's own that
    gives each process its own batch where the step needs the global one).
    Nothing is written then; the checkpoints there stay as they were. A
    collective: every process writes. `named_variables()` lists the
    variables, called only where the check runs (a job of several
    processes)."""
    mode = divergence_check_mode()
    if mode == "off" or engine.process_count == 1:
        return
    named = named_variables()
    # (Across processes only, one copy of each region read: a replicated
    # variable on a host of 8 devices is read to the host once, not 8
    # times. The copies inside a process are fit's check, at epoch ends.)
    found = find_divergence(engine, named, within_process=False)
    if found is None:
        return
    message = divergence_message(
        found[0], found[1], f"before writing the checkpoint {path}") + (
        " (On JAX, a jitted step of your own given each process's own "
        "batch — a NumPy array — trains one model per process: give it "
        "the global batch, from strategy.experimental_distribute_dataset.)"
        " Nothing was written: the checkpoints already there are as they "
        "were.")
    if mode == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    raise ReplicasDivergedError(message, variable=found[0])


def with_divergence_check(engine: ReplicaEngine, callbacks: Any) -> Any:
    """`fit`'s `callbacks` with the check first at every epoch end (before
    the callbacks that save or read the model); unchanged with one replica,
    with the check off, or for a prepared `CallbackList`."""
    mode = divergence_check_mode()
    if mode == "off" or (engine.num_replicas == 1
                         and engine.process_count == 1) or not isinstance(
                             callbacks, (list, tuple, type(None))):
        return callbacks
    import keras

    class DivergenceCheck(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            check_replicas_agree(engine, self.model,
                                 when=f"after epoch {epoch + 1}", mode=mode)

    return [DivergenceCheck()] + list(callbacks or [])
