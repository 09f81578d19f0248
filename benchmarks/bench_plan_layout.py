"""Planning a 7B-shaped model's layout: time, memory, and against the map
keras-hub writes by hand.

`kd.layouts.plan_layout` plans keras-hub's `GemmaBackbone` at Gemma-7B's
shape (28 layers, hidden 3072, 16 heads of 256, feed-forward 49152,
vocabulary 256000; ~8.5 billion parameters, 17 GB in bfloat16) on a
(2, 4) batch x model mesh, building the model without values (JAX:
`jax.eval_shape`). Measured in one run: the planning time (median of
`--trials`, after one warm-up), the process's peak resident memory and
what planning added to it, and the plan's bytes per device against
keras-hub's own `GemmaBackbone.get_layout_map` (the hand-written anchor),
with how many variables the two lay out differently. Goals (#46): under
10 s and 2 GB on 2 cores; bytes per device at most 1.05x the anchor's.

Then training under each map: a small `GemmaBackbone` (4 layers, hidden
256, feed-forward 1024, vocabulary 4096, sequence 64, batch 32, float32)
fits `--steps` batches under `kd.MirroredStrategy(layout_map=...)` on the
same (2, 4) mesh of simulated devices, once with the planned map and once
with keras-hub's, trials interleaved: the median step time (after the
compiling first epoch) and the largest weight difference from the same
steps on one device. Goal: step time at most 1.05x the anchor's, weights
equal to one device's (1e-5).

With `--backend tensorflow` or `--backend torch`, only the planning of the
7B shape is measured (built in a TensorFlow graph of its own, or on torch's
fake tensors) and recorded as `plan_layout_7b_<backend>`; training under a
planned map on torch processes is `bench_plan_layout_torch.py`.

Usage:
    python benchmarks/bench_plan_layout.py [--backend jax|tensorflow|torch]
"""

import argparse
import os
import resource
import statistics
import sys
import time

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--trials", type=int, default=3)
PARSER.add_argument("--steps", type=int, default=20)
PARSER.add_argument("--backend", default="jax",
                    choices=["jax", "tensorflow", "torch"])
ARGS = PARSER.parse_args() if __name__ == "__main__" else None

if ARGS is not None:
    os.environ["KERAS_BACKEND"] = ARGS.backend
    os.environ.setdefault("XLA_FLAGS",
                          "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

GOAL_S, GOAL_BYTES, GOAL_RATIO = 10.0, 2 * 10**9, 1.05


def gemma_7b_shape():
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=256000, num_layers=28, num_query_heads=16,
        num_key_value_heads=16, hidden_dim=3072, intermediate_dim=49152,
        head_dim=256, dtype="bfloat16")


def small_gemma():
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=4096, num_layers=4, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=256, intermediate_dim=1024,
        head_dim=64, dtype="float32")


def train(layout_map, steps):
    """`(median step seconds, weights)` of `steps` batches of fit under
    `layout_map` (None: one device)."""
    import keras
    import numpy as np

    import keras_distribute as kd

    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 4096, (32 * steps, 64), "int32"),
         "padding_mask": np.ones((32 * steps, 64), "int32")}
    y = rng.normal(size=(32 * steps, 64, 256)).astype("float32") * 0.1
    keras.backend.clear_session()  # the same variable paths every time
    keras.utils.set_random_seed(0)
    if layout_map is None:
        model = small_gemma()
    else:
        with kd.MirroredStrategy(layout_map=layout_map).scope():
            model = small_gemma()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    from _common import StepTimer

    clock = StepTimer(warmup=0)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
              callbacks=[clock])  # the first epoch compiles
    return (statistics.median(clock.times[steps:]),
            [np.asarray(w) for w in model.get_weights()])


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    import keras
    import keras_hub

    import keras_distribute as kd

    # (A plan needs the mesh's shape only: on torch and TensorFlow one
    # process names the 8 devices a job of 8 would have.)
    devices = (keras.distribution.list_devices() if ARGS.backend == "jax"
               else [f"cpu:{i}" for i in range(8)])
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    before = peak_rss_bytes()
    times = []
    for _ in range(ARGS.trials + 1):  # the first warms up
        started = time.perf_counter()
        plan = kd.layouts.plan_layout(gemma_7b_shape, mesh)
        times.append(time.perf_counter() - started)
    peak = peak_rss_bytes()
    anchor = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    anchor_bytes, differ = 0, 0
    for row in plan.variables:
        layout = anchor[row.path]
        axes = (tuple(layout.axes) if layout is not None
                else (None,) * len(row.shape))
        whole = row.bytes_per_device * _shards(row.axes, sizes)
        anchor_bytes += whole // _shards(axes, sizes)
        differ += axes != row.axes
    planned = {
        "model": "keras-hub GemmaBackbone, Gemma-7B shape, bfloat16",
        "parameters": sum(
            row.bytes_per_device * _shards(row.axes, sizes) // 2
            for row in plan.variables),
        "variables": len(plan.variables),
        "mesh": "(2, 4) batch x model",
        "plan_s": statistics.median(times[1:]),
        "first_plan_s": times[0],
        "peak_rss_bytes": peak,
        "planning_added_rss_bytes": peak - before,
        "plan_bytes_per_device": plan.bytes_per_device,
        "anchor_bytes_per_device": anchor_bytes,
        "ratio": plan.bytes_per_device / anchor_bytes,
        "variables_laid_out_differently": differ,
        "replicated_bytes": plan.replicated_bytes,
        "goal": f"< {GOAL_S:.0f} s, < 2 GB, <= {GOAL_RATIO}x the anchor",
    }
    from _results import record

    if ARGS.backend != "jax":
        record(f"plan_layout_7b_{ARGS.backend}", dict(
            planned, built={"tensorflow": "in a TensorFlow graph of its own",
                            "torch": "on torch fake tensors"}[ARGS.backend]))
        return
    small_plan = kd.layouts.plan_layout(small_gemma, mesh)
    small = small_plan.layout_map
    by_hand = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    small_differ = sum(
        (tuple(by_hand[row.path].axes) if by_hand[row.path] is not None
         else (None,) * len(row.shape)) != row.axes
        for row in small_plan.variables)
    step_times = {"plan": [], "keras_hub": []}
    weights = {}
    for _ in range(ARGS.trials):
        for name, layout_map in (("plan", small), ("keras_hub", by_hand)):
            step, weights[name] = train(layout_map, ARGS.steps)
            step_times[name].append(step)
    _, reference = train(None, ARGS.steps)
    differences = {name: max(float(abs(a - b).max()) for a, b in zip(
        found, reference)) for name, found in weights.items()}
    record("plan_layout", dict(planned, **{
        "train_model": "keras-hub GemmaBackbone, 4 layers, hidden 256, "
                       "sequence 64, batch 32, float32",
        "train_steps": 2 * ARGS.steps,
        "train_variables_laid_out_differently":
            f"{small_differ} of {len(small_plan.variables)}",
        "plan_step_s": statistics.median(step_times["plan"]),
        "anchor_step_s": statistics.median(step_times["keras_hub"]),
        "step_ratio": statistics.median(step_times["plan"])
        / statistics.median(step_times["keras_hub"]),
        "max_weight_difference_from_one_device": differences,
    }))


def _shards(axes, sizes):
    shards = 1
    for axis in axes:
        shards *= sizes[axis] if axis is not None else 1
    return shards


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
