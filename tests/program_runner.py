"""Runs a Python program as `python program.py` would, without paying for
Keras' import each time.

The docs' pages and the examples run as programs, each in a fresh
interpreter; importing Keras and its backend costs each of them 3-5 s of CPU
(about a fifth of these tests on CI's 2 cores). `run_program` forks each
program from a server process that imported `keras` and `keras_distribute`
once, as `kd.launch` starts its processes (keras_distribute/launch/
starting.py). The server is a fresh interpreter started with the variables
that imports read (`KERAS_BACKEND`, `XLA_FLAGS`, `PYTHONPATH`, ...) as the
program's environment gives them, one server per such environment; nothing
has been built, traced or initialised in it (JAX's devices included: they are
made at first use, from the program's `XLA_FLAGS`). The forked program gets
the environment, working directory, arguments, `sys.path[0]`, fresh random
states, default signal handlers and standard streams that a new interpreter
would, and leaves as one does: non-daemon threads joined, `atexit` handlers
run, streams flushed.

`KD_TEST_PROGRAMS=spawn` runs each program in a new interpreter instead.

Usage (the server side is this file run with `--serve`):

    done = run_program(["page.py"], cwd=directory, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
"""

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

# What imports read: a server serves only programs whose values of these
# match (kd.launch's fork server decides by the same list).
from keras_distribute.launch.starting import IMPORT_TIME_PREFIXES

_servers = {}
_lock = threading.Lock()


def _import_env(env):
    return tuple(sorted((name, value) for name, value in env.items()
                        if name.upper().startswith(IMPORT_TIME_PREFIXES)))


class _Server:
    """One server process (started by this process; stopped at its exit)."""

    def __init__(self, env):
        # What the server itself prints (its imports' warnings) goes here,
        # not into the tests' output; its replies come on its stdout.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", os.path.abspath(__file__),
             "--serve"], env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            cwd=tempfile.gettempdir())
        if self._reply() != "ready":
            self.process.kill()
            self.process.wait()
            raise RuntimeError(self._died("did not start"))

    def _reply(self):
        return self.process.stdout.readline().strip()

    def _died(self, what):
        self.log.seek(0)
        return (f"the program server (tests/program_runner.py) {what}; its "
                f"output:\n{self.log.read()[-4000:]}")

    def run(self, argv, cwd, env, timeout):
        with tempfile.TemporaryDirectory(prefix="kd-program-") as streams:
            out, err = (os.path.join(streams, name) for name in ("out", "err"))
            self.process.stdin.write(json.dumps({
                "argv": list(argv), "cwd": str(cwd), "env": dict(env),
                "stdout": out, "stderr": err}) + "\n")
            self.process.stdin.flush()
            started = self._reply()
            if not started:
                raise RuntimeError(self._died("ended before the program"))
            pid = json.loads(started)["pid"]
            finished = []
            reader = threading.Thread(target=lambda: finished.append(
                self._reply()), daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = reader.is_alive()
            if timed_out:
                os.kill(pid, signal.SIGKILL)  # the program this call started
                reader.join()
            if not finished[0]:
                raise RuntimeError(self._died("ended during the program"))
            status = json.loads(finished[0])["status"]
            with open(out, errors="replace") as file:
                stdout = file.read()
            with open(err, errors="replace") as file:
                stderr = file.read()
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(
            [sys.executable, *argv], os.waitstatus_to_exitcode(status),
            stdout, stderr)

    def stop(self):
        self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()  # the server this process started
            self.process.wait()
        self.log.close()


def _stop_servers():
    for server in _servers.values():
        server.stop()
    _servers.clear()


atexit.register(_stop_servers)


def run_program(argv, *, cwd, env, timeout):
    """Runs `python *argv` (a script and its arguments) in `cwd` with `env`.

    Args:
        argv: the script's path (absolute, or relative to `cwd`) and its
            arguments.
        cwd: the working directory.
        env: the whole environment of the program.
        timeout: seconds; the program is killed after them.

    Returns:
        A `subprocess.CompletedProcess` with text `stdout` and `stderr`
        (`returncode` negative when a signal ended the program).

    Raises:
        subprocess.TimeoutExpired: the program ran longer than `timeout`.

    Example:

    ```python
    done = run_program(["page.py"], cwd=tmp_path, env=env, timeout=600)
    ```
    """
    if os.environ.get("KD_TEST_PROGRAMS", "fork") == "spawn":
        return subprocess.run(
            [sys.executable, "-X", "faulthandler", *argv], cwd=cwd, env=env,
            capture_output=True, text=True, timeout=timeout)
    key = _import_env(env)
    with _lock:
        server = _servers.get(key)
        if server is None or server.process.poll() is not None:
            server = _servers[key] = _Server(env)
        return server.run(argv, cwd, env, timeout)


# The server side -----------------------------------------------------------


def _exit_code(error):
    code = error.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _program(request):
    """In the forked process: becomes the program, runs it, never returns."""
    code = 1
    try:
        import random
        import runpy
        import traceback

        import numpy as np

        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY),
                                (2, request["stderr"], os.O_WRONLY)):
            opened = os.open(path, flags | (os.O_CREAT if fd else 0), 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        np.random.seed()
        script = os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][1:]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as error:
            code = _exit_code(error)
        except BaseException:
            traceback.print_exc()
            code = 1
        # As an interpreter ends: non-daemon threads, then atexit.
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _serve():
    # Replies go to the client on a copy of stdout; stdout itself goes to
    # the server's log, so that nothing an import prints reads as a reply.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import keras  # noqa: F401

    import keras_distribute  # noqa: F401

    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _program(request)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status}), file=replies, flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
