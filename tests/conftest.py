"""Simulated devices per backend, set up before any framework is imported.

- JAX: 8 CPU devices through XLA_FLAGS.
- TensorFlow: the CPU split into 4 logical devices.
- Tests that need a strategy on a backend without one yet are skipped with a
  reason naming the backend (`requires_strategy`).
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# kd.launch's fork server imports TensorFlow too, where installed: most of
# the suite's launched processes seed through keras.utils.set_random_seed,
# which imports it (2-2.5 s of CPU in each; ~47 processes of the torch
# stage's launches did). test_torch_multiprocess.py checks a launch without.
if importlib.util.find_spec("tensorflow") is not None:
    os.environ.setdefault("KERAS_DISTRIBUTE_PRELOAD", "tensorflow")
# XLA's compilation cache, one per run, shared by every process of it
# (pytest-xdist's workers and the processes a test starts inherit it): the
# suite compiles the same small models' steps again and again (JAX only).
# Keyed by the program, its devices and XLA's flags, it changes what runs
# in no way; removed when the run ends. (scripts/test.sh gives one to all
# its runs, both Keras stacks.)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="kd-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Keras takes its backend from this variable before its config file (set
# above where it is not): the backend is known without importing Keras,
# which pytest-xdist's controller, which runs no test, then never does
# (~5 s of a stage's start, before its workers start).
BACKEND = os.environ["KERAS_BACKEND"]
STRATEGY_BACKENDS = ("jax", "tensorflow")
# TensorFlow's logical devices: 4, or KD_TEST_TF_DEVICES (CI's next-Keras
# stage runs with 2: MirroredStrategy traces a step once per replica, and
# that stage checks another Keras, not another replica count).
TF_DEVICES = int(os.environ.get("KD_TEST_TF_DEVICES", "4"))
NUM_DEVICES = {"jax": 8, "tensorflow": TF_DEVICES}.get(BACKEND, 1)


def _runs_no_test(config):
    """Whether this process is pytest-xdist's controller, which hands the
    tests to its workers and collects none itself."""
    return (not hasattr(config, "workerinput")
            and config.getoption("dist", "no") != "no"
            and not config.getoption("collectonly"))


def pytest_configure(config):
    # Before any test module is imported (they import Keras and the
    # framework), in each process that runs tests.
    if BACKEND == "tensorflow" and not _runs_no_test(config):
        from worker_common import tf_data_iterators_without_autotune

        import keras_distribute as kd

        kd.simulate_cpu_devices(NUM_DEVICES)
        tf_data_iterators_without_autotune()  # why: its docstring


requires_strategy = pytest.mark.skipif(
    BACKEND not in STRATEGY_BACKENDS,
    reason=f"in-process multi-replica test: on the '{BACKEND}' backend each "
    "process is one replica, so these behaviours are tested across "
    "processes in test_torch_multiprocess.py",
)


# Seconds of test time of the longest files in each of CI's stages (c40,
# 2026-12-07, on 2 cores; the next-Keras TensorFlow stage on 2 devices):
# scripts/test.sh hands whole files to two pytest-xdist workers in
# collection order (--no-loadscope-reorder; xdist's own order, most tests
# first, put long files last, and one worker then ran the last one alone),
# and a worker takes its next file while its last 2 tests run. Each stage
# starts with its own longest files; the rest keep their order.
STAGE_SECONDS = {
    "test_torch_multiprocess.py": {"torch": 270, "next torch": 100},
    "test_jax_multiprocess.py": {"jax": 193, "next jax": 27},
    "test_tf_multiworker.py": {"tensorflow": 143, "next tensorflow": 16},
    "test_ray_train.py": {"jax": 120, "tensorflow": 31, "torch": 70},
    "test_keras_hub_families.py": {"jax": 250},
    "test_keras_hub_families_torch.py": {"torch": 95},
    "test_docs_blocks.py": {"jax": 135, "tensorflow": 41, "torch": 76},
    "test_memory_estimate.py": {"jax": 101, "tensorflow": 20, "torch": 72,
                                "next jax": 46, "next tensorflow": 11,
                                "next torch": 66},
    "test_fit.py": {"jax": 15, "tensorflow": 98, "next jax": 19,
                    "next tensorflow": 59},
    "test_cluster_recipes.py": {"jax": 91, "tensorflow": 25, "torch": 86},
    "test_preemption_restart.py": {"jax": 6, "torch": 91, "next jax": 6},
    "test_examples.py": {"jax": 65, "tensorflow": 88, "torch": 70},
    "test_docs_recipes.py": {"jax": 85, "tensorflow": 44, "torch": 74},
    "test_checkpoint_callbacks.py": {"jax": 20, "tensorflow": 77, "torch": 18,
                                     "next jax": 26, "next tensorflow": 51,
                                     "next torch": 15},
    "test_object_store.py": {"jax": 110, "tensorflow": 33, "torch": 24},
    "test_notebooks.py": {"jax": 53},
    "test_ecosystem_programs.py": {"jax": 49, "tensorflow": 32, "torch": 3,
                                   "next jax": 20, "next tensorflow": 7},
    "test_several_hosts.py": {"jax": 33, "tensorflow": 43, "torch": 42},
    "test_keras_versions.py": {"jax": 15, "tensorflow": 5, "torch": 32,
                               "next jax": 13, "next tensorflow": 5,
                               "next torch": 28},
    "test_compression.py": {"jax": 25, "tensorflow": 17, "next jax": 29,
                            "next tensorflow": 9},
    "test_launcher_signals.py": {"jax": 26},
    "test_data_safety.py": {"jax": 24, "tensorflow": 20, "torch": 15},
    "test_checkpoint_lease.py": {"torch": 23},
    "test_checkpoint.py": {"jax": 22},
    "test_gpu_tier_script.py": {"jax": 13, "torch": 22},
    "test_dry_run.py": {"jax": 21, "tensorflow": 11, "torch": 11},
    "test_tpu_strategy.py": {"jax": 19, "next jax": 10},
    "test_user_steps.py": {"tensorflow": 10, "torch": 11, "next torch": 18},
    "test_soak.py": {"jax": 17, "tensorflow": 16, "torch": 15},
    "test_custom_loop_tf.py": {"tensorflow": 15, "next tensorflow": 7},
    "test_checkpoint_security.py": {"tensorflow": 11, "next torch": 15},
}


# The next-Keras stack (scripts/test.sh sets KD_KERAS_STACK=next) runs every
# in-process test and, of the files that start jobs of several processes,
# the runs that compare a whole job with one process (their names say
# "matches", "train(s)_like" or "same_in_every"): what Keras does in each
# process is what its in-process tests run; the rest of those files tests
# kd's own work between processes (saves, preemption, the launcher), which
# a Keras version does not change, on the release stack (CI's budget: 30
# minutes on 2 cores).
CROSS_PROCESS_FILES = ("test_jax_multiprocess.py", "test_tf_multiworker.py",
                       "test_torch_multiprocess.py")
NEXT_STACK_CROSS_PROCESS_RUNS = ("matches", "trains_like", "train_like",
                                 "same_in_every")
on_the_release_stack_only = pytest.mark.skip(
    reason="the next-Keras stack runs the whole-job comparisons of this "
    "file; the rest runs on the release stack (tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    next_stack = os.environ.get("KD_KERAS_STACK") == "next"
    for item in items:
        if "strategy" in item.fixturenames or item.get_closest_marker(
            "needs_strategy"
        ):
            item.add_marker(requires_strategy)
        if (next_stack and item.path.name in CROSS_PROCESS_FILES
                and not any(word in item.name
                            for word in NEXT_STACK_CROSS_PROCESS_RUNS)):
            item.add_marker(on_the_release_stack_only)
    stage = ("next " if next_stack else "") + BACKEND
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (
        -STAGE_SECONDS.get(item.path.name, {}).get(stage, 0),
        order[id(item)]))


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


def needs_cpu_devices(n):
    """Skips a test of `n` named CPU devices where this process has fewer
    (TensorFlow with KD_TEST_TF_DEVICES under `n`)."""
    return pytest.mark.skipif(
        BACKEND == "tensorflow" and TF_DEVICES < n,
        reason=f"{n} TensorFlow devices; this run has {TF_DEVICES} "
               f"(KD_TEST_TF_DEVICES): a run with 4 runs it")


def make_mlp():
    """The small tanh MLP of the parity tests (tanh: no ReLU kinks)."""
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(3),
    ])


# ------------------------------------------------ the bad-input table
# With KD_RECORD_BAD_INPUTS=<file>, every `pytest.raises` that catches its
# exception records the test, the exception type and the message, for
# docs/bad_inputs.md (scripts/bad_inputs_table.py; run by scripts/test.sh).
_RECORD = os.environ.get("KD_RECORD_BAD_INPUTS")
_recorded = []
_current_test = [None, 0]  # node id, bad inputs recorded in it so far

if _RECORD:
    _real_raises = pytest.raises

    class _Recording:
        def __init__(self, context):
            self._context = context

        def __enter__(self):
            self._info = self._context.__enter__()
            return self._info

        def __exit__(self, *exc):
            handled = self._context.__exit__(*exc)
            error = exc[1]
            if handled and error is not None and _current_test[0]:
                _current_test[1] += 1  # the n-th bad input of this test
                _recorded.append({
                    "test": f"{_current_test[0]}#{_current_test[1]}",
                    "backend": BACKEND,
                    "type": type(error).__name__,
                    "message": str(error).strip().splitlines()[0]
                    if str(error).strip() else ""})
            return handled

    def _recording_raises(expected_exception=None, *args, **kwargs):
        context = _real_raises(expected_exception, *args, **kwargs)
        if args:  # the function form: nothing to wrap
            return context
        return _Recording(context)

    pytest.raises = _recording_raises

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        _current_test[:] = [item.nodeid, 0]
        yield
        _current_test[:] = [None, 0]

    def pytest_sessionfinish(session):
        import json

        # Under pytest-xdist each worker records its own tests in a file
        # of its own (`<file>.gw0`, ...); the controller records nothing.
        if _runs_no_test(session.config):
            return
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(f"{_RECORD}.{worker}" if worker else _RECORD, "w") as f:
            json.dump(_recorded, f, indent=0)


def proc_status(field):
    """A `/proc/self/status` size in bytes (`"VmRSS"`, `"VmHWM"`)."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_resident():
    """Resets the peak resident memory (Linux `VmHWM`) to the current one
    and returns that: the baseline a peak is measured above (the test
    skips where it cannot be reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError as error:
        pytest.skip(f"the peak resident memory cannot be reset: {error}")
    return proc_status("VmRSS")


def keras_hub_or_skip():
    """keras_hub, or the test skips where it does not import."""
    import keras

    try:
        import keras_hub

        keras_hub.models.GemmaBackbone  # (its modules load lazily)
    except ImportError as error:  # keras-hub 0.32 predates Keras 3.16
        pytest.skip(f"keras-hub does not import with Keras "
                    f"{keras.__version__}: {error}")
    return keras_hub
