"""MultiWorkerMirroredStrategy on JAX: 2 processes x 2 CPU devices, loopback."""

import os

import numpy as np
import pytest
import workers_jax as workers
from conftest import BACKEND
from worker_common import assert_hung_peer_is_named
from worker_common import assert_survivor_fails_within
from worker_common import assert_taken_port_is_named

import keras_distribute as kd

pytestmark = pytest.mark.skipif(
    BACKEND != "jax", reason="jax.distributed tests: JAX backend")
TIMEOUT = 300


def test_multi_worker_fit_matches_one_device():
    results = kd.launch(workers.multi_worker_fit, num_processes=2,
                        timeout=TIMEOUT)
    x, y = workers.make_data()
    model = workers.make_model(workers.initial_weights())
    history = model.fit(x, y, batch_size=workers.BATCH, epochs=3,
                        shuffle=False, verbose=0, validation_split=0.2)
    predictions = model.predict(x, batch_size=workers.BATCH, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=workers.BATCH, verbose=0)
    assert [r["local_ids"] for r in results] == [[0, 1], [2, 3]]
    for result in results:
        assert result["replicas"] == 4
        assert result["sum_ids"] == 6.0
        assert result["gather"] == [0, 1, 2, 3]
        for key in ("loss", "accuracy", "val_loss"):
            np.testing.assert_allclose(result["history"][key],
                                       history.history[key], rtol=1e-5)
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(result["evaluate"], evaluation, rtol=1e-5)
        np.testing.assert_allclose(result["predict"], predictions, atol=1e-5)
        # #16: gradients all-reduced in fp16 across the processes: one set
        # of weights in both, near the one-device run, global logs.
        compressed = result["compressed"]
        assert {dtype for dtype, _ in compressed["reduced"]} == {"float16"}
        assert sum(n for _, n in compressed["reduced"]) == (
            2 * model.count_params())
        for a, b in zip(compressed["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-3)
        for key in ("loss", "accuracy", "val_loss"):
            np.testing.assert_allclose(compressed["history"][key],
                                       history.history[key], rtol=1e-3)
    for a, b in zip(results[0]["compressed"]["weights"],
                    results[1]["compressed"]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_multi_worker_custom_loop_with_train_step_matches_fit():
    # Regression: the documented JAX loop failed at step 2 ("does not
    # support cross-host device transfers").
    from worker_common import assert_train_step_loop_matches_fit

    assert_train_step_loop_matches_fit(kd.launch(
        workers.multi_worker_train_step, num_processes=2, timeout=TIMEOUT))


def test_a_lost_worker_fails_the_survivor_within_the_timeout():
    assert_survivor_fails_within(kd.launch, workers.peer_leaves_early, TIMEOUT)


def test_a_hung_worker_that_still_runs_is_named_not_waited_for():
    # Rank 1 sleeps in a callback (alive): JAX would wait for it without
    # end in native code; kd's watchdog ends rank 0 after the 10 s timeout,
    # naming rank 1, and the launcher blames rank 1.
    assert_hung_peer_is_named(kd.launch, workers.hang_on_rank_one)


def test_a_worker_that_never_joins_fails_within_the_timeout():
    import time

    # JAX's coordination service aborts the waiting process (SIGABRT, which
    # no Python code can catch) once `initialization_timeout` has passed;
    # the launcher says what it was doing (#17: not a bare SIGABRT).
    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match=r"Process 0 of 1 died with exit "
                       r"code -6 before returning \(killed by SIGABRT\) "
                       r"while joining "
                       r"jax.distributed at 127.0.0.1:\d+ as process 0 of 2: "
                       r"JAX aborts a process \(SIGABRT\) when not every "
                       r"process joined within \d+ s"):
        kd.launch(workers.peer_never_joins, num_processes=1, timeout=TIMEOUT)
    assert time.monotonic() - start < 60


LONELY_WORKER = """
import json, os, socket
ports = []
for _ in range(2):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        ports.append(probe.getsockname()[1])
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
    "task": {"type": "worker", "index": 0}})
import keras_distribute as kd
kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=5))
"""


def test_a_worker_started_by_hand_says_why_jax_aborted_it(tmp_path):
    """#29: started as the TF tutorials do (TF_CONFIG, no kd launcher),
    a worker whose peer never joins was aborted with JAX's native log
    only. kd's note now reaches its own stderr, with the exit code."""
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(LONELY_WORKER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_DISTRIBUTE_NOTES_DIR", "RANK",
                        "KERAS_DISTRIBUTION_PROCESS_ID")}
    done = subprocess.run([sys.executable, str(script)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == -6  # SIGABRT, from JAX's native code
    assert ("keras_distribute: process 0 ended without exiting (killed by a "
            "signal, or aborted in native code: exit code 128 + the signal, "
            "e.g. 134 for SIGABRT) while joining jax.distributed at "
            "127.0.0.1:") in done.stderr
    assert "not every process joined within 5 s" in done.stderr


def test_checkpoint_callbacks_across_processes(tmp_path):
    from worker_common import assert_checkpoints_hold

    directory = str(tmp_path / "ckpt")
    results = kd.launch(workers.sharded_checkpoints, num_processes=2,
                        args=(directory,), timeout=TIMEOUT)
    assert_checkpoints_hold(results, directory)


TORCHRUN_SCRIPT = """
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
import os

import numpy as np
import keras_distribute as kd
strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=20))
values = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
result = {"replicas": strategy.num_replicas_in_sync,
          "sum": float(strategy.reduce("sum", values, axis=None))}
with open(os.path.join(os.path.dirname(__file__),
                       f"result-{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
"""


def test_torchrun_launches_a_jax_job(tmp_path):
    # Regression (docs/multi_worker.md: torchrun on any backend): JAX's
    # coordinator tried MASTER_PORT, which torchrun's own store holds.
    import json
    import subprocess
    import sys

    from keras_distribute.launch.processes import free_port

    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    port = free_port()  # below the ephemeral range (its docstring)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
         "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         str(script)], capture_output=True, text=True, timeout=240,
        env={**os.environ, "KERAS_BACKEND": "jax"})
    # Exit code 0: both processes joined and finished (before the fix they
    # failed with the port clash). A result with 2 replicas and the sum 3
    # proves the all-reduce spanned both. (A full-suite CI run twice saw
    # only one process's report although both exited 0; the check does not
    # depend on both reports arriving.)
    results = [json.loads(path.read_text())
               for path in sorted(tmp_path.glob("result-*.json"))]
    assert done.returncode == 0 and results, done.stderr[-3000:]
    assert all(r == {"replicas": 2, "sum": 3.0} for r in results), results


def test_keras_own_file_callbacks_resume_across_processes(tmp_path):
    # #20.6 regression, JAX: "passed to device_put is not the same on each
    # process" (the chief's save built Keras' reference Optimizer under the
    # distribution).
    from worker_common import launch_keras_callbacks_resume

    launch_keras_callbacks_resume(workers, str(tmp_path), TIMEOUT)


def test_a_divergence_in_any_region_of_any_variable_is_caught():
    # #72.9: region keys and 63-bit digests crossed the processes as int64,
    # which JAX without 64-bit types truncates (a key read as negative was
    # "holds none"), and only the first region a process held of a sharded
    # variable was compared: 9 of 30 such divergences went unseen.
    results = kd.launch(workers.divergence_in_every_region,
                        num_processes=2, timeout=TIMEOUT)
    assert results[0] == results[1]
    cases = results[0]
    # big/kernel and down/kernel: 2 regions each; with their Adam slots,
    # 6 sharded variables of 2 regions; biases, slots of biases, counters.
    assert sum(1 for _, region, _ in cases
               if region not in {tuple((0, n) for n in (32,)),
                                 tuple((0, n) for n in (4,))}) >= 12
    unseen = [(path, region) for path, region, named in cases
              if named != path]
    assert unseen == [], unseen


def test_a_large_sharded_variable_is_born_sharded_from_process_zeros_seed():
    # #45.3 with several processes: each process computes only its shards
    # of the 4 MiB kernel (never the whole value, never a whole broadcast),
    # from process 0's seed, although each process drew its own.
    import keras

    results = kd.launch(workers.born_sharded_from_process_zero,
                        num_processes=2, timeout=TIMEOUT)
    assert results[0]["own_seed"] != results[1]["own_seed"]  # diverged
    expected = np.asarray(keras.initializers.GlorotUniform(
        seed=results[0]["own_seed"])((1024, 1024)))
    for result in results:
        assert result["processes"] == 2
        assert result["shards"] == [(1024, 512)]
        np.testing.assert_array_equal(result["kernel"], expected)
        assert result["ones"] == 1.0
        # Only small broadcasts (seeds, the small variables): no kernel.
        assert result["largest_broadcast"] < 1024 * 1024, result


def test_a_model_built_after_random_states_diverged_starts_from_the_chief():
    # #20.10 regression: JAX failed: "device_put ... not the same on each
    # process".
    from worker_common import launch_diverged_random_states

    launch_diverged_random_states(workers, TIMEOUT)


def test_save_before_fit_with_one_device_per_process(tmp_path):
    # Regression (#19.3): multi_worker.md's custom-loop checkpoint with one
    # device per process raised "An argument array had 2 shard(s)".
    results = kd.launch(workers.save_before_fit_one_device_per_process,
                        num_processes=2, args=(str(tmp_path),),
                        timeout=TIMEOUT)
    assert [r["path"] for r in results] == [str(tmp_path / "ckpt-1")] * 2
    for result in results:
        for a, b in zip(result["weights"], workers.initial_weights()):
            np.testing.assert_array_equal(a, b)


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


def test_a_one_host_job_listens_on_loopback_only():
    # #43: the coordinator (process 0) listened on every interface.
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    for addresses in kd.launch(workers.listening_addresses, num_processes=2,
                               timeout=TIMEOUT):
        assert addresses and set(addresses) <= loopback, addresses


def test_workers_given_different_clusters_are_refused():
    # #43: a worker told of 3 processes beside a coordinator told of 2
    # trained, and both exited 0. Now every process refuses before training
    # (JAX then aborts them at exit: its shutdown barrier cannot pass); the
    # launch names the cause.
    with pytest.raises(kd.LaunchError, match="given different cluster "
                       "descriptions.*num_processes.: [23].*num_processes.: "
                       "[23]"):
        kd.launch(workers.different_cluster_descriptions, num_processes=2,
                  timeout=TIMEOUT)


def test_a_taken_port_is_named_before_the_job_starts():
    assert_taken_port_is_named()


def test_a_checkpoint_of_processes_that_trained_apart_is_not_written(tmp_path):
    # keras-io's jitted loop given each process's own NumPy rows: JAX
    # takes them as the same everywhere, unchecked, and each process
    # trains its own model. The save finds it before writing anything.
    directory = str(tmp_path / "ckpt")
    results = kd.launch(workers.own_jitted_loop_then_save, num_processes=2,
                        args=(directory,), timeout=TIMEOUT)
    for result in results:
        assert "kernel" in result["own_rows"], result["own_rows"]
        assert "before writing the checkpoint" in result["own_rows"]
        assert "global batch" in result["own_rows"]
        assert result["after_own_rows"] == [result["first"]]
        # kd.set_divergence_check("warn"): written, and the same words warned
        assert any("before writing the checkpoint" in w
                   for w in result["warnings"]), result["warnings"]
        assert result["whole_batch"] not in (result["first"],
                                             result["warned"])
    # Given the whole batch in every process, the loop trains one model.
    for mine, theirs in zip(*(r["weights"] for r in results)):
        np.testing.assert_array_equal(mine, theirs)
    assert sorted(name for name in os.listdir(directory)
                  if not name.startswith(".")) == sorted(
        {results[0][key] for key in ("first", "warned", "whole_batch")})
