"""Chooses the backend module for the active Keras backend, once."""

import importlib

_SUPPORTED = {
    "jax": "keras_distribute.backend.jax",
    "tensorflow": "keras_distribute.backend.tensorflow",
    "torch": "keras_distribute.backend.torch",
}
_loaded = {}


def backend_name() -> str:
    import keras

    return keras.backend.backend()


def get_backend():
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
