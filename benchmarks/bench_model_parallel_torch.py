"""Sharded (DTensor) vs replicated on torch: step time and memory per process.

Two gloo processes on this machine train the same MLP-heavy model twice in
one run: replicated (`MirroredStrategy()`: 2 replicas, DDP, each process
takes half of every global batch) and with its large kernels sharded over a
model axis of 2 (`MirroredStrategy(layout_map=...)` on a (1, 2) mesh: one
replica over both processes, every process takes the whole batch). Memory
per process is what the model's and the optimizer's variables occupy in it.
Prints one JSON object.

Tensor parallelism trades compute for memory: each process does half of the
large matmuls on the whole batch, plus a collective per sharded layer; data
parallelism does all of them on half the batch, plus one gradient
all-reduce. On CPU processes sharing 2 cores the sharded model is expected
to be slower; what it buys is the memory ratio.

Usage:
    python benchmarks/bench_model_parallel_torch.py [--steps 20] [--width 2048]
"""

import os
import sys

from _results import record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["KERAS_BACKEND"] = "torch"


def parse_args():
    from _args import model_parallel_args

    return model_parallel_args(__doc__.splitlines()[0], width=2048)


def local_bytes(variables):
    total = 0
    for variable in variables:
        value = variable.value
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return total


def measure(steps, trials, width):
    """Runs in each of the 2 processes."""
    import keras
    import numpy as np
    import torch
    from _common import EpochTimer
    from _common import make_wide_mlp
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    import keras_distribute as kd

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * steps, 256)).astype("float32")
    y = rng.integers(0, 10, size=(256 * steps,))
    layout_map = LayoutMap(DeviceMesh((1, 2), ["batch", "model"],
                                      ["cpu:0", "cpu:1"]))
    layout_map[".*up/kernel"] = (None, "model")
    layout_map[".*up/bias"] = ("model",)
    layout_map[".*down/kernel"] = ("model", None)
    strategies = {"replicated": kd.MirroredStrategy(),
                  "sharded": kd.MirroredStrategy(layout_map=layout_map)}
    times = {name: [] for name in strategies}
    memory = {}
    for _ in range(trials):
        for name, strategy in strategies.items():
            with strategy.scope():
                model = make_wide_mlp(width)
            timer = EpochTimer()
            model.fit(x, y, batch_size=256, epochs=3, shuffle=False,
                      verbose=0, callbacks=[timer])
            times[name] += timer.per_step[1:]
            memory[name] = local_bytes(model.weights +
                                       model.optimizer.variables)
            del model
            keras.backend.clear_session()
    return {"ms": {k: 1000 * float(np.median(v)) for k, v in times.items()},
            "bytes": memory}


def main():
    args = parse_args()
    from _common import sharded_vs_replicated

    import keras_distribute as kd

    results = kd.launch(measure, args=(args.steps, args.trials, args.width),
                        num_processes=2, timeout=1800)
    ms, nbytes = results[0]["ms"], results[0]["bytes"]
    record("model_parallel_torch", sharded_vs_replicated(
        "model_parallel_vs_replicated_torch", "process", ms, nbytes,
        processes=2, width=args.width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
