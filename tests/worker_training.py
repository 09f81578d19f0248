"""The #16 training features across 2 processes, on every backend.

Each backend's `workers_*` module wraps a body here with its own strategy;
the `launch_*` helpers run it under `kd.launch` and compare it with one
process.
"""

import numpy as np

from worker_common import initial_weights, make_data, make_model

# Accumulate 3 batches per update, keep an EMA and write it into the
# weights every 4 updates: the 2 conditional updates Keras wraps in
# `ops.cond`.
ACCUMULATION = {"gradient_accumulation_steps": 3, "use_ema": True,
                "ema_overwrite_frequency": 4}


def accumulating_model():
    import keras

    model = make_model(initial_weights())
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9, **ACCUMULATION),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit_accumulating(model):
    x, y = make_data(n=100)  # batch 16: 6 full batches and one of 4
    return model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                     verbose=0).history


def gradient_accumulation(strategy):
    """`fit` of the accumulating model under `strategy` (in each process)."""
    with strategy.scope():
        model = accumulating_model()
    history = _fit_accumulating(model)
    return {"loss": history["loss"], "weights": model.get_weights(),
            "iterations": int(model.optimizer.iterations)}


def launch_gradient_accumulation(workers, timeout):
    """Runs `workers.gradient_accumulation` on 2 processes: identical
    weights in both, equal to one process (short last batch included)."""
    import keras_distribute as kd

    results = kd.launch(workers.gradient_accumulation, num_processes=2,
                        timeout=timeout)
    reference = accumulating_model()
    history = _fit_accumulating(reference)
    for result in results:
        # 14 batches, one update every 3.
        assert result["iterations"] == 14 // 3
        np.testing.assert_allclose(result["loss"], history["loss"],
                                   rtol=1e-5)
        for a, b, c in zip(result["weights"], results[0]["weights"],
                           reference.get_weights()):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, c, atol=1e-5)
