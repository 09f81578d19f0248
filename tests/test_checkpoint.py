"""Sharded checkpoints: bit-exact round trips, resharding, cross-backend,
atomic writes, corruption detection."""

import json
import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_distribute as kd

ckpt = kd.checkpoint


def make_model(name="net"):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", name="hidden"),
        keras.layers.Dense(4, name="out"),
    ], name=name)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def trained_model():
    model = make_model()
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(32, 8)), rng.normal(size=(32, 4)),
              batch_size=8, epochs=2, verbose=0)
    return model


def state(model):
    return [np.asarray(keras.ops.convert_to_numpy(v.value))
            for v in model.weights + model.optimizer.variables]


@pytest.mark.parametrize("block_bytes", [None, 40])
def test_round_trip_is_bit_exact_with_optimizer_state(tmp_path, monkeypatch,
                                                      block_bytes):
    if block_bytes is not None:  # written and read in blocks by threads
        monkeypatch.setattr(ckpt.storage.parallel_io, "BLOCK_BYTES",
                            block_bytes)
    model = trained_model()
    checkpoint = ckpt.ShardedCheckpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.write(str(tmp_path / "c"))
    fresh = make_model()
    fresh.optimizer.build(fresh.trainable_variables)
    status = ckpt.ShardedCheckpoint(model=fresh, optimizer=fresh.optimizer
                                    ).read(path)
    status.assert_consumed()
    for a, b in zip(state(model), state(fresh)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    index = json.load(open(os.path.join(path, "index.json")))
    assert index["format_version"] == 2 and index["backend"] == BACKEND


def test_save_numbering_restore_and_latest(tmp_path):
    model = trained_model()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    first = checkpoint.save(str(tmp_path / "run"))
    second = checkpoint.save(str(tmp_path / "run"))
    assert first.endswith("run-1") and second.endswith("run-2")
    os.makedirs(tmp_path / "run-3.tmp-deadbeef")  # an unfinished save
    assert ckpt.latest_checkpoint(str(tmp_path)) == second
    assert ckpt.latest_checkpoint(str(tmp_path / "nothing")) is None
    other = ckpt.ShardedCheckpoint(model=make_model())
    other.restore(second).assert_consumed()
    assert other.save_counter == 2


def test_partial_matches_are_reported(tmp_path):
    model = trained_model()
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    bigger = ckpt.ShardedCheckpoint(model=make_model(),
                                    extra=keras.Variable(np.ones(3)))
    status = bigger.read(path)
    with pytest.raises(AssertionError, match="objects only: \\['extra'\\]"):
        status.assert_consumed()
    status.expect_partial()


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = trained_model()
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    path = checkpoint.write(str(tmp_path / "c"))
    before = open(os.path.join(path, "index.json")).read()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.storage.writing, "_write_shards", broken)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.write(path)
    assert open(os.path.join(path, "index.json")).read() == before
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary left over


def test_commit_never_reads_a_part_still_being_written(tmp_path,
                                                     monkeypatch):
    # Regression (seen in CI, 2 TF workers): the chief polled for the other
    # process's part by name and read it while it was still empty.
    import threading

    fmt = ckpt.storage.writing
    path = str(tmp_path / "c")
    temporary = fmt.prepare(path)
    piece = ((2,), "float32", (None,), [(((0, 2),), np.ones(2, "f4"))], "w")
    fmt.write_process_shards(temporary, {"w": piece}, 0)
    outcome = []

    def chief():
        try:
            fmt.commit(path, 2, {"backend": BACKEND}, timeout_s=10)
            outcome.append("committed")
        except Exception as error:  # reported by the assertion below
            outcome.append(error)

    committing = threading.Thread(target=chief)
    real_dump, real_dumps = fmt.json.dump, fmt.json.dumps

    def while_serialising(serialise):
        def slowly(*args, **kwargs):
            if not committing.is_alive() and not outcome:
                committing.start()  # the chief polls while process 1 writes
                time.sleep(0.3)
            return serialise(*args, **kwargs)
        return slowly

    monkeypatch.setattr(fmt.json, "dump", while_serialising(real_dump))
    monkeypatch.setattr(fmt.json, "dumps", while_serialising(real_dumps))
    fmt.write_process_shards(temporary, {"v": piece}, 1)
    monkeypatch.undo()
    committing.join(15)
    assert outcome == ["committed"]
    assert sorted(os.listdir(path)) == ["index.json", "shards-00000.h5",
                                        "shards-00001.h5"]
    assert ckpt.list_variables(path) == [("v", (2,)), ("w", (2,))]


# None: each piece moved whole; 40: written and read in blocks of 40 bytes by
# a pool of threads (the path of pieces over 1 MiB).
@pytest.mark.parametrize("block_bytes", [None, 40])
def test_corrupt_truncated_and_mismatched_checkpoints(tmp_path, monkeypatch,
                                                      block_bytes):
    if block_bytes is not None:
        monkeypatch.setattr(ckpt.storage.parallel_io, "BLOCK_BYTES",
                            block_bytes)
    model = trained_model()
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    shard = os.path.join(path, "shards-00000.h5")
    data = bytearray(open(shard, "rb").read())
    index = json.load(open(os.path.join(path, "index.json")))
    # Flip one float of the first kernel inside the file.
    saved = np.asarray(keras.ops.convert_to_numpy(model.weights[0].value))
    needle = saved.tobytes()[:16]
    at = bytes(data).find(needle)
    assert at >= 0
    data[at] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="does not match its "
                       "checksum"):
        ckpt.ShardedCheckpoint(model=make_model()).read(path)
    data[at] ^= 0xFF  # intact again, then cut short
    open(shard, "wb").write(bytes(data[:len(data) // 3]))
    with pytest.raises(ckpt.CheckpointError, match="beyond the end of the "
                       "file .* truncated"):
        ckpt.ShardedCheckpoint(model=make_model()).read(path)
    os.remove(os.path.join(path, "index.json"))
    with pytest.raises(ckpt.CheckpointError, match="not a committed"):
        ckpt.ShardedCheckpoint(model=make_model()).read(path)
    assert index["variables"]

    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "d"))
    wider = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(32, name="hidden"),
                              keras.layers.Dense(4, name="out")], name="net")
    with pytest.raises(ckpt.CheckpointError, match="has shape \\(8, 16\\) but "
                       "the variable 'net/hidden/kernel' has \\(8, 32\\)"):
        ckpt.ShardedCheckpoint(model=wider).read(path)


def test_bfloat16_round_trip(tmp_path):
    variable = keras.Variable(np.arange(6.0).reshape(2, 3), dtype="bfloat16")
    path = ckpt.ShardedCheckpoint(v=variable).write(str(tmp_path / "c"))
    target = keras.Variable(np.zeros((2, 3)), dtype="bfloat16")
    ckpt.ShardedCheckpoint(v=target).read(path).assert_consumed()
    assert np.array_equal(keras.ops.convert_to_numpy(target.value),
                          keras.ops.convert_to_numpy(variable.value))


@pytest.mark.skipif(BACKEND != "jax", reason="sharded layouts: JAX")
def test_resharding_between_meshes_is_bit_exact(tmp_path):
    import jax
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    layout_map = LayoutMap(DeviceMesh((4, 2), ["batch", "model"],
                                      jax.devices()))
    layout_map[".*hidden/kernel"] = (None, "model")
    sharded = kd.MirroredStrategy(layout_map=layout_map)
    with sharded.scope():
        model = trained_model()
    kernel = model.get_layer("hidden").kernel
    assert {s.data.shape for s in kernel.value.addressable_shards} == {(8, 8)}
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    index = json.load(open(os.path.join(path, "index.json")))
    record = index["variables"]["model/0"]
    assert record["path"] == "net/hidden/kernel"
    assert record["layout"] == [None, "model"]
    assert len(record["pieces"]) == 2  # the two unique shards, once each
    expected = state(model)[:len(model.weights)]
    for strategy in (kd.MirroredStrategy(), kd.MirroredStrategy(
            ["CPU:0", "CPU:1"])):
        with strategy.scope():
            target = make_model()
        ckpt.ShardedCheckpoint(model=target).read(path).expect_partial()
        for a, b in zip(expected, state(target)):
            assert np.array_equal(a, b)
    # ... and back from replicated onto the sharded layout.
    with kd.MirroredStrategy().scope():
        replicated = trained_model()
    path = ckpt.ShardedCheckpoint(model=replicated).write(str(tmp_path / "r"))
    with sharded.scope():
        target = make_model()
    ckpt.ShardedCheckpoint(model=target).read(path).expect_partial()
    restored = target.get_layer("hidden").kernel.value
    assert {s.data.shape for s in restored.addressable_shards} == {(8, 8)}
    assert np.array_equal(np.asarray(restored), np.asarray(
        replicated.get_layer("hidden").kernel.value))


@pytest.mark.skipif(BACKEND != "jax", reason="written once, on JAX")
@pytest.mark.parametrize("other", ["tensorflow", "torch"])
def test_checkpoint_written_on_jax_restores_on_another_backend(tmp_path, other):
    model = trained_model()
    path = ckpt.ShardedCheckpoint(model=model).write(str(tmp_path / "c"))
    np.save(tmp_path / "expected.npy", np.concatenate(
        [w.ravel() for w in model.get_weights()]))
    script = textwrap.dedent(f"""
        import numpy as np, keras, keras_distribute as kd, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import make_model
        model = make_model()
        kd.checkpoint.ShardedCheckpoint(model=model).read({path!r}).assert_consumed()
        got = np.concatenate([w.ravel() for w in model.get_weights()])
        expected = np.load({str(tmp_path / 'expected.npy')!r})
        print("EQUAL" if np.array_equal(got, expected) else "DIFFERENT")
    """)
    env = dict(os.environ, KERAS_BACKEND=other)
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert "EQUAL" in done.stdout, done.stderr[-2000:]


def test_progress_line_per_save_and_restore(tmp_path, capsys, caplog,
                                            monkeypatch):
    model = trained_model()
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    checkpoint = ckpt.ShardedCheckpoint(model=model)
    loud = ckpt.CheckpointOptions(verbose=1)
    path = checkpoint.write(str(tmp_path / "c"), options=loud)
    ckpt.ShardedCheckpoint(model=make_model()).read(path, options=loud)
    saved, restored = capsys.readouterr().out.splitlines()
    megabytes = f"{nbytes / 1e6:,.1f} MB"
    assert saved.startswith(f"keras_distribute: saved {megabytes} {path} in ")
    assert restored.startswith(f"keras_distribute: restored {megabytes} ")
    assert saved.endswith(" MB/s") and restored.endswith(" MB/s")
    # "auto" (the default) speaks from 1 GiB a process; 0 never.
    monkeypatch.setattr(ckpt.progress, "AUTO_BYTES", nbytes + 1)
    checkpoint.write(path)
    ckpt.ShardedCheckpoint(model=make_model()).read(path)
    monkeypatch.setattr(ckpt.progress, "AUTO_BYTES", nbytes)
    checkpoint.write(path, options=ckpt.CheckpointOptions(verbose=0))
    assert capsys.readouterr().out == ""
    checkpoint.write(path)
    assert "saved" in capsys.readouterr().out
    # Keras' logging switch: to the logger instead of stdout.
    keras.config.disable_interactive_logging()
    try:
        with caplog.at_level("INFO", logger="keras_distribute"):
            checkpoint.write(path, options=loud)
    finally:
        keras.config.enable_interactive_logging()
    assert capsys.readouterr().out == ""
    assert "keras_distribute: saved" in caplog.text
    with pytest.raises(ValueError, match="Expected `verbose` to be 0"):
        ckpt.CheckpointOptions(verbose=2)


def test_replicated_variables_are_spread_over_the_writing_processes():
    from keras_distribute.checkpoint.objects.saved_objects import (
        balanced_writers,
    )

    mib = 1 << 20
    sizes = {"a": 8 * mib, "b": 4 * mib, "c": 4 * mib, "d": 2 * mib,
             "e": 2 * mib, "count": 8, "total": 4}
    # Largest first, each to the process with fewest bytes; small ones
    # (counters, metric totals) by process 0.
    assert balanced_writers(sizes, 2) == {
        "a": 0, "b": 1, "c": 1, "d": 0, "e": 1, "count": 0, "total": 0}
    assert balanced_writers(sizes, 1) == dict.fromkeys(sizes, 0)
    spread = balanced_writers(sizes, 3)
    assert sorted(set(spread.values())) == [0, 1, 2]
    # A pure function of the keys and sizes: the same in every process,
    # whatever order they list the variables in.
    assert balanced_writers(dict(reversed(list(sizes.items()))), 3) == spread


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's restore "
                    "hands the read buffer over without a copy (DLPack)")
def test_tf_restore_without_a_copy_never_shares_memory_it_changes(
        tmp_path, monkeypatch):
    from keras_distribute.backend.tensorflow import checkpoint as tf_backend
    from keras_distribute.checkpoint.storage import parallel_io

    handed_over = []
    zero_copy = tf_backend._zero_copy_tensor
    monkeypatch.setattr(tf_backend, "_zero_copy_tensor", lambda array: (
        handed_over.append(zero_copy(array)) or handed_over[-1]))

    aligned = parallel_io.aligned_empty((4, 3), np.float32)
    aligned[...] = 1.0
    import tensorflow as tf

    assert isinstance(tf_backend._zero_copy_tensor(aligned), tf.Tensor)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        variable = keras.Variable(np.arange(12, dtype="float32").reshape(4, 3))
    path = kd.checkpoint.ShardedCheckpoint(weights=[variable]).write(
        str(tmp_path / "ckpt"))
    saved = np.arange(12, dtype="float32").reshape(4, 3)
    variable.assign(np.zeros((4, 3), "float32"))
    handed_over.clear()
    kd.checkpoint.ShardedCheckpoint(weights=[variable]).read(path)
    assert [type(t).__name__ for t in handed_over] == ["EagerTensor"]
    # Updates after the restore (TensorFlow copies the restored buffer
    # before its first write) land once on every replica.
    variable.assign_add(np.ones((4, 3), "float32"))
    strategy.run(tf.function(lambda: variable.assign_add(
        tf.fill((4, 3), 2.0))))
    for component in strategy.experimental_local_results(variable.value):
        np.testing.assert_array_equal(np.asarray(component), saved + 3)
    # A second restore of the same file still reads what was saved.
    kd.checkpoint.ShardedCheckpoint(weights=[variable]).read(path)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), saved)
