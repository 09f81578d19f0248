"""Multi-process checkpoint checks shared by the three backends' launches
(run inside `worker_training.training_features`)."""

import numpy as np


def spread_writes(strategy, directory):
    """Each process: a `ShardedCheckpoint` of a model whose replicated
    variables are spread over the writers (`SPREAD_BYTES` lowered so small
    ones count), read back into a new model. `directory` may be an
    `s3://` prefix (each process then uploads its own shard file)."""
    import posixpath

    import keras

    import keras_distribute as kd
    from keras_distribute.checkpoint.objects import saved_objects

    def make(seed):
        keras.utils.set_random_seed(seed)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)),
                                      keras.layers.Dense(16),
                                      keras.layers.Dense(16),
                                      keras.layers.Dense(3)])
        return model

    spread, saved_objects.SPREAD_BYTES = saved_objects.SPREAD_BYTES, 64
    try:
        model = make(1)
        path = kd.checkpoint.ShardedCheckpoint(model=model).write(
            posixpath.join(directory, "spread"))
    finally:
        saved_objects.SPREAD_BYTES = spread
    restored = make(2)
    kd.checkpoint.ShardedCheckpoint(model=restored).read(
        path).assert_consumed()
    return {"path": path, "weights": model.get_weights(),
            "restored": restored.get_weights()}


def check_spread_writes(results):
    """`spread_writes` of 2 processes: both shard files hold variables (the
    4 kernels and biases of at least 64 bytes: 2 each by bytes), every
    process restores exactly what it saved."""
    import json
    import os

    path = results[0]["path"]
    if path.startswith("s3://"):
        from keras_distribute.checkpoint.storage import remote_checkpoints

        index = remote_checkpoints.read_index(path)
        assert sorted(index["object_store"]["files"]) == [
            "shards-00000.h5", "shards-00001.h5"]
    else:
        with open(os.path.join(path, "index.json")) as f:
            index = json.load(f)
    files = sorted(piece["file"] for entry in index["variables"].values()
                   for piece in entry["pieces"])
    assert set(files) == {"shards-00000.h5", "shards-00001.h5"}, files
    for result in results:
        for a, b, c in zip(result["weights"], result["restored"],
                           results[0]["weights"]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(b, c)


def directory_held_by_another_job(strategy, directory):
    """Each process (#43 item 4): a manager on a directory whose lease
    another job (a process that process 0 starts) holds is refused in every
    process, with the same message; once that job ends, the managers take
    it."""
    import os
    import subprocess
    import sys

    import keras

    import keras_distribute as kd
    from keras_distribute.checkpoint.storage import lease

    directory = os.path.join(directory, "leased")
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    holder = None
    if kd.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        holder = subprocess.Popen(
            [sys.executable, "-c",
             "import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('l', "
             f"{lease.__file__!r})\n"
             "l = importlib.util.module_from_spec(spec)\n"
             "spec.loader.exec_module(l)\n"
             f"l.take({directory!r}); print('held', flush=True)\n"
             "sys.stdin.read()\n"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    try:
        # The others wait in the manager for process 0's verdict.
        kd.checkpoint.CheckpointManager(checkpoint, directory)
        refused = None
    except kd.checkpoint.DirectoryInUseError as error:
        refused = str(error)
    finally:
        if holder is not None:
            holder.communicate("", timeout=60)
    manager = kd.checkpoint.CheckpointManager(checkpoint, directory)
    saved = os.path.basename(manager.save())
    manager.close()
    return {"refused": refused, "saved": saved,
            "holder": holder.pid if holder is not None else None}


def check_directory_held_by_another_job(results):
    holder = results[0]["holder"]
    for result in results:
        assert result["refused"] is not None, "a process was not refused"
        assert result["refused"] == results[0]["refused"]
        assert f"process id {holder}" in result["refused"]
        assert result["saved"] == "ckpt-1"
