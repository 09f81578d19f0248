"""The planned layout against keras-hub's hand-written map, on torch
processes: step time and weights.

`bench_plan_layout.py` measures the plan on JAX's simulated devices; here
the same small keras-hub `GemmaBackbone` (4 layers, hidden 256,
feed-forward 1024, vocabulary 4096, sequence 64, batch 32, float32) fits
`--steps` batches twice per trial on `--processes` gloo processes (one
thread each) under `kd.MirroredStrategy(layout_map=...)` on a `--mesh`
of processes: once with `kd.layouts.plan_layout`'s map and once with
`GemmaBackbone.get_layout_map`, trials interleaved. Reported: the median
step time (after the first epoch), the planned time over the anchor's,
how many variables the two maps lay out differently (an axis of size 1
counts as none: it shards nothing), and the largest
weight difference from the same steps in one plain process. Goal (#46):
step time at most 1.05x the anchor's, weights equal to one process's
(1e-5).

Usage:
    python benchmarks/bench_plan_layout_torch.py [--mesh 2,1] [--steps 10]
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ["KERAS_BACKEND"] = "torch"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2,1",
                        help="batch,model sizes of the mesh of processes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--trials", type=int, default=2)
    return parser.parse_args()


def measure(shape, steps, trials):
    """Runs in each process: step times under both maps, and the weights;
    process 0 also trains the one-process reference."""
    import keras
    import keras_hub
    import numpy as np
    import torch
    from bench_plan_layout import small_gemma
    from bench_plan_layout import train

    import keras_distribute as kd

    torch.set_num_threads(1)
    size = int(np.prod(shape))
    mesh = keras.distribution.DeviceMesh(
        tuple(shape), ["batch", "model"], [f"cpu:{r}" for r in range(size)])
    plan = kd.layouts.plan_layout(small_gemma, mesh)
    by_hand = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    sizes = dict(zip(mesh.axis_names, mesh.shape))

    def effective(axes):  # an axis of size 1 shards nothing
        return tuple(a if a is not None and sizes[a] > 1 else None
                     for a in axes)

    differ = sum(effective(by_hand[row.path].axes if by_hand[row.path]
                           is not None else (None,) * len(row.shape))
                 != effective(row.axes) for row in plan.variables)
    times = {"plan": [], "keras_hub": []}
    weights = {}
    for _ in range(trials):
        for name, layout_map in (("plan", plan.layout_map),
                                 ("keras_hub", by_hand)):
            step, weights[name] = train(layout_map, steps)
            times[name].append(step)
    result = {"times": times, "differ": differ,
              "variables": len(plan.variables)}
    if kd.process_index() == 0:
        _, reference = train(None, steps)
        result["difference"] = {
            name: max(float(abs(a - b).max())
                      for a, b in zip(found, reference))
            for name, found in weights.items()}
    return result


def main():
    args = parse_args()
    shape = tuple(int(s) for s in args.mesh.split(","))
    import numpy as np
    from _results import record

    import keras_distribute as kd

    results = kd.launch(measure, num_processes=int(np.prod(shape)),
                        args=(shape, args.steps, args.trials), timeout=3600)
    first = results[0]
    # A step ends when the slowest process ends it: the slowest median.
    plan_s = max(statistics.median(r["times"]["plan"]) for r in results)
    anchor_s = max(statistics.median(r["times"]["keras_hub"])
                   for r in results)
    record(f"plan_layout_torch_{shape[0]}x{shape[1]}", {
        "model": "keras-hub GemmaBackbone, 4 layers, hidden 256, "
                 "sequence 64, batch 32, float32",
        "mesh": f"{shape} batch x model, torch processes (gloo, 1 thread)",
        "train_steps": 2 * args.steps,
        "trials": args.trials,
        "variables_laid_out_differently":
            f"{first['differ']} of {first['variables']}",
        "plan_step_s": plan_s,
        "anchor_step_s": anchor_s,
        "step_ratio": plan_s / anchor_s,
        "max_weight_difference_from_one_process": first["difference"],
        "goal": "step time <= 1.05x keras-hub's map; weights within 1e-5",
    })


if __name__ == "__main__":
    main()
