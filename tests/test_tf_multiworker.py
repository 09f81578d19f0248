"""MultiWorkerMirroredStrategy on TensorFlow: 2 worker processes, loopback."""

import numpy as np
import pytest
import workers_tf as workers
from conftest import BACKEND
from worker_common import assert_hung_peer_is_named
from worker_common import assert_start_refused
from worker_common import assert_survivor_fails_within
from worker_common import assert_taken_port_is_named

import keras_distribute as kd

pytestmark = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.distribute multi-worker: TF backend")
TIMEOUT = 300


def test_multi_worker_fit_matches_one_process(tmp_path):
    results = kd.launch(workers.multi_worker_fit, num_processes=2,
                        args=(str(tmp_path),), timeout=TIMEOUT)
    x, y = workers.make_data()
    model = workers.make_model(workers.initial_weights())
    history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False,
                        verbose=0)
    evaluation = model.evaluate(x, y, batch_size=20, verbose=0)
    for result in results:
        assert result["replicas"] == 2
        assert result["sum_ids"] == 1.0
        np.testing.assert_allclose(result["history"]["loss"],
                                   history.history["loss"], rtol=1e-5)
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(result["evaluate"], evaluation, rtol=1e-5)
    assert [r["task"] for r in results] == [("worker", 0), ("worker", 1)]
    rows = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 3  # header + 2 epochs, written by the chief only


def test_a_lost_worker_fails_the_survivor_within_the_timeout():
    assert_survivor_fails_within(kd.launch, workers.peer_leaves_early, TIMEOUT)


def test_a_hung_worker_that_still_runs_is_named_not_waited_for():
    # Rank 1 sleeps in a callback (alive): TensorFlow would wait for it without
    # end in native code; kd's watchdog ends rank 0 after the 10 s timeout,
    # naming rank 1, and the launcher blames rank 1.
    assert_hung_peer_is_named(kd.launch, workers.hang_on_rank_one)


def test_checkpoint_callbacks_across_processes(tmp_path):
    from worker_common import assert_checkpoints_hold

    directory = str(tmp_path / "ckpt")
    results = kd.launch(workers.sharded_checkpoints, num_processes=2,
                        args=(directory,), timeout=TIMEOUT)
    assert_checkpoints_hold(results, directory)


def test_keras_own_file_callbacks_resume_across_processes(tmp_path):
    # #20.6 regression, TF: "Collective instance ... expected type 0 ... got
    # type 1" (the chief's save built Keras' reference Optimizer under the
    # strategy).
    from worker_common import launch_keras_callbacks_resume

    launch_keras_callbacks_resume(workers, str(tmp_path), TIMEOUT)


def test_a_model_built_after_random_states_diverged_starts_from_the_chief():
    # #20.10 regression: TF broadcasts the chief's values itself.
    from worker_common import launch_diverged_random_states

    launch_diverged_random_states(workers, TIMEOUT)


def test_training_features_across_processes(tmp_path):
    # #16: gradient accumulation + EMA overwrite (short last batch) equal to
    # one process; kd.allreduce/allgather/broadcast and Horovod's callbacks.
    # #17: PreemptionCheckpoint with SIGTERM to process 0, 1 or both at 5
    # seeded steps, resumed bit-identical. One launch
    # (worker_training.training_features).
    from worker_training import launch_training_features

    launch_training_features(workers, str(tmp_path), TIMEOUT)


def test_preemption_checkpoint_handler_custom_loop(tmp_path):
    # #17: tf.distribute's PreemptionCheckpointHandler loop (total_run_calls).
    from worker_training import launch_preemption_handler

    launch_preemption_handler(workers, str(tmp_path), TIMEOUT)


def test_a_worker_that_never_joins_fails_within_the_timeout():
    # #17: TensorFlow waited without end (past 180 s) in native code that
    # no exception reaches; kd's watchdog ends the process and says why.
    import time

    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match=(
            r"Process 0 of 1 died with exit code -9 before returning \(killed "
            r"by SIGKILL\) while joining the TensorFlow job .* as worker 0: "
            r"not every worker joined within 5 s")):
        kd.launch(workers.peer_never_joins, num_processes=1, timeout=TIMEOUT)
    assert time.monotonic() - start < 40


def test_training_holds_no_thread_per_collective():
    # #17 soak: with a per-collective timeout TensorFlow kept a thread per
    # all-reduce alive for the whole timeout (+400 threads an epoch here).
    for counts in kd.launch(workers.fit_thread_count, num_processes=2,
                            args=(50,), timeout=TIMEOUT):
        assert counts[-1] <= counts[0] + 5, counts


def test_every_variable_is_the_same_in_every_worker(tmp_path):
    """#30: BatchNormalization's moving statistics differed between the
    workers after fit; now every variable is equal in every worker."""
    from worker_common import assert_one_state

    assert_one_state(kd.launch(workers.batchnorm_one_state, num_processes=2,
                               args=(str(tmp_path),), timeout=TIMEOUT))


def test_workers_that_would_train_different_models_are_refused():
    from worker_common import assert_different_training_is_refused

    assert_different_training_is_refused(kd.launch(
        workers.different_training, num_processes=2, timeout=TIMEOUT))


@pytest.mark.parametrize("change,match", [
    ("count", r"given different cluster descriptions.*num_processes.: "
              r"[23].*num_processes.: [23]"),
    # Two tasks 0 on one host: the second finds the first's port taken
    # (before its server starts, or as it starts when both checked at once).
    ("index", r"(is already in use on this machine, so TensorFlow's gRPC "
              r"server|could not listen on its given address .*port is "
              r"taken).*given the same task index")])
def test_workers_given_different_clusters_are_refused(change, match):
    # #43: TensorFlow failed the first collective, in its words ("is
    # joining a group with size3, but that group has size 2"), or said only
    # "Could not start gRPC server". Now the job is refused before a step
    # runs, naming the difference.
    assert_start_refused(workers.different_cluster_descriptions, (change,),
                         match, TIMEOUT)


def test_a_taken_port_is_named_before_the_job_starts():
    assert_taken_port_is_named()


EXIT_PROGRAM = r'''
import atexit, sys, time
from keras_distribute.backend.tensorflow import cluster
cluster.EXIT_AFTER_LOSS_S = 2.0
if sys.argv[1] == "hangs":
    atexit.register(time.sleep, 120)  # runs after kd's (LIFO): a stuck exit
cluster._bound_the_exit("process 1 of 2 lost process 0 at 10.0.0.1")
cluster._bound_the_exit("again")  # once is enough
raise SystemExit(3)
'''


@pytest.mark.parametrize("shutdown", ["hangs", "ends"])
def test_a_process_that_lost_a_worker_exits_within_a_bound(tmp_path,
                                                           shutdown):
    # TensorFlow's shutdown after a lost peer can wait without end in
    # native code (seen in CI: a partitioned worker raised WorkerLostError
    # and never ended); a watcher started at exit ends it, saying why. A
    # process whose exit completes is left alone (its own exit code).
    import subprocess
    import sys
    import time

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", EXIT_PROGRAM, shutdown],
                          capture_output=True, text=True, timeout=100,
                          cwd=tmp_path)
    took = time.monotonic() - started
    if shutdown == "hangs":
        assert done.returncode == -9 and took < 60, (done.returncode, took)
        assert ("TensorFlow did not shut down within 2 s after process 1 of "
                "2 lost process 0 at 10.0.0.1") in done.stderr
    else:
        assert done.returncode == 3, done.stderr
        assert "did not shut down" not in done.stderr
