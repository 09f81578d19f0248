"""Backend-neutral pieces: reduce ops, device names, contexts, inputs."""

import re

import numpy as np
import pytest

import keras_distribute as kd
from keras_distribute.common.devices import DeviceSpec
from keras_distribute.common.devices import parse_device_name
from keras_distribute.input.data_sources import split_batch


@pytest.mark.parametrize("value", ["sum", "SUM", "Sum", kd.ReduceOp.SUM])
def test_reduce_op_accepts_strings_any_case(value):
    assert kd.ReduceOp.from_value(value) is kd.ReduceOp.SUM


def test_reduce_op_rejects_unknown():
    with pytest.raises(ValueError, match=r"Received: reduce_op='max'"):
        kd.ReduceOp.from_value("max")


@pytest.mark.parametrize(
    "name, expected",
    [
        ("GPU:0", DeviceSpec("gpu", 0)),
        ("/gpu:1", DeviceSpec("gpu", 1)),
        ("gpu:0", DeviceSpec("gpu", 0)),
        ("cpu", DeviceSpec("cpu", 0)),
        ("/device:CPU:2", DeviceSpec("cpu", 2)),
        ("/job:localhost/replica:0/task:0/device:CPU:0",
         DeviceSpec("cpu", 0, task=0)),
        ("/job:worker/task:1/device:GPU:3", DeviceSpec("gpu", 3, task=1)),
    ],
)
def test_parse_device_names(name, expected):
    assert parse_device_name(name) == expected


@pytest.mark.parametrize(
    "name, match",
    [
        ("XPU:0", "unknown device type"),
        ("GPU:x", "is not a number"),
        ("", "non-empty string"),
        ("/job:localhost/task:a/device:CPU:0", "task 'a' is not a number"),
        ("/job:localhost/replica:0", "names no device"),
    ],
)
def test_parse_device_name_errors(name, match):
    with pytest.raises(ValueError, match=match):
        parse_device_name(name)


def test_default_context_outside_any_scope():
    assert not kd.has_strategy()
    assert not kd.in_cross_replica_context()
    strategy = kd.get_strategy()
    assert strategy.num_replicas_in_sync == 1
    ctx = kd.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert strategy.run(lambda x: x + 1, args=(1,)) == 2
    assert strategy.reduce("sum", 3.0, axis=None) == 3.0
    assert strategy.experimental_local_results(5) == (5,)


def test_value_context():
    ctx = kd.ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    assert ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync == 0.5


def test_input_context_per_replica_batch_size():
    ctx = kd.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                          num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id) == (2, 1)
    with pytest.raises(ValueError, match="global_batch_size=10"):
        ctx.get_per_replica_batch_size(10)


def test_input_options_validation():
    assert kd.InputOptions().fetch_to_device
    assert not kd.InputOptions(
        experimental_fetch_to_device=False).fetch_to_device
    with pytest.raises(ValueError, match="PER_REPLICA"):
        kd.InputOptions(experimental_place_dataset_on_device=True)
    with pytest.raises(ValueError, match="positive int"):
        kd.InputOptions(experimental_per_replica_buffer_size=0)
    with pytest.raises(ValueError, match="InputReplicationMode"):
        kd.InputOptions(experimental_replication_mode="per_worker")


def test_auto_shard_policy_values_match_tf():
    assert [p.name for p in kd.AutoShardPolicy] == [
        "OFF", "AUTO", "FILE", "DATA", "HINT"]
    assert kd.AutoShardPolicy.OFF == -1 and kd.AutoShardPolicy.DATA == 2


def test_split_batch_short_batch_in_replica_order():
    # tf.distribute: a last batch of 6 over 2 replicas of 4 -> [4, 2].
    parts = split_batch(np.arange(6), num_replicas=2, per_replica=4)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]
    parts = split_batch({"x": np.arange(3)}, num_replicas=4, per_replica=1)
    assert [p["x"].tolist() for p in parts] == [[0], [1], [2], []]


def test_per_replica_repr():
    value = kd.PerReplica([1, 2])
    assert repr(value).startswith("PerReplica:{")
    assert value.values == (1, 2)


def test_compute_average_loss_default_strategy():
    loss = kd.compute_average_loss(np.array([1.0, 2.0, 3.0, 4.0]),
                                   global_batch_size=8)
    np.testing.assert_allclose(np.asarray(loss), 10.0 / 8)
    loss = kd.compute_average_loss(np.array([1.0, 2.0]),
                                   sample_weight=np.array([2.0, 0.0]))
    np.testing.assert_allclose(np.asarray(loss), 1.0)
    assert float(np.asarray(kd.compute_average_loss(
        np.array([1.0]), global_batch_size=0))) == 0.0


def test_compute_average_loss_errors():
    with pytest.raises(ValueError, match="rank >= 1"):
        kd.compute_average_loss(np.float32(1.0))
    with pytest.raises(ValueError, match="non-negative"):
        kd.compute_average_loss(np.array([1.0]), global_batch_size=-1)
    with pytest.raises(ValueError, match="integer"):
        kd.compute_average_loss(np.array([1.0]), global_batch_size=2.5)


def test_unsupported_backend_error_names_backend(monkeypatch):
    from keras_distribute import backend

    monkeypatch.setattr(backend, "backend_name", lambda: "openvino")
    with pytest.raises(NotImplementedError, match="'openvino' Keras backend"):
        kd.MirroredStrategy()


def test_tpu_strategy_without_tpus_names_what_works():
    from conftest import BACKEND

    if BACKEND == "torch":
        with pytest.raises(NotImplementedError, match="'torch' Keras backend"):
            kd.TPUStrategy()
    else:
        with pytest.raises(RuntimeError, match="found no TPU|needs TPUs"):
            kd.TPUStrategy()
    with pytest.raises((ValueError, NotImplementedError)):
        kd.TPUStrategy(device_assignment="2x4")


@pytest.mark.parametrize("axis", ["0", 0.0, True, [0]])
def test_reduce_axis_must_be_none_or_an_integer(axis):
    strategy = kd.get_strategy()
    with pytest.raises(TypeError, match="`axis` must be None.*an integer.*"
                       f"Received: axis={re.escape(repr(axis))}"):
        strategy.reduce("sum", np.ones(4, "float32"), axis=axis)


@pytest.mark.parametrize("method, batch_size", [
    ("fit", 0), ("fit", -1), ("fit", 2.5), ("fit", "8"), ("evaluate", 0),
    ("predict", -4)])
def test_batch_size_must_be_a_positive_integer(method, batch_size):
    import keras

    with kd.MirroredStrategy().scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    args = (x,) if method == "predict" else (x, y)
    before = model.get_weights()
    received = re.escape(repr(batch_size))
    with pytest.raises(ValueError, match="positive integer: the global "
                       f"batch.*Received: batch_size={received}"):
        getattr(model, method)(*args, batch_size=batch_size, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # nothing trained


def test_numpy_under_the_default_strategy_on_every_backend():
    import keras

    strategy = kd.get_strategy()
    variable = keras.Variable(np.arange(3.0), trainable=True)
    out = strategy.run(lambda: variable * 2.0)  # a tensor needing no grad
    got = kd.numpy({"out": out, "variable": variable, "n": 3})
    np.testing.assert_array_equal(got["out"], [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(got["variable"], [0.0, 1.0, 2.0])
    assert kd.numpy(kd.PerReplica([np.ones(2), np.zeros(2)]))[1].tolist() == [
        0.0, 0.0]


@pytest.mark.needs_strategy
def test_run_on_one_device_returns_plain_values():
    """#30: a one-device strategy's `run` gives the plain value (as
    tf.distribute's), which reduce / gather / local results accept."""
    import keras

    strategy = kd.MirroredStrategy(devices=["cpu:0"])
    loss = strategy.run(lambda x: keras.ops.sum(x) * 2.0,
                        args=(np.ones(3, "float32"),))
    assert not isinstance(loss, kd.PerReplica)
    assert float(loss) == 6.0
    assert float(strategy.reduce("SUM", loss, axis=None)) == 6.0
    assert float(strategy.reduce("MEAN", loss, axis=None)) == 6.0
    assert strategy.experimental_local_results(loss) == (loss,)
    rows = strategy.run(lambda: keras.ops.ones((2, 1)))
    assert keras.ops.convert_to_numpy(strategy.gather(rows, axis=0)).shape == (
        2, 1)
    several = kd.MirroredStrategy().run(lambda: keras.ops.ones(()))
    assert isinstance(several, kd.PerReplica)  # several replicas here
