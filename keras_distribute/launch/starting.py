"""How `kd.launch` starts its processes: from a fork server that imported
Keras once.

A fresh Python process spends seconds importing Keras and its backend (about
6 s of CPU for Keras on torch on a CI core), and `kd.launch` used to pay that
in every process of every launch. The standard library's fork server
(`multiprocessing`'s "forkserver" start method) is started once per
launching process and imports `keras` and `keras_distribute` (and the main
script, as "spawn" would) before it forks; each launched process is a fork of
it, started in a fraction of a second. The server is a fresh interpreter,
not a fork of the launcher: nothing of the launcher's state reaches the
processes beyond what "spawn" sends (the function, `sys.path`, the working
directory).

What a forked process would otherwise inherit from the server rather than
from the launcher at launch time is handed over explicitly, so a process
starts as a spawned one would:

- the launcher's current environment (the server's is the one it started
  with); when a variable a framework reads as it is imported changed since
  the server started (`KERAS_BACKEND`, `JAX_*`, `XLA_FLAGS`, `TF_*`, ...)
  the imports the server holds are stale, and that launch spawns;
- the launcher's current standard output and error (a notebook cell, a
  test's captured output);
- a fresh NumPy global random state (fork would copy the server's);
- Python's default SIGINT handler (`KeyboardInterrupt`), and the `atexit`
  handlers run at the end (a forked process leaves through `os._exit`).

On the torch backend with a CUDA GPU the launch always spawns: importing
Keras there asks torch for its GPUs, which starts CUDA in the fork server,
and CUDA started in a parent does not survive a fork (each forked process
failed at its first tensor with "CUDA error: initialization error", found
on the GPU tier's first run).

`KERAS_DISTRIBUTE_PRELOAD=tensorflow,...` has the server import those
modules too, where every process would import them anyway: on JAX or torch
with TensorFlow installed, `keras.utils.set_random_seed` imports TensorFlow
to seed it as well (2-2.5 s of CPU in each process of each launch).

`KERAS_DISTRIBUTE_START_METHOD=spawn` restores a fresh interpreter per
process; platforms without a fork server (Windows) always spawn.

Imports: `multiprocessing`, the standard library.
"""

import atexit
import contextlib
import importlib.util
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from multiprocessing import reduction
from typing import Any
from typing import Dict
from typing import Iterator
from typing import Mapping
from typing import Optional
from typing import Tuple

START_METHOD_VARIABLE = "KERAS_DISTRIBUTE_START_METHOD"
START_METHODS = ("forkserver", "spawn")

# What the fork server imports before it forks ("__main__" as the standard
# fork server does: the launching script, under its main guard).
PRELOADED_MODULES = ("__main__", "keras", "keras_distribute")

# More modules for the fork server to import after those (comma-separated
# names), read when the first launch starts it; imported by `_PRELOADER`.
PRELOAD_VARIABLE = "KERAS_DISTRIBUTE_PRELOAD"
_PRELOADER = "keras_distribute.launch.preload"
# When those imports must have ended (seconds since the epoch): the
# launch's deadline, in the environment the fork server starts with only
# (`server_start_environment`).
PRELOAD_DEADLINE_VARIABLE = "KERAS_DISTRIBUTE_PRELOAD_DEADLINE"

# Variables that Keras, the frameworks and their native libraries read as
# they are imported: a change since the server started makes its imports
# stale.
IMPORT_TIME_PREFIXES = ("KERAS", "JAX", "XLA", "TF_", "TORCH", "PYTORCH",
                        "CUDA", "NCCL", "OMP_", "MKL", "OPENBLAS", "PYTHON",
                        "LD_", "TPU", "GRPC")

# keras_distribute's own settings (KERAS_DISTRIBUTE_TIMEOUT, ...): read when
# a strategy, a launch or a save runs, never as kd is imported, so a change
# between launches reaches the forked processes (they get the launcher's
# environment of the moment) without making the server's imports stale.
RUN_TIME_PREFIX = "KERAS_DISTRIBUTE_"

# The cluster a scheduler describes to each process (TF_CONFIG names its
# task, JAX's variables its coordinator and index): read when a job starts
# (`jax.distributed.initialize`, the cluster resolvers), never as a
# framework is imported. A program that launches again with another
# cluster (a test of several, a notebook) keeps forking.
JOB_START_VARIABLES = frozenset({
    "TF_CONFIG", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS"})

# Variables that importing a framework sets in `os.environ` of its own
# accord (measured: TensorFlow 2.21's import sets the first six where unset,
# JAX's first device query TPU_SKIP_MDS_QUERY and TF_CPP_MIN_LOG_LEVEL,
# torch's inductor its cache directory at its first use). One that was not
# set when the server started and is set now is such a side effect, which a
# forked process's own import repeats, not a setting that makes the server's
# imports stale: a program that imports TensorFlow after its first launch
# (for tf.data) kept forking (each later launch spawned, ~8 s).
SET_BY_IMPORTS = frozenset({
    "TF2_BEHAVIOR", "TPU_ML_PLATFORM", "TPU_ML_PLATFORM_VERSION",
    "TF_FORCE_GPU_ALLOW_GROWTH", "TPU_SKIP_MDS_QUERY", "TF_CPP_MIN_LOG_LEVEL",
    "TORCHINDUCTOR_CACHE_DIR"})

# The environment the fork server was started with (None: not started here).
_server: Dict[str, Optional[Dict[str, str]]] = {"import_env": None}


def import_time_env(
        environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables of an environment that imports read.

    Args:
        environ: the environment; `os.environ` when None.

    Returns:
        `{name: value}` of the variables named by `IMPORT_TIME_PREFIXES`,
        less keras_distribute's own settings (`RUN_TIME_PREFIX`: read as a
        job runs) and the cluster's (`JOB_START_VARIABLES`).

    Example:

    >>> import_time_env({"XLA_FLAGS": "x", "HOME": "/root",
    ...                  "KERAS_DISTRIBUTE_TIMEOUT": "60", "TF_CONFIG": "{}"})
    {'XLA_FLAGS': 'x'}
    """
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items()
            if name.upper().startswith(IMPORT_TIME_PREFIXES)
            and not name.upper().startswith(RUN_TIME_PREFIX)
            and name.upper() not in JOB_START_VARIABLES}


def start_method() -> str:
    """The start method the next launch uses: "forkserver" or "spawn".

    Returns:
        "spawn" when `KERAS_DISTRIBUTE_START_METHOD=spawn`, when the platform
        has no fork server, on the torch backend with a CUDA GPU (see
        `torch_backend_sees_cuda`), or when a variable imports read changed
        since this process's fork server started (other than one an import
        set since: `SET_BY_IMPORTS`); else "forkserver".

    Raises:
        ValueError: if `KERAS_DISTRIBUTE_START_METHOD` is set to something
            other than "forkserver" or "spawn".

    Example:

    >>> os.environ["KERAS_DISTRIBUTE_START_METHOD"] = "spawn"
    >>> start_method()
    'spawn'
    """
    wanted = os.environ.get(START_METHOD_VARIABLE, "forkserver")
    if wanted not in START_METHODS:
        raise ValueError(
            f"Expected {START_METHOD_VARIABLE} to be one of {START_METHODS}. "
            f"Received: {wanted!r}. Unset it (processes are forked from a "
            "server that imported Keras once) or set it to 'spawn' (a fresh "
            "interpreter per process).")
    if (wanted == "spawn"
            or "forkserver" not in multiprocessing.get_all_start_methods()
            or torch_backend_sees_cuda()):
        return "spawn"
    started_with = _server["import_env"]
    if started_with is not None and _imports_are_stale(started_with):
        return "spawn"
    return "forkserver"


def _imports_are_stale(started_with: Dict[str, str]) -> bool:
    """Whether a variable imports read differs from the server's start,
    beyond those that an import set since (`SET_BY_IMPORTS`), or the
    modules `KERAS_DISTRIBUTE_PRELOAD` names do."""
    now = import_time_env()
    now[PRELOAD_VARIABLE] = os.environ.get(PRELOAD_VARIABLE, "")
    changed = {name for name in set(started_with) | set(now)
               if started_with.get(name) != now.get(name)}
    return bool(changed - (SET_BY_IMPORTS - set(started_with)))


def torch_backend_sees_cuda() -> bool:
    """Whether this process runs Keras on torch with a CUDA GPU visible.

    Such a launch cannot fork: the fork server's `import keras` asks torch
    whether CUDA is available, which starts CUDA there, and a process
    forked after that fails at its first CUDA call. Keras is imported here
    when the launching program has not yet (`import keras_distribute`
    imports none; the fork server imports it anyway), as importing it asks
    torch the same question.

    Returns:
        True when Keras runs on the torch backend and
        `torch.cuda.is_available()`; else False.

    Example:

    >>> torch_backend_sees_cuda()  # a CPU machine
    False
    """
    try:
        import keras

        if keras.backend.backend() != "torch":
            return False
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a stand-in module, a broken CUDA install: no GPU
        return False


def preloaded_modules(
        environ: Optional[Mapping[str, str]] = None) -> Tuple[str, ...]:
    """What the fork server imports before it forks.

    The launching script (under its main guard), `keras` and
    `keras_distribute`, then each module `KERAS_DISTRIBUTE_PRELOAD` names
    (comma-separated), in its order. Each launched process then starts with
    them imported, once per server instead of once per process: worth it
    for a module every process imports anyway (TensorFlow, which
    `keras.utils.set_random_seed` imports wherever it is installed; a
    keras-hub model's package).

    Args:
        environ: the environment; `os.environ` when None.

    Returns:
        The module names, `PRELOADED_MODULES` first.

    Raises:
        ValueError: a name that is not a module's (dotted identifiers), or
            whose top-level package is not installed.

    Example:

    >>> preloaded_modules({"KERAS_DISTRIBUTE_PRELOAD": "tensorflow"})
    ('__main__', 'keras', 'keras_distribute', 'tensorflow')
    """
    environ = os.environ if environ is None else environ
    value = environ.get(PRELOAD_VARIABLE, "")
    names = []
    for name in (part.strip() for part in value.split(",")):
        if not name or name in PRELOADED_MODULES or name in names:
            continue
        top = name.split(".")[0]
        if not all(part.isidentifier() for part in name.split(".")):
            problem = "is not a module name"
        elif importlib.util.find_spec(top) is None:
            problem = f"names a package that is not installed ({top!r})"
        else:
            names.append(name)
            continue
        raise ValueError(
            f"Expected {PRELOAD_VARIABLE} to name importable modules, "
            f"separated by commas (e.g. 'tensorflow'). Received: {value!r}, "
            f"whose {name!r} {problem}. Fix the name, or unset "
            f"{PRELOAD_VARIABLE} (the launched processes then import what "
            "they need themselves).")
    return PRELOADED_MODULES + tuple(names)


def context_for_launch() -> Tuple[Any, bool]:
    """The `multiprocessing` context of a launch, and whether it forks.

    The first forking launch sets the fork server's preloaded modules
    (`preloaded_modules`) and records the environment it starts with.

    Raises:
        ValueError: `KERAS_DISTRIBUTE_PRELOAD` names no module (see
            `preloaded_modules`), or `KERAS_DISTRIBUTE_START_METHOD` no
            start method.
    """
    method = start_method()
    context = multiprocessing.get_context(method)
    if method == "forkserver" and _server["import_env"] is None:
        modules = preloaded_modules()
        if len(modules) > len(PRELOADED_MODULES):
            # (the named ones through `preload`: each bounded, its failure
            # kept for the launched processes to raise)
            modules = PRELOADED_MODULES + (_PRELOADER,)
        context.set_forkserver_preload(list(modules))
        started_with = import_time_env()
        started_with[PRELOAD_VARIABLE] = os.environ.get(PRELOAD_VARIABLE, "")
        _server["import_env"] = started_with
    return context, method == "forkserver"


@contextlib.contextmanager
def server_start_environment(timeout: float) -> Iterator[None]:
    """Around a launch's first process starts: the fork server, if this
    starts it, ends the imports `KERAS_DISTRIBUTE_PRELOAD` names by the
    launch's deadline (`timeout` seconds from now). The variable is in this
    process's environment only while the processes start (a forked process
    takes the launcher's environment from before, `launcher_state`)."""
    deadline = repr(time.time() + float(timeout))  # (the server: this host)
    os.environ[PRELOAD_DEADLINE_VARIABLE] = deadline
    try:
        yield
    finally:
        if os.environ.get(PRELOAD_DEADLINE_VARIABLE) == deadline:
            del os.environ[PRELOAD_DEADLINE_VARIABLE]


def raise_preload_failure() -> None:
    """In a launched process: raises `ImportError` naming the module that
    the fork server it was forked from could not import (`preload`)."""
    loaded = sys.modules.get(_PRELOADER)
    if loaded is not None:
        loaded.raise_failure()


class InheritedStream:
    """A file descriptor of the launcher that a forked process takes over.

    Pickled for the process while `multiprocessing` starts it, the
    descriptor travels with it (`reduction.DupFd`: the fork server's file
    descriptor passing); unpickled, it is the process's own descriptor.
    """

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(duplicate: Any) -> int:
    return int(duplicate.detach())


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def launcher_state() -> Dict[str, Any]:
    """What a forked process takes from the launcher at launch time.

    A standard stream the launcher has closed (a daemon's) is not handed
    over: the process keeps the fork server's.
    """
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    return {"environ": dict(os.environ),
            "streams": tuple(InheritedStream(fd) if _is_open(fd) else None
                             for fd in (1, 2))}


def become_launched(state: Optional[Dict[str, Any]]) -> None:
    """Called first in a launched process: start as a spawned one would.

    Args:
        state: `launcher_state()` of the launch, or `None` for a spawned
            process (which already has all of it).
    """
    if state is None:
        return
    os.environ.clear()
    os.environ.update(state["environ"])
    # `tempfile` fixed its directory from the server's environment (an
    # import there asked for it): found again from this one (TMPDIR), as
    # a spawned process finds it.
    tempfile.tempdir = None
    for source, target in zip(state["streams"], (1, 2)):
        if source is not None:
            os.dup2(source, target)
            os.close(source)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS, as a fresh import seeds it


def leave_launched(state: Optional[Dict[str, Any]]) -> None:
    """Called last in a launched process: a forked one runs the `atexit`
    handlers its modules registered (it leaves through `os._exit`)."""
    if state is not None:
        atexit._run_exitfuncs()
