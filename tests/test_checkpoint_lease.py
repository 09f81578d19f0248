"""One directory, one job (#43 item 4): a checkpoint directory's lease.

Before, a second job whose manager or checkpoint callback used the same
directory removed the first job's unfinished save on start, and the first
job failed inside HDF5 (`FileNotFoundError ... ckpt-1.tmp/shards-00000.h5`).
Now the second job is refused, before it touches the directory, with an
error naming the job that holds it; a lease left by a job that died is
taken over.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_distribute as kd
from keras_distribute.checkpoint.storage import lease

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Another job: loads only lease.py (no framework, so it starts in ~0.1 s),
# takes the lease on argv[1], says so, and holds it until stdin closes.
HOLDER = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location(
    "lease",
    {os.path.join(ROOT, "keras_distribute", "checkpoint", "storage",
                  "lease.py")!r})
lease = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lease)
path = lease.take(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
lease.release(path)
"""


def _holder(directory):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def _manager(directory, **kwargs):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    return kd.checkpoint.CheckpointManager(checkpoint, str(directory),
                                           **kwargs)


# The lease is framework-free (checkpoint/storage/lease.py): its real waits
# run once, on torch with the release Keras.
_REAL_WAITS_HERE = (BACKEND == "torch"
                    and os.environ.get("KD_KERAS_STACK") != "next")


def _short_ending_wait(monkeypatch):
    """A live holder is refused once `ENDING_WAIT_S` passed without it
    ending: the wait shortened where the real one (5 s) does not run."""
    if not _REAL_WAITS_HERE:
        monkeypatch.setattr(lease, "ENDING_WAIT_S", 0.5)


def test_a_second_job_is_refused_naming_the_first(tmp_path, monkeypatch):
    _short_ending_wait(monkeypatch)
    other = _holder(tmp_path)
    try:
        (tmp_path / "ckpt-1.tmp").mkdir()  # the other job's unfinished save
        with pytest.raises(kd.checkpoint.DirectoryInUseError) as error:
            _manager(tmp_path)
        message = str(error.value)
        assert f"process id {other.pid}" in message
        assert repr(socket.gethostname()) in message
        assert str(tmp_path) in message
        # Refused before touching anything: the unfinished save is there.
        assert (tmp_path / "ckpt-1.tmp").is_dir()
    finally:
        other.communicate("", timeout=30)
    # The other job ended and released it: this one takes it.
    assert not (tmp_path / lease.LEASE).exists()
    manager = _manager(tmp_path)
    manager.save()
    assert lease.holder(str(tmp_path))["pid"] == os.getpid()
    manager.close()
    assert not (tmp_path / lease.LEASE).exists()


def test_a_lease_left_by_a_killed_job_is_taken_over(tmp_path):
    other = _holder(tmp_path)
    other.send_signal(signal.SIGKILL)
    other.wait(timeout=30)
    assert lease.holder(str(tmp_path))["pid"] == other.pid  # left behind
    started = time.monotonic()
    manager = _manager(tmp_path)
    assert time.monotonic() - started < lease.ENDING_WAIT_S
    assert lease.holder(str(tmp_path))["pid"] == os.getpid()
    assert manager.save().endswith("ckpt-1")
    manager.close()


def _foreign_lease(directory, beating):
    """Writes a lease as a job on another host would; with `beating`, a
    thread keeps its heartbeat going as that job's would."""
    record = {"job": "f" * 32, "host": "another-host.example", "pid": 1,
              "start_ticks": None, "boot": "other-boot", "began": time.time(),
              "beat": 0}
    path = os.path.join(directory, lease.LEASE)
    with open(path, "w") as file:
        json.dump(record, file)
    stop = threading.Event()

    def beat():
        while not stop.wait(lease.HEARTBEAT_S / 2):
            record["beat"] += 1
            with open(path + ".beat", "w") as file:
                json.dump(record, file)
            os.replace(path + ".beat", path)

    if beating:
        threading.Thread(target=beat, daemon=True).start()
    return stop


_WAITS_ONCE = pytest.mark.skipif(
    not _REAL_WAITS_HERE, reason="waits out the lease's heartbeat and "
    "staleness, which are framework-free (checkpoint/storage/lease.py): "
    "checked once, on torch with the release Keras")


@_WAITS_ONCE
def test_another_hosts_lease_is_live_while_it_beats_and_stale_after(
        tmp_path):
    stop = _foreign_lease(str(tmp_path), beating=True)
    try:
        with pytest.raises(kd.checkpoint.DirectoryInUseError,
                           match="on host 'another-host.example'"):
            _manager(tmp_path)
    finally:
        stop.set()
    # Its beat stopped (the job died): taken over once it is stale.
    time.sleep(lease.HEARTBEAT_S)
    started = time.monotonic()
    manager = _manager(tmp_path)
    assert lease.STALE_AFTER_S - 1 < time.monotonic() - started
    assert lease.holder(str(tmp_path))["pid"] == os.getpid()
    manager.close()


def test_writers_of_one_job_share_the_lease_until_the_last_lets_go(
        tmp_path):
    first = _manager(tmp_path)
    second = _manager(tmp_path, checkpoint_name="other", owner="other")
    first.save()
    second.save()
    first.close()
    assert lease.holder(str(tmp_path))["pid"] == os.getpid()
    second.close()
    assert lease.holder(str(tmp_path)) is None
    # A save after close takes it again; the context manager lets it go.
    with first:
        first.save()
        assert lease.holder(str(tmp_path))["pid"] == os.getpid()
    assert lease.holder(str(tmp_path)) is None
    # A manager that is collected lets go too, at the next heartbeat (a
    # finalizer may run inside any allocation, so it only records it).
    third = _manager(tmp_path)
    assert lease.holder(str(tmp_path)) is not None
    del third
    import gc

    gc.collect()
    deadline = time.monotonic() + 2 * lease.HEARTBEAT_S + 1
    while lease.holder(str(tmp_path)) is not None:
        assert time.monotonic() < deadline, "the collected manager's lease"
        time.sleep(0.1)


def test_a_second_jobs_checkpoint_callback_is_refused_first_keeps_its_saves(
        tmp_path, monkeypatch):
    # The case of the report: two jobs' kd.callbacks.ShardedCheckpoint in
    # one directory. The first job (here a process holding the lease, as
    # its manager does) keeps what it wrote; the second is told at once.
    first = _manager(tmp_path)
    first.save()
    written = sorted(os.listdir(tmp_path))
    first.close()
    monkeypatch.setattr(lease, "ENDING_WAIT_S", 0.5)  # (the real one: above)
    other = _holder(tmp_path)
    try:
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x = np.zeros((8, 2), "float32")
        with pytest.raises(kd.checkpoint.DirectoryInUseError,
                           match=f"process id {other.pid}"):
            model.fit(x, x[:, :1], epochs=1, verbose=0, callbacks=[
                kd.callbacks.ShardedCheckpoint(str(tmp_path))])
        assert sorted(os.listdir(tmp_path)) == written
    finally:
        other.communicate("", timeout=30)
    # The callback lets go at the end of fit: the next job may use it.
    callback = kd.callbacks.ShardedCheckpoint(str(tmp_path))
    model.fit(x, x[:, :1], epochs=1, verbose=0, callbacks=[callback])
    assert lease.holder(str(tmp_path)) is None


@_WAITS_ONCE
def test_an_unreadable_lease_file_is_not_taken_for_ours(tmp_path):
    # Garbage where the lease goes (not JSON): treated as another host's
    # lease without a heartbeat, so stale after the wait; nothing crashes.
    (tmp_path / lease.LEASE).write_bytes(b"\x00\xff" * 10_000)
    manager = _manager(tmp_path)
    assert lease.holder(str(tmp_path))["pid"] == os.getpid()
    manager.close()


UNWRITABLE_PROGRAM = """
import sys
import keras
import keras_distribute as kd

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
try:
    kd.checkpoint.CheckpointManager(checkpoint, sys.argv[1], max_to_keep=2)
except Exception as error:
    print("RAISED", type(error).__name__, error)
"""


def test_a_directory_this_process_cannot_write_is_named_as_such():
    # Run as an unprivileged user (root writes anywhere): the manager's
    # lease cannot be made, and the error says so - not a lease "held".
    import shutil
    import tempfile

    if BACKEND != "torch":
        pytest.skip("the lease takes no framework: run once, on torch")
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as an unprivileged user")
    # (a directory of its own that the unprivileged user can reach: the
    # test's tmp_path lies under pytest's directory, private to root)
    place = tempfile.mkdtemp(prefix="kd-unwritable-")
    try:
        os.chmod(place, 0o755)
        directory = os.path.join(place, "read-only")
        os.mkdir(directory, 0o555)
        os.chmod(directory, 0o555)
        program = os.path.join(place, "program.py")
        with open(program, "w") as file:
            file.write(UNWRITABLE_PROGRAM)
        os.chmod(program, 0o644)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, HOME=place, KERAS_HOME=place,
                   PYTHONPATH=os.pathsep.join([root, os.environ.get(
                       "PYTHONPATH", "")]), PYTHONDONTWRITEBYTECODE="1")
        for variable in ("JAX_COMPILATION_CACHE_DIR", "TMPDIR"):
            env.pop(variable, None)
        run = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, program, directory], env=env, cwd=place,
            capture_output=True, text=True, timeout=240)
        assert "RAISED PermissionError The checkpoint directory" in (
            run.stdout), run.stdout + run.stderr[-3000:]
        assert "cannot be written by this process" in run.stdout
        assert os.listdir(directory) == []  # nothing written
    finally:
        shutil.rmtree(place)
