"""The engines: one package per framework behind one contract.

- `interface`: the engine contract, as `typing.Protocol`s, and what every
  backend module provides (`BackendModule`).
- `jax/`, `tensorflow/`, `torch/`: each a backend module (its `__init__`)
  over that framework's engine, devices, collectives and checkpoint view.

`get_backend()` chooses the backend module for the active Keras backend,
once. May import: `common`, `job`, `cluster_resolver`, and its framework.
Never `training`, `input`, `checkpoint`, `integration` or anything above
them: what an engine needs from above is handed to it (see
`call_trainer`).
"""

import importlib
from types import MappingProxyType
from typing import Any

_SUPPORTED = MappingProxyType({
    "jax": "keras_distribute.backend.jax",
    "tensorflow": "keras_distribute.backend.tensorflow",
    "torch": "keras_distribute.backend.torch",
})
_loaded = {}


def backend_name() -> str:
    import keras

    return keras.backend.backend()


def get_backend() -> Any:
    """Returns the backend module (see `interface.BackendModule`).

    Raises:
        NotImplementedError: on a Keras backend that keras_distribute does
            not support yet; the message names the backend and what works.
    """
    name = backend_name()
    if name not in _loaded:
        if name not in _SUPPORTED:
            raise NotImplementedError(
                f"keras_distribute strategies are not available on the "
                f"'{name}' Keras backend. Supported backends: "
                f"{', '.join(sorted(_SUPPORTED))}. Set KERAS_BACKEND=jax "
                "before importing keras to use them now."
            )
        _loaded[name] = importlib.import_module(_SUPPORTED[name])
    return _loaded[name]
