"""The JAX backend module (see `interface.BackendModule`).

What the neutral layer calls on JAX, gathered from the modules that
implement it: this process's devices (`devices`), the engine over one
process's or a job's devices (`engine`, `jobs`), `run`'s training
helpers (`run`) and the checkpoint's view of a variable
(`checkpoint`).
"""

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
from keras_distribute.backend.jax.run import apply_gradients  # noqa: F401
from keras_distribute.backend.jax.run import value_and_gradients  # noqa: F401

name = "jax"
