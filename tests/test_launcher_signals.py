"""A scheduler stops a job by signalling the launcher: the workers hear it.

Regression (#17): `python -m keras_distribute.launch` ended by SIGTERM died
at once and left its workers running. Now the signal is passed on to every
worker, they get a grace period to save and exit, and the launcher exits
with 128 + the signal; nothing is left behind. The workers here are plain
Python (no framework), so this runs once, under the JAX suite.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BACKEND

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    BACKEND != "jax", reason="no framework involved: run once")

WORKER = """
import os, signal, sys, time
rank = os.environ["RANK"]
def on_term(signum, frame):
    open(f"got-{signum}-{rank}", "w").close()   # a worker saving its state
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(f"pid-{rank}", "w").write(str(os.getpid()))
for _ in range(600):
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _worker_pids(directory, seconds: float) -> list:
    """The two workers' pids, once both have written them."""
    files = [directory / f"pid-{rank}" for rank in range(2)]
    assert _wait_for(lambda: all(f.exists() and f.read_text()
                                 for f in files), seconds)
    return [int(f.read_text()) for f in files]


def _terminate_once_started(argv, directory, start_s, **popen):
    """Starts `argv` in `directory`, waits for its two workers' pids, sends
    it SIGTERM; returns `(exit code, worker pids, process, seconds from
    the signal to the exit)`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(argv, cwd=directory, env=env, **popen)
    try:
        pids = _worker_pids(directory, start_s)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        seconds = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    return code, pids, process, seconds


def test_sigterm_to_the_launcher_reaches_every_worker(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    code, pids, launcher, _ = _terminate_once_started(
        [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
         "--signal-grace", "10", "worker.py"], tmp_path, 60,
        stderr=subprocess.PIPE, text=True)
    assert code == 128 + signal.SIGTERM
    for rank in range(2):  # each worker got the signal and could save
        assert (tmp_path / f"got-{int(signal.SIGTERM)}-{rank}").exists()
    assert _wait_for(lambda: not any(map(_alive, pids)), 10), "orphans"
    assert "received SIGTERM, passed it on" in launcher.stderr.read()


def test_a_worker_ignoring_the_signal_is_killed_after_the_grace(tmp_path):
    (tmp_path / "worker.py").write_text(
        WORKER.replace("sys.exit(0)", "pass  # ignores it"))
    code, pids, _, seconds = _terminate_once_started(
        [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
         "--signal-grace", "1", "worker.py"], tmp_path, 60,
        stderr=subprocess.DEVNULL)
    assert code == 128 + signal.SIGTERM
    assert seconds < 15
    assert _wait_for(lambda: not any(map(_alive, pids)), 10), "orphans"


PARENT = """
import os, time
import keras_distribute as kd

def work():
    open(f"pid-{os.environ['RANK']}", "w").write(str(os.getpid()))
    time.sleep(60)

if __name__ == "__main__":
    try:
        kd.launch(work, num_processes=2)
    except kd.LaunchError as error:
        print("LaunchError:", error)
        raise SystemExit(3)
"""


def test_sigterm_to_a_kd_launch_parent_ends_its_workers(tmp_path):
    (tmp_path / "parent.py").write_text(PARENT)
    code, pids, parent, _ = _terminate_once_started(
        [sys.executable, "parent.py"], tmp_path, 120,
        stdout=subprocess.PIPE, text=True)
    assert code == 3
    assert "received SIGTERM and passed it on" in parent.stdout.read()
    assert _wait_for(lambda: not any(map(_alive, pids)), 10), "orphans"


def test_a_process_a_runtime_aborts_is_reported_with_its_last_note(tmp_path):
    # #17: a runtime that aborts a process from native code (JAX's
    # coordination service) leaves no traceback; the launcher says what the
    # process noted it was doing. Its notes directory is gone afterwards.
    (tmp_path / "worker.py").write_text(
        "import os, signal\n"
        "from keras_distribute.job import process_notes\n"
        "if os.environ['RANK'] == '1':\n"
        "    open('notes-dir', 'w').write(os.environ["
        "process_notes.NOTES_VARIABLE])\n"
        "    process_notes.write('waiting for the runtime to answer')\n"
        "    os.kill(os.getpid(), signal.SIGABRT)\n"
        "import time; time.sleep(30)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
         "worker.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60)
    assert result.returncode == 1, result.stderr
    assert ("process 1 of 2 exited with code -6 (killed by SIGABRT) while "
            "waiting for the runtime to answer; ending the others"
            ) in result.stderr
    # Python's fault handler, on in every launched process, printed where
    # it died: the Python stack of each thread.
    assert "Fatal Python error: Aborted" in result.stderr
    assert 'worker.py", line 6 in <module>' in result.stderr
    assert not os.path.exists((tmp_path / "notes-dir").read_text())


# --------------------------------------------- what a launch is given (#29)
@pytest.mark.parametrize("kwargs, match", [
    (dict(num_processes=10000), r"at most \d+ local processes .* "
     "Received: num_processes=10000.*KERAS_DISTRIBUTE_MAX_PROCESSES"),
    (dict(num_processes=2, timeout="60"), "finite, positive number of "
     "seconds. Received: timeout='60'"),
    (dict(num_processes=2, timeout=float("nan")), "Received: timeout=nan"),
    (dict(num_processes=2, timeout=float("inf")), "Received: timeout=inf"),
    (dict(num_processes=2, timeout=0), "Received: timeout=0"),
])
def test_launch_refuses_bad_sizes_and_timeouts_before_starting(kwargs,
                                                               match):
    import multiprocessing

    import keras_distribute as kd

    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=match):
        kd.launch(print, **kwargs)
    assert len(multiprocessing.active_children()) == before


def test_the_process_limit_can_be_raised_on_purpose(monkeypatch):
    import importlib

    launch = importlib.import_module("keras_distribute.launch.launcher")
    monkeypatch.setenv("KERAS_DISTRIBUTE_MAX_PROCESSES", "20000")
    launch.check_num_processes(10000)
    monkeypatch.setenv("KERAS_DISTRIBUTE_MAX_PROCESSES", "many")
    with pytest.raises(ValueError, match="must be an integer"):
        launch.check_num_processes(2)


def test_the_fork_servers_extra_modules_are_checked_before_a_launch(
        monkeypatch):
    import multiprocessing

    import keras_distribute as kd
    from keras_distribute.launch import starting

    def preload(value):
        return starting.preloaded_modules({"KERAS_DISTRIBUTE_PRELOAD": value})

    assert starting.preloaded_modules({}) == starting.PRELOADED_MODULES
    assert preload(" json, keras,json ,os.path,") == (
        "__main__", "keras", "keras_distribute", "json", "os.path")
    for value, problem in [
            ("tensorflw", "whose 'tensorflw' names a package that is not "
             "installed \\('tensorflw'\\)"),
            ("json, tensor-flow", "whose 'tensor-flow' is not a module name"),
            ("os..path", "whose 'os..path' is not a module name")]:
        with pytest.raises(ValueError, match="Expected KERAS_DISTRIBUTE_"
                           "PRELOAD to name importable modules, separated by "
                           "commas .* Received: .*" + problem):
            preload(value)
    # The first forking launch reads it (this process's fork server may have
    # started already: as if not), and refuses before anything starts.
    monkeypatch.setitem(starting._server, "import_env", None)
    monkeypatch.setenv("KERAS_DISTRIBUTE_PRELOAD", "tensorflw")
    monkeypatch.delenv("KERAS_DISTRIBUTE_START_METHOD", raising=False)
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match="Fix the name, or unset "
                       "KERAS_DISTRIBUTE_PRELOAD"):
        kd.launch(print, num_processes=1)
    assert len(multiprocessing.active_children()) == before
    assert starting._server["import_env"] is None


@pytest.mark.parametrize("argv, match", [
    (["--nproc", "10000", "x.py"], r"at most \d+ local processes .*--nproc"),
    (["--timeout", "nan", "x.py"], r"`--timeout` to be a finite.*"
     "Received: --timeout=nan"),
    (["--nproc", "0", "x.py"], r"`--nproc` to be a positive int"),
])
def test_launch_command_refuses_bad_sizes_and_timeouts(argv, match, capsys):
    from keras_distribute.launch.script import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


def _returns_a_lock():
    import threading

    return threading.Lock()


def test_a_return_value_that_cannot_be_pickled_is_named():
    import keras_distribute as kd

    with pytest.raises(kd.LaunchError, match="returned cannot be pickled.*"
                       "lock"):
        kd.launch(_returns_a_lock, num_processes=1, timeout=120)


def test_a_process_ends_when_its_store_host_is_cut_off():
    """#43: behind a network partition the store's host never answers; the
    final "ended" mark of the heartbeat blocked there (torch and TF workers
    ran on 180 s after their error). The write is bounded now."""
    import threading

    from keras_distribute.job.peer_board import PeerBoard

    class CutOffStore:
        def __init__(self):
            self.cut = threading.Event()
            self.values = {}

        def set(self, key, text):
            if self.cut.is_set():
                threading.Event().wait()  # never answers
            self.values[key] = text

        def get(self, key):
            return self.values.get(key)

    store = CutOffStore()
    board = PeerBoard(store, rank=1, world_size=2, timeout_s=2.0)
    time.sleep(0.3)
    assert store.values["keras_distribute/beat/1"].endswith(" 0")  # beats
    store.cut.set()
    started = time.monotonic()
    board.close()
    assert time.monotonic() - started < 2 * (board.interval_s + 1.0) + 1.0
    assert store.values["keras_distribute/beat/1"] != "ended"
    # A store that answers takes the mark.
    healthy = CutOffStore()
    board = PeerBoard(healthy, rank=0, world_size=2, timeout_s=2.0)
    board.close()
    assert healthy.values["keras_distribute/beat/0"] == "ended"


class _MemoryStore:
    """The job's store as `cluster_agreement` sees it, in one process."""

    def __init__(self):
        self.values = {}

    def claim(self, key):
        first = key not in self.values
        self.values[key] = "claimed"
        return first

    def publish(self, key, text):
        self.values[key] = text

    def fetch(self, key, timeout_s):
        return self.values.get(key)


def test_cluster_agreement_names_a_difference_a_twin_and_a_silent_peer():
    # The three backends hand in their own stores (tests of each in
    # test_several_hosts.py / test_tf_multiworker.py); the rule is here.
    from keras_distribute.cluster_resolver import SimpleClusterResolver
    from keras_distribute.job import cluster_agreement as agreement

    two = agreement.describe(SimpleClusterResolver(["a:1", "b:1"], 0))
    three = agreement.describe(SimpleClusterResolver(["a:1", "b:1", "c:1"], 0))
    assert two == ('{"num_processes": 2, "addresses": ["a:1", "b:1"]}')
    store = _MemoryStore()
    store.publish("keras_distribute/cluster/1", two)  # process 1, so far
    agreement.check_same_cluster(store, 0, 2, two, timeout_s=0)
    agreement.check_same_cluster(store, 1, 2, two, timeout_s=0)
    with pytest.raises(ValueError, match="both given process index 1"):
        agreement.check_same_cluster(store, 1, 2, two, timeout_s=0)

    store = _MemoryStore()
    store.publish("keras_distribute/cluster/0", two)
    with pytest.raises(ValueError, match=(
            "given different cluster descriptions. Received: process 1: "
            r'\{"num_processes": 3.*process 0: \{"num_processes": 2')):
        agreement.check_same_cluster(store, 1, 3, three, timeout_s=0)

    with pytest.raises(TimeoutError, match="Process 1 did not publish"):
        agreement.check_same_cluster(_MemoryStore(), 0, 2, two, timeout_s=0)


def test_a_jobs_free_port_is_outside_the_kernels_ephemeral_range(
        monkeypatch, tmp_path):
    # CI: a torch job's coordinator port, picked by bind(0), was taken
    # before process 0 bound it ("already in use"): ports the kernel picks
    # come from the range it also gives outgoing connections.
    import socket

    from keras_distribute.job import ports as processes

    low, high = (int(v) for v in open(
        "/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = [processes.free_port() for _ in range(20)]
    assert all(max(1024, low - processes.PORT_SEARCH_SPAN) <= port < low
               for port in ports), (ports, low, high)
    with socket.socket() as sock:  # and it is free
        sock.bind(("127.0.0.1", ports[0]))
    # Where the range is unknown (not Linux), the kernel picks one.
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE",
                        str(tmp_path / "missing"))
    assert 0 < processes.free_port() < 65536


PRELOAD_PROGRAM = """
import os, sys, tempfile, time
import keras_distribute as kd

def where_temporary_files_go():
    return tempfile.gettempdir()

if __name__ == "__main__":
    if sys.argv[1] == "tmpdir":
        os.environ["TMPDIR"] = sys.argv[2]
        first = kd.launch(where_temporary_files_go, num_processes=1)
        os.environ["TMPDIR"] = sys.argv[3]
        second = kd.launch(where_temporary_files_go, num_processes=1)
        print("TEMPORARY", first[0], second[0])
        raise SystemExit(0)
    started = time.monotonic()
    try:
        kd.launch(print, num_processes=1, timeout=float(sys.argv[2]))
    except BaseException as error:
        print("RAISED", type(error).__name__, error)
    print(f"AFTER {time.monotonic() - started:.1f}")
"""

PRELOADED = {
    "kd_raising": "raise RuntimeError('no licence server found')\n",
    "kd_exiting": "raise SystemExit(3)\n",
    "kd_blocking": "import time\ntime.sleep(600)\n",
    "kd_tempdir": "import tempfile\ntempfile.gettempdir()\n",
}


def test_a_preloaded_module_that_fails_is_named_within_the_timeout(
        tmp_path):
    # Python's fork server ignored an ImportError (a missing submodule was
    # dropped), died on any other error (EOFError in the launcher) and
    # waited without end on a blocking import (a launch with timeout=60
    # hung past 150 s). Each is now named, within the launch's timeout.
    (tmp_path / "program.py").write_text(PRELOAD_PROGRAM)
    for name, source in PRELOADED.items():
        (tmp_path / f"{name}.py").write_text(source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("KERAS_DISTRIBUTE_START_METHOD", None)
    cases = {"kd_raising": "RuntimeError: no licence server found",
             "kd_exiting": "SystemExit: 3",
             "json.kd_missing": "ModuleNotFoundError: No module named "
                                "'json.kd_missing'",
             "kd_blocking": "did not finish within the launch's timeout"}
    runs = {module: subprocess.Popen(
        [sys.executable, "program.py", "fail", "8"], cwd=tmp_path,
        env=dict(env, KERAS_DISTRIBUTE_PRELOAD=module), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for module in cases}
    for module, expected in cases.items():
        out, _ = runs[module].communicate(timeout=180)
        assert "RAISED LaunchError" in out or "RAISED ImportError" in out, out
        assert f"KERAS_DISTRIBUTE_PRELOAD names {module!r}, which the " \
               "launch's fork server could not import" in out, out
        assert expected in out, out
        seconds = float(out.rsplit("AFTER ", 1)[1].split()[0])
        # (the blocking module sleeps 600 s: it is cut at the launch's
        # deadline, 8 s after its start; the rest is the fork server's own
        # start, which four programs at once on 2 cores make slow)
        assert seconds < 90, out


def test_a_forked_process_finds_temporary_files_where_the_launcher_says(
        tmp_path):
    # A preloaded import fixed tempfile's directory in the fork server
    # (from the server's TMPDIR): a forked process must find it from the
    # launcher's environment of the moment, as a spawned one does.
    import shutil
    import tempfile

    (tmp_path / "program.py").write_text(PRELOAD_PROGRAM)
    (tmp_path / "kd_tempdir.py").write_text(PRELOADED["kd_tempdir"])
    # (short paths: the fork server's socket is made in TMPDIR, and a
    # socket's path may not exceed 107 bytes)
    first, second = (tempfile.mkdtemp(prefix="kd-t") for _ in range(2))
    env = dict(os.environ, KERAS_DISTRIBUTE_PRELOAD="kd_tempdir",
               PYTHONPATH=os.pathsep.join(
                   [str(tmp_path), str(ROOT),
                    os.environ.get("PYTHONPATH", "")]))
    env.pop("KERAS_DISTRIBUTE_START_METHOD", None)
    try:
        run = subprocess.run(
            [sys.executable, "program.py", "tmpdir", first, second],
            cwd=tmp_path, env=env, text=True, capture_output=True,
            timeout=180)
    finally:
        for made in (first, second):
            shutil.rmtree(made)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert f"TEMPORARY {first} {second}" in run.stdout, run.stdout
