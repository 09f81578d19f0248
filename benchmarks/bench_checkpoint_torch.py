"""Save / restore of the sharded checkpoint on 2 torch processes, against
`torch.distributed.checkpoint` (DCP) on the same state.

Both gloo processes hold the same replicated state (`--megabytes` of float32
Keras variables, 8 matrices, under `kd.MirroredStrategy()`). Each trial
saves it with kd's `ShardedCheckpoint`, with DCP (`dcp.save` of the
variables' tensors; it writes each replicated tensor once, spread over the
ranks, and fsyncs) and raw `numpy.save` + `fsync` (each process its half of
the variables: the limit of the disk), and kd's save again with the
divergence check off (before it writes, a save in a job of several
processes compares the processes' fingerprints of the trainable
variables: its cost), then restores each into zeroed
variables (`dcp.load` in place; every process reads the whole state).
Times are rank 0's between barriers (the slowest process's); trials
interleave the methods, after one unrecorded warm-up trial; medians with
[min, max]. Prints one JSON object.

    python benchmarks/bench_checkpoint_torch.py --megabytes 1024
"""

import os
import shutil
import sys
import tempfile
import time

from _args import checkpoint_args
from _results import record

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
METHODS = ("kd", "dcp", "numpy", "kd_unchecked")


def _between_barriers(engine, fn) -> float:
    engine.barrier("bench.start")
    start = time.perf_counter()
    fn()
    engine.barrier("bench.end")
    return time.perf_counter() - start


def trials(megabytes: int, directory: str, repeats: int) -> dict:
    """One process of the benchmark (under `kd.launch`)."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from _common import make_checkpoint_state

    import keras_distribute as kd

    strategy = kd.MirroredStrategy()
    engine = strategy.engine
    rank, count = kd.process_index(), kd.process_count()
    with strategy.scope():
        model = make_checkpoint_state(megabytes, seed=0)
    expected = [np.array(v.numpy()) for v in model.weights]
    tensors = {f"w{i}": v.value for i, v in enumerate(model.weights)}
    times = {f"{kind}/{method}": [] for kind in ("save", "restore")
             for method in METHODS}

    def zero():
        with torch.no_grad():
            for tensor in tensors.values():
                tensor.zero_()

    def check():
        for v, e in zip(model.weights, expected):
            if not np.array_equal(v.numpy(), e):
                raise AssertionError(f"{v.path} was not restored exactly")

    def unchecked_write(where):
        kd.set_divergence_check("off")
        try:
            kd.checkpoint.ShardedCheckpoint(model=model).write(
                where, options=kd.checkpoint.CheckpointOptions(verbose=0))
        finally:
            kd.set_divergence_check("raise")

    def numpy_save(where):
        os.makedirs(where, exist_ok=True)
        for i, tensor in enumerate(tensors.values()):
            if i % count == rank:
                with open(os.path.join(where, f"{i}.npy"), "wb") as f:
                    np.save(f, tensor.detach().numpy())
                    f.flush()
                    os.fsync(f.fileno())

    def numpy_restore(where):
        with torch.no_grad():
            for i, tensor in enumerate(tensors.values()):
                tensor.copy_(torch.from_numpy(
                    np.load(os.path.join(where, f"{i}.npy"))))

    for trial in range(-1, repeats):  # -1: a warm-up, not recorded
        where = {m: os.path.join(directory, f"{m}-{trial}")
                 for m in METHODS}
        checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
        quiet = kd.checkpoint.CheckpointOptions(verbose=0)
        saves = {
            "kd": lambda: checkpoint.write(where["kd"], options=quiet),
            "dcp": lambda: dcp.save(tensors, checkpoint_id=where["dcp"]),
            "numpy": lambda: numpy_save(where["numpy"]),
            "kd_unchecked": lambda: unchecked_write(where["kd_unchecked"]),
        }
        restores = {
            "kd": lambda: kd.checkpoint.ShardedCheckpoint(model=model).read(
                where["kd"], options=quiet).assert_consumed(),
            "dcp": lambda: dcp.load(tensors, checkpoint_id=where["dcp"]),
            "numpy": lambda: numpy_restore(where["numpy"]),
            "kd_unchecked": lambda: kd.checkpoint.ShardedCheckpoint(
                model=model).read(where["kd_unchecked"],
                                  options=quiet).assert_consumed(),
        }
        order = list(METHODS)
        order = order[trial % 4:] + order[:trial % 4]  # interleaved
        for method in order:
            seconds = _between_barriers(engine, saves[method])
            if trial >= 0:
                times[f"save/{method}"].append(seconds)
        for method in order:
            zero()
            seconds = _between_barriers(engine, restores[method])
            if trial >= 0:
                times[f"restore/{method}"].append(seconds)
            check()
        engine.barrier("bench.trial")
        if rank == 0:
            for path in where.values():
                shutil.rmtree(path, ignore_errors=True)
    return {"times": times, "torch": torch.__version__}


def main():
    from _common import checkpoint_summary

    import keras_distribute as kd

    args = checkpoint_args(__doc__).parse_args()
    directory = tempfile.mkdtemp(dir=args.directory, prefix="kd-bench-")
    try:
        results = kd.launch(trials, num_processes=2,
                            args=(args.megabytes, directory, args.repeats),
                            timeout=3600)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    record("checkpoint_torch", {
        "megabytes": args.megabytes, "processes": 2, "repeats": args.repeats,
        **checkpoint_summary(results[0]["times"], METHODS, anchor="dcp"),
        "bit_exact": True,
        "runs": results[0]["times"]})


if __name__ == "__main__":
    main()
