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

Usage:
    python benchmarks/bench_plan_layout.py
"""

import argparse
import os
import resource
import statistics
import sys
import time

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--trials", type=int, default=3)
ARGS = PARSER.parse_args() if __name__ == "__main__" else None

if ARGS is not None:
    os.environ["KERAS_BACKEND"] = "jax"
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


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    import keras
    import keras_hub

    import keras_distribute as kd

    mesh = keras.distribution.DeviceMesh(
        (2, 4), ["batch", "model"], keras.distribution.list_devices())
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
    from _results import record

    record("plan_layout", {
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
    })


def _shards(axes, sizes):
    shards = 1
    for axis in axes:
        shards *= sizes[axis] if axis is not None else 1
    return shards


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
