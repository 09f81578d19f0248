"""Steps users write are distributed (#42): an overridden `train_step` or
`test_step`, a GAN's two optimizers, a step through its own DDP, one that
never calls an optimizer, one that calls it twice, gradient accumulation,
a loop of the user's own outside `strategy.run`; and the guard that says
when replicas diverge, on every backend."""

import warnings

import keras
import numpy as np
import pytest
import workers_user_steps as workers
from conftest import BACKEND

import keras_distribute as kd

torch_only = pytest.mark.skipif(
    BACKEND != "torch", reason="process-per-replica steps: torch backend "
    "(JAX and TensorFlow optimizers see global gradients by construction)")
TIMEOUT = 240


@pytest.fixture(scope="module")
def user_step_runs():
    reference = workers.user_steps()  # one process: one replica
    ranks = kd.launch(workers.user_steps, num_processes=2, timeout=TIMEOUT)
    return reference, ranks


def _assert_same_weights(expected, actual, atol):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=0, atol=atol)


def _assert_logs_equal(expected, actual):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert set(e) == set(a)
        for key in e:
            np.testing.assert_allclose(a[key], e[key], rtol=1e-5, atol=1e-6)


@torch_only
@pytest.mark.parametrize("kind", ["guide", "accumulation", "ddp", "twice",
                                  "gan", "no_optimizer", "autoencoder"])
def test_a_users_step_trains_like_one_process_in_every_process(
        user_step_runs, kind):
    reference, (rank0, rank1) = user_step_runs
    # Every process holds the same weights, bit for bit ...
    _assert_same_weights(rank0[kind]["weights"], rank1[kind]["weights"], 0)
    # ... those of one process on the whole batches (the guide's and the
    # accumulating run's last batch of 5 rows splits 2 + 3).
    _assert_same_weights(reference[kind]["weights"], rank0[kind]["weights"],
                         1e-5)
    assert rank0[kind]["batch_logs"] == rank1[kind]["batch_logs"]
    assert rank0[kind]["history"] == rank1[kind]["history"]


@torch_only
def test_a_users_own_loop_outside_run_trains_like_one_process():
    # keras-io's torch loop from scratch, each process on its half of every
    # batch: a Keras optimizer made in the scope applies the processes'
    # averaged gradients (clipping sees them averaged; gradients the loop
    # all-reduced itself stay as they are). A torch optimizer is the
    # user's: the processes diverge, and the check says so.
    reference = workers.own_loops(1)
    ranks = kd.launch(workers.own_loops, num_processes=2, args=(2,),
                      timeout=TIMEOUT)
    for kind in ("adam", "clipped", "reduced_by_hand"):
        for rank in ranks:
            _assert_same_weights(reference[kind], rank[kind], 1e-5)
            _assert_same_weights(ranks[0][kind], rank[kind], 0)
    assert not all(np.array_equal(a, b) for a, b in zip(
        ranks[0]["torch_optim"], ranks[1]["torch_optim"]))
    for rank in ranks:
        assert "The replicas diverged" in rank["torch_optim_check"]
    # Every variable sharded over the processes (FSDP): DTensor sums the
    # gradients of the sharded ones; they are averaged all the same.
    ranks = kd.launch(workers.own_loops, num_processes=2, args=(2, True),
                      timeout=TIMEOUT)
    for kind in ("adam", "clipped"):
        for rank in ranks:
            _assert_same_weights(reference[kind], rank[kind], 1e-5)
            _assert_same_weights(ranks[0][kind], rank[kind], 0)


@torch_only
def test_a_users_step_with_fully_sharded_variables_trains_like_one_process():
    # FSDP (kd.layouts.fully_sharded): each variable's gradient is DTensor's
    # reduce-scatter, weighted by each process's share of the global batch
    # inside a user's step (the guide's last batch splits 2 + 3); it is
    # never all-reduced again with the other processes' shards.
    reference = workers.fully_sharded_user_steps(1)
    ranks = kd.launch(workers.fully_sharded_user_steps, num_processes=2,
                      args=(2,), timeout=TIMEOUT)
    for rank in ranks:
        assert rank["kernel_local"] == (4, 3)  # (4, 6) over 2
        for kind in ("guide", "twice", "gan"):
            _assert_same_weights(reference[kind], rank[kind], 1e-5)
            _assert_same_weights(ranks[0][kind], rank[kind], 0)
        # A step that wraps the model in its own DDP: DDP cannot take
        # DTensors; kd says so, and what to do instead.
        assert "DistributedDataParallel cannot wrap a model whose " \
            "variables kd shards" in rank["ddp_error"]
        assert "forward through the model itself" in rank["ddp_error"]


@torch_only
@pytest.mark.parametrize("kind", ["ddp", "twice", "gan"])
def test_a_users_step_logs_global_values(user_step_runs, kind):
    reference, (rank0, _) = user_step_runs
    _assert_logs_equal(reference[kind]["batch_logs"], rank0[kind]["batch_logs"])
    _assert_logs_equal([reference[kind]["history"]], [rank0[kind]["history"]])


@torch_only
def test_the_guides_metrics_and_test_step_are_global(user_step_runs):
    reference, (rank0, rank1) = user_step_runs
    # Its metrics (a nested `compile_metrics` result included) are global
    # in every batch's logs; its `Mean` of per-step losses counts each
    # process's step once, as tf.distribute's does, so the short last
    # batch's 2 + 3 split weighs the two halves alike: compared up to it.
    ours, theirs = rank0["guide"]["batch_logs"], reference["guide"][
        "batch_logs"]
    _assert_logs_equal([{"mae": t["mae"]} for t in theirs],
                       [{"mae": o["mae"]} for o in ours])
    _assert_logs_equal([{"loss": t["loss"]} for t in theirs[:3]],
                       [{"loss": o["loss"]} for o in ours[:3]])
    np.testing.assert_allclose(rank0["guide"]["history"]["mae"],
                               reference["guide"]["history"]["mae"],
                               rtol=1e-5)
    # The same fit with no reader of per-batch logs: its history is global
    # too (the step's nested `compile_metrics` log had kept Keras from
    # taking the metrics' results at the epoch's end: each process's own).
    for rank in (rank0, rank1):
        np.testing.assert_allclose(rank["guide_quiet"]["history"]["mae"],
                                   reference["guide_quiet"]["history"]["mae"],
                                   rtol=1e-5)
    assert rank0["guide_quiet"]["history"] == rank1["guide_quiet"]["history"]
    # The custom test_step returns the loss itself: the last batch's,
    # global (rows-weighted over the processes), not one process's.
    np.testing.assert_allclose(rank0["guide"]["evaluate"],
                               reference["guide"]["evaluate"], rtol=1e-5)
    assert rank0["guide"]["evaluate"] == rank1["guide"]["evaluate"]


@torch_only
def test_a_step_without_an_optimizer_changes_nothing_and_logs_means(
        user_step_runs):
    reference, (rank0, _) = user_step_runs
    runs = rank0["no_optimizer"]
    _assert_logs_equal([{"raw_loss": r["raw_loss"]}
                        for r in reference["no_optimizer"]["batch_logs"]],
                       [{"raw_loss": r["raw_loss"]}
                        for r in runs["batch_logs"]])
    # A scalar that is not a metric is averaged over the processes (as
    # TensorFlow's trainer averages a replica's outputs): 16 rows each.
    assert {r["rows"] for r in runs["batch_logs"]} == {16.0}


@torch_only
def test_a_step_that_bypasses_the_optimizer_is_caught_in_every_process():
    results = kd.launch(workers.diverging_step, num_processes=2,
                        args=("raise",), timeout=TIMEOUT)
    for result in results:
        message, variable = result["error"]
        assert variable == result["first_variable"]
        assert "after epoch 1" in message
        assert "between process 0 and process 1" in message
        assert "optimizer.apply" in message and "'warn'" in message
        assert result["on_demand"] == variable
    warned = kd.launch(workers.diverging_step, num_processes=2,
                       args=("warn",), timeout=TIMEOUT)
    for result in warned:
        assert result["error"] is None
        assert [m[:40] for m in result["warnings"]] == [
            "The replicas diverged: after epoch 1, th",
            "The replicas diverged: after epoch 2, th"]


def _mirrored_model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(3, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    return model


def _tamper_one_copy(variable):
    """Makes one replica's copy of `variable` differ from the others."""
    if BACKEND == "jax":
        import jax

        value = variable.value
        shards = [jax.device_put(np.asarray(s.data) + (i == 1), s.device)
                  for i, s in enumerate(value.addressable_shards)]
        variable._value = jax.make_array_from_single_device_arrays(
            value.shape, value.sharding, shards)
    else:
        copy = variable.value.values[1]
        copy.assign(copy + 1.0)


@pytest.mark.needs_strategy
def test_replicas_of_one_process_agree_after_fit_and_a_tampered_copy_is_named():
    strategy = kd.MirroredStrategy()
    model = _mirrored_model(strategy)
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.fit(x, x[:, :1], batch_size=16, epochs=2, verbose=0)
    strategy.check_replicas_agree(model)  # no error
    kernel = model.layers[1].kernel
    _tamper_one_copy(kernel)
    with pytest.raises(kd.ReplicasDivergedError,
                       match="between the replicas of process 0") as caught:
        strategy.check_replicas_agree(model)
    assert caught.value.variable == kernel.path
    # fit checks at each epoch end (here the copy differs before it starts,
    # and an update keeps the difference).
    with pytest.raises(kd.ReplicasDivergedError, match="after epoch 1"):
        model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0)
    # A small variable's copies are shown (what a step count differs by).
    fresh = _mirrored_model(strategy)
    _tamper_one_copy(fresh.layers[-1].bias)
    with pytest.raises(kd.ReplicasDivergedError,
                       match=r"this process's copies hold \[\["):
        strategy.check_replicas_agree(fresh)


def test_the_check_mode_is_validated_and_one_replica_is_never_checked(
        monkeypatch):
    from keras_distribute.training import divergence

    with pytest.raises(ValueError, match="must be one of .* Received: "
                       "mode='loud'"):
        kd.set_divergence_check("loud")
    monkeypatch.setenv("KERAS_DISTRIBUTE_DIVERGENCE_CHECK", "sometimes")
    with pytest.raises(ValueError, match="Received: KERAS_DISTRIBUTE_"
                       "DIVERGENCE_CHECK='sometimes'"):
        divergence.divergence_check_mode()
    monkeypatch.setenv("KERAS_DISTRIBUTE_DIVERGENCE_CHECK", "WARN")
    assert divergence.divergence_check_mode() == "warn"
    monkeypatch.delenv("KERAS_DISTRIBUTE_DIVERGENCE_CHECK")
    assert divergence.divergence_check_mode() == "raise"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kd.get_strategy().check_replicas_agree(model)  # default strategy: no-op


def test_a_save_reads_one_copy_of_each_region_of_a_variable():
    # The check before a checkpoint is written compares processes: it
    # reads one copy of each region (a replicated variable on a host of 8
    # devices once, not 8 times); fit's check reads every copy.
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    kernel = model.layers[0].kernel
    every = strategy.engine.replica_copies(kernel)
    one = strategy.engine.replica_copies(kernel, one_per_region=True)
    expected = 1 if BACKEND == "torch" else strategy.num_replicas_in_sync
    assert len(every) == expected
    assert expected > 1 or BACKEND == "torch"  # (several copies to skip)
    assert [region for region, _ in one] == [every[0][0]]
    np.testing.assert_array_equal(one[0][1], every[0][1])


@torch_only
def test_variables_agree_from_the_moment_they_are_made_in_the_scope():
    # The transfer-learning guide reads weights inside the scope and checks
    # them against a later read (its assert_allclose).
    results = kd.launch(workers.weights_inside_the_scope, num_processes=2,
                        timeout=TIMEOUT)
    for result in results:
        for inside, after in (("inside", "after"),
                              ("head_inside", "head_after")):
            _assert_same_weights(result[inside], result[after], 0)
    for key in ("inside", "head_inside"):
        _assert_same_weights(results[0][key], results[1][key], 0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="the TensorFlow guide's "
                    "steps (tf.GradientTape) under 4 TF logical devices")
def test_tensorflow_guides_steps_log_the_true_loss_and_the_gan_builds():
    # Under a strategy Keras scales `compute_loss` by 1/replicas for the
    # gradient sum, and the guide's tracker logged that (1/4 of the loss);
    # its GAN (no `call`) failed to build. kd: the one-device numbers.
    reference = workers.tf_guide_programs(kd.get_strategy())
    runs = workers.tf_guide_programs(kd.MirroredStrategy())
    for kind in ("guide", "gan"):
        _assert_same_weights(reference[kind]["weights"],
                             runs[kind]["weights"], 1e-5)
        _assert_logs_equal(reference[kind]["batch_logs"],
                           runs[kind]["batch_logs"])
        _assert_logs_equal([reference[kind]["history"]],
                           [runs[kind]["history"]])
    _assert_logs_equal([reference["guide"]["evaluate"]],
                       [runs["guide"]["evaluate"]])
