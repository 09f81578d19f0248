"""The strategy across 2 gloo processes (PyTorch), through `kd.launch`.

Each launch starts real processes on 127.0.0.1; every wait is bounded.
"""

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import workers_torch as workers
from conftest import BACKEND
from worker_common import assert_hung_peer_is_named
from worker_common import assert_start_refused
from worker_common import assert_survivor_fails_within

import keras_distribute as kd

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="process-per-replica tests: torch backend")
TIMEOUT = 240


def reference_fit():
    x, y = workers.make_data()
    model = workers.make_model(workers.initial_weights())
    history = model.fit(x, y, batch_size=workers.BATCH, epochs=3,
                        shuffle=False, verbose=0)
    return model, history, x, y


@pytest.fixture(scope="module")
def fit_results():
    return kd.launch(workers.fit_evaluate_predict, num_processes=2,
                     timeout=TIMEOUT)


def test_fit_matches_single_process_with_short_last_batch(fit_results):
    model, history, x, y = reference_fit()
    for result in fit_results:
        assert result["replicas"] == 2
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(result["history"][key],
                                       history.history[key], rtol=1e-5)


def test_weights_and_logs_identical_on_every_rank(fit_results):
    first, second = fit_results
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)
    assert first["batch_logs"] == second["batch_logs"]
    assert first["history"] == second["history"]


NO_TENSORFLOW_PROGRAM = """
import json, sys
import keras_distribute as kd
import workers_torch

if __name__ == "__main__":
    results = kd.launch(workers_torch.fit_evaluate_predict, num_processes=2,
                        timeout=240)
    print(json.dumps([r["tensorflow_imported"] for r in results]
                     + ["tensorflow" in sys.modules]))
"""


def test_a_fit_of_several_processes_imports_no_tensorflow(tmp_path):
    # kd compares every process's model configuration before fit; Keras'
    # serialization imported all of TensorFlow (where installed) in each
    # torch process for it (~5 s of CPU each): integration/configs.py.
    # (The suite's own launches preload it: KERAS_DISTRIBUTE_PRELOAD in
    # conftest.py. Here a program that never imported it launches.)
    import json

    from program_runner import run_program

    script = tmp_path / "launch.py"
    script.write_text(NO_TENSORFLOW_PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.abspath(__file__)),
        os.environ.get("PYTHONPATH")])))
    env.pop("KERAS_DISTRIBUTE_PRELOAD", None)
    env.pop("KD_RECORD_BAD_INPUTS", None)
    done = run_program([str(script)], cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        False, False, False]


def test_evaluate_and_predict_are_global_and_ordered(fit_results):
    model, _, x, y = reference_fit()
    expected = model.evaluate(x, y, batch_size=workers.BATCH, verbose=0)
    predictions = model.predict(x, batch_size=workers.BATCH, verbose=0)
    for result in fit_results:
        np.testing.assert_allclose(result["evaluate"], expected, rtol=1e-5)
        assert result["predict"].shape == (203, 3)
        np.testing.assert_allclose(result["predict"], predictions, atol=1e-5)
        np.testing.assert_allclose(result["predict_on_batch"],
                                   predictions[:13], atol=1e-5)
    assert fit_results[0]["train_on_batch"] == fit_results[1]["train_on_batch"]


def test_documentation_examples_across_processes():
    rank0, rank1 = kd.launch(workers.docs_examples, num_processes=2,
                             timeout=TIMEOUT)
    assert rank0["doubled"] == [[[0]], [[4]]]
    assert rank1["doubled"] == [[[2]], [[6]]]
    assert (rank0["ids"], rank1["ids"]) == ([0], [1])
    for out in (rank0, rank1):
        assert out["sum_ids"] == 1.0
        assert out["all_reduce"] == [2.0]
        assert out["all_gather"] == [[1, 2, 3, 1, 2, 3]]
        assert out["gather_shape"] == (4, 1)
        assert out["reduce_none"] == [4.0, 6.0, 8.0, 10.0]
        assert out["reduce_axis0"] == 3.5
        assert out["short_mean"] == pytest.approx(10.5)
        assert out["avg_loss"] == pytest.approx(1.0)
    assert (rank0["array_value"], rank1["array_value"]) == ([3.0], [2.0])
    assert rank0["contexts"] == [(2, 0, 2)] and rank1["contexts"] == [(2, 1, 2)]
    assert rank1["from_function"] == [[[1, 1]]]


def test_custom_loop_matches_fit():
    results = kd.launch(workers.custom_loop, num_processes=2, timeout=TIMEOUT)
    x, y = workers.make_data(n=128)
    model = workers.make_model(workers.initial_weights())
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                        verbose=0).history
    for result in results:
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
        # Metrics updated inside `run` are global on every process
        # (regression: 5.5 on one rank, 1.5 on the other).
        assert result["mean"] == 3.5
        np.testing.assert_allclose(result["accuracies"],
                                   history["accuracy"], rtol=1e-6)
    assert results[0]["losses"] == results[1]["losses"]


def test_backend_neutral_train_step_matches_fit():
    from worker_common import assert_train_step_loop_matches_fit

    assert_train_step_loop_matches_fit(kd.launch(
        workers.train_step_loop, num_processes=2, timeout=TIMEOUT))


def test_fit_on_tf_data_py_dataset_and_data_loader():
    results = kd.launch(workers.input_types, num_processes=2, timeout=TIMEOUT)
    x, y = workers.make_data(n=96)
    model = workers.make_model(workers.initial_weights())
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for weights in results:
        for name, values in weights.items():
            for a, b in zip(values, model.get_weights()):
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)


def test_single_process_has_one_replica():
    assert kd.launch(workers.single_process_info, num_processes=1,
                     timeout=TIMEOUT) == [1]


def test_launch_returns_in_rank_order():
    assert kd.launch(workers.rank_and_world, num_processes=3,
                     timeout=TIMEOUT) == [(0, 3), (1, 3), (2, 3)]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(kd.LaunchError, match="(?s)Process 1 of 2 failed.*"
                       "rank one is broken") as info:
        kd.launch(workers.raise_on_rank_one, num_processes=2, timeout=TIMEOUT)
    assert info.value.rank == 1


def test_a_dead_rank_fails_the_launch_quickly_without_orphans():
    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match="Process 1 of 2 died with exit "
                       "code 3") as info:
        kd.launch(workers.die_on_rank_one_during_training, num_processes=2,
                  timeout=TIMEOUT)
    assert info.value.rank == 1
    assert time.monotonic() - start < TIMEOUT / 2
    import multiprocessing

    assert multiprocessing.active_children() == []


def test_a_frozen_rank_is_named_not_the_survivor():
    start = time.monotonic()
    with pytest.raises(kd.LaunchError, match="Process 1 of 2 is frozen "
                       r"\(stopped by SIGSTOP.*process 0 then failed "
                       "waiting for it") as info:
        kd.launch(workers.freeze_on_rank_one, num_processes=2,
                  timeout=TIMEOUT)
    assert info.value.rank == 1  # not 0, which only reported the loss
    # The survivor's own error names the frozen process too (kd's, with
    # gloo's timeout as its cause).
    # "on <host>": where it runs (its address in the job, else the host
    # name: #43).
    assert re.search(r"WorkerLostError: Process 0 of 2 could not complete a "
                     r"collective: process 1 of 2 on \S+ stopped answering",
                     str(info.value))
    # Named from the heartbeats read while it waited, not by watching them
    # for 2.5 beats more after gloo's timeout (a lost peer across hosts was
    # named 9 s past a 60 s timeout so).
    assert "did not change for" in str(info.value)
    assert "while this process waited" in str(info.value)
    assert time.monotonic() - start < TIMEOUT / 2
    import multiprocessing

    assert multiprocessing.active_children() == []  # the stopped one too


def test_a_hung_rank_that_still_runs_is_named_by_the_survivor():
    # Rank 1 sleeps in a callback (alive, its heartbeat goes on): rank 0's
    # collective times out (5 s) and its error says rank 1 is behind; the
    # launcher blames rank 1 and ends it.
    assert_hung_peer_is_named(kd.launch, workers.hang_on_rank_one)


def test_launches_fork_from_a_server_that_imported_keras_once(
        monkeypatch, capfd):
    # Every launch but the first starts in well under a second (no import of
    # Keras; docs/benchmarks.md has the figures): its processes are forks of one
    # server (their parent) that imported Keras once; each still gets the
    # launcher's environment and output of the moment, its own NumPy random
    # state and Python's SIGINT handler.
    from keras_distribute.launch import starting

    first = kd.launch(workers.how_it_started, num_processes=2, args=("a",),
                      timeout=TIMEOUT)
    monkeypatch.setenv("KD_TEST_TAG", "changed after the server started")
    capfd.readouterr()
    second = kd.launch(workers.how_it_started, num_processes=2, args=("b",),
                       timeout=TIMEOUT)
    assert starting.start_method() == "forkserver"
    server = {p["parent"] for p in first + second}
    assert len(server) == 1 and os.getpid() not in server
    assert all(p["keras_preloaded"] and p["sigint"] for p in first + second)
    # What KERAS_DISTRIBUTE_PRELOAD names (tensorflow: conftest.py) too.
    if os.environ.get("KERAS_DISTRIBUTE_PRELOAD") == "tensorflow":
        assert all(p["tensorflow_preloaded"] for p in first + second)
    assert [p["tag"] for p in second] == [
        "changed after the server started"] * 2
    assert second[0]["random"] != second[1]["random"]
    out = capfd.readouterr().out
    assert "launched process 0 says b" in out and "says a" not in out
    # A stream the launcher has closed (a daemon's) is not handed over
    # (the process keeps the server's) and the launch still runs.
    is_open = starting._is_open
    monkeypatch.setattr(starting, "_is_open", lambda fd: fd != 1)
    assert [p["tag"] for p in kd.launch(
        workers.how_it_started, num_processes=1, args=("d",),
        timeout=TIMEOUT)] == ["changed after the server started"]
    monkeypatch.setattr(starting, "_is_open", is_open)
    # A variable imports read changed: the server's imports are stale, so
    # the launch spawns (its processes are the launcher's children).
    monkeypatch.setenv("KERAS_HOME", os.path.join(os.getcwd(), "other"))
    assert starting.start_method() == "spawn"
    spawned = kd.launch(workers.how_it_started, num_processes=1,
                        args=("c",), timeout=TIMEOUT)
    assert spawned[0]["parent"] == os.getpid()
    monkeypatch.delenv("KERAS_HOME")
    assert starting.start_method() == "forkserver"
    # What importing a framework sets itself (TensorFlow imported after the
    # first launch, for tf.data; inductor's first use) leaves the server's
    # imports as they are: the launch still forks. A value the user changes
    # of a variable set when the server started does not.
    import tensorflow  # noqa: F401
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()
    for name in starting.SET_BY_IMPORTS - set(starting.import_time_env()):
        monkeypatch.setenv(name, "set by an import")
    assert starting.start_method() == "forkserver"
    assert kd.launch(workers.how_it_started, num_processes=1, args=("e",),
                     timeout=TIMEOUT)[0]["parent"] in server
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")  # set when it started
    assert starting.start_method() == "spawn"
    monkeypatch.undo()
    # kd's own settings are read as a job runs, not as kd is imported: a
    # new timeout reaches a forked process.
    monkeypatch.setenv("KERAS_DISTRIBUTE_TIMEOUT", "123")
    assert starting.start_method() == "forkserver"
    assert kd.launch(workers.timeout_setting, num_processes=1,
                     timeout=TIMEOUT) == [123.0]
    monkeypatch.undo()
    # So is the cluster a scheduler describes (TF_CONFIG, JAX's variables):
    # another cluster for the next job leaves the server's imports as they
    # are.
    for name in starting.JOB_START_VARIABLES:
        monkeypatch.setenv(name, "another cluster")
    assert starting.start_method() == "forkserver"
    monkeypatch.undo()
    # On the torch backend with a CUDA GPU a launch spawns: CUDA, which
    # the server's `import keras` starts, does not survive a fork.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert starting.torch_backend_sees_cuda()
    assert starting.start_method() == "spawn"
    monkeypatch.undo()
    assert not starting.torch_backend_sees_cuda()
    monkeypatch.setenv("KERAS_DISTRIBUTE_START_METHOD", "spawn")
    assert starting.start_method() == "spawn"
    monkeypatch.setenv("KERAS_DISTRIBUTE_START_METHOD", "fork")
    with pytest.raises(ValueError, match="Expected KERAS_DISTRIBUTE_START_"
                       "METHOD to be one of.*Received: 'fork'"):
        kd.launch(workers.rank_and_world, num_processes=1)


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="positive int"):
        kd.launch(workers.rank_and_world, num_processes=0)
    with pytest.raises(ValueError, match="callable"):
        kd.launch(3, num_processes=1)


def test_launch_module_runs_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        import keras_distribute as kd
        strategy = kd.MirroredStrategy()
        out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt")
        with open(out, "w") as f:
            f.write(str(strategy.num_replicas_in_sync))
    """))
    env = dict(os.environ, KERAS_BACKEND="torch")
    done = subprocess.run(
        [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
         str(script), str(tmp_path)], env=env, timeout=TIMEOUT)
    assert done.returncode == 0
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [
        "2", "2"]
    failing = tmp_path / "fail.py"
    failing.write_text("import os, sys\nsys.exit(7 if os.environ['RANK'] == "
                       "'1' else 0)\n")
    done = subprocess.run(
        [sys.executable, "-m", "keras_distribute.launch", "--nproc", "2",
         str(failing)], env=env, timeout=TIMEOUT, capture_output=True,
        text=True)
    assert done.returncode == 7
    assert "process 1 of 2 exited with code 7" in done.stderr


def test_torch_device_errors():
    with pytest.raises(ValueError, match="each process is one replica"):
        kd.MirroredStrategy(["CPU:0", "CPU:1"])


def test_epoch_logs_are_global_when_no_batch_log_is_read():
    x, y = workers.make_data()
    model = workers.make_model(workers.initial_weights())
    expected = model.fit(x, y, batch_size=workers.BATCH, epochs=2,
                         shuffle=False, verbose=0).history
    for history in kd.launch(workers.fit_quiet, num_processes=2,
                             timeout=TIMEOUT):
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(history[key], expected[key], rtol=1e-5)


def test_notebook_launcher_runs_a_function_defined_in_main():
    namespace = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        def notebook_cell_fn(offset):
            import os
            import keras_distribute as kd
            strategy = kd.MirroredStrategy()
            return (int(os.environ["RANK"]) + offset,
                    strategy.num_replicas_in_sync)
    """), namespace)
    assert kd.notebook_launcher(
        namespace["notebook_cell_fn"], num_processes=2, args=(10,),
        timeout=TIMEOUT) == [(10, 2), (11, 2)]


def test_multi_worker_strategy_from_tf_config_matches_one_process():
    from keras_distribute.launch.processes import free_port as _free_port

    results = kd.launch(workers.multi_worker_from_tf_config, num_processes=2,
                        args=(_free_port(),), timeout=TIMEOUT)
    x, y = workers.make_data(n=100)
    model = workers.make_model(workers.initial_weights())
    expected = model.fit(x, y, batch_size=20, epochs=2, shuffle=False,
                         verbose=0).history
    assert [r["task"] for r in results] == [("worker", 0, True),
                                            ("worker", 1, False)]
    for result in results:
        assert result["replicas"] == 2
        np.testing.assert_allclose(result["history"]["loss"], expected["loss"],
                                   rtol=1e-5)
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_multi_worker_peer_that_never_joins_times_out_clearly():
    from keras_distribute.launch.processes import free_port as _free_port

    (message, elapsed), = kd.launch(workers.multi_worker_peer_never_joins,
                                    num_processes=1, args=(_free_port(),),
                                    timeout=TIMEOUT)
    assert "Not every worker joined within 3 s" in message
    assert elapsed < 60


def test_communication_options_validation():
    with pytest.raises(ValueError, match="positive number"):
        kd.CommunicationOptions(timeout_seconds=0)


def test_only_the_chief_writes_and_early_stopping_agrees(tmp_path):
    results = kd.launch(workers.fit_with_file_callbacks, num_processes=2,
                        args=(str(tmp_path),), timeout=TIMEOUT)
    (epochs0, weights0), (epochs1, weights1) = results
    assert epochs0 == epochs1 < 20  # every rank stopped at the same epoch
    for a, b in zip(weights0, weights1):
        np.testing.assert_array_equal(a, b)
    rows = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert rows[0].startswith("epoch") and len(rows) == epochs0 + 1
    saved = sorted(p.name for p in tmp_path.glob("ckpt_*.weights.h5"))
    assert len(saved) == epochs0
    assert not (tmp_path / "backup").exists()  # the chief cleaned it up


def test_rank_dependent_callbacks_and_saves_in_every_process(tmp_path):
    # Regressions: a chief-only callback list hung both ranks (one
    # all-reduced metrics every step, the other not); rank 1 read the
    # chief's file before it was written; model.save in both processes gave
    # `BadZipFile`; kd BackupAndRestore failed on rank 1 (the chief deleted
    # the backup first).
    results = kd.launch(workers.rank_dependent_callbacks_and_saves,
                        num_processes=2, args=(str(tmp_path),),
                        timeout=TIMEOUT)
    for result in results:
        for name in ("loaded",):
            for a, b in zip(result[name], results[0]["weights"]):
                np.testing.assert_array_equal(a, b)
        for weights in result["reloaded"]:
            for a, b in zip(weights, results[0]["weights"]):
                np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "chief.weights.h5", "model.keras"]


def test_a_lost_worker_fails_the_survivor_within_the_timeout():
    error = assert_survivor_fails_within(kd.launch, workers.peer_leaves_early,
                                         TIMEOUT)
    assert re.search(r"WorkerLostError: Process 0 of 2 could not complete a "
                     r"collective: process 1 of 2 on \S+ has left the job",
                     str(error))


def test_auto_shard_policies_decide_what_each_worker_reads(tmp_path):
    (tmp_path / "part0.txt").write_text("0\n1\n2\n3\n")
    (tmp_path / "part1.txt").write_text("10\n11\n12\n13\n")
    rank0, rank1 = kd.launch(workers.auto_shard_policies, num_processes=2,
                             args=(str(tmp_path),), timeout=TIMEOUT)
    # FILE: each worker reads its own file, in its own batches of 2.
    assert rank0["FILE"] == [[0, 1], [2, 3]]
    assert rank1["FILE"] == [[10, 11], [12, 13]]
    # DATA / AUTO: every global batch of 2 is split across both workers.
    for policy in ("DATA", "AUTO"):
        assert rank0[policy] == [[0], [2], [10], [12]]
        assert rank1[policy] == [[1], [3], [11], [13]]
    # OFF: every worker reads everything.
    assert rank0["OFF"] == rank1["OFF"] == [[0, 1], [2, 3], [10, 11], [12, 13]]


def test_checkpoint_callbacks_across_processes(tmp_path):
    from worker_common import assert_checkpoints_hold

    directory = str(tmp_path / "ckpt")
    results = kd.launch(workers.sharded_checkpoints, num_processes=2,
                        args=(directory,), timeout=TIMEOUT)
    assert_checkpoints_hold(results, directory)


# ------------------------------------------------- sharded layouts (DTensor)
@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded")
    results = kd.launch(workers.sharded_fit, num_processes=2,
                        args=(str(directory),), timeout=TIMEOUT)
    return results, str(directory / "ckpt")


def single_process_sharded_reference(dropout=True):
    model, x, y, _ = workers.make_sharded_parts(dropout=dropout)
    model.compile(optimizer=workers.sharded_optimizer(), loss="mse",
                  metrics=["mae"])
    initial = model.get_weights()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                        verbose=0)
    return model, initial, history, x, y


def assert_like_single_process(results, model, history, x, y, atol):
    """Every process's weights, logs, evaluate and predict equal the single
    process run's; every process holds the same weights."""
    for result in results:
        for a, b in zip(result["weights"], model.get_weights()):
            np.testing.assert_allclose(a, b, atol=atol)
        for key in ("loss", "mae"):
            np.testing.assert_allclose(result["history"][key],
                                       history.history[key], rtol=1e-5)
        np.testing.assert_allclose(
            result["evaluate"], model.evaluate(x, y, batch_size=16,
                                               verbose=0), rtol=1e-5)
        np.testing.assert_allclose(
            result["predict"], model.predict(x, batch_size=16, verbose=0),
            atol=1e-5)
    for result in results[1:]:
        for a, b in zip(result["weights"], results[0]["weights"]):
            np.testing.assert_array_equal(a, b)


def assert_mesh_is_keras(report, ranks, model_ranks):
    """The engine's torch mesh puts the mesh's devices' ranks where the
    mesh does; where Keras distributes torch (3.16) it is Keras' own mesh
    and every sharded variable has the placements Keras gives its layout."""
    import keras

    assert report["ranks"] == ranks
    assert report["model_ranks"] == model_ranks
    if keras.version() < "3.16":
        assert report["keras_layouts"] is False
        return
    assert report["keras_layouts"] is True
    assert report["is_keras_backend_mesh"] is True
    assert report["placements"] and all(
        ours == keras_own for ours, keras_own in report["placements"])
    assert any("Shard" in ours for ours, _ in report["placements"])


def test_sharded_embedding_and_dense_train_like_one_process(sharded_results):
    results, _ = sharded_results
    model, initial, history, x, y = single_process_sharded_reference()
    expected_optimizer = [np.asarray(v) for v in model.optimizer.variables]
    for result in results:
        assert result["replicas"] == 1  # one replica over both processes
        # Each process holds half of every sharded variable.
        assert result["local_shapes"] == [(12, 4), (40, 8), (8,), (8, 3),
                                          (3,), None, None]
        for a, b in zip(result["initial"], initial):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(result["optimizer"], expected_optimizer):
            np.testing.assert_allclose(a, b, atol=1e-6)  # slots too
    assert_like_single_process(results, model, history, x, y, atol=1e-6)
    first = results[0]
    for a, b in zip(first["reset"], initial):
        np.testing.assert_array_equal(a, b)  # set_weights on sharded
    assert "size 5, which does not divide" in first["errors"]["indivisible"]
    assert "matches none of the variables" in first["errors"]["unmatched"]
    assert "variables were created outs" in first["errors"]["outside"]
    for result, rank in zip(results, (0, 1)):
        assert_mesh_is_keras(result["mesh"], [[0, 1]], [0, 1])
    assert "(None, 'model')" in first["layout"]
    assert "up/kernel" in first["layout"] and "1.2 KiB" in first["layout"]
    # Drawn: the mesh of the 2 processes, each holding the same bytes.
    picture = first["layout"].to_html()
    assert picture.count(">device ") == 2 and "1.2 KiB</td>" in picture


def test_sharded_checkpoint_restores_onto_sharded_and_one_process(
        sharded_results):
    import json

    results, path = sharded_results
    first = results[0]
    for a, b in zip(first["restored"], first["weights"]):
        np.testing.assert_array_equal(a, b)  # into a fresh sharded model
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    embeddings = next(entry for entry in index["variables"].values()
                      if entry["path"].endswith("embed/embeddings"))
    # Each process wrote its own half, once.
    assert sorted((p["file"], tuple(map(tuple, p["slice"])))
                  for p in embeddings["pieces"]) == [
        ("shards-00000.h5", ((0, 12), (0, 4))),
        ("shards-00001.h5", ((0, 12), (4, 8)))]
    # 2 processes -> 1: a plain model reads the sharded checkpoint whole,
    # and what the callbacks wrote during fit (the chief's files only).
    directory = os.path.dirname(path)
    latest = kd.checkpoint.latest_checkpoint(os.path.join(directory,
                                                          "latest"))
    for source in (path, latest):
        plain, _, _, _ = workers.make_sharded_parts(seed=5)
        kd.checkpoint.ShardedCheckpoint(model=plain).read(
            source).expect_partial()
        for a, b in zip(plain.get_weights(), first["weights"]):
            np.testing.assert_array_equal(a, b)
    for name in ("keras.weights.h5", "export.weights.h5"):
        plain.load_weights(os.path.join(directory, name))
        for a, b in zip(plain.get_weights(), first["weights"]):
            np.testing.assert_array_equal(a, b)
    assert os.path.exists(os.path.join(directory, "backup",
                                       "latest.weights.h5"))


def test_sharded_layout_errors_in_one_process():
    import keras
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    two = LayoutMap(DeviceMesh((1, 2), ["batch", "model"], ["cpu:0", "cpu:1"]))
    two[".*kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"needs 2 processes.*Received: 1"):
        kd.MirroredStrategy(layout_map=two)
    mixed = LayoutMap(DeviceMesh((2, 2), ["batch", "model"],
                                 [f"cpu:{i}" for i in range(4)]))
    mixed[".*kernel"] = (None, "model")
    with pytest.raises(ValueError, match=r"needs 4 processes"):
        kd.MirroredStrategy(layout_map=mixed)
    fsdp = LayoutMap(DeviceMesh((2, 2), ["batch", "model"],
                                [f"cpu:{i}" for i in range(4)]))
    fsdp[".*kernel"] = ("batch", "model")  # FSDP-style: checked as any map
    with pytest.raises(ValueError, match=r"needs 4 processes"):
        kd.MirroredStrategy(layout_map=fsdp)
    twice = LayoutMap(DeviceMesh((1, 2), ["batch", "model"],
                                 ["cpu:0", "cpu:1"]))
    twice[".*kernel"] = ("model", "model")
    with pytest.raises(ValueError, match="two dimensions over mesh axis "
                       "'model'.*Received: layout axes=\\('model', 'model'"):
        kd.MirroredStrategy(layout_map=twice)
    import torch

    from keras_distribute.backend.torch import mesh as torch_mesh

    cpu = torch.device("cpu")
    ranks = torch_mesh.mesh_ranks(
        DeviceMesh((2, 2), ["batch", "model"],
                   ["cpu:0", "cpu:2", "cpu:1", "cpu:3"]), cpu, 4)
    assert ranks.tolist() == [[0, 2], [1, 3]]
    for devices, message in (
            (["gpu:0", "gpu:1"], "device type \\('cpu'\\).*'gpu:0'"),
            (["cpu", "cpu:1"], "Received: device 'cpu'"),
            (["cpu:1", "cpu:1"], "each rank of the job \\(0..1\\) once.*"
             "ranks \\[1, 1\\]"),
            (["cpu:0", "cpu:2"], "ranks \\[0, 2\\]"),
            # torch's groups order processes by rank: a shard would land on
            # the wrong process (seen: halves of a kernel's update swapped).
            (["cpu:1", "cpu:0"], "ranks must increase.*\\[\\[1, 0\\]\\] "
             "along axis 'model'")):
        with pytest.raises(ValueError, match=message) as raised:
            torch_mesh.mesh_ranks(
                DeviceMesh((1, 2), ["batch", "model"], devices), cpu, 2)
        # The fix it suggests works on the Keras in use (Keras 3.15's torch
        # backend has no keras.distribution.list_devices()).
        suggested = str(raised.value)
        assert "[f'cpu:{r}' for r in range(2)]" in suggested
        if "list_devices()" in suggested:
            assert keras.distribution.list_devices()
    replicated = LayoutMap(DeviceMesh((1, 2), ["batch", "model"],
                                      ["cpu:0", "cpu:1"]))
    replicated[".*kernel"] = (None, None)  # nothing sharded: plain engine
    strategy = kd.MirroredStrategy(layout_map=replicated)
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
    assert type(layer.kernel.value).__name__ == "Parameter"


def test_backup_and_restore_resumes_mid_epoch_across_processes(tmp_path):
    results = kd.launch(workers.resume_mid_epoch, num_processes=2,
                        args=(str(tmp_path / "backup"),), timeout=TIMEOUT)
    for result in results:
        for a, b in zip(result["reference"], result["resumed"]):
            np.testing.assert_array_equal(a, b)
        # The resumed epoch's logs count the batches before the interrupt:
        # the metric state of every process was saved and restored.
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(result["history"][key],
                                       result["expected"][key][1:],
                                       rtol=1e-6)


def test_data_times_model_parallel_over_four_processes(tmp_path):
    import json

    results = kd.launch(workers.sharded_data_parallel_fit, num_processes=4,
                        args=(str(tmp_path),), timeout=TIMEOUT)
    model, _, history, x, y = single_process_sharded_reference(dropout=False)
    for rank, result in enumerate(results):
        assert result["replicas"] == 2
        assert result["local_shapes"][:4] == [(12, 4), (40, 8), (8,), (8, 3)]
        assert_mesh_is_keras(result["mesh"], [[0, 2], [1, 3]],
                             [[0, 2], [1, 3]][rank % 2])
    assert_like_single_process(results, model, history, x, y, atol=1e-5)
    for result in results:  # rank 1 changed its half of up/kernel
        variable, message = result["diverged"]
        assert variable == result["up_kernel_path"]
        assert "between process 0 and process 1" in message
    for result in results:  # interrupted mid-epoch, resumed: the same run
        for a, b in zip(result["resumed"], result["weights"]):
            np.testing.assert_array_equal(a, b)
        for key in ("loss", "mae"):
            np.testing.assert_allclose(result["resumed_history"][key],
                                       result["history"][key][1:], rtol=1e-6)
    # Replica 0's two processes (ranks 0 and 2) wrote one half each;
    # replica 1 nothing.
    with open(os.path.join(results[0]["path"], "index.json")) as f:
        index = json.load(f)
    kernel = next(entry for entry in index["variables"].values()
                  if entry["path"].endswith("up/kernel"))
    assert sorted(p["file"] for p in kernel["pieces"]) == [
        "shards-00000.h5", "shards-00002.h5"]
    plain, _, _, _ = workers.make_sharded_parts(seed=5, dropout=False)
    kd.checkpoint.ShardedCheckpoint(model=plain).read(
        results[0]["path"]).expect_partial()
    for a, b in zip(plain.get_weights(), results[0]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_fully_sharded_variables_train_like_one_process_and_reshard(
        tmp_path):
    # FSDP in one line (kd.layouts.fully_sharded over a 1-D mesh of 2):
    # 2 replicas; each process holds half of every variable of 32 elements
    # or more (on its largest even dimension), of its gradient and of its
    # Adam slots; the smaller ones are replicated.
    results = kd.launch(workers.fully_sharded_fit, num_processes=2,
                        args=(str(tmp_path / "two"), (2,), "one_line"),
                        timeout=TIMEOUT)
    model, _, history, x, y = single_process_sharded_reference(dropout=False)
    for result in results:
        assert result["replicas"] == 2
        assert result["local_shapes"] == [(6, 8), (20, 16), (16,), (8, 3),
                                          (3,), None, None]
        assert result["slot_shapes"][2:6] == [(6, 8), (6, 8), (20, 16),
                                              (20, 16)]
    assert_like_single_process(results, model, history, x, y, atol=1e-5)
    for result in results[1:]:
        for a, b in zip(result["weights"], results[0]["weights"]):
            np.testing.assert_array_equal(a, b)
    trained = results[0]["weights"]
    # 2 -> 1: a plain model reads the checkpoint whole, bit-exactly.
    plain, _, _, _ = workers.make_sharded_parts(seed=5, dropout=False)
    kd.checkpoint.ShardedCheckpoint(model=plain).read(
        results[0]["path"]).expect_partial()
    for a, b in zip(plain.get_weights(), trained):
        np.testing.assert_array_equal(a, b)
    # 2 -> 4, another cut: the one-line FSDP composed with a model-axis
    # map on a (2, 2) mesh (batch x model) reads it, then trains like one
    # process itself.
    results = kd.launch(workers.fully_sharded_fit, num_processes=4,
                        args=(str(tmp_path / "four"), (2, 2),
                              "one_line_x_model", results[0]["path"]),
                        timeout=TIMEOUT)
    for result in results:
        for a, b in zip(result["restored"], trained):
            np.testing.assert_array_equal(a, b)
        assert result["local_shapes"][:4] == [(6, 4), (20, 8), (8,), (8, 3)]
    assert_like_single_process(results, model, history, x, y, atol=1e-5)


def test_every_keras_optimizer_trains_fully_sharded_like_one_process():
    # Adafactor's factored slots are plain tensors updated from sharded
    # gradients; global_clipnorm sums norms over DTensors on two meshes.
    from worker_common import every_optimizer_fit

    reference = every_optimizer_fit(kd.MirroredStrategy())
    ranks = kd.launch(workers.every_optimizer_fully_sharded, num_processes=2,
                      timeout=TIMEOUT)
    for name, expected in reference.items():
        for rank in ranks:
            for a, b in zip(rank[name], expected):
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=name)
            for a, b in zip(rank[name], ranks[0][name]):
                np.testing.assert_array_equal(a, b, err_msg=name)


def test_lora_adapters_are_sharded_and_saved_under_fully_sharded(tmp_path):
    # #71.3: `enable_lora` under one-line FSDP: the adapters (128 and 256
    # elements, over min_size=64) stayed whole on torch, and save_weights
    # crashed ("aten.add.Tensor got mixed torch.Tensor and DTensor": Keras
    # merges the adapters into the kernel at save). They are laid out like
    # any variable of their size, train as one process does, and the saved
    # file (adapters merged) gives one process's predictions.
    import keras

    results = kd.launch(workers.lora_fully_sharded, num_processes=2,
                        args=(str(tmp_path),), timeout=TIMEOUT)
    reference = workers._lora_model()
    x, y = workers._lora_data()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for result in results:
        assert result["local"] == {"lora_kernel_a": (16, 4),
                                   "lora_kernel_b": (4, 32)}
        assert any("lora_kernel_a" in p for p in result["trainable"])
        for a, b in zip(result["weights"], reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)
    plain = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(64, activation="tanh",
                                                 name="up"),
                              keras.layers.Dense(8, name="down")])
    plain.load_weights(str(tmp_path / "lora.weights.h5"))
    np.testing.assert_allclose(plain.predict(x, verbose=0),
                               reference.predict(x, verbose=0), atol=1e-5)
    np.testing.assert_allclose(results[0]["predict"],
                               reference.predict(x, verbose=0), atol=1e-5)


def test_the_processes_of_one_replica_draw_the_same_dropout_masks():
    # #72.10: keras-io's guide under a (1, 2) mesh with no seed set: the
    # two processes of the one model replica drew their own dropout masks
    # (torch's global generator), the replicated d2/kernel diverged and the
    # guard stopped fit after the first epoch.
    results = kd.launch(workers.guide_model_parallel_unseeded,
                        num_processes=2, timeout=TIMEOUT)
    for result in results:
        assert result["error"] is None, result["error"]
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)


def test_a_large_sharded_variable_is_born_as_its_shards():
    # #45.3 on torch: each process draws only its half of the 4 MiB
    # kernel (in chunks of 65,536 values), from process 0's seed although
    # each process drew its own, and fills only its half of a zeros one;
    # the values equal the unsharded GlorotUniform's from that seed bit for
    # bit, and training from them equals one process.
    import keras

    results = kd.launch(workers.born_sharded_fit, num_processes=2,
                        timeout=TIMEOUT)
    assert results[0]["own_seed"] != results[1]["own_seed"]  # diverged
    expected = keras.ops.convert_to_numpy(keras.initializers.GlorotUniform(
        seed=results[0]["own_seed"])((1024, 1024)))
    for result in results:
        assert result["local"] == result["zero_local"] == (512, 1024)
        assert result["largest_draw"] <= 1 << 16, result["largest_draw"]
        # (the zeros kernel made as its half, never whole)
        assert result["largest_fill"] <= 512 * 1024, result["largest_fill"]
        np.testing.assert_array_equal(result["initial"][0], expected)
        np.testing.assert_array_equal(result["initial"][2], 0)
        for a, b in zip(result["trained"], results[0]["trained"]):
            np.testing.assert_array_equal(a, b)
    model = keras.Sequential([keras.Input((1024,)),
                              keras.layers.Dense(1024),
                              keras.layers.Dense(1024),
                              keras.layers.Dense(3)])
    model.set_weights(results[0]["initial"])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 1024)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), results[0]["trained"]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_sharded_transformer_block_matches_one_process():
    from worker_common import transformer_block
    from worker_common import transformer_data

    results = kd.launch(workers.sharded_transformer_block, num_processes=2,
                        timeout=TIMEOUT)
    reference = transformer_block()
    x, y = transformer_data()
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    for result in results:
        assert result["query_local"] == (16, 1, 8)  # 2 heads over 2
        assert result["replicas"] == 1
        assert_mesh_is_keras(result["mesh"], [[0, 1]], [0, 1])
        for a, b in zip(result["weights"], reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_convolutions_with_kernels_cut_by_channels_match_one_process():
    # A CNN under tensor parallelism (as plan_layout plans one): DTensor
    # cannot convolve a kernel cut by channels, so a convolution computes
    # on its gathered variables; they stay cut at rest, and training
    # equals one process.
    results = kd.launch(workers.sharded_convolutions, num_processes=2,
                        timeout=TIMEOUT)
    reference = workers.small_cnn()
    x, y = workers.small_cnn_data()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for result in results:
        assert result["local"] == [(3, 3, 3, 4), (3, 3, 4, 6)]
        for a, b in zip(result["weights"], reference.get_weights()):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_keras_own_file_callbacks_resume_across_processes(tmp_path):
    # #20.6 regression, torch: the same programs as on TF and JAX.
    from worker_common import launch_keras_callbacks_resume

    launch_keras_callbacks_resume(workers, str(tmp_path), TIMEOUT)


def test_a_model_built_after_random_states_diverged_starts_from_the_chief():
    # #20.10 regression: torch broadcasts rank 0's values.
    from worker_common import launch_diverged_random_states

    launch_diverged_random_states(workers, TIMEOUT)


def test_counting_metrics_are_global_with_one_ddp_and_one_reduction():
    # Regressions: TruePositives' result is a view of its variable, so a
    # read gave this process's count (6 on one rank, 10 on the other; 16
    # in one process). Keras 3.16 makes its own DDP and all-reduces every
    # metric variable itself: the engine uses that DDP and its one flat
    # reduction replaces Keras' (not two of each).
    import keras
    from worker_common import counting_metrics_fit

    results = kd.launch(workers.counting_metrics_and_one_ddp,
                        num_processes=2, timeout=TIMEOUT)
    history, evaluation, _ = counting_metrics_fit()
    for result in results:
        for name in ("true_positives", "false_negatives"):
            assert result["history"][name] == history[name]
            assert result["evaluate"][name] == evaluation[name]
            assert result["results"][name] == evaluation[name]
        assert result["ddp"] == ["Sequential"]  # one DDP, made once
        assert result["reductions"] == [(4,)]  # one flat all-reduce
        if keras.version() < "3.16":  # no torch distribution in Keras
            assert result["distribution"] is None
            continue
        # Keras 3.16 distributes torch: the strategy drives its
        # DataParallel over Keras' device list (current in fit, no second
        # sharding of the input), and Keras' DDP runs on the mesh's group.
        assert result["distribution"] == {
            "type": "DataParallel", "devices": ["cpu:0", "cpu:1"],
            "keras_devices": ["cpu:0", "cpu:1"],
            "auto_shard_dataset": False, "current_in_fit": True,
            "ddp_group_is_the_mesh_group": True}


def test_a_compiled_step_matches_one_process_and_never_recompiles():
    # #32: `jit_compile=True` runs Keras' step through torch.compile under
    # the held DDP. kd's per-step Python state (the watchdog's step count,
    # the DDP lookup) ran inside the traced step: a guard that failed at
    # every step, so each step recompiled until dynamo gave up (8 times)
    # and ran it eagerly. Now no frame compiles after the first epoch. On
    # CPU processes the step compiles whole (dynamo's "no_optimization":
    # DDP's graph split cost more than it gained), only while `fit` runs.
    results = kd.launch(workers.compiled_fit, num_processes=2,
                        timeout=TIMEOUT)
    x, y = workers.make_data()
    model = workers.make_model(workers.initial_weights())
    history = model.fit(x, y, batch_size=workers.BATCH, epochs=3,
                        shuffle=False, verbose=0).history
    for result in results:
        assert result["jit_compile"] is True
        assert result["mode_in_fit"] == [False], result
        assert result["mode_after_fit"] is True, result
        first_epoch, third_epoch = result["compiled"]
        assert first_epoch == third_epoch, result["compiled"]
        np.testing.assert_allclose(result["loss"], history["loss"],
                                   rtol=1e-5)
        for a, b, c in zip(result["weights"], results[0]["weights"],
                           model.get_weights()):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, atol=1e-5)


def test_a_compiled_step_compiles_whole_only_on_cpu_and_by_default():
    # kd replaces dynamo's default DDP graph split for a compiled `fit` on
    # CPU processes only; a mode the user set, compiled autograd (which
    # "no_optimization" cannot run with), an accelerator or an eager model
    # keep dynamo's setting as it is.
    from types import SimpleNamespace

    import torch
    import torch._dynamo

    from keras_distribute.backend.torch import training

    config = torch._dynamo.config
    cpu = SimpleNamespace(device=torch.device("cpu"))
    compiled = SimpleNamespace(jit_compile=True)

    def mode_inside(engine, model):
        with training.compiled_ddp_mode(engine, model):
            return config.optimize_ddp

    assert config.optimize_ddp is True
    assert mode_inside(cpu, compiled) is False  # "no_optimization"
    assert config.optimize_ddp is True
    assert mode_inside(SimpleNamespace(device=torch.device("cuda", 0)),
                       compiled) is True
    assert mode_inside(cpu, SimpleNamespace(jit_compile=False)) is True
    assert mode_inside(cpu, SimpleNamespace(jit_compile="auto")) is True
    for chosen in ("ddp_optimizer", "no_optimization", "python_reducer"):
        with config.patch(optimize_ddp=chosen):
            assert mode_inside(cpu, compiled) == chosen
    with config.patch(compiled_autograd=True):
        assert mode_inside(cpu, compiled) is True


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_equals_one_process_and_skips_together(policy):
    # #16: parity under a mixed policy (tolerance of the compute dtype),
    # float32 variables, and a non-finite gradient on one rank only skips
    # the step on both (the loss scale halves on both).
    import keras

    results = kd.launch(workers.mixed_precision, num_processes=2,
                        args=(policy,), timeout=TIMEOUT)
    previous = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        x, y = workers.make_data(n=96)
        model = workers.make_model(workers.initial_weights())
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                            verbose=0).history
        expected = model.get_weights()
    finally:
        keras.mixed_precision.set_dtype_policy(previous)
    tolerance = 5e-2 if policy == "mixed_bfloat16" else 5e-3
    for result in results:
        assert result["dtypes"] == ["float32"]
        np.testing.assert_allclose(result["loss"], history["loss"],
                                   rtol=tolerance)
        for a, b, c in zip(result["weights"], results[0]["weights"],
                           expected):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, atol=tolerance)
        if policy == "mixed_float16":
            skipped = result["skipped"]
            assert skipped["unchanged"]
            assert skipped["scale_after"] == skipped["scale_before"] / 2


def test_compressed_all_reduce_halves_the_bytes_and_keeps_accuracy():
    # #16: CommunicationOptions(compression="fp16"/"bf16"): a DDP
    # communication hook; bytes measured by torch's profiler.
    from worker_training import launch_compressed_all_reduce

    launch_compressed_all_reduce(workers, TIMEOUT)


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


def test_run_combines_the_metric_variables_every_process_holds():
    # Known bug (#17 notes): a process holding one more "sum" variable made
    # the combine after `run` all-reduce lists of different lengths (gloo
    # aborted). Mean of range(8) is 3.5 on both ranks, twice.
    results = kd.launch(workers.run_with_different_metric_variables,
                        num_processes=2, timeout=TIMEOUT)
    assert results == [[3.5, 3.5], [3.5, 3.5]]


def test_arrays_of_different_lengths_fail_alike_in_every_rank():
    """#29: a wrong-length `y`, `sample_weight` or validation array was a
    SIGABRT (gloo's collective mismatch) in rank 1; now every rank raises
    Keras' own error before any collective, and the job goes on."""
    results = kd.launch(workers.wrong_lengths, num_processes=2,
                        timeout=TIMEOUT)
    (errors0, loss0, weights0), (errors1, loss1, weights1) = results
    assert errors0 == errors1
    for name, message in errors0.items():
        assert message is not None and message.startswith(
            "Data cardinality is ambiguous"), name
    assert "in `validation_data`" in errors0["fit validation_data"]
    assert "'x' sizes: 203\n'y' sizes: 200" in errors0["fit y"]
    assert loss0 == loss1
    np.testing.assert_array_equal(weights0, weights1)


def test_run_returns_plain_values_where_a_process_has_one_replica():
    """#30: the keras-io PyTorch guide's `loss.item()` on `run`'s result
    failed ('PerReplica' object has no attribute 'item'); as tf.distribute,
    a process with one replica gets the plain value, and reduce / gather
    take it as that replica's."""
    first, second = kd.launch(workers.run_returns_plain_values,
                              num_processes=2, timeout=TIMEOUT)
    assert first["type"] == second["type"] == "Tensor"
    assert (first["item"], second["item"]) == (3.0, 6.0)
    for result in (first, second):
        assert result["sum"] == 9.0 and result["mean"] == 4.5
        assert result["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert result["local"] == 1
    assert (first["numpy"], second["numpy"]) == (3.0, 6.0)


def test_every_variable_is_the_same_in_every_process(tmp_path):
    """#30: BatchNormalization's moving statistics (and a layer's counter)
    differed between the processes after fit (up to 9e-4): the chief's
    saved model and the other process predicted differently. Now every
    variable, trainable or not, is equal in every process, and so are
    evaluate and predict."""
    from worker_common import assert_one_state

    assert_one_state(kd.launch(workers.batchnorm_one_state, num_processes=2,
                               args=(str(tmp_path),), timeout=TIMEOUT))


def test_processes_that_would_train_different_models_are_refused():
    """#30: keras-tuner's per-process oracles picked other hyperparameters:
    DDP failed on other layer sizes, another learning rate trained
    silently. Every process now raises before the first step, naming the
    first difference and the process."""
    from worker_common import assert_different_training_is_refused

    assert_different_training_is_refused(kd.launch(
        workers.different_training, num_processes=2, timeout=TIMEOUT))


def test_keras_tuner_with_a_seed_tunes_across_processes(tmp_path):
    first, second = kd.launch(workers.keras_tuner_search, num_processes=2,
                              args=(str(tmp_path),), timeout=TIMEOUT)
    assert first == second
    assert first["trials"] == first["completed"] == 2
    assert np.isfinite(first["evaluate"])


def test_a_tf_data_pipeline_of_unknown_length_trains():
    """#30: keras-hub's preprocessing mapped over tf.data (unknown
    cardinality) failed in both ranks with 'generator raised
    StopIteration'; it now trains like the same pipeline of known length."""
    for (known, unknown) in kd.launch(workers.unknown_cardinality,
                                      num_processes=2, timeout=TIMEOUT):
        assert unknown[0] == known[0] and unknown[1] == known[1]
        for a, b in zip(known[2], unknown[2]):
            np.testing.assert_array_equal(a, b)


def test_a_group_of_one_binds_no_port(tmp_path):
    # A one-worker MultiWorkerMirroredStrategy with no cluster named (the
    # multi_worker.md block) bound the default port 29500, and failed with
    # EADDRINUSE when another job held it: a group of one needs no port.
    script = tmp_path / "alone.py"
    script.write_text(textwrap.dedent("""
        import socket
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:
            pass  # someone else holds it: as good for this test
        import numpy as np
        import keras
        import keras_distribute as kd
        strategy = kd.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
        print("replicas", strategy.num_replicas_in_sync)
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                        "TF_CONFIG")}
    result = subprocess.run([sys.executable, str(script)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replicas 1" in result.stdout


def test_a_one_host_job_listens_on_loopback_only():
    # #43: torch's TCPStore listened on every interface (`*:port`) whatever
    # its host; kd hands it a socket bound to the coordinator's address.
    for addresses in kd.launch(workers.listening_addresses, num_processes=2,
                               timeout=TIMEOUT):
        assert addresses and set(addresses) <= {"127.0.0.1", "::1"}, addresses


@pytest.mark.parametrize("change,match", [
    ("count", r"given different cluster descriptions.*num_processes.: "
              r"[23].*num_processes.: [23]"),
    # Two processes 0 on one host: the second cannot bind the store's port.
    ("index", r"coordinator port .* already in use.*also given index 0")])
def test_workers_given_different_clusters_are_refused(change, match):
    # #43: a worker told of 3 processes waited for a third that never came,
    # and two "process 0 of 2" both waited out the timeout (the second
    # could not even host the store: its port is taken). Now the job is
    # refused before the group forms, naming the difference.
    assert_start_refused(workers.different_cluster_descriptions, (change,),
                         match, TIMEOUT)


def test_a_taken_coordinator_port_is_named():
    import socket

    from keras_distribute.backend.torch import groups

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"coordinator port {port} on "
                           "127.0.0.1 is already in use.*Received: address "
                           f"'127.0.0.1:{port}'.*choose a free port"):
            groups._listening_socket("127.0.0.1", port)
    finally:
        holder.close()
    assert groups._listening_socket("192.0.2.1", 1) is None  # not ours


def test_a_store_client_facing_a_foreign_listener_ends_in_time():
    # #43: with the coordinator's port held by another program, worker 1's
    # store client connected and waited for a handshake without end.
    import socket

    from keras_distribute.backend.torch import groups

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(4)  # accepts connections, never answers
    port = holder.getsockname()[1]
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=f"process 1 of 2 reached the "
                           f"job's store at 127.0.0.1:{port} but had no "
                           "answer from it within 2 s.*MASTER_PORT"):
            groups._store_client("127.0.0.1", port, 2, 2, "process 1 of 2")
    finally:
        holder.close()
    assert time.monotonic() - start < 30


def test_a_layer_computing_with_its_sublayers_kernels_matches_one_process(
        tmp_path):
    # keras-hub's Gemma 4 block reads `self.ffw_linear.kernel` itself,
    # outside the sublayer's call: that kernel, sharded over the batch axis
    # (FSDP-style) or a model axis, crashed the backward pass ("local_tensor
    # argument only accepts torch.Tensor but got DTensor") or, sharded over
    # the batch axis alone, trained to silently wrong weights. And a LoRA
    # head whose adapters the map leaves replicated could not be saved
    # (its kernel and adapters on two meshes).
    from worker_common import kernel_reading_data
    from worker_common import kernel_reading_model

    results = kd.launch(workers.kernel_reading_block, num_processes=2,
                        args=(str(tmp_path),), timeout=TIMEOUT)
    reference = kernel_reading_model(lora=True)
    x, y = kernel_reading_data()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for shape, local in (((2, 1), {"block/gate/kernel": (8, 32),
                                   "block/out/kernel": (32, 8)}),
                         ((1, 2), {"block/gate/kernel": (16, 16),
                                   "block/out/kernel": (16, 16)})):
        for result in results:
            mine = result[shape]
            for path, want in local.items():
                assert mine["local"][path] == want, (shape, path)
            for a, b in zip(mine["weights"], reference.get_weights()):
                np.testing.assert_allclose(a, b, atol=1e-5)
            for a, b in zip(mine["weights"], results[0][shape]["weights"]):
                np.testing.assert_array_equal(a, b)
        plain = kernel_reading_model(lora=True)
        plain.load_weights(results[0][shape]["path"])
        merged = kernel_reading_model()  # (no adapters: merged in)
        merged.load_weights(results[0][shape]["path"])
        want = reference.predict(x, verbose=0)
        for loaded in (plain, merged):
            np.testing.assert_allclose(loaded.predict(x, verbose=0), want,
                                       atol=1e-5)
    for result in results:  # (every process raises alike)
        assert result["diverged"] is not None
        assert "lora_kernel_a" in result["diverged"], result["diverged"]
