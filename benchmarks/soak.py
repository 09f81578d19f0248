"""Soak: a long multi-process `fit` with sharded checkpoints, watched for leaks.

Two processes (`kd.launch`) train under `kd.MultiWorkerMirroredStrategy()`
for `--steps` steps with a `kd.callbacks.ShardedCheckpoint` every `--every`
steps. Each process samples, at every save, its resident memory (VmRSS), its
threads and its open file descriptors; at the end the checkpoint directory
and the system's temporary directory are searched for leftovers (anything
that is not a committed checkpoint; `keras_distribute*` temporaries).

Reported per process: RSS growth from the third sample (after the first
saves warmed every code path) to the last, threads and descriptors then and
at the end, stale entries. `tests/test_soak.py` runs a short version.

Usage:
    KERAS_BACKEND=torch python benchmarks/soak.py [--steps 2000] [--every 100]
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GOAL = "RSS growth < 5 %, no thread or descriptor growth, no leftovers"


def _proc_status(reads: int = 5, pause_s: float = 0.02) -> dict:
    """VmRSS, threads and descriptors; threads and descriptors are the
    fewest of `reads` reads `pause_s` apart: the engines' thread pools and
    input pipelines start and end workers on demand (TensorFlow's grow by
    one for a moment, now and then), while a leaked thread or descriptor
    stays in every read."""
    threads, fds = [], []
    for read in range(reads):
        if read:
            time.sleep(pause_s)
        threads.append(len(os.listdir("/proc/self/task")))
        fds.append(len(os.listdir("/proc/self/fd")))
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": min(threads), "fds": min(fds)}


def _our_temporaries() -> set:
    return {name for name in os.listdir(tempfile.gettempdir())
            if name.startswith("keras_distribute") and "notes" not in name}


def soak(steps: int, every: int, directory: str) -> dict:
    """One process of the soak (run by `kd.launch` on 2 processes)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import keras
    import numpy as np

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy()
    temporaries_before = _our_temporaries()
    batch, per_epoch = 32, 50
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * per_epoch, 64)).astype("float32")
    y = rng.integers(0, 10, size=batch * per_epoch)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True))
    samples = []

    class Sample(keras.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, step, logs=None):
            self.seen += 1
            if self.seen % every == 0:
                samples.append(dict(_proc_status(), step=self.seen))

    model.fit(x, y, batch_size=batch, epochs=-(-steps // per_epoch),
              shuffle=True, verbose=0,
              callbacks=[Sample(), kd.callbacks.ShardedCheckpoint(
                  directory, save_freq=every, max_to_keep=2)])
    committed = {os.path.basename(p)
                 for p in kd.checkpoint.checkpoints_in(directory)}
    leftovers = sorted(set(os.listdir(directory)) - committed)
    warm, last = samples[min(2, len(samples) - 1)], samples[-1]
    return {
        "process": strategy.cluster_resolver.process_id,
        "steps": samples[-1]["step"], "saves": len(samples),
        "rss_mb_warm": round(warm["rss_mb"], 1),
        "rss_mb_end": round(last["rss_mb"], 1),
        "rss_growth": round(last["rss_mb"] / warm["rss_mb"] - 1, 4),
        "threads_warm": warm["threads"], "threads_end": last["threads"],
        "fds_warm": warm["fds"], "fds_end": last["fds"],
        "max_threads": max(s["threads"] for s in samples[2:] or samples),
        "max_fds": max(s["fds"] for s in samples[2:] or samples),
        "leftovers": leftovers,
        "new_temporaries": sorted(_our_temporaries() - temporaries_before),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--no-record", action="store_true",
                        help="print only; do not write benchmarks/results/")
    args = parser.parse_args(argv)
    import keras

    import keras_distribute as kd

    with tempfile.TemporaryDirectory() as scratch:
        results = kd.launch(soak, num_processes=2, timeout=3600,
                            args=(args.steps, args.every,
                                  os.path.join(scratch, "ckpt")))
    result = {"backend": keras.backend.backend(), "processes": 2,
              "steps": args.steps, "checkpoint_every": args.every,
              "goal": GOAL, "per_process": results,
              "max_rss_growth": max(r["rss_growth"] for r in results)}
    if args.no_record:
        import json

        print(json.dumps(result))
        return
    sys.path.insert(0, HERE)
    from _results import record

    record(f"soak_{keras.backend.backend()}", result)


if __name__ == "__main__":
    main()
