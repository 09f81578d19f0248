"""Reading a model's configuration without importing TensorFlow.

Before each `fit` of a job of several processes, kd compares every
process's model (`training/config.py`: every layer's `get_config()` and
the compile configuration). Keras' serialization asks of each object it
serializes whether it is a TensorFlow `TensorShape`, `DType` or `TypeSpec`,
through its lazy `tensorflow` module, whose `available` imports TensorFlow
where it is installed. In a torch or JAX job on a machine that also has
TensorFlow (Colab, a shared image), every process imported all of
TensorFlow for that question: ~5 s of CPU and its memory per process
(measured, 2026-12-06: a 2-process torch `fit` took TensorFlow in through
`Layer.get_config` -> `dtype_policies.serialize` -> `serialize_keras_object`).

While kd reads configurations, `configs_read_without_tensorflow()` puts a
stand-in for that lazy module in `keras.src.saving.serialization_lib`:
`available` answers False while no one has imported TensorFlow (no object
can then be one of its types, so every answer Keras derives is the one it
would have derived) and asks the real lazy module otherwise; every other
attribute is the real module's (a deserialization in another thread that
needs TensorFlow still imports it). Where the running Keras does not have
that lazy module (`keras_private_rows.py`), configurations are read as
Keras reads them: TensorFlow may then be imported, nothing else changes.
"""

import contextlib
import sys
from typing import Any
from typing import Iterator

from keras_distribute.integration import registry


class _TensorflowTypeChecks:
    """Keras' lazy `tensorflow` module, except that `available` imports
    nothing: False while TensorFlow is not imported."""

    def __init__(self, lazy_module: Any):
        self._lazy_module = lazy_module

    @property
    def available(self) -> bool:
        return ("tensorflow" in sys.modules
                and bool(self._lazy_module.available))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lazy_module, name)


def _keras_lazy_tensorflow() -> Any:
    """`(serialization_lib, its lazy tensorflow module)`, or None where the
    running Keras has no such lazy module there."""
    serialization_lib = registry.resolve("serialization_lib")
    lazy_class = registry.resolve("LazyModule")
    if serialization_lib is None or lazy_class is None:
        return None
    lazy = serialization_lib.__dict__.get("tf")
    if not isinstance(lazy, lazy_class) or (
            lazy.__dict__.get("name") != "tensorflow"):
        return None
    return serialization_lib, lazy


@contextlib.contextmanager
def configs_read_without_tensorflow() -> Iterator[None]:
    """Inside, Keras' serialization (`get_config`, `get_compile_config`)
    does not import TensorFlow to ask whether an object is one of its
    types.

    Yields:
        None. On exit, Keras' own lazy module is back in place.

    Example:

    >>> with configs_read_without_tensorflow():
    ...     config = layer.get_config()
    """
    found = None if "tensorflow" in sys.modules else _keras_lazy_tensorflow()
    if found is None:
        yield
        return
    serialization_lib, lazy = found
    stand_in = _TensorflowTypeChecks(lazy)
    serialization_lib.tf = stand_in
    try:
        yield
    finally:
        if serialization_lib.__dict__.get("tf") is stand_in:
            serialization_lib.tf = lazy
