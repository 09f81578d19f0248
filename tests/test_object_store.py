"""Checkpoints in object storage (#47), against a real S3-API server.

moto's server (`moto[server]`) runs on 127.0.0.1 in its own process for
this module, started and stopped here; a proxy in front of it answers some
requests with 503 SlowDown, slowly. Every backend runs these: what a
backend gives the storage layer (each process's host arrays) is the same
as on disk; the kill -9 and the throttling tests run on JAX only (the
storage layer they test imports no framework).
"""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import keras
import numpy as np
import pytest

import keras_distribute as kd
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage import remote_lease
from keras_distribute.checkpoint.storage import store_limits

pytest.importorskip("s3fs", reason="the [s3] extra (s3fs) is not installed")
pytest.importorskip("moto", reason="moto[server] is not installed")

import s3_server  # noqa: E402

BUCKET = "kd-test"
CheckpointError = kd.checkpoint.CheckpointError


@pytest.fixture(scope="module")
def endpoint():
    saved = {key: os.environ.get(key) for key in
             s3_server.environment("").keys()}
    # What lives when the module starts is left out of the collections its
    # tests run (`prefix`): each walked the framework's whole heap, 0.2-0.9 s
    # on TensorFlow, ~45 s of a CI run. Collected first, so no garbage is
    # kept; given back to the collector when the module ends.
    gc.collect()
    gc.freeze()
    try:
        with s3_server.s3_server() as url:
            os.environ.update(s3_server.environment(url))
            object_store.forget_stores()
            s3_server.make_bucket(url, BUCKET)
            try:
                yield url
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                object_store.forget_stores()
    finally:
        gc.unfreeze()


@pytest.fixture
def prefix(endpoint, monkeypatch):
    """A fresh `s3://kd-test/<random>` for one test (seconds-long lease
    settling cut for tests). After the test, what its writers held is let
    go (a fit an exception ended keeps its callbacks, and their lease, in
    the traceback's cycle until collected), and no heartbeat may beat on:
    one left beating would retry against the stopped server from a later
    test, and botocore's retry jitter draws from Python's global `random`
    (a test that builds a model twice from one seed saw its start differ)."""
    monkeypatch.setattr(remote_lease, "SETTLE_S", 0.05)
    yield f"s3://{BUCKET}/{uuid.uuid4().hex}"
    try:
        gc.collect()
        remote_lease.release_collected()
        assert _heartbeats() == [], "a heartbeat outlived its test"
    finally:
        # A failed test's managers (kept alive by its traceback) are ended,
        # and no store made during it (perhaps through a proxy now gone)
        # reaches the next test.
        if _heartbeats():
            remote_lease.end_all()
        object_store.forget_stores()


def _heartbeats():
    return [t for t in threading.enumerate()
            if t.name == "kd-checkpoint-heartbeat" and t.is_alive()]


def _fs():
    return object_store.store_for("s3://x").fs


def _objects(prefix):
    return sorted(object_store.store_for(prefix).files_under(prefix))


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    x = np.random.default_rng(seed).normal(size=(16, 5)).astype("float32")
    model.fit(x, x[:, :3], epochs=1, batch_size=8, verbose=0)
    return model


def _weights(model):
    return [np.array(w) for w in model.weights] + [
        np.array(v) for v in model.optimizer.variables]


def _scramble(model):
    for variable in list(model.weights) + list(model.optimizer.variables):
        variable.assign(np.full(variable.shape, 7, variable.dtype))


def test_a_checkpoint_saved_to_s3_restores_bit_exactly(prefix, tmp_path,
                                                       monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model()
    saved = _weights(model)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    path = checkpoint.save(prefix + "/ckpt", metadata={"epoch": 3})
    assert path == prefix + "/ckpt-1"
    assert os.listdir(tmp_path) == []  # no local "s3:" directory
    # One generation, committed by its index; nothing else.
    names = _objects(path)
    generation = names[0].split("/")[0]
    assert names == [f"{generation}/generation.json",
                     f"{generation}/shards-00000.h5", "index.json"]
    _scramble(model)
    checkpoint.save_counter = 0
    checkpoint.restore(path).assert_consumed()
    for a, b in zip(saved, _weights(model)):
        np.testing.assert_array_equal(a, b)
    assert checkpoint.save_counter == 1
    assert kd.checkpoint.latest_checkpoint(prefix) == path
    assert kd.checkpoint.read_metadata(prefix)["epoch"] == 3
    keys = dict(kd.checkpoint.list_variables(path))
    key = next(k for k, shape in keys.items() if shape == (5, 8))
    np.testing.assert_array_equal(kd.checkpoint.load_variable(path, key),
                                  saved[0])
    # A background save, then overwritten in place by write(): readers
    # see the new one, the old generation is gone.
    options = kd.checkpoint.CheckpointOptions(enable_async=True)
    second = checkpoint.save(prefix + "/ckpt", options=options)
    checkpoint.sync()
    model.layers[0].kernel.assign(np.ones((5, 8), "float32"))
    checkpoint.write(second)
    assert len([n for n in _objects(second) if n.endswith(".h5")]) == 1
    fresh = _model(seed=5)
    kd.checkpoint.ShardedCheckpoint(model=fresh).read(second)
    np.testing.assert_array_equal(np.array(fresh.layers[0].kernel),
                                  np.ones((5, 8), "float32"))


def test_gs_paths_go_through_gcsfs_to_a_gcs_server(tmp_path, monkeypatch):
    # The same checkpoint through gcsfs, against a fake GCS server (its
    # JSON API, gcp-storage-emulator): save, restore bit for bit, a manager
    # that keeps its last one, a hostile index refused.
    pytest.importorskip("gcsfs", reason="the [gcs] extra is not installed")
    pytest.importorskip("gcp_storage_emulator",
                        reason="gcp-storage-emulator is not installed")
    monkeypatch.setattr(remote_lease, "SETTLE_S", 0.05)
    with s3_server.gcs_server(BUCKET) as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        object_store.forget_stores()
        try:
            prefix = f"gs://{BUCKET}/{uuid.uuid4().hex}"
            model = _model()
            saved = _weights(model)
            checkpoint = kd.checkpoint.ShardedCheckpoint(
                model=model, optimizer=model.optimizer)
            manager = kd.checkpoint.CheckpointManager(checkpoint, prefix,
                                                      max_to_keep=1)
            first, path = manager.save(), manager.save()
            assert manager.checkpoints == [path] == (
                kd.checkpoint.checkpoints_in(prefix))
            assert _objects(first) == []
            manager.close()
            _scramble(model)
            checkpoint.restore(path).assert_consumed()
            for a, b in zip(saved, _weights(model)):
                np.testing.assert_array_equal(a, b)
            other = checkpoint.write(prefix + "/other")
            _tamper(other, lambda i: i["object_store"].update(files={}))
            with pytest.raises(CheckpointError, match="does not list"):
                kd.checkpoint.ShardedCheckpoint(model=_model(1)).read(other)
            # A large shard streams up in 1 MiB chunks from memory: the
            # object is the file a local save writes, byte for byte.
            from keras_distribute.checkpoint.storage import streamed_upload

            monkeypatch.setattr(streamed_upload, "PART_BYTES", 1 << 20)
            streamed, stream = [], streamed_upload._streamed
            monkeypatch.setattr(streamed_upload, "_streamed", lambda *a: (
                streamed.append(a[3]), stream(*a)))
            large = keras.Sequential([keras.Input((1000,)),
                                      keras.layers.Dense(1000)])
            checkpoint = kd.checkpoint.ShardedCheckpoint(model=large)
            path = checkpoint.write(prefix + "/large")
            assert len(streamed) == 1 and streamed[0] > 4_000_000
            local = checkpoint.write(str(tmp_path / "large"))
            (shard,) = [n for n in _objects(path) if n.endswith(".h5")]
            with open(os.path.join(local, "shards-00000.h5"), "rb") as f:
                assert object_store.store_for(path).fs.cat_file(
                    f"{path}/{shard}") == f.read()
            kernel = np.array(large.layers[0].kernel)
            large.layers[0].kernel.assign(np.zeros((1000, 1000), "float32"))
            checkpoint.read(path).assert_consumed()
            np.testing.assert_array_equal(np.array(large.layers[0].kernel),
                                          kernel)
        finally:
            object_store.forget_stores()


def test_a_manager_on_s3_keeps_its_own_and_never_touches_the_rest(prefix):
    store = object_store.store_for(prefix)
    # Someone else's objects: a file beside, and a name the manager would
    # use (it numbers after it and never deletes it).
    store.write_bytes(prefix + "/notes.txt", b"mine")
    store.write_bytes(prefix + "/ckpt-2/data.csv", b"1,2")
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix + "/",
                                              max_to_keep=2)
    paths = [manager.save(metadata={"step": i}) for i in range(3)]
    assert paths == [f"{prefix}/ckpt-{n}" for n in (3, 4, 5)]
    assert manager.checkpoints == paths[1:]
    assert _objects(paths[0]) == []  # deleted: it was this manager's
    assert store.read_bytes(prefix + "/notes.txt", 100) == b"mine"
    assert store.read_bytes(prefix + "/ckpt-2/data.csv", 100) == b"1,2"
    assert kd.checkpoint.checkpoints_in(prefix) == paths[1:]
    # Another job cannot use the directory while this one holds it.
    other = dict(json.loads(store.read_bytes(
        prefix + "/.keras_distribute-lease", 1 << 16)))
    assert other["pid"] == os.getpid()
    manager.close()
    assert not store.exists(prefix + "/.keras_distribute-lease")
    saved = _weights(model)
    _scramble(model)
    resumed = kd.checkpoint.CheckpointManager(checkpoint, prefix,
                                              max_to_keep=2)
    assert resumed.restore_or_initialize() == paths[-1]
    for a, b in zip(saved, _weights(model)):
        np.testing.assert_array_equal(a, b)
    resumed.close()


def test_two_jobs_on_one_prefix_are_refused(prefix, monkeypatch):
    store = object_store.store_for(prefix)
    import time

    lease_key = prefix + "/.keras_distribute-lease"
    store.write_bytes(lease_key, json.dumps({
        "job": "another-job", "host": "node-7", "pid": 12,
        "beat": time.time()}).encode())
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=_model())
    with pytest.raises(kd.checkpoint.DirectoryInUseError,
                       match="node-7.*own directory"):
        kd.checkpoint.CheckpointManager(checkpoint, prefix)
    # Its heartbeat stopped: the lease is taken over.
    monkeypatch.setattr(remote_lease, "STALE_AFTER_S", 0.0)
    kd.checkpoint.CheckpointManager(checkpoint, prefix).close()
    # A save in progress of another job at the same path is refused too.
    target = prefix + "/shared"
    store.write_bytes(target + "/g-" + "a" * 32 + "/generation.json",
                      json.dumps({"job": "another-job", "host": "node-7",
                                  "pid": 12, "owner": None,
                                  "beat": time.time()}).encode())
    with pytest.raises(CheckpointError, match="another job is writing"):
        checkpoint.write(target)
    # Foreign objects at a checkpoint path are never replaced.
    store.write_bytes(prefix + "/theirs/data.csv", b"1,2")
    with pytest.raises(CheckpointError, match="did not write.*data.csv"):
        checkpoint.write(prefix + "/theirs")
    assert store.read_bytes(prefix + "/theirs/data.csv", 100) == b"1,2"


def test_a_remote_lease_is_let_go_when_its_writer_is_collected_and_at_exit(
        prefix, tmp_path, monkeypatch):
    # A manager nobody closed: once collected, its lease goes at the next
    # heartbeat (its finalizer only records it: it may run inside any
    # allocation, even one made while the lease's lock is held).
    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    monkeypatch.setattr(remote_checkpoints, "HEARTBEAT_S", 0.2)
    store = object_store.store_for(prefix)
    key = prefix + "/.keras_distribute-lease"
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=_model())
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
    assert store.exists(key) and len(_heartbeats()) == 1
    del manager
    gc.collect()
    deadline = time.monotonic() + 30
    while store.exists(key) or _heartbeats():
        assert time.monotonic() < deadline, "the collected manager's lease"
        time.sleep(0.05)
    # In a process of its own (a hang is bounded there): a writer
    # collected while the lease's lock is held (as any allocation may
    # trigger) hangs nothing and is let go; one still held when the
    # process ends (no close) is let go at exit.
    program = tmp_path / "holds.py"
    program.write_text(textwrap.dedent("""
        import faulthandler
        import gc
        import sys
        import keras
        import keras_distribute as kd
        from keras_distribute.checkpoint.storage import remote_lease
        faulthandler.dump_traceback_later(60, exit=True)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        def manager(path):
            return kd.checkpoint.CheckpointManager(
                kd.checkpoint.ShardedCheckpoint(model=model), path)
        collected = manager(sys.argv[1] + "/collected")
        with remote_lease._lock:
            del collected
            gc.collect()
        kept = manager(sys.argv[1] + "/kept")
        print("held", flush=True)
    """))
    done = subprocess.run([sys.executable, str(program), prefix],
                          timeout=180, capture_output=True, text=True)
    assert done.returncode == 0 and "held" in done.stdout, done.stderr[-2000:]
    for name in ("collected", "kept"):
        assert not store.exists(f"{prefix}/{name}/.keras_distribute-lease")


def test_a_throttling_slow_server_loses_nothing(prefix, endpoint):
    if keras.backend.backend() != "jax":
        pytest.skip("the store's retries are the storage layer's, which "
                    "imports no framework: tested on JAX (each failed "
                    "request costs the client's backoff, about 1 s)")
    model = _model()
    saved = _weights(model)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    with s3_server.FlakyProxy(endpoint, fail_every=7,
                              delay_s=0.01) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        object_store.forget_stores()
        try:
            manager = kd.checkpoint.CheckpointManager(checkpoint, prefix,
                                                      max_to_keep=1)
            path = manager.save()
            _scramble(model)
            checkpoint.restore(path).assert_consumed()
            manager.close()
        finally:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            object_store.forget_stores()
    assert proxy.failed >= 3, (proxy.failed, proxy.requests)
    for a, b in zip(saved, _weights(model)):
        np.testing.assert_array_equal(a, b)
    assert kd.checkpoint.checkpoints_in(prefix) == [path]


def test_a_store_that_stops_answering_fails_the_save_within_its_bound(
        prefix, endpoint, monkeypatch):
    # #72.4: a store that stopped answering held a save (and fit, at its
    # next save) for about an hour: a 120 s read timeout x botocore's 8
    # attempts x kd's 4 tries. Every operation has one deadline
    # (KERAS_DISTRIBUTE_STORE_TIMEOUT_S); the save then fails naming the
    # store, and the checkpoint saved before is intact.
    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    monkeypatch.setenv(store_limits.TIMEOUT_VARIABLE, "2")
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model,
                                                 optimizer=model.optimizer)
    with s3_server.FlakyProxy(endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        object_store.forget_stores()
        try:
            manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
            first = manager.save()
            saved = _weights(model)
            before = _objects(prefix)
            _scramble(model)
            proxy.stall.set()
            started = time.monotonic()
            with pytest.raises(kd.checkpoint.CheckpointStorageError,
                               match=r"s3://.* within 2 s, the bound "
                               "KERAS_DISTRIBUTE_STORE_TIMEOUT_S.*did not "
                               "answer.*a checkpoint saved before is "
                               "intact"):
                manager.save()
            took = time.monotonic() - started
            proxy.stall.clear()
            # (the save's first call failed; its cleanup gave up likewise)
            assert took < 15, took
            checkpoint.restore(first).assert_consumed()
            for a, b in zip(saved, _weights(model)):
                np.testing.assert_array_equal(a, b)
            assert [n for n in _objects(prefix) if n in before] == before
            manager.close()
        finally:
            proxy.stall.clear()
            object_store.forget_stores()


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf", "nan"])
def test_a_bad_store_timeout_is_refused_naming_the_variable(value,
                                                            monkeypatch):
    monkeypatch.setenv(store_limits.TIMEOUT_VARIABLE, value)
    with pytest.raises(ValueError, match="KERAS_DISTRIBUTE_STORE_TIMEOUT_S "
                       "must be a positive number of seconds.*"
                       f"{value!r}"):
        store_limits.operation_timeout_s()


def _lease_of(job, host="node-7"):
    return json.dumps({"job": job, "host": host, "pid": 12,
                       "beat": time.time()}).encode()


def test_jobs_racing_for_one_prefix_never_both_take_it(prefix, endpoint,
                                                       monkeypatch):
    # #72.1: with a slow link to the store, two jobs both held the lease
    # (write, wait, read back) and both wrote ckpt-31. The store's
    # conditional writes decide: of jobs racing for a free lease, or for a
    # stale one, exactly one takes it, in every interleaving tried.
    import random

    from keras_distribute.checkpoint.storage import conditional_writes

    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    monkeypatch.setattr(remote_lease, "STALE_AFTER_S", 2.0)
    jitter = random.Random(7)
    with s3_server.FlakyProxy(endpoint, delay_s=0.03) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        object_store.forget_stores()
        try:
            store = object_store.store_for(prefix)
            assert conditional_writes.honoured(store, prefix)
            stale = prefix + "/stale"
            store.write_bytes(stale + "/.keras_distribute-lease",
                              _lease_of("dead-job"))
            time.sleep(2.5)
            for round_number in range(6):
                directory = (stale if round_number == 5
                             else f"{prefix}/r{round_number}")
                key = directory + "/.keras_distribute-lease"
                won, refused = [], []

                def contend(job, directory=directory, key=key,
                            won=won, refused=refused):
                    time.sleep(jitter.random() * 0.05)
                    record = {"job": job, "host": job, "pid": 1,
                              "beat": time.time(), "write": job + "-w"}
                    try:
                        remote_lease.take_conditionally(store, directory,
                                                        key, record)
                        won.append(job)
                    except kd.checkpoint.DirectoryInUseError:
                        refused.append(job)

                threads = [threading.Thread(target=contend, args=(f"j{i}",))
                           for i in range(3)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(60)
                assert len(won) == 1 and len(refused) == 2, (won, refused)
                holder = json.loads(store.read_bytes(key, 1 << 16))
                assert holder["job"] == won[0]
        finally:
            object_store.forget_stores()


def test_a_job_that_lost_its_lease_commits_nothing(prefix, monkeypatch):
    # #72.1: a holder that froze past its lease's expiry and resumed wrote
    # its heartbeat over the new holder's lease, and both jobs then wrote
    # the same checkpoint names into one prefix. The renewal is
    # conditional: the resumed job finds the lease changed, stops beating
    # and, at its next save, commits nothing (fencing) and says so.
    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    monkeypatch.setattr(remote_checkpoints, "HEARTBEAT_S", 0.2)
    store = object_store.store_for(prefix)
    key = prefix + "/.keras_distribute-lease"
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
    first = manager.save()
    # Another job took the directory over (as its take does once this
    # job's heartbeat is stale): a new version of the lease.
    theirs = _lease_of("the-other-job", host="node-9")
    store.write_bytes(key, theirs)
    time.sleep(1.0)  # several of this job's heartbeats
    assert store.read_bytes(key, 1 << 16) == theirs  # not written over
    with pytest.raises(kd.checkpoint.DirectoryInUseError,
                       match="no longer holds the lease.*node-9.*Nothing "
                       "more is committed"):
        manager.save()
    assert kd.checkpoint.checkpoints_in(prefix) == [first]
    assert not [n for n in store.children(first) if n.startswith("g-")][1:]
    manager.close()
    assert store.read_bytes(key, 1 << 16) == theirs  # not deleted either


@pytest.mark.parametrize("conditions", ["honoured", "ignored"])
@pytest.mark.parametrize("content", [b"my notes", b'{"job": 1}',
                                     b'{"job": "x", "host": "h"}'],
                         ids=["text", "json", "partial"])
def test_an_object_at_the_lease_key_that_kd_did_not_write_is_kept(
        prefix, endpoint, monkeypatch, conditions, content):
    # #72.3: a user's object at the lease's key was overwritten (and then
    # deleted at close). kd writes and deletes only what it created: the
    # directory is refused, the object left as it was.
    from keras_distribute.checkpoint.storage import conditional_writes

    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    monkeypatch.setattr(remote_lease, "STALE_AFTER_S", 0.0)
    dropped = ("If-None-Match", "If-Match") if conditions == "ignored" else ()
    with s3_server.FlakyProxy(endpoint, drop_headers=dropped) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        object_store.forget_stores()
        try:
            store = object_store.store_for(prefix)
            assert conditional_writes.honoured(store, prefix) == (
                conditions == "honoured")
            key = prefix + "/.keras_distribute-lease"
            store.write_bytes(key, content)
            checkpoint = kd.checkpoint.ShardedCheckpoint(model=_model())
            with pytest.raises(kd.checkpoint.DirectoryInUseError,
                               match="holds an object keras_distribute did "
                               "not write.*never overwrites or deletes"):
                kd.checkpoint.CheckpointManager(checkpoint, prefix)
            assert store.read_bytes(key, 1 << 16) == content
            assert _objects(prefix) == [".keras_distribute-lease"]
        finally:
            object_store.forget_stores()


def test_a_store_that_ignores_conditions_still_keeps_one_job(
        prefix, endpoint, monkeypatch):
    # Where the store ignores If-None-Match / If-Match (some S3-API
    # servers; GCS through gcsfs), the lease is written and read back, and
    # a renewal that finds another job's lease stops instead of writing
    # over it.
    from keras_distribute.checkpoint.storage import conditional_writes

    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    # (no beat during the test: without conditions a beat's read and its
    # write leave a window another job's write can fall into - documented;
    # the renewal before the commit is what is tested here)
    monkeypatch.setattr(remote_checkpoints, "HEARTBEAT_S", 600.0)
    with s3_server.FlakyProxy(endpoint, drop_headers=(
            "If-None-Match", "If-Match")) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        object_store.forget_stores()
        try:
            store = object_store.store_for(prefix)
            assert not conditional_writes.honoured(store, prefix)
            key = prefix + "/.keras_distribute-lease"
            store.write_bytes(key, _lease_of("another-job"))
            checkpoint = kd.checkpoint.ShardedCheckpoint(model=_model())
            with pytest.raises(kd.checkpoint.DirectoryInUseError,
                               match="node-7.*own directory"):
                kd.checkpoint.CheckpointManager(checkpoint, prefix + "")
            store.remove([key])
            manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
            try:
                first = manager.save()
                theirs = _lease_of("the-other-job", host="node-9")
                store.write_bytes(key, theirs)
                with pytest.raises(kd.checkpoint.DirectoryInUseError,
                                   match="node-9"):
                    manager.save()
                assert kd.checkpoint.checkpoints_in(prefix) == [first]
                assert store.read_bytes(key, 1 << 16) == theirs
            finally:
                manager.close()
            assert store.read_bytes(key, 1 << 16) == theirs
        finally:
            object_store.forget_stores()


def _tamper(path, change):
    store = object_store.store_for(path)
    index = json.loads(store.read_bytes(path + "/index.json", 1 << 24))
    change(index)
    store.write_bytes(path + "/index.json", json.dumps(index).encode())


@pytest.mark.parametrize("case", [
    "file_size", "generation_outside", "unlisted_file", "file_name",
    "shard_replaced", "dense_index", "no_index", "file_too_large",
], ids=lambda c: c)
def test_a_hostile_object_layout_is_refused_and_restores_nothing(prefix,
                                                                 case):
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    path = checkpoint.write(prefix + "/ckpt")
    store = object_store.store_for(path)
    generation = _objects(path)[0].split("/")[0]
    # A secret beside the checkpoint: no tampering makes kd read it.
    store.write_bytes(prefix + "/secret.h5", b"x" * 64)
    files = "object_store", "files"
    if case == "file_size":
        _tamper(path, lambda i: i[files[0]][files[1]].update(
            {"shards-00000.h5": 10}))
        match = "records 10"
    elif case == "generation_outside":
        _tamper(path, lambda i: i[files[0]].update(generation="../.."))
        match = "names no generation"
    elif case == "unlisted_file":
        _tamper(path, lambda i: i[files[0]].update(files={}))
        match = "does not list"
    elif case == "file_name":
        _tamper(path, lambda i: i[files[0]][files[1]].update(
            {"../secret.h5": 64}))
        match = "lists its files wrongly"
    elif case == "shard_replaced":
        store.write_bytes(f"{path}/{generation}/shards-00000.h5",
                          b"\0" * (1 << 20))
        match = "changed or replaced"
    elif case == "file_too_large":
        # An object the pieces cannot justify is not downloaded, even when
        # the index claims its size.
        store.write_bytes(f"{path}/{generation}/shards-00000.h5",
                          b"\0" * (4 << 20))
        _tamper(path, lambda i: i[files[0]][files[1]].update(
            {"shards-00000.h5": 4 << 20}))
        match = "more than the"
    elif case == "dense_index":
        store.write_bytes(path + "/index.json", b"[" * 100000)
        match = "dense|corrupt"
    else:
        store.remove([path + "/index.json"])
        match = "not a committed"
    before = _weights(model)[:4]
    _scramble(model)
    scrambled = _weights(model)[:4]
    with pytest.raises(CheckpointError, match=match):
        checkpoint.read(path)
    for a, b in zip(scrambled, _weights(model)[:4]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(before[0], scrambled[0])


@pytest.mark.parametrize("path", [
    "s3://b/run", "s3://bucket/../run", "s3://bucket//run", "s3://Bucket/r",
    "gs://bucket/a/./b",
], ids=["short_bucket", "dot_dot", "empty_segment", "uppercase",
        "dot_segment"])
def test_a_malformed_bucket_path_is_refused(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=_model())
    with pytest.raises(ValueError, match="not a usable.*Received: bucket="):
        checkpoint.write(path)
    assert os.listdir(tmp_path) == []


_KILLED_PROGRAM = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import keras
    import keras_distribute as kd
    from keras_distribute.checkpoint.storage import object_store

    from keras_distribute.checkpoint.storage import streamed_upload

    prefix, out, where = sys.argv[1], sys.argv[2], sys.argv[3]
    inputs, units = {"part": (5, 64), "multipart": (1000, 3000)}[where]
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((inputs,)),
                              keras.layers.Dense(units)])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
    manager.save()
    np.save(out, np.array(model.layers[0].kernel))
    model.layers[0].kernel.assign(np.zeros((inputs, units), "float32"))
    write = object_store.Store.write_bytes

    def killed_at_the_part(self, key, data):
        if key.endswith("part-00000.json"):  # the shards are uploaded
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, key, data)

    object_store.Store.write_bytes = killed_at_the_part
    if where == "multipart":  # killed in the shard's open multipart upload
        streamed_upload.PART_BYTES = 5 << 20
        fs = object_store.store_for(prefix).fs
        call_s3 = fs.call_s3

        def killed_at_part_2(method, *args, **kwargs):
            if method == "upload_part" and kwargs["PartNumber"] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return call_s3(method, *args, **kwargs)

        fs.call_s3 = killed_at_part_2
    manager.save()
""")


def _open_uploads(prefix):
    fs = _fs()
    listed = fs.call_s3("list_multipart_uploads", Bucket=BUCKET,
                        Prefix=prefix.split("/", 3)[3] + "/")
    return listed.get("Uploads") or []


@pytest.mark.parametrize("where", ["part", "multipart"])
def test_a_save_killed_mid_upload_is_never_read_and_is_cleaned(
        prefix, endpoint, tmp_path, monkeypatch, where):
    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: its kill -9 "
                    "test runs on JAX (the parity tests on every backend)")
    program = tmp_path / "killed.py"
    program.write_text(_KILLED_PROGRAM)
    out = str(tmp_path / "saved.npy")
    done = subprocess.run(
        [sys.executable, str(program), prefix, out, where], timeout=180,
        env=dict(os.environ, KERAS_BACKEND="jax"), capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    # Killed after its shards were uploaded, or in the middle of their
    # multipart upload (left open: no object yet): uncommitted either way;
    # readers see the first checkpoint only.
    second = [n for n in _objects(prefix + "/ckpt-2")]
    if where == "part":
        assert any(n.endswith("shards-00000.h5") for n in second), second
    else:
        assert [n.split("/")[-1] for n in second] == ["generation.json"]
        assert len(_open_uploads(prefix + "/ckpt-2")) == 1
    assert "index.json" not in second
    assert kd.checkpoint.latest_checkpoint(prefix) == prefix + "/ckpt-1"
    inputs, units = {"part": (5, 64), "multipart": (1000, 3000)}[where]
    # A new run of the same owner: the dead job's lease and unfinished save
    # (their heartbeats stopped) are taken over and removed; it resumes
    # from the first checkpoint.
    monkeypatch.setattr(remote_lease, "STALE_AFTER_S", 0.0)
    monkeypatch.setattr(remote_checkpoints, "STALE_AFTER_S", 0.0)
    # An unfinished save of another owner, also dead: not this manager's to
    # remove.
    theirs = prefix + "/ckpt-7/g-" + "b" * 32
    store = object_store.store_for(prefix)
    store.write_bytes(theirs + "/generation.json", json.dumps(
        {"job": "gone", "owner": "someone-else", "beat": 0}).encode())
    store.write_bytes(theirs + "/shards-00000.h5", b"x")
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((inputs,)),
                              keras.layers.Dense(units)])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
    assert _objects(prefix + "/ckpt-2") == []
    assert _open_uploads(prefix + "/ckpt-2") == []  # its parts aborted
    assert manager.restore_or_initialize() == prefix + "/ckpt-1"
    np.testing.assert_array_equal(np.array(model.layers[0].kernel),
                                  np.load(out))
    assert _objects(prefix + "/ckpt-7") == [
        "g-" + "b" * 32 + "/generation.json",
        "g-" + "b" * 32 + "/shards-00000.h5"]
    assert manager.save() == prefix + "/ckpt-8"
    manager.close()


def test_a_corrupt_backup_in_s3_is_moved_aside_and_the_older_one_used(
        prefix):
    # As on disk (test_checkpoint_callbacks): the newest backup's largest
    # piece has a flipped byte; BackupAndRestore resumes from the older
    # one and moves the corrupt one to `<name>.corrupt` (copied by the
    # store, then removed), so a later run does not meet it again.
    import test_checkpoint_callbacks as on_disk

    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    backup_dir = prefix + "/backup"
    model = on_disk.make_model()
    reference = on_disk.fit(model, [])
    expected = on_disk.state(model)
    model = on_disk.make_model()
    with pytest.raises(on_disk.Interrupt):
        on_disk.fit(model, [kd.callbacks.BackupAndRestore(backup_dir),
                            on_disk.InterruptAt(15)])
    newest = kd.checkpoint.latest_checkpoint(backup_dir)
    store = object_store.store_for(newest)
    index = json.loads(store.read_bytes(newest + "/index.json", 1 << 20))
    piece = max((p for r in index["variables"].values() for p in r["pieces"]
                 if "offset" in p),
                key=lambda p: np.prod([hi - lo for lo, hi in p["slice"]]))
    shard = f"{newest}/{index['object_store']['generation']}/{piece['file']}"
    data = bytearray(_fs().cat_file(shard))
    data[piece["offset"] + 3] ^= 0x10
    store.write_bytes(shard, bytes(data))
    model, seen = on_disk.make_model(), []
    with pytest.warns(UserWarning, match="resuming from the older backup"):
        resumed = on_disk.fit(model, [
            kd.callbacks.BackupAndRestore(backup_dir),
            keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda *_: seen.append(
                    sorted(store.children(backup_dir))))])
    name = newest.rpartition("/")[2]
    assert [n for n in seen[0] if not n.startswith(".")] == [
        "backup-1", name + ".corrupt"]
    assert len(resumed.history["loss"]) == 2  # epochs 1 and 2 again
    np.testing.assert_allclose(resumed.history["loss"],
                               reference.history["loss"][1:], rtol=1e-6)
    for a, b in zip(expected, on_disk.state(model)):
        np.testing.assert_array_equal(a, b)
    # The moved copy is the corrupt backup, byte for byte; nothing else of
    # the run is left.
    moved = f"{backup_dir}/{name}.corrupt"
    assert _fs().cat_file(moved + shard[len(newest):]) == bytes(data)
    assert [n for n in store.children(backup_dir)
            if not n.startswith(".")] == [name + ".corrupt"]


def test_every_checkpoint_entry_point_takes_an_s3_path(prefix, tmp_path,
                                                       monkeypatch):
    # The entry points the refusal of other schemes lists
    # (test_checkpoint_security.py) take s3://, and make nothing locally.
    monkeypatch.chdir(tmp_path)
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    path = checkpoint.write(prefix + "/w")
    checkpoint.read(path).assert_consumed()
    assert checkpoint.save(prefix + "/s") == prefix + "/s-1"
    checkpoint.restore(prefix + "/s-1").assert_consumed()
    assert kd.checkpoint.latest_checkpoint(prefix) == prefix + "/s-1"
    assert kd.checkpoint.checkpoints_in(prefix) == [prefix + "/s-1"]
    assert kd.checkpoint.read_metadata(path)["save_counter"] == 0
    assert len(kd.checkpoint.list_variables(path)) == 4
    assert kd.checkpoint.load_checkpoint(path).has_tensor("model/0")
    for callback in (kd.callbacks.ShardedCheckpoint(prefix + "/cb"),
                     kd.callbacks.BackupAndRestore(prefix + "/backup"),
                     kd.callbacks.PreemptionCheckpoint(prefix + "/pre")):
        assert callback.directory.startswith(prefix)
    handler = kd.experimental.PreemptionCheckpointHandler(
        kd.get_strategy().cluster_resolver, checkpoint, prefix + "/handler")
    assert object_store.store_for(prefix).exists(
        prefix + "/handler/.keras_distribute-lease")
    del handler
    assert os.listdir(tmp_path) == []


def test_a_large_shard_goes_up_in_parts_from_memory_bit_for_bit(
        prefix, tmp_path, monkeypatch):
    # Parts of 5 MiB (S3's least): a 12 MB model's shard goes up as a
    # multipart upload assembled from the layout file and the arrays;
    # the object is the file a local save writes, byte for byte. A part
    # that fails aborts the upload; the earlier checkpoint stays.
    from keras_distribute.checkpoint.storage import streamed_upload

    monkeypatch.setattr(streamed_upload, "PART_BYTES", 5 << 20)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((1000,)), keras.layers.Dense(3000)])
    saved = [np.array(w) for w in model.weights]
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    fs, calls = _fs(), []
    call_s3 = fs.call_s3

    def recorded(method, *args, **kwargs):
        calls.append((method, kwargs.get("PartNumber")))
        return call_s3(method, *args, **kwargs)

    monkeypatch.setattr(fs, "call_s3", recorded)
    path = checkpoint.write(prefix + "/ckpt")
    assert sorted(n for m, n in calls if m == "upload_part") == [1, 2, 3]
    local = checkpoint.write(str(tmp_path / "local"))
    shard = next(n for n in _objects(path) if n.endswith(".h5"))
    with open(os.path.join(local, "shards-00000.h5"), "rb") as f:
        assert fs.cat_file(f"{path}/{shard}") == f.read()

    def failing(method, *args, **kwargs):
        if method == "upload_part" and kwargs["PartNumber"] == 2:
            raise PermissionError("part 2 refused (test)")
        return call_s3(method, *args, **kwargs)

    monkeypatch.setattr(fs, "call_s3", failing)
    model.layers[0].kernel.assign(np.zeros((1000, 3000), "float32"))
    with pytest.raises(PermissionError, match="part 2 refused"):
        checkpoint.write(prefix + "/ckpt")
    monkeypatch.setattr(fs, "call_s3", call_s3)
    bucket = prefix.split("/")[2]
    assert not call_s3("list_multipart_uploads", Bucket=bucket,
                       Prefix=path.split("/", 3)[3]).get("Uploads")
    assert [n for n in _objects(path) if n.endswith(".h5")] == [shard]
    # Read back in ranges of 5 MiB, straight into the kernel's memory.
    from keras_distribute.checkpoint.storage import remote_ranges

    monkeypatch.setattr(remote_ranges, "RANGE_CHUNK_BYTES", 5 << 20)
    ranges = []
    read_range = object_store.Store.read_range

    def recorded_range(self, key, start, stop):
        ranges.append(stop - start)
        return read_range(self, key, start, stop)

    monkeypatch.setattr(object_store.Store, "read_range", recorded_range)
    checkpoint.read(path).assert_consumed()
    for a, b in zip(saved, model.weights):
        np.testing.assert_array_equal(a, np.array(b))
    assert sorted(ranges)[-2:] == [6_000_000, 6_000_000]  # 12 MB: 2 ranges


def test_large_pieces_read_one_after_another_are_read_ahead(prefix,
                                                           monkeypatch):
    # Pieces of at least RANGE_CHUNK_BYTES (here 256 KiB) go straight into
    # memory; once two follow each other in their file, the next ones are
    # fetched ahead in the background. The values are the saved ones.
    import threading

    from keras_distribute.checkpoint.storage import remote_ranges

    monkeypatch.setattr(remote_ranges, "RANGE_CHUNK_BYTES", 256 << 10)
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((256,))] + [
        keras.layers.Dense(256, name=f"d{i}") for i in range(6)])
    saved = [np.array(w) for w in model.weights]
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    path = checkpoint.write(prefix + "/ckpt")
    threads = []
    read_range = object_store.Store.read_range

    def recorded(self, key, start, stop):
        threads.append(threading.current_thread().name)
        return read_range(self, key, start, stop)

    monkeypatch.setattr(object_store.Store, "read_range", recorded)
    for variable in model.weights:
        variable.assign(np.zeros(variable.shape, variable.dtype))
    checkpoint.read(path).assert_consumed()
    for a, b in zip(saved, model.weights):
        np.testing.assert_array_equal(a, np.array(b))
    assert any(t.startswith("kd-readahead") for t in threads), threads
    assert not [t for t in threading.enumerate()
                if t.name.startswith("kd-readahead")]  # released
    # An index that puts the last large piece past its file's end: the
    # restore is refused, and no range outside the file is ever asked for
    # (not even ahead).
    monkeypatch.setattr(object_store.Store, "read_range", read_range)
    path = checkpoint.write(prefix + "/crafted")
    index = json.loads(object_store.store_for(path).read_bytes(
        path + "/index.json", 1 << 20))
    (size,) = index["object_store"]["files"].values()
    last = max((p for r in index["variables"].values()
                for p in r["pieces"] if len(p["slice"]) == 2),  # kernels
               key=lambda p: p["offset"])
    last["offset"] = size + (1 << 20)
    object_store.store_for(path).write_bytes(path + "/index.json",
                                             json.dumps(index).encode())
    ranges = []

    def bounded(self, key, start, stop):
        ranges.append(stop)
        return read_range(self, key, start, stop)

    monkeypatch.setattr(object_store.Store, "read_range", bounded)
    with pytest.raises(CheckpointError, match="beyond the end of the file"):
        checkpoint.read(path)
    assert ranges and max(ranges) <= size


def test_a_reader_reads_only_the_byte_ranges_it_restores(prefix, tmp_path,
                                                        monkeypatch):
    # Two processes' files, written and committed through the protocol's
    # own steps (each process uploads its file and part; the chief
    # commits); a reader of one variable reads only the blocks (here of 64
    # bytes) holding its piece, from the file holding it, into memory.
    from keras_distribute.checkpoint.storage import remote_ranges
    from keras_distribute.checkpoint.storage import remote_writing

    path = prefix + "/two"
    generation, heartbeat = remote_writing.prepare(path, None)
    arrays = {"a": np.arange(6.0), "b": np.ones(4)}
    try:
        for process_id, key in enumerate(sorted(arrays)):
            staging = tmp_path / f"process-{process_id}"
            staging.mkdir()
            array = arrays[key]
            remote_writing.upload_process_shards(
                path, generation, str(staging), {key: (
                    array.shape, "float64", [None],
                    [(((0, len(array)),), array)], key)}, process_id)
        remote_writing.commit(path, generation, 2, {"backend": "none"}, 60)
    finally:
        heartbeat.stop()
    assert sorted(n.split("/")[-1] for n in _objects(path)) == [
        "generation.json", "index.json", "shards-00000.h5", "shards-00001.h5"]
    monkeypatch.setattr(remote_ranges, "RANGE_BLOCK_BYTES", 64)
    ranges = []
    read_range = object_store.Store.read_range

    def recorded(self, key, start, stop):
        ranges.append((key.rpartition("/")[2], start, stop))
        return read_range(self, key, start, stop)

    monkeypatch.setattr(object_store.Store, "read_range", recorded)
    reader = kd.checkpoint.load_checkpoint(path)
    np.testing.assert_array_equal(reader.get_tensor("b"), arrays["b"])
    index = json.loads(object_store.store_for(path).read_bytes(
        path + "/index.json", 1 << 20))
    (piece,) = index["variables"]["b"]["pieces"]
    assert {name for name, _, _ in ranges} == {"shards-00001.h5"}
    read = sorted((start, stop) for _, start, stop in ranges)
    assert read[0][0] <= piece["offset"] < piece["offset"] + 32 <= read[-1][1]
    assert sum(stop - start for start, stop in read) <= 128  # 32 B: 2 blocks
    assert index["object_store"]["files"]["shards-00001.h5"] > 1000
    np.testing.assert_array_equal(reader.get_tensor("a"), arrays["a"])
    assert {name for name, _, _ in ranges} == {"shards-00000.h5",
                                               "shards-00001.h5"}
    assert os.listdir(reader.path) == ["index.json"]  # nothing downloaded


def test_checkpoint_numbers_of_any_size_order_exactly_on_s3(prefix):
    # A nanosecond timestamp as the step (19 digits, past int64's 18):
    # a new manager sees it, resumes the latest, and numbers after it.
    timestamp = 1796656304171905536
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix,
                                              max_to_keep=5)
    saved = [manager.save(checkpoint_number=timestamp - 5),
             manager.save(checkpoint_number=timestamp), manager.save()]
    assert saved[-1] == f"{prefix}/ckpt-{timestamp + 1}"
    manager.close()
    again = kd.checkpoint.CheckpointManager(checkpoint, prefix,
                                            max_to_keep=5)
    assert again.checkpoints == saved
    assert again.latest_checkpoint == saved[-1]
    assert kd.checkpoint.checkpoints_in(prefix) == saved
    assert again.save() == f"{prefix}/ckpt-{timestamp + 2}"
    again.close()


def test_a_store_that_fails_mid_resume_is_named_and_the_backup_kept(
        prefix, monkeypatch):
    # #72.4b: a store resetting ranged reads during a BackupAndRestore
    # resume was taken for corruption: the intact backup was moved aside
    # as `.corrupt` and the job trained from epoch 0. A network failure
    # that outlasts the retries is raised as what it is, and nothing of
    # the backups is moved; once the store answers, the resume works.
    import test_checkpoint_callbacks as on_disk

    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    backup_dir = prefix + "/backup"
    model = on_disk.make_model()
    reference = on_disk.fit(model, [])
    model = on_disk.make_model()
    with pytest.raises(on_disk.Interrupt):
        on_disk.fit(model, [kd.callbacks.BackupAndRestore(backup_dir),
                            on_disk.InterruptAt(15)])
    store = object_store.store_for(backup_dir)
    before = sorted(store.files_under(backup_dir))
    original = store.fs.cat_file

    def reset_shard_reads(key, *args, **kwargs):
        if key.endswith(".h5"):  # (the index reads; the shards' ranges not)
            raise ConnectionResetError(104, "Connection reset by peer")
        return original(key, *args, **kwargs)

    monkeypatch.setattr(object_store, "_BACKOFF_S", 0.01)
    monkeypatch.setattr(store.fs, "cat_file", reset_shard_reads)
    with pytest.raises(kd.checkpoint.CheckpointStorageError,
                       match=r"Reading s3://.*\.h5 failed \(4 tries within.*"
                       "Connection reset by peer.*store did not answer"):
        on_disk.fit(on_disk.make_model(),
                    [kd.callbacks.BackupAndRestore(backup_dir)])
    monkeypatch.setattr(store.fs, "cat_file", original)
    assert sorted(store.files_under(backup_dir)) == before  # all kept
    assert not [n for n in store.children(backup_dir) if "corrupt" in n]
    resumed = on_disk.fit(on_disk.make_model(),
                          [kd.callbacks.BackupAndRestore(backup_dir)])
    assert len(resumed.history["loss"]) == 1  # only epoch 2 was left
    np.testing.assert_allclose(resumed.history["loss"],
                               reference.history["loss"][2:], rtol=1e-6)


def test_a_refusing_store_is_named_with_the_url_and_what_to_check(
        prefix, monkeypatch):
    # #72.5: a missing bucket or refused credentials gave the store's own
    # words ("The specified bucket does not exist", botocore's "The request
    # signature we calculated does not match") without the URL, the
    # operation or the fix. The error keeps its type.
    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")
    model = _model()
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    missing = "s3://kd-no-such-bucket/run"
    with pytest.raises(FileNotFoundError, match="s3://kd-no-such-bucket/run.*"
                       "check the bucket's name, that it exists"):
        kd.checkpoint.CheckpointManager(checkpoint, missing)
    with pytest.raises(FileNotFoundError, match="Writing s3://kd-no-such-"
                       "bucket/run/c.*check the bucket's name"):
        checkpoint.write(missing + "/c")
    path = checkpoint.write(prefix + "/c")
    store = object_store.store_for(prefix)

    def refused(*args, **kwargs):  # (s3fs' translation of a bad signature)
        raise PermissionError("The request signature we calculated does "
                              "not match the signature you provided.")

    monkeypatch.setattr(store.fs, "cat_file", refused)
    with pytest.raises(PermissionError, match=f"Reading {path}/index.json: "
                       "The request signature .* check the credentials"):
        checkpoint.read(path)


def test_the_dry_run_proves_it_can_write_and_delete_in_the_store(
        prefix, monkeypatch):
    # #72.6: a listing alone passed a missing bucket and a read-only user.
    # The check writes, reads and deletes a probe object of its own.
    if keras.backend.backend() != "jax":
        pytest.skip("the storage layer imports no framework: tested on JAX")

    def make_model():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])

    def findings(directory):
        verdict = kd.layouts.dry_run(make_model,
                                     checkpoint_directory=directory)
        return [f for f in verdict.findings if f.kind == "checkpoint"]

    assert findings(prefix) == []
    assert _objects(prefix) == []  # the probe was deleted, nothing left
    (missing,) = findings("s3://kd-no-such-bucket/run")
    assert "cannot list, write and delete" in missing.message
    assert "check the bucket's name" in missing.message
    store = object_store.store_for(prefix)

    def read_only(*args, **kwargs):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(store.fs, "pipe_file", read_only)
    (refused,) = findings(prefix)
    assert "PermissionError" in refused.message
    assert "check the credentials" in refused.message


def test_a_lease_is_judged_by_the_stores_clock_not_its_writers(
        prefix, monkeypatch):
    # #72.2: liveness compared the holder's clock with this host's: a dead
    # job whose host clock ran 10 minutes ahead kept its lease while its
    # last beat lay "in the future", and a live job whose clock ran behind
    # lost it. The store's own stamps decide.
    import time

    store = object_store.store_for(prefix)
    lease_key = prefix + "/.keras_distribute-lease"
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=_model())
    monkeypatch.setattr(remote_lease, "STALE_AFTER_S", 3.0)
    # A live job, its clock 10 minutes behind: refused.
    store.write_bytes(lease_key, json.dumps({
        "job": "behind", "host": "node-8", "pid": 13,
        "beat": time.time() - 600}).encode())
    with pytest.raises(kd.checkpoint.DirectoryInUseError, match="node-8"):
        kd.checkpoint.CheckpointManager(checkpoint, prefix)
    # A dead job, its clock 10 minutes ahead, silent for longer than the
    # staleness bound by the store's clock: taken over.
    store.write_bytes(lease_key, json.dumps({
        "job": "ahead", "host": "node-9", "pid": 14,
        "beat": time.time() + 600}).encode())
    time.sleep(4.5)
    manager = kd.checkpoint.CheckpointManager(checkpoint, prefix)
    assert json.loads(store.read_bytes(lease_key, 1 << 16))["job"] != "ahead"
    manager.close()
    # The probes that read the store's clock are gone.
    assert not [n for n in store.children(prefix) if "clock" in n]
