"""Multi-process checkpoint checks shared by the three backends' launches
(run inside `worker_training.training_features`)."""

import numpy as np


def spread_writes(strategy, directory):
    """Each process: a `ShardedCheckpoint` of a model whose replicated
    variables are spread over the writers (`SPREAD_BYTES` lowered so small
    ones count), read back into a new model."""
    import os

    import keras

    import keras_distribute as kd
    from keras_distribute.checkpoint import saved_objects

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
            os.path.join(directory, "spread"))
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

    with open(os.path.join(results[0]["path"], "index.json")) as f:
        index = json.load(f)
    files = sorted(piece["file"] for entry in index["variables"].values()
                   for piece in entry["pieces"])
    assert set(files) == {"shards-00000.h5", "shards-00001.h5"}, files
    for result in results:
        for a, b, c in zip(result["weights"], result["restored"],
                           results[0]["weights"]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(b, c)
