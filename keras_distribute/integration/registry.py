"""Every Keras-private name keras_distribute touches, as rows of one table.

Keras' public API (`keras.*`, `keras.distribution.*`) is the contract;
`keras.src.*` names are private and move between releases (3.16 renamed
`trainers.trainer.Trainer` to `BaseTrainer`, moved `backend.<name>.core` to
`backend.<name>.ops.core`, renamed the backend trainers `Trainer`). Each row
says what is used, why, on which Keras versions, what upstream change would
make it unnecessary, and the parameters a patched callable must take; its
`candidates` are the places it is found, tried in order (the table:
`keras_private_rows`, and `keras_private_attribute_rows` for private
attributes of Keras objects). `check()` verifies
every row that applies to the running backend before anything is patched
and fails with one `KerasVersionError` naming the Keras version, the rows
that do not fit and the supported range — never half-installed, never an
`AttributeError` from inside Keras.

This module imports Keras only when a row is resolved.
"""

import importlib
import inspect
import random
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np

from keras_distribute.integration import keras_private_attribute_rows
from keras_distribute.integration import keras_private_rows
from keras_distribute.integration.keras_private_rows import Row

# What CI tests (pyproject.toml declares the same range): the release stack
# in constraints.txt and the pinned next Keras in constraints-next.txt.
SUPPORTED_KERAS = (">=3.15.1,<3.17 (tested: 3.15.1 and keras-nightly "
                   "3.16.0.dev2026102704)")


class KerasVersionError(RuntimeError):
    """The running Keras does not have what keras_distribute hooks into."""


# Every Keras-private name: callables and modules, then private attributes.
ROWS = keras_private_rows.ROWS + keras_private_attribute_rows.ROWS
_BY_KEY: Dict[str, Row] = {row.key: row for row in ROWS}
_probes: Dict[str, Any] = {}


def _probe(kind: str) -> Any:
    """A fresh Keras object of `kind`, made once, outside every strategy."""
    if kind not in _probes:
        import keras

        makers = {
            "Variable": lambda: keras.Variable(0.0, trainable=False),
            "Model": lambda: keras.Sequential(),
            "Layer": lambda: keras.layers.Dense(1),
            "Optimizer": lambda: keras.optimizers.SGD(),
            "BackupAndRestore": lambda: keras.callbacks.BackupAndRestore(
                "kd-probe-backup"),
            "ModelCheckpoint": lambda: keras.callbacks.ModelCheckpoint(
                "kd-probe.keras"),
        }
        # A probe must leave the user's random streams alone: Keras draws
        # an initializer's default seed from Python's `random` (a seeded
        # program would otherwise build other weights under a strategy).
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            _probes[kind] = makers[kind]()
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
    return _probes[kind]


_resolved: Dict[str, Any] = {}


def keras_version() -> str:
    import keras

    return keras.__version__


def _find(row: Row) -> Any:
    """The object of `row`; raises `LookupError` saying what is missing."""
    if row.instance_of is not None:
        attribute = row.key.rpartition(".")[2]
        probe = _probe(row.instance_of)
        if not hasattr(probe, attribute):
            raise LookupError(f"a new keras {type(probe).__name__} has no "
                              f"attribute {attribute!r}")
        return attribute
    if not row.candidates:  # "Owner.attribute": an attribute of a row
        owner_key, _, attribute = row.key.rpartition(".")
        owner = _resolved.get(owner_key) or _find(_BY_KEY[owner_key])
        if not hasattr(owner, attribute):
            raise LookupError(f"{owner_key} has no attribute {attribute!r}")
        return getattr(owner, attribute)
    tried = []
    for module_name, path in row.candidates:
        try:
            found = importlib.import_module(module_name)
            for part in filter(None, path.split(".")):
                found = getattr(found, part)
            return found
        except (ImportError, AttributeError):
            tried.append(f"{module_name}:{path}" if path else module_name)
    raise LookupError(f"none of {tried} exists")


def _check_parameters(row: Row, found: Any) -> None:
    if row.parameters is None:
        return
    try:
        names = tuple(inspect.signature(found).parameters)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to compare
    if names[:len(row.parameters)] != row.parameters:
        raise LookupError(
            f"its parameters are {names}, expected {row.parameters} first")


def resolve(key: str) -> Any:
    """The object the row `key` names, for the running Keras.

    Raises:
        KerasVersionError: if the running Keras has no such object.
    """
    if key not in _resolved:
        row = _BY_KEY[key]
        try:
            found = _find(row)
            _check_parameters(row, found)
        except LookupError as error:
            if row.optional:
                return None
            raise KerasVersionError(_message([(row, str(error))])) from None
        _resolved[key] = found
    return _resolved[key]


def check(backend: str, keys: Optional[Sequence[str]] = None) -> None:
    """Verifies every row the backend uses (or `keys`) before a patch.

    Raises:
        KerasVersionError: naming every row that does not fit.
    """
    rows = [_BY_KEY[k] for k in keys] if keys is not None else [
        row for row in ROWS if not row.backends or backend in row.backends]
    failures: List[Tuple[Row, str]] = []
    for row in rows:
        if row.key in _resolved:
            continue
        try:
            found = _find(row)
            _check_parameters(row, found)
        except LookupError as error:
            if not row.optional:
                failures.append((row, str(error)))
            continue
        _resolved[row.key] = found
    if failures:
        raise KerasVersionError(_message(failures))


def _message(failures: List[Tuple[Row, str]]) -> str:
    lines = "\n".join(
        f"  - {row.key}: {reason} (used for: {row.reason}; known on Keras "
        f"{row.keras_versions})" for row, reason in failures)
    return (
        f"keras_distribute does not support the installed Keras "
        f"{keras_version()}: what it hooks into is not there.\n{lines}\n"
        f"Supported: keras{SUPPORTED_KERAS}. Install a supported Keras "
        "(pip install 'keras>=3.15.1,<3.17'), or upgrade keras_distribute.")


def forget() -> None:
    """Drops the resolved objects and probes (after a test changed a row)."""
    _resolved.clear()
    _probes.clear()
