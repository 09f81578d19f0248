"""What the divergence check costs: its time against one epoch of `fit`.

At the end of every epoch of a distributed `fit`, kd fingerprints every
copy of the model's trainable and optimizer variables and compares them
(`keras_distribute/training/divergence.py`). This times that check directly
(the median of `--repeats` calls of `strategy.check_replicas_agree`) on the
fit benchmarks' model (256 -> 512 -> 512 -> 10, Adam: 399,370 parameters,
3 copies of each with Adam's slots), and one epoch of the fit benchmarks
(`--steps` steps of `--batch-size` rows: the median step time of the fit
benchmarks' timer times the steps) with the check switched off, in the
same run: JAX on 8 simulated devices, TensorFlow on 4 logical CPU
devices, torch on 2 processes. Goal: under 0.5 % of the epoch.

Usage:
    python benchmarks/bench_divergence_check.py --backend jax
"""

import argparse
import os
import sys
import time

PARSER = argparse.ArgumentParser(description=__doc__.splitlines()[0])
PARSER.add_argument("--backend", choices=("jax", "tensorflow", "torch"),
                    required=True)
PARSER.add_argument("--steps", type=int, default=60)
PARSER.add_argument("--batch-size", type=int, default=256)
PARSER.add_argument("--trials", type=int, default=3)
PARSER.add_argument("--repeats", type=int, default=20)
ARGS = PARSER.parse_args() if __name__ == "__main__" else None

if ARGS is not None:
    os.environ["KERAS_BACKEND"] = ARGS.backend
    os.environ.setdefault("XLA_FLAGS",
                          "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

GOAL = 0.005


def measure(steps, batch_size, trials, repeats):
    """`{epoch_s, check_s, replicas, processes}` in this process (one
    process of a launch on torch)."""
    import keras
    from _common import fit_step_times
    from _common import make_model

    import keras_distribute as kd

    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)
    kd.set_divergence_check("off")  # the epochs timed without it
    strategy = kd.MirroredStrategy()
    rng = np.random.default_rng(0)
    n = steps * batch_size
    x = rng.normal(size=(n, 256)).astype("float32")
    y = rng.integers(0, 10, size=(n,))
    with strategy.scope():
        model = make_model()
    model.fit(x[:batch_size * 4], y[:batch_size * 4], batch_size=batch_size,
              epochs=1, verbose=0)  # compiled, optimizer built
    # An epoch: the median step (of the fit benchmarks' per-batch timer)
    # times the steps. (A JAX `fit` with no per-batch reader on 8 simulated
    # CPU devices can stall in XLA's collective rendezvous on 2 cores,
    # under Keras' own DataParallel too: the timer's hook avoids it.)
    epochs = []
    for _ in range(trials):
        times = fit_step_times(model, x, y, batch_size)
        epochs.append(float(np.median(times)) * steps)
    checks = []
    for _ in range(repeats):
        start = time.perf_counter()
        strategy.check_replicas_agree(model)
        checks.append(time.perf_counter() - start)
    return {"epoch_s": float(np.median(epochs)),
            "check_s": float(np.median(checks)),
            "replicas": strategy.num_replicas_in_sync,
            "processes": kd.process_count(),
            "parameters": model.count_params()}


def _torch_process(steps, batch_size, trials, repeats):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return measure(steps, batch_size, trials, repeats)


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import record

    import keras_distribute as kd

    if ARGS.backend == "tensorflow":
        kd.simulate_cpu_devices(4)
    args = (ARGS.steps, ARGS.batch_size, ARGS.trials, ARGS.repeats)
    if ARGS.backend == "torch":
        result = kd.launch(_torch_process, num_processes=2, args=args,
                           timeout=900)[0]
    else:
        result = measure(*args)
    record(f"divergence_{ARGS.backend}", {
        "benchmark": "divergence_check",
        "backend": ARGS.backend,
        "replicas": result["replicas"],
        "processes": result["processes"],
        "parameters": result["parameters"],
        "steps_per_epoch": ARGS.steps,
        "global_batch": ARGS.batch_size,
        "epoch_ms": round(1000 * result["epoch_s"], 1),
        "check_ms": round(1000 * result["check_s"], 2),
        "check_share_of_epoch": round(result["check_s"] / result["epoch_s"],
                                      5),
        "goal": f"< {GOAL:.1%}",
    })


if __name__ == "__main__":
    main()
