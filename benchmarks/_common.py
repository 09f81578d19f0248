"""Pieces both fit benchmarks share: the timed model and the step timer."""

import time

import keras


class StepTimer(keras.callbacks.Callback):
    """Records the wall time of every training step after `warmup` steps."""

    def __init__(self, warmup=5):
        super().__init__()
        self.warmup, self.times, self._start = warmup, [], None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if batch >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


def fit_step_times(model, x, y, batch_size):
    """Step times of one epoch of `model.fit(x, y)` (`StepTimer`'s)."""
    timer = StepTimer()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[timer])
    return timer.times


def make_model(jit_compile="auto", optimizer="adam"):
    """The 3-layer MLP both benchmarks time (256 -> 512 -> 512 -> 10);
    `jit_compile` goes to `compile` (on torch, `True` is `torch.compile`),
    as does `optimizer`."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=jit_compile)
    return model


class EpochTimer(keras.callbacks.Callback):
    """Wall time per step of each epoch, with no per-batch hook.

    A per-batch hook changes what `fit` does (Keras and kd then prepare
    every batch's logs), so steady-state step time is taken per epoch.
    """

    def __init__(self):
        super().__init__()
        self.per_step, self._start = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        steps = self.params["steps"]
        self.per_step.append((time.perf_counter() - self._start) / steps)


def make_wide_mlp(width):
    """The model-parallel benchmarks' MLP: 256 -> width ("up") -> 256
    ("down") -> 10 ("head"); "up" and "down" are the kernels they shard."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(width, activation="relu", name="up"),
        keras.layers.Dense(256, name="down"),
        keras.layers.Dense(10, name="head"),
    ])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def sharded_vs_replicated(benchmark, unit, ms, nbytes, **extra):
    """The model-parallel benchmarks' JSON object: step times in ms and
    variable bytes per `unit` ("device" or "process"), with their ratios."""
    return {
        "benchmark": benchmark, **extra,
        "replicated_step_ms": round(ms["replicated"], 3),
        "sharded_step_ms": round(ms["sharded"], 3),
        "step_time_ratio": round(ms["sharded"] / ms["replicated"], 3),
        f"replicated_variable_bytes_per_{unit}": nbytes["replicated"],
        f"sharded_variable_bytes_per_{unit}": nbytes["sharded"],
        "memory_ratio": round(nbytes["sharded"] / nbytes["replicated"], 3),
    }


def make_checkpoint_state(megabytes: int, seed=None):
    """The checkpoint benchmarks' state: eight float32 matrices of equal
    size, `megabytes` in all, as Keras variables of a model (random with a
    `seed`, else zeros), in existence before anything is timed."""
    import numpy as np

    rows = max(1, int(megabytes * 2**20 / 4 / 8 / 1024))

    class Holder(keras.Model):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(seed)
            self.parts = [self.add_weight(
                shape=(rows, 1024), name=f"w{i}",
                initializer="zeros" if seed is None else
                keras.initializers.Constant(
                    rng.standard_normal((rows, 1024), np.float32)))
                for i in range(8)]

        def call(self, x):
            return x

    model = Holder()
    model.built = True
    if keras.backend.backend() == "jax":
        import jax

        jax.block_until_ready([v.value for v in model.weights])
    return model


def checkpoint_summary(times: dict, methods, anchor: str) -> dict:
    """The checkpoint benchmarks' figures from per-trial `times`
    (`"save/<method>"` / `"restore/<method>"` -> seconds): for each method
    its seconds and its time over numpy's in the same trial, and kd's time
    over the `anchor`'s, each as the median and `[min, max]`."""
    figure = median_spread
    out = {"save_s": {}, "restore_s": {}, "save_time_vs_numpy": {},
           "restore_time_vs_numpy": {}, f"kd_vs_{anchor}": {}}
    for kind in ("save", "restore"):
        numpy_times = times[f"{kind}/numpy"]
        for method in methods:
            values = times[f"{kind}/{method}"]
            out[f"{kind}_s"][method] = figure(values)
            out[f"{kind}_time_vs_numpy"][method] = figure(
                [v / n for v, n in zip(values, numpy_times)])
        out[f"kd_vs_{anchor}"][kind] = figure(
            [k / a for k, a in zip(times[f"{kind}/kd"],
                                   times[f"{kind}/{anchor}"])])
    return out


def median_spread(values) -> dict:
    """`{"median": ..., "spread": [min, max]}` of some figures."""
    import numpy as np

    return {"median": round(float(np.median(values)), 3),
            "spread": [round(min(values), 3), round(max(values), 3)]}
