"""What the layers below the Keras integration need from it, typed.

The neutral layer, the backends and the checkpoint never import
`keras_distribute.integration` (it sits above them). The few things they
need from it — a context where only the chief writes Keras' files, Keras'
own torch distribution objects, hooks installed on request — are the fields
of one `KerasServices`, which the integration layer hands down with
`provide()` when it is imported (`import keras_distribute` does). A lower
layer calls `keras_services.get().<field>(...)`: named and typed, no
string-keyed lookups.

This module imports nothing from keras_distribute or any framework.
"""

import dataclasses
from typing import Any, Callable, ContextManager, Optional


@dataclasses.dataclass(frozen=True)
class KerasServices:
    """The integration layer's services to the layers below it.

    Attributes:
        chief_only_writes: `(callbacks, is_chief, ...) -> context`: inside,
            Keras' own file-writing callbacks write in the chief only
            (`integration/worker_callbacks.py`).
        keras_torch_data_parallel: `(world_size) -> DataParallel or None`:
            Keras' own torch `DataParallel` for a data-parallel torch engine
            (Keras 3.16 distributes torch itself); `None` on Keras versions
            whose torch backend has no distribution.
        keras_torch_mesh: `(keras DeviceMesh) -> torch DeviceMesh or None`:
            Keras' own torch mesh of a sharded torch engine, else `None`.
        install_deferred_restores: Installs the hooks that restore deferred
            checkpoint values once variables exist (once).
        install_torch_sharding: Installs the sharded torch forward (once).
        seed_every_process: Gives every JAX process one global seed, as
            `keras.distribution.initialize` does.
        install_chief_values: Makes a variable created while the JAX
            processes' random states differ take process 0's value (once).
    """

    chief_only_writes: Callable[..., ContextManager[Any]]
    keras_torch_data_parallel: Callable[[int], Any]
    keras_torch_mesh: Callable[[Any], Any]
    install_deferred_restores: Callable[[], None]
    install_torch_sharding: Callable[[], None]
    seed_every_process: Callable[[], None]
    install_chief_values: Callable[[], None]


_provided: Optional[KerasServices] = None


def provide(services: KerasServices) -> None:
    """Hands the integration layer's services down (its import does it).

    Args:
        services: The `KerasServices` instance.

    Raises:
        TypeError: if `services` is not a `KerasServices`.
    """
    global _provided
    if not isinstance(services, KerasServices):
        raise TypeError(
            "Expected a keras_services.KerasServices. Received: "
            f"{type(services).__name__}.")
    _provided = services


def get() -> KerasServices:
    """The integration layer's services.

    Returns:
        The `KerasServices` the integration layer provided.

    Raises:
        RuntimeError: if the integration layer was never imported (a lower
            module used on its own, without `import keras_distribute`).

    Example:

    ```python
    with keras_services.get().chief_only_writes(callbacks, is_chief):
        ...
    ```
    """
    if _provided is None:
        raise RuntimeError(
            "keras_distribute's Keras integration is not loaded: a lower "
            "module was used without `import keras_distribute`. Import "
            "keras_distribute first.")
    return _provided
