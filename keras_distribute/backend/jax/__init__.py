"""The JAX backend module (see `interface.BackendModule`).

What the neutral layer calls on JAX, gathered from the modules that
implement it: this process's devices (`devices`), the engine over one
process's or a job's devices (`engine`, `jobs`), `run`'s training
helpers (`run`) and the checkpoint's view of a variable
(`checkpoint`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Callable

from keras_distribute.backend import interface
from keras_distribute.backend.jax.checkpoint import checkpoint_assign  # noqa: F401
from keras_distribute.backend.jax.checkpoint import checkpoint_pieces  # noqa: F401
from keras_distribute.backend.jax.checkpoint import checkpoint_snapshot  # noqa: F401
from keras_distribute.backend.jax.devices import default_devices  # noqa: F401
from keras_distribute.backend.jax.devices import device_name  # noqa: F401
from keras_distribute.backend.jax.devices import resolve_device  # noqa: F401
from keras_distribute.backend.jax.engine import JaxEngine  # noqa: F401
from keras_distribute.backend.jax.engine import make_engine  # noqa: F401
from keras_distribute.backend.jax.jobs import make_multi_worker_engine  # noqa: F401
from keras_distribute.backend.jax.jobs import make_tpu_engine  # noqa: F401
from keras_distribute.backend.jax.memory import step_memory  # noqa: F401
from keras_distribute.backend.jax.run import apply_gradients  # noqa: F401
from keras_distribute.backend.jax.run import value_and_gradients  # noqa: F401

if TYPE_CHECKING:
    from keras import Variable
    from keras.distribution import LayoutMap

name = "jax"


def checkpoint_value(variable: Variable) -> Any:
    """A replicated variable's value on the host."""
    return interface.host_value(variable)


def refuse_unsupported_layouts(layout_map: LayoutMap) -> None:
    """JAX shards any layout Keras can describe: nothing is refused."""


def mesh_devices(layout_map: LayoutMap) -> list:
    """Every device of the mesh (one process may hold all of them)."""
    return interface.mesh_devices_by_name(layout_map, resolve_device)


def host_rng_state() -> None:
    """JAX keeps no global host RNG (its keys are explicit)."""
    return None


def set_host_rng_state(state: Any) -> None:
    """Nothing to set (see `host_rng_state`)."""


def build_without_values(build: Callable[[], Any]) -> Any:
    """Builds under `jax.eval_shape`: every value the build computes (each
    variable's, each symbolic call's) is abstract, so a model of any size
    builds in seconds and holds no memory; `compile()` may be part of it.
    The model returned holds abstract values: read its variables' shapes,
    dtypes and paths only."""
    import jax

    built = []

    def abstract() -> None:
        built.append(build())

    jax.eval_shape(abstract)
    return built[0]


def refuse_tpu_strategy() -> None:
    """A TPUStrategy can be made here (whether TPUs exist is the engine's
    to say): nothing is refused."""
