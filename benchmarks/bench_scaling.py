"""Cost as the job grows: start-up and step time for 1, 2, 4, 8 processes.

Weak scaling, the way a job grows: every replica keeps a per-replica batch
of 128 rows of the fit benchmarks' MLP (399,370 parameters), so the global
batch grows with the replicas. For each size it measures

- start-up: from the launch until every process holds its model under the
  strategy (processes spawned, Keras and the framework imported, the group
  joined, the model built and made equal everywhere), the slowest process;
- step time: the median steady-state `fit` step (epochs after the first);
- what each step sends: the gradient bytes one all-reduce carries (every
  float32 gradient once) and the collectives per step.

Torch: `kd.MirroredStrategy` in 1, 2, 4, 8 gloo processes (`kd.launch`).
JAX: `kd.MultiWorkerMirroredStrategy` in 1, 2, 4, 8 processes of one CPU
device each (`jax.distributed`), and `kd.MirroredStrategy` over 2, 4, 8
simulated devices in one process. On this 2-core machine every size above
2 processes shares the same 2 cores: their step time is CPU contention
(work per core grows with the replicas), not communication; what the
sizes show is how start-up and the all-reduce grow.

Usage:
    python benchmarks/bench_scaling.py [--sizes 1 2 4 8] [--steps 20]
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PER_REPLICA_BATCH = 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=4)
    # One measurement, in a child process (the driver runs these).
    parser.add_argument("--backend", choices=["torch", "jax"])
    parser.add_argument("--processes", type=int)
    parser.add_argument("--devices", type=int)
    return parser.parse_args(argv)


def _data(replicas: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    n = PER_REPLICA_BATCH * replicas * steps
    return (rng.normal(size=(n, 256)).astype("float32"),
            rng.integers(0, 10, size=(n,)))


def process_worker(backend: str, launched_at: float, steps: int,
                   epochs: int):
    """One process of the job: when its model was ready, its step times."""
    if backend == "torch":
        import torch

        torch.set_num_threads(1)
    else:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        os.environ["JAX_PLATFORMS"] = "cpu"
    from _common import EpochTimer
    from _common import make_model

    import keras_distribute as kd

    strategy = (kd.MirroredStrategy() if backend == "torch" else
                kd.MultiWorkerMirroredStrategy())
    with strategy.scope():
        model = make_model()
    ready_s = time.time() - launched_at
    replicas = strategy.num_replicas_in_sync
    x, y = _data(replicas, steps)
    timer = EpochTimer()
    model.fit(x, y, batch_size=PER_REPLICA_BATCH * replicas, epochs=epochs,
              shuffle=False, verbose=0, callbacks=[timer])
    return {"ready_s": ready_s, "per_step": timer.per_step[1:],
            "replicas": replicas,
            "parameters": model.count_params()}


def measure_processes(args) -> dict:
    import numpy as np

    os.environ["KERAS_BACKEND"] = args.backend
    import keras_distribute as kd

    launched_at = time.time()
    results = kd.launch(process_worker, num_processes=args.processes,
                        args=(args.backend, launched_at, args.steps,
                              args.epochs), timeout=1800)
    return {"backend": args.backend, "processes": args.processes,
            "replicas": results[0]["replicas"],
            "startup_s": round(max(r["ready_s"] for r in results), 2),
            "step_ms": round(1000 * float(np.median(
                [t for r in results for t in r["per_step"]])), 2),
            "parameters": results[0]["parameters"]}


def measure_devices(args) -> dict:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={args.devices}")
    started = time.time()
    import numpy as np
    from _common import EpochTimer
    from _common import make_model

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model()
    ready_s = time.time() - started
    x, y = _data(args.devices, args.steps)
    timer = EpochTimer()
    model.fit(x, y, batch_size=PER_REPLICA_BATCH * args.devices,
              epochs=args.epochs, shuffle=False, verbose=0, callbacks=[timer])
    return {"backend": "jax", "devices": args.devices,
            "replicas": strategy.num_replicas_in_sync,
            "startup_s": round(ready_s, 2),
            "step_ms": round(1000 * float(np.median(timer.per_step[1:])), 2),
            "parameters": model.count_params()}


def _child(options) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *options]
    done = subprocess.run(command, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(options)} failed:\n"
                           f"{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    args = parse_args()
    if args.backend is not None:  # one measurement, for the driver
        row = (measure_processes(args) if args.processes else
               measure_devices(args))
        print(json.dumps(row))
        return 0
    from _results import record

    common = ["--steps", str(args.steps), "--epochs", str(args.epochs)]
    rows = []
    for backend in ("torch", "jax"):
        for size in args.sizes:
            rows.append(_child(["--backend", backend, "--processes",
                                str(size), *common]))
            print(rows[-1], flush=True)
    for size in [s for s in args.sizes if s > 1]:
        rows.append(_child(["--backend", "jax", "--devices", str(size),
                            *common]))
        print(rows[-1], flush=True)
    for row in rows:
        replicas = row["replicas"]
        # Every float32 gradient all-reduced once per step (DDP's buckets
        # on torch, one fused all-reduce in XLA's step on JAX); a ring
        # all-reduce sends 2 (n - 1) / n of it from each replica.
        row["gradient_bytes_per_step"] = 4 * row["parameters"]
        row["ring_bytes_sent_per_replica"] = int(
            2 * (replicas - 1) / replicas * row["gradient_bytes_per_step"])
    record("scaling", {"benchmark": "scaling",
                       "per_replica_batch": PER_REPLICA_BATCH,
                       "steps": args.steps, "epochs": args.epochs,
                       "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
