"""Horovod migration helpers in one process (#16): `kd.allreduce`,
`allgather`, `broadcast` return the value itself, bad arguments say what
was expected, and `kd.callbacks.LearningRateWarmup` checks what it needs.
Across 2 processes on every backend: test_*_multi*.py through
worker_training.py."""

import keras
import numpy as np
import pytest
from conftest import make_mlp

import keras_distribute as kd


def test_one_process_collectives_return_the_value():
    assert kd.process_count() == 1 and kd.process_index() == 0
    assert float(kd.allreduce(2.5)) == 2.5
    assert kd.allreduce(np.arange(3), op="sum").tolist() == [0, 1, 2]
    assert kd.allgather(np.ones((2, 3))).shape == (2, 3)
    assert kd.broadcast(7, root_rank=0) == 7
    tensor = kd.allreduce(keras.ops.ones((2,)), op="max")
    assert not isinstance(tensor, np.ndarray)  # a backend tensor stays one
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(tensor),
                                  [1.0, 1.0])


def test_collective_argument_errors():
    with pytest.raises(ValueError, match="Expected `op` to be one of "
                       "'average', 'mean', 'sum', 'min', 'max'"):
        kd.allreduce(1.0, op="prod")
    with pytest.raises(ValueError, match=r"process index in \[0, 1\)"):
        kd.broadcast(1.0, root_rank=1)
    with pytest.raises(ValueError, match="Use `kd.allreduce` for scalars"):
        kd.allgather(3.0)
    with pytest.raises(TypeError, match="holding Python objects"):
        kd.allreduce(np.array(["a"], dtype=object))


def test_warmup_argument_errors():
    for bad in (0, -1.0, "0.1", True):
        with pytest.raises(ValueError, match="Expected `initial_lr` to be "
                           "a positive number"):
            kd.callbacks.LearningRateWarmup(initial_lr=bad)
    with pytest.raises(ValueError, match="Expected `warmup_epochs` to be "
                       "a positive number of epochs"):
        kd.callbacks.LearningRateWarmup(0.1, warmup_epochs=0)


def test_warmup_refuses_a_schedule_and_ramps_a_constant():
    x = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
    y = np.zeros(32, dtype="int32")
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="learning rate is "
                       "computed by a learning rate schedule"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[
            kd.callbacks.LearningRateWarmup(0.1, warmup_epochs=1)])
    model = make_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    # One replica: Horovod's ramp is flat (initial_lr / 1 from the start).
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        kd.callbacks.LearningRateWarmup(0.1, warmup_epochs=1)])
    assert float(keras.ops.convert_to_numpy(
        model.optimizer.learning_rate)) == pytest.approx(0.1)
