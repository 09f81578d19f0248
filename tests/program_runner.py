"""Runs a Python program as `python program.py` would, without paying for
Keras' import each time.

The docs' pages and the examples run as programs, each in a fresh
interpreter; importing Keras and its backend costs each of them 3-5 s of CPU
(about a fifth of these tests on CI's 2 cores). `run_program` forks each
program from a server process that imported `keras` and `keras_distribute`
once, as `kd.launch` starts its processes (keras_distribute/launch/
starting.py), and what the program's `KERAS_DISTRIBUTE_PRELOAD` names, as
that fork server does (`starting.preloaded_modules`; the suite names
TensorFlow: `keras.utils.set_random_seed` imports it on every backend, 2-2.5 s
of CPU in each program that seeds). A program that checks what it imports
itself runs without that variable.

A server is a fresh interpreter started with the variables that imports
read (`KERAS_BACKEND`, `XLA_FLAGS`, `PYTHONPATH`, ...) as the program's
environment gives them, one server per such environment; nothing has been
built, traced or initialised in it (JAX's devices included: they are made
at first use, from the program's `XLA_FLAGS`). The forked program gets the
environment, working directory, arguments, `sys.path[0]`, fresh random
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
import queue
import signal
import subprocess
import sys
import tempfile
import threading

# What imports read: a server serves only programs whose values of these
# match (kd.launch's fork server decides by the same list).
from keras_distribute.launch.starting import PRELOAD_VARIABLE
from keras_distribute.launch.starting import SET_BY_IMPORTS
from keras_distribute.launch.starting import import_time_env

_servers = {}
_lock = threading.Lock()


def _import_env(env):
    # (Not what an import sets itself: a server's forked program gets the
    # program's environment whole, and its imports keep what they find.)
    return tuple(sorted((name, value)
                        for name, value in import_time_env(env).items()
                        if name not in SET_BY_IMPORTS)), env.get(
        PRELOAD_VARIABLE, "")


class _Server:
    """One server process (started by this process; stopped at its exit)."""

    def __init__(self, env):
        # What the server itself prints (its imports' warnings) goes here,
        # not into the tests' output; its replies come on its stdout.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", os.path.abspath(__file__),
             "--serve"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, cwd=tempfile.gettempdir())
        if self._reply() != "ready":
            self.process.kill()
            self.process.wait()
            raise RuntimeError(self._died("did not start"))
        self._requests_lock = threading.Lock()
        self._replies = {}  # request number -> its queue of replies
        self._next_id = 0
        threading.Thread(target=self._dispatch, daemon=True).start()

    def _reply(self):
        return self.process.stdout.readline().strip()

    def _died(self, what):
        self.log.seek(0)
        return (f"the program server (tests/program_runner.py) {what}; its "
                f"output:\n{self.log.read()[-4000:]}")

    def run(self, argv, cwd, env, timeout):
        with tempfile.TemporaryDirectory(prefix="kd-program-") as streams:
            out, err = (os.path.join(streams, name) for name in ("out", "err"))
            replies = queue.Queue()
            with self._requests_lock:
                self._next_id += 1
                number = self._next_id
                self._replies[number] = replies
                self.process.stdin.write(json.dumps({
                    "id": number, "argv": list(argv), "cwd": str(cwd),
                    "env": dict(env), "stdout": out, "stderr": err}) + "\n")
                self.process.stdin.flush()
            try:
                started = replies.get()
                if started is None:
                    raise RuntimeError(self._died("ended before the program"))
                try:
                    finished = replies.get(timeout=timeout)
                    timed_out = False
                except queue.Empty:
                    timed_out = True
                    # the program this call started
                    os.kill(started["pid"], signal.SIGKILL)
                    finished = replies.get()
                if finished is None:
                    raise RuntimeError(self._died("ended during the program"))
            finally:
                with self._requests_lock:
                    self._replies.pop(number, None)
            status = finished["status"]
            with open(out, errors="replace") as file:
                stdout = file.read()
            with open(err, errors="replace") as file:
                stderr = file.read()
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return subprocess.CompletedProcess(
            [sys.executable, *argv], os.waitstatus_to_exitcode(status),
            stdout, stderr)

    def _dispatch(self):
        """Hands each reply of the server to the call waiting for it (the
        server runs several programs at once); at its end, `None` to all."""
        for line in self.process.stdout:
            reply = json.loads(line)
            with self._requests_lock:
                waiting = self._replies.get(reply["id"])
            if waiting is not None:
                waiting.put(reply)
        with self._requests_lock:
            for waiting in self._replies.values():
                waiting.put(None)

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
    return server.run(argv, cwd, env, timeout)  # several at once


def failure_excerpt(output, limit=4000):
    """What a failed program's `output` says of its failure: its last
    `limit` characters — or, where a native library aborted a process
    (Python's fault handler: "Fatal Python error"), the error and every
    thread's Python stack, without the list of extension modules after
    them that would fill the tail, then the last lines.

    Example:

    ```python
    assert done.returncode == 0, failure_excerpt(done.stdout + done.stderr)
    ```
    """
    fatal = output.find("Fatal Python error")
    if fatal < 0:
        return output[-limit:]
    stacks = output[fatal:]
    modules = stacks.find("\nExtension modules:")
    if modules >= 0:
        stacks = stacks[:modules]
    return (stacks[:limit] + "\n[... the output's last lines:]\n"
            + output[-limit // 4:])


def run_together(commands, *, cwd, timeout):
    """Runs every `(argv, env)` of `commands` at once (the processes of one
    job); returns `[(returncode, stdout + stderr)]` in their order
    (`returncode` `None` for one that ran past `timeout` and was killed).

    A `python script.py ...` command is forked from the server as
    `run_program` does; any other (`python -m ...`, torchrun) starts as
    given.

    Example:

    ```python
    results = run_together([([sys.executable, "train.py"], env0),
                            ([sys.executable, "train.py"], env1)],
                           cwd=directory, timeout=300)
    ```
    """
    import concurrent.futures

    def one(argv, env):
        try:
            if argv[0] == sys.executable and len(argv) > 1 and str(
                    argv[1]).endswith(".py"):
                done = run_program(list(argv[1:]), cwd=cwd, env=env,
                                   timeout=timeout)
            else:
                done = subprocess.run(argv, cwd=cwd, env=env, text=True,
                                      capture_output=True, timeout=timeout)
            return done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as error:
            output = "".join(
                part.decode(errors="replace") if isinstance(part, bytes)
                else part for part in (error.stdout, error.stderr) if part)
            return None, f"(killed after {timeout} s)\n{output}"

    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda command: one(*command), commands))


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
    # One thread only (a fork copies no other thread's held lock): requests
    # are read and children reaped in one loop, several programs at once.
    import select
    import time

    replies = os.dup(1)
    os.dup2(2, 1)
    import importlib

    import keras  # noqa: F401

    import keras_distribute  # noqa: F401
    from keras_distribute.launch.starting import preloaded_modules

    for name in preloaded_modules():  # (kd.launch's fork server's too)
        if name != "__main__":
            importlib.import_module(name)

    def reply(message):
        os.write(replies, (json.dumps(message) + "\n").encode())

    os.write(replies, b"ready\n")
    running, pending, reading = {}, b"", True  # pid -> request number
    while reading or running:
        if reading and select.select([0], [], [], 0.01)[0]:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    os.close(replies)
                    _program(request)
                running[pid] = request["id"]
                reply({"id": request["id"], "pid": pid})
        elif not reading:
            time.sleep(0.01)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            reply({"id": running.pop(pid), "status": status})


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
