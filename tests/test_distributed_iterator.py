"""The iterator of a distributed dataset, as the tf.distribute "Distributed
input" guide uses it: next / get_next / get_next_as_optional, element_spec,
and (a kd addition, JAX and torch) saving its position in a checkpoint."""

import numpy as np
import pytest
from conftest import BACKEND
from conftest import cpu_names
from conftest import needs_cpu_devices

import keras_distribute as kd

NATIVE_TF = BACKEND == "tensorflow"  # TF's own distributed iterators


@pytest.fixture
def tf():
    # Imported by the test that runs (not at collection, in every
    # pytest-xdist worker of a JAX or torch stage: ~3 s each).
    return pytest.importorskip("tensorflow")


def make_strategy():
    # 4 replicas in this process on JAX and TF; one per process on torch.
    return kd.MirroredStrategy() if BACKEND == "torch" else (
        kd.MirroredStrategy(cpu_names(4)))


def local(strategy, value):
    return [np.asarray(v).tolist()
            for v in strategy.experimental_local_results(value)]


@needs_cpu_devices(4)
def test_get_next_as_optional_ends_a_loop_without_an_exception(tf):
    strategy = make_strategy()
    dataset = tf.data.Dataset.range(10).batch(4)
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    steps = []
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        steps.append(local(strategy, strategy.run(
            lambda x: x, args=(optional.get_value(),))))
    if strategy.num_replicas_in_sync == 4:  # the short batch: 1 row each
        assert steps == [[[0], [1], [2], [3]], [[4], [5], [6], [7]],
                         [[8], [9], [], []]]
    else:
        assert steps == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    errors = (tf.errors.OutOfRangeError if NATIVE_TF else kd.OutOfRangeError)
    with pytest.raises(errors):
        iterator.get_next()
    if not NATIVE_TF:
        with pytest.raises(kd.OutOfRangeError, match="Check `has_value"):
            optional.get_value()


@needs_cpu_devices(4)
def test_next_get_next_and_element_spec(tf):
    strategy = make_strategy()
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 3), "float32"), np.zeros((8,), "int64"))).batch(4)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)
    first, second = next(iterator), iterator.get_next()
    assert [np.shape(v) for v in strategy.experimental_local_results(
        first[0])] == [(4 // strategy.num_replicas_in_sync, 3)] * (
        strategy.num_replicas_in_sync)
    assert local(strategy, second[1]) == local(strategy, first[1])
    for spec in (dist_dataset.element_spec, iterator.element_spec):
        x_spec, y_spec = spec
        if strategy.num_replicas_in_sync > 1:  # one spec per replica
            values = lambda s: (s.values if isinstance(s, kd.PerReplica)  # noqa: E731
                                else s._value_specs)
            assert len(values(x_spec)) == strategy.num_replicas_in_sync
            x_spec, y_spec = values(x_spec)[0], values(y_spec)[0]
        assert x_spec == tf.TensorSpec((None, 3), tf.float32)
        assert y_spec == tf.TensorSpec((None,), tf.int64)


@pytest.mark.skipif(NATIVE_TF, reason="TF's own distributed iterators "
                    "cannot be saved (tested below)")
def test_distributed_iterator_position_round_trips(tf, tmp_path):
    strategy = make_strategy()
    # Batches of 6, then 3: on 4 replicas the short batch is split with the
    # per-replica size of the full ones (2, 1, 0, 0), so the split state
    # is saved with the position.
    dataset = tf.data.Dataset.range(9).batch(6)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)
    next(iterator)
    checkpoint = kd.checkpoint.ShardedCheckpoint(iterator=iterator)
    path = checkpoint.write(str(tmp_path / "c"))
    expected = local(strategy, next(iterator))
    resumed = iter(dist_dataset)
    kd.checkpoint.ShardedCheckpoint(iterator=resumed).read(
        path).assert_consumed()
    assert local(strategy, next(resumed)) == expected
    if strategy.num_replicas_in_sync == 4:
        assert expected == [[6, 7], [8], [], []]
    assert not resumed.get_next_as_optional().has_value()
    # From a function: the same, one element per replica.
    from_function = strategy.distribute_datasets_from_function(
        lambda ctx: tf.data.Dataset.range(16).batch(2))
    iterator = iter(from_function)
    next(iterator)
    path = kd.checkpoint.ShardedCheckpoint(iterator=iterator).write(
        str(tmp_path / "f"))
    expected = local(strategy, next(iterator))
    resumed = iter(from_function)
    kd.checkpoint.ShardedCheckpoint(iterator=resumed).read(path)
    assert local(strategy, next(resumed)) == expected


@needs_cpu_devices(4)
def test_iterators_that_cannot_be_saved_are_refused(tf, tmp_path):
    strategy = make_strategy()
    iterator = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(8).batch(4)))
    if NATIVE_TF:
        with pytest.raises(ValueError, match="tf.distribute's own "
                                             "distributed iterators"):
            kd.checkpoint.ShardedCheckpoint(iterator=iterator)
    else:
        # A saved plain tf.data position does not fit a distributed one.
        plain = iter(tf.data.Dataset.range(8).batch(4))
        path = kd.checkpoint.ShardedCheckpoint(iterator=plain).write(
            str(tmp_path / "plain"))
        with pytest.raises(kd.checkpoint.CheckpointError,
                           match="not the position of a distributed"):
            kd.checkpoint.ShardedCheckpoint(iterator=iterator).read(path)
    from_list = iter(strategy.experimental_distribute_dataset(
        [np.arange(4), np.arange(4, 8)]))
    if not NATIVE_TF:
        with pytest.raises(ValueError, match="Only the position of a "
                                             "distributed tf.data"):
            kd.checkpoint.ShardedCheckpoint(iterator=from_list)
