"""What the layers below the Keras integration need from it, typed.

The neutral layer, the backends and the checkpoint never import
`keras_distribute.integration` (it sits above them). The few things they
need from it — a context where only the chief writes Keras' files, Keras'
own torch distribution objects, hooks installed on request — are the fields
of one `KerasServices`, which the integration layer makes
(`keras_distribute.integration.services()`) and the strategies hand to the
engine they make (`make_engine(..., services=...)`). A lower layer calls
`engine.keras_services.<field>(...)`: named, typed and handed in, no global
lookup and no string-keyed one.

This module imports nothing from keras_distribute or any framework.
"""

import dataclasses
from typing import Any
from typing import Callable
from typing import ContextManager


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
        configs_read_without_tensorflow: `() -> context`: inside, Keras'
            `get_config` and `get_compile_config` do not import TensorFlow
            to ask whether an object is one of its types
            (`integration/configs.py`).
    """

    chief_only_writes: Callable[..., ContextManager[Any]]
    keras_torch_data_parallel: Callable[[int], Any]
    keras_torch_mesh: Callable[[Any], Any]
    install_deferred_restores: Callable[[], None]
    install_torch_sharding: Callable[[], None]
    seed_every_process: Callable[[], None]
    install_chief_values: Callable[[], None]
    configs_read_without_tensorflow: Callable[[], ContextManager[Any]]
