"""The JAX backend module (see `interface.BackendModule`).

What the neutral layer calls on JAX, gathered from the modules that
implement it: this process's devices (`jax_devices`), the engine over one
process's or a job's devices (`jax_engine`, `jax_jobs`), `run`'s training
helpers (`jax_run`) and the checkpoint's view of a variable
(`jax_checkpoint`).
"""

from keras_distribute.backend.jax_checkpoint import checkpoint_assign  # noqa: F401
from keras_distribute.backend.jax_checkpoint import checkpoint_pieces  # noqa: F401
from keras_distribute.backend.jax_checkpoint import checkpoint_snapshot  # noqa: F401
from keras_distribute.backend.jax_devices import default_devices  # noqa: F401
from keras_distribute.backend.jax_devices import device_name  # noqa: F401
from keras_distribute.backend.jax_devices import resolve_device  # noqa: F401
from keras_distribute.backend.jax_engine import JaxEngine  # noqa: F401
from keras_distribute.backend.jax_engine import make_engine  # noqa: F401
from keras_distribute.backend.jax_jobs import make_multi_worker_engine  # noqa: F401
from keras_distribute.backend.jax_jobs import make_tpu_engine  # noqa: F401
from keras_distribute.backend.jax_run import apply_gradients  # noqa: F401
from keras_distribute.backend.jax_run import value_and_gradients  # noqa: F401

name = "jax"
