"""Steady-state training step time on 2 gloo processes: kd vs hand-written DDP.

kd side: `model.fit` under `kd.MirroredStrategy()` in each process, eager
and with `jit_compile=True` (Keras' step through `torch.compile`: compiled
whole, kd's choice on CPU processes, and split at DDP's buckets, dynamo's
default, set by hand).
Native side: the same Keras model (a `torch.nn.Module`) wrapped in
`DistributedDataParallel`, trained by a plain torch loop (forward, loss,
backward, `torch.optim.Adam.step`) on the same per-rank batches. On a Keras
that distributes torch itself (3.16), Keras' own `DataParallel` too: each
process fits its rows of every global batch. Controls: single-process Keras
`fit` and the plain torch loop on one per-rank batch, which give what
distribution adds (kd over Keras alone, DDP over the loop alone). Every
trial runs each side once, in turn; medians compared. Prints one JSON
object.

Usage:
    python benchmarks/bench_fit_torch.py [--steps 60] [--trials 3]
"""

import argparse
import os
import sys

from _results import record

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--anchor-only", action="store_true",
        help="time kd (eager and compiled) and the hand-written DDP loop "
             "only (the regression guard's short run); the controls and "
             "the other rows need the full run")
    return parser.parse_args(argv)


def _data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    n = args.batch_size * args.steps
    return (rng.normal(size=(n, 256)).astype("float32"),
            rng.integers(0, 10, size=(n,)))


def kd_times(args, compression=None, jit_compile="auto"):
    """`fit` under kd.MirroredStrategy: per-step times of the epochs after
    the first, and the gradient bytes all-reduced per step (counted by kd
    where it compresses, else `None`)."""
    import torch

    torch.set_num_threads(1)
    from _common import EpochTimer
    from _common import make_model

    import keras_distribute as kd

    x, y = _data(args)
    strategy = kd.MirroredStrategy(
        communication_options=kd.CommunicationOptions(
            compression=compression))
    with strategy.scope():
        model = make_model(jit_compile)
    timer = EpochTimer()
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
              shuffle=False, verbose=0, callbacks=[timer])
    counted = strategy.engine.gradient_bytes_reduced
    steps = args.epochs * args.steps
    # The first epoch compiles and warms up.
    return timer.per_step[1:], counted / steps if counted else None


def _torch_loop_times(args, distributed: bool, compression=None):
    """The hand-written torch loop on this process's per-rank batches.

    With `distributed`, the model is wrapped in DistributedDataParallel and
    rank r takes rows [r * local, (r + 1) * local) of each global batch;
    without, one process trains on the same per-rank batch size alone.
    `compression` ("fp16"/"bf16") registers torch's compression hook.
    """
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from _common import make_model

    from keras_distribute.backend.torch import ensure_process_group

    rank, world = 0, 2
    if distributed:
        ensure_process_group()
        rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(args)
    model = make_model()
    forward = torch.nn.parallel.DistributedDataParallel(model) if (
        distributed) else model
    if compression is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[compression]
        # DDP refuses bf16_compress_hook by name off CUDA/XPU; gloo reduces
        # bfloat16 on CPU, so it is registered through a wrapper (as kd's).
        forward.register_comm_hook(None, lambda state, bucket: hook(
            state, bucket))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = args.batch_size // world
    stride = args.batch_size if distributed else local
    per_step = []
    for _ in range(args.epochs):
        start = time.perf_counter()
        for step in range(args.steps):
            lo = step * stride + rank * local
            xb = torch.from_numpy(x[lo:lo + local])
            yb = torch.from_numpy(y[lo:lo + local])
            optimizer.zero_grad()
            loss = loss_fn(forward(xb), yb)
            loss.backward()
            optimizer.step()
        loss.item()
        per_step.append((time.perf_counter() - start) / args.steps)
    return per_step[1:]


def native_times(args):
    """Hand-written DDP loop on 2 processes."""
    return _torch_loop_times(args, distributed=True)


def kd_compiled_times(args):
    """`fit` under kd.MirroredStrategy with `jit_compile=True`."""
    return kd_times(args, jit_compile=True)[0]


def kd_compiled_split_times(args):
    """As `kd_compiled_times`, with dynamo's DDP graph split chosen by the
    user (`optimize_ddp="ddp_optimizer"`, which kd leaves as it is): what
    compiling the step whole on CPU processes gains."""
    import torch._dynamo

    torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    return kd_times(args, jit_compile=True)[0]


def keras_data_parallel_times(args):
    """Keras' own torch `DataParallel` (Keras 3.16): each process fits its
    rows of every global batch, Keras wrapping the model in its DDP."""
    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from _common import EpochTimer
    from _common import make_model

    from keras_distribute.backend.torch import ensure_process_group

    ensure_process_group()  # Keras' `initialize` on the launcher's group
    rank, world = dist.get_rank(), dist.get_world_size()
    # Each process passes its own rows (as kd's fit takes them).
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices(), auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)
    x, y = _data(args)
    local = args.batch_size // world
    rows = np.concatenate([
        np.arange(step * args.batch_size + rank * local,
                  step * args.batch_size + (rank + 1) * local)
        for step in range(args.steps)])
    model = make_model()
    timer = EpochTimer()
    model.fit(x[rows], y[rows], batch_size=local, epochs=args.epochs,
              shuffle=False, verbose=0, callbacks=[timer])
    return timer.per_step[1:]


def keras_single_times(args, jit_compile="auto"):
    """Control: plain Keras `fit` in one process on a per-rank batch
    (`jit_compile=True`: Keras' step through `torch.compile`)."""
    import torch

    torch.set_num_threads(1)
    from _common import EpochTimer
    from _common import make_model

    x, y = _data(args)
    half = len(x) // 2
    model = make_model(jit_compile)
    timer = EpochTimer()
    model.fit(x[:half], y[:half], batch_size=args.batch_size // 2,
              epochs=args.epochs, shuffle=False, verbose=0, callbacks=[timer])
    return timer.per_step[1:]


def torch_single_times(args):
    """Control: the hand-written loop in one process, without DDP."""
    return _torch_loop_times(args, distributed=False)


def kd_code_microseconds(args, calls=2000):
    """kd's own code in each training step, timed directly (`calls`
    calls each, after a short `fit` under kd.MirroredStrategy on 2
    processes; a profiler would inflate Python-heavy code): the metric-
    results hook over Keras' own `get_metrics_result`, `step_begins` (the
    step count and the held DDP's lookup), and taking this process's rows
    of a global batch over slicing the same rows of an array."""
    import time

    import torch

    torch.set_num_threads(1)
    from _common import make_model

    import keras_distribute as kd
    from keras_distribute.input.process_data import ArrayShards

    x, y = _data(args)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model()
    model.fit(x[:args.batch_size * 4], y[:args.batch_size * 4],
              batch_size=args.batch_size, epochs=1, verbose=0)
    engine = strategy.engine

    def each(fn):
        fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    # As inside `fit`'s train step when no callback reads batch logs.
    engine._in_train_step, engine.sync_metrics_each_step = True, False
    keras_results = type(model).get_metrics_result.__wrapped__
    try:
        hook = each(model.get_metrics_result) - each(
            lambda: keras_results(model))
        step_begins = each(lambda: engine.step_begins(model))
    finally:
        engine._in_train_step, engine.sync_metrics_each_step = False, True
    shards = ArrayShards(engine, x, y, None, args.batch_size, shuffle=False)
    local = args.batch_size // 2
    batch = iter(range(10 ** 9))

    def kd_rows():
        shards[next(batch) % len(shards)]

    def sliced_rows():
        lo = (next(batch) % args.steps) * local
        (x[lo:lo + local], y[lo:lo + local])

    rows = each(kd_rows) - each(sliced_rows)
    return {"metric_results_hook": round(hook, 1),
            "step_begins": round(step_begins, 1),
            "process_rows_over_slicing": round(rows, 1),
            "total": round(hook + step_begins + rows, 1)}


def _keras_distributes_torch():
    import keras

    return keras.version() >= "3.16"


def main():
    import keras
    import numpy as np

    import keras_distribute as kd

    args = parse_args()
    sides = {"kd": lambda: kd.launch(kd_times, num_processes=2,
                                     args=(args,))[0][0],
             "native": lambda: kd.launch(native_times, num_processes=2,
                                         args=(args,))[0],
             "kd_compiled": lambda: kd.launch(
                 kd_compiled_times, num_processes=2, args=(args,))[0],
             "kd_compiled_split": lambda: kd.launch(
                 kd_compiled_split_times, num_processes=2, args=(args,))[0],
             "keras_single": lambda: kd.launch(
                 keras_single_times, num_processes=1, args=(args,))[0],
             "keras_single_compiled": lambda: kd.launch(
                 keras_single_times, num_processes=1,
                 args=(args, True))[0],
             "torch_single": lambda: kd.launch(
                 torch_single_times, num_processes=1, args=(args,))[0]}
    if args.anchor_only:
        sides = {name: sides[name]
                 for name in ("kd", "native", "kd_compiled")}
    elif _keras_distributes_torch():
        sides["keras_data_parallel"] = lambda: kd.launch(
            keras_data_parallel_times, num_processes=2, args=(args,))[0]
    times = {name: [] for name in sides}
    for _ in range(args.trials):  # interleaved: each side once per trial
        for name, run in sides.items():
            times[name] += run()
    ms = {name: 1000 * float(np.median(values))
          for name, values in times.items()}
    spread = {name: [round(1000 * float(min(values)), 3),
                     round(1000 * float(max(values)), 3)]
              for name, values in times.items()}
    result = {
        "benchmark": "fit_step_time_torch",
        "keras": keras.__version__,
        "processes": 2,
        "global_batch": args.batch_size,
        "trials": args.trials,
        "epochs_timed": len(times["kd"]),
        "kd_mirrored_ms": round(ms["kd"], 3),
        "hand_written_ddp_ms": round(ms["native"], 3),
        "ratio": round(ms["kd"] / ms["native"], 3),
        "goal": "<= 1.05",
        "spread_ms": spread,
    }
    result.update({
        "kd_compiled_ms": round(ms["kd_compiled"], 3),
        "kd_compiled_over_ddp": round(ms["kd_compiled"] / ms["native"], 3),
    })
    if args.anchor_only:
        record("fit_torch_anchor_only", result)
        return 0
    result.update({
        "kd_compiled_split_ms": round(ms["kd_compiled_split"], 3),
        "control_single_process_keras_fit_ms": round(ms["keras_single"], 3),
        "control_single_process_torch_loop_ms": round(ms["torch_single"], 3),
        "control_single_process_keras_fit_compiled_ms": round(
            ms["keras_single_compiled"], 3),
        "control_keras_fit_overhead_ratio": round(
            ms["keras_single"] / ms["torch_single"], 3),
        # What distribution adds: kd over Keras alone on the per-rank
        # batch, against DDP over the plain loop alone.
        "kd_over_keras_single": round(ms["kd"] / ms["keras_single"], 3),
        "ddp_over_torch_single": round(ms["native"] / ms["torch_single"], 3),
    })
    code = kd.launch(kd_code_microseconds, num_processes=2, args=(args,))[0]
    result["kd_code_per_step_us"] = code
    result["kd_code_share_of_step"] = round(
        code["total"] / (1000 * ms["kd"]), 4)
    if "keras_data_parallel" in ms:
        result["keras_data_parallel_ms"] = round(ms["keras_data_parallel"], 3)
        result["kd_over_keras_data_parallel"] = round(
            ms["kd"] / ms["keras_data_parallel"], 3)
    record("fit_torch_next" if "keras_data_parallel" in ms else "fit_torch",
           result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
