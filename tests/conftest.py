"""Simulated devices per backend, set up before any framework is imported.

- JAX: 8 CPU devices through XLA_FLAGS.
- TensorFlow: the CPU split into 4 logical devices.
- Tests that need a strategy on a backend without one yet are skipped with a
  reason naming the backend (`requires_strategy`).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()
STRATEGY_BACKENDS = ("jax", "tensorflow")
NUM_DEVICES = {"jax": 8, "tensorflow": 4}.get(BACKEND, 1)

if BACKEND == "tensorflow":
    import keras_distribute as _kd

    _kd.simulate_cpu_devices(NUM_DEVICES)

requires_strategy = pytest.mark.skipif(
    BACKEND not in STRATEGY_BACKENDS,
    reason=f"in-process multi-replica test: on the '{BACKEND}' backend each "
    "process is one replica, so these behaviours are tested across "
    "processes in test_torch_multiprocess.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "strategy" in item.fixturenames or item.get_closest_marker(
            "needs_strategy"
        ):
            item.add_marker(requires_strategy)


@pytest.fixture
def strategy():
    """A MirroredStrategy over every simulated device."""
    import keras_distribute as kd

    return kd.MirroredStrategy()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def cpu_names(n):
    return [f"CPU:{i}" for i in range(n)]


def make_mlp():
    """The small tanh MLP of the parity tests (tanh: no ReLU kinks)."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(3),
    ])
