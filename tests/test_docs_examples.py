"""The code examples of the tf.distribute MirroredStrategy documentation,
with the values the documentation prints."""

import numpy as np
import pytest
from conftest import cpu_names
from conftest import needs_cpu_devices

import keras_distribute as kd

pytestmark = pytest.mark.needs_strategy


def local(strategy, value):
    return [np.asarray(v).tolist() for v in
            strategy.experimental_local_results(value)]


def test_distribute_dataset_range4_batch2_doubled():
    import tensorflow as tf

    strategy = kd.MirroredStrategy(devices=["CPU:0", "CPU:1"])
    dataset = tf.data.Dataset.range(4).batch(2)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    result = [strategy.run(lambda x: x * 2, args=(x,)) for x in dist_dataset]
    assert [local(strategy, r) for r in result] == [[[0], [2]], [[4], [6]]]
    assert all(isinstance(r, kd.PerReplica) for r in result)


def test_run_replica_id_and_reduce_sum():
    strategy = kd.MirroredStrategy(cpu_names(2))

    def step_fn():
        return kd.get_replica_context().replica_id_in_sync_group

    per_replica_result = strategy.run(step_fn)
    assert local(strategy, per_replica_result) == [0, 1]
    total = strategy.reduce("SUM", per_replica_result, axis=None)
    assert int(np.asarray(total)) == 1


def test_run_with_plain_tensor_input():
    strategy = kd.MirroredStrategy(cpu_names(2))
    result = strategy.run(lambda v: v * 2.0, args=(np.float32(3.0),))
    assert local(strategy, result) == [6.0, 6.0]


def test_values_from_function_num_replicas_and_fraction():
    strategy = kd.MirroredStrategy(cpu_names(2))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.num_replicas_in_sync)
    assert local(strategy, values) == [2, 2]
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync)
    assert local(strategy, values) == [0.0, 0.5]
    doubled = strategy.run(lambda v: v * 2, args=(
        strategy.experimental_distribute_values_from_function(
            lambda ctx: ctx.num_replicas_in_sync),))
    assert local(strategy, doubled) == [4, 4]


def test_values_from_function_array_value():
    strategy = kd.MirroredStrategy(cpu_names(2))
    array_value = np.array([3.0, 2.0, 1.0])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group])
    assert local(strategy, values) == [3.0, 2.0]


def test_values_from_function_then_all_reduce_in_run():
    strategy = kd.MirroredStrategy(cpu_names(2))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.int32(ctx.replica_id_in_sync_group))
    result = strategy.run(
        lambda v: kd.get_replica_context().all_reduce("sum", v), args=(values,))
    assert local(strategy, result) == [1, 1]


@needs_cpu_devices(4)
def test_gather_shapes_on_four_replicas():
    strategy = kd.MirroredStrategy(cpu_names(4))
    values = strategy.experimental_distribute_values_from_function(
        lambda _: np.array([[1], [2]]))
    gathered = strategy.gather(values, axis=0)
    assert gathered.shape == (8, 1)
    assert np.asarray(gathered).ravel().tolist() == [1, 2] * 4
    single = np.arange(6).reshape(1, 2, 3)
    values = strategy.experimental_distribute_values_from_function(
        lambda _: single)
    assert strategy.gather(values, axis=0).shape == (4, 2, 3)
    assert strategy.gather(values, axis=1).shape == (1, 8, 3)
    assert strategy.gather(values, axis=2).shape == (1, 2, 12)
    np.testing.assert_array_equal(
        np.asarray(strategy.gather(values, axis=2))[0, 0],
        [0, 1, 2] * 4)


def test_gather_two_replicas():
    strategy = kd.MirroredStrategy(cpu_names(2))
    values = strategy.experimental_distribute_values_from_function(
        lambda _: np.array([[1], [2]]))
    assert np.asarray(strategy.gather(values, axis=0)).tolist() == [
        [1], [2], [1], [2]]


def test_all_reduce_scalar_and_list():
    strategy = kd.MirroredStrategy(cpu_names(2))

    def step_fn():
        return kd.get_replica_context().all_reduce(kd.ReduceOp.SUM, 1.0)

    assert local(strategy, strategy.run(step_fn)) == [2.0, 2.0]

    def step_fn_list():
        return kd.get_replica_context().all_reduce("sum", [1.0, 2.0])

    results = strategy.experimental_local_results(strategy.run(step_fn_list))
    assert [[float(v) for v in r] for r in results] == [[2.0, 4.0]] * 2


def test_all_reduce_nested_sum_and_mean():
    strategy = kd.MirroredStrategy(cpu_names(2))
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: [
            {"a": 1.0, "b": [40.0, 1.0]},
            {"a": 3.0, "b": [2.0, 98.0]}][ctx.replica_id_in_sync_group])

    def fn(op):
        return lambda v: kd.get_replica_context().all_reduce(op, v)

    total = strategy.experimental_local_results(
        strategy.run(fn("sum"), args=(per_replica,)))[0]
    assert float(total["a"]) == 4.0
    assert [float(v) for v in total["b"]] == [42.0, 99.0]
    mean = strategy.experimental_local_results(
        strategy.run(fn("mean"), args=(per_replica,)))[1]
    assert float(mean["a"]) == 2.0
    assert [float(v) for v in mean["b"]] == [21.0, 49.5]


def test_all_gather_value_and_nest():
    strategy = kd.MirroredStrategy(cpu_names(2))
    result = strategy.run(lambda: kd.get_replica_context().all_gather(
        np.array([1, 2, 3]), axis=0))
    assert local(strategy, result) == [[1, 2, 3, 1, 2, 3]] * 2
    result = strategy.run(lambda: kd.get_replica_context().all_gather(
        [np.array([1, 2, 3]), np.array([[1, 2], [3, 4]])], axis=0))
    first, second = strategy.experimental_local_results(result)
    assert np.asarray(first[1]).tolist() == [[1, 2], [3, 4], [1, 2], [3, 4]]
    assert np.asarray(second[0]).tolist() == [1, 2, 3, 1, 2, 3]


def test_replica_context_in_run_and_cross_replica_in_scope():
    strategy = kd.MirroredStrategy(cpu_names(2))
    with strategy.scope():
        assert kd.has_strategy()
        assert kd.in_cross_replica_context()
        assert kd.get_replica_context() is None
        assert kd.get_strategy() is strategy

    def fn():
        ctx = kd.get_replica_context()
        assert not kd.in_cross_replica_context()
        assert ctx.num_replicas_in_sync == 2
        assert kd.get_strategy() is strategy
        return ctx.replica_id_in_sync_group

    assert local(strategy, strategy.run(fn)) == [0, 1]
    assert not kd.has_strategy()


def test_reduce_axis_semantics():
    # Global batch 8 on 2 replicas: [0..3] and [4..7].
    strategy = kd.MirroredStrategy(cpu_names(2))
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (np.arange(4, dtype="float32")
                     + 4 * ctx.replica_id_in_sync_group))
    assert np.asarray(strategy.reduce("sum", values, axis=None)).tolist() == [
        4.0, 6.0, 8.0, 10.0]
    assert float(strategy.reduce("sum", values, axis=0)) == 28.0
    assert float(strategy.reduce("mean", values, axis=0)) == 3.5


def test_reduce_mean_axis0_short_batch_uses_true_divisor():
    # A last batch of 6 split [0, 1, 2, 3] and [4, 5]: mean is over 6.
    import tensorflow as tf

    strategy = kd.MirroredStrategy(cpu_names(2))
    dataset = tf.data.Dataset.range(14).map(
        lambda x: tf.cast(x, "float32")).batch(8)
    batches = list(strategy.experimental_distribute_dataset(dataset))
    parts = [np.asarray(v).tolist() for v in
             strategy.experimental_local_results(batches[-1])]
    # JAX splits [4, 2] as the docs describe; tf.distribute splits [3, 3].
    assert sum(parts, []) == [8.0, 9.0, 10.0, 11.0, 12.0, 13.0]
    assert max(len(p) for p in parts) <= 4
    last = batches[-1]
    assert float(strategy.reduce("mean", last, axis=0)) == pytest.approx(10.5)
    assert float(strategy.reduce("sum", last, axis=0)) == 63.0


def test_experimental_local_results_always_tuple():
    strategy = kd.MirroredStrategy(cpu_names(1))
    result = strategy.run(lambda: 1.0)
    assert isinstance(strategy.experimental_local_results(result), tuple)
    assert len(strategy.experimental_local_results(result)) == 1
    assert strategy.experimental_local_results(7) == (7,)


def test_variable_created_in_scope_is_mirrored():
    import keras

    strategy = kd.MirroredStrategy(cpu_names(2))
    with strategy.scope():
        mirrored = keras.Variable(1.0)
    regular = keras.Variable(1.0)
    assert strategy.extended.variable_created_in_scope(mirrored)
    assert not strategy.extended.variable_created_in_scope(regular)
    copies = strategy.experimental_local_results(mirrored)
    assert [float(c) for c in copies] == [1.0, 1.0]


def test_distribute_datasets_from_function():
    import tensorflow as tf

    strategy = kd.MirroredStrategy(cpu_names(2))
    contexts = []

    def dataset_fn(input_context):
        contexts.append(input_context)
        batch = input_context.get_per_replica_batch_size(4)
        ds = tf.data.Dataset.range(8).batch(batch)
        return ds.shard(input_context.num_input_pipelines,
                        input_context.input_pipeline_id)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    steps = [local(strategy, x) for x in dist]
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # The former name, which tf.distribute programs of TF 2.3 still use.
    former = strategy.experimental_distribute_datasets_from_function(
        dataset_fn)
    assert [local(strategy, x) for x in former] == steps
    assert len(contexts) == 2  # once per pipeline, per call
    for ctx in contexts:
        assert (ctx.num_input_pipelines, ctx.input_pipeline_id,
                ctx.num_replicas_in_sync) == (1, 0, 2)


def test_distribute_datasets_from_function_with_arrays_and_lists():
    # Regression (#19.7, TF): a dataset_fn returning arrays or a list of
    # batches (accepted on JAX and torch) raised TF's "'list' object has no
    # attribute 'element_spec'". Every backend: each element is one
    # replica's batch, dataset_fn runs once.
    strategy = kd.MirroredStrategy(cpu_names(2))
    calls = []

    def batches_fn(ctx):
        calls.append(ctx.input_pipeline_id)
        return [np.full((2, 3), i, "float32") for i in range(4)]

    steps = [local(strategy, strategy.run(lambda b: b * 2, args=(batch,)))
             for batch in strategy.distribute_datasets_from_function(
                 batches_fn)]
    assert steps == [[[[0.0] * 3] * 2, [[2.0] * 3] * 2],
                     [[[4.0] * 3] * 2, [[6.0] * 3] * 2]]
    assert calls == [0]
    rows = strategy.distribute_datasets_from_function(
        lambda ctx: np.arange(8, dtype="float32").reshape(4, 2))
    assert [local(strategy, x) for x in rows] == [
        [[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]


def test_uneven_last_batch_runs_per_replica_with_collectives():
    import keras

    strategy = kd.MirroredStrategy(cpu_names(2))
    batches = list(strategy.experimental_distribute_dataset(
        [np.arange(4.0), np.arange(3.0)]))

    def fn(x):
        ctx = kd.get_replica_context()
        return x.shape[0], ctx.all_reduce("sum", keras.ops.sum(x))

    sizes, totals = strategy.run(fn, args=(batches[1],))
    assert list(strategy.experimental_local_results(sizes)) == [2, 1]
    assert [float(t) for t in strategy.experimental_local_results(totals)] == [
        3.0, 3.0]


def test_distribute_pydataset_and_generator():
    import keras

    class Squares(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            x = np.arange(4.0) + 4 * i
            return x, x**2

    strategy = kd.MirroredStrategy(cpu_names(2))
    steps = list(strategy.experimental_distribute_dataset(Squares()))
    assert np.asarray(steps[1][1].values[1]).tolist() == [36.0, 49.0]
    gen = (np.ones((4, 2)) * i for i in range(3))
    assert len(list(strategy.experimental_distribute_dataset(gen))) == 3
