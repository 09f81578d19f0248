"""Steady-state training step time on 2 gloo processes: kd vs hand-written DDP.

kd side: `model.fit` under `kd.MirroredStrategy()` in each process.
Native side: the same Keras model (a `torch.nn.Module`) wrapped in
`DistributedDataParallel`, trained by a plain torch loop (forward, loss,
backward, `torch.optim.Adam.step`) on the same per-rank batches. Trials
alternate; medians compared. Prints one JSON object.

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
    return parser.parse_args(argv)


def _data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    n = args.batch_size * args.steps
    return (rng.normal(size=(n, 256)).astype("float32"),
            rng.integers(0, 10, size=(n,)))


def kd_times(args, compression=None):
    """`fit` under kd.MirroredStrategy: per-step times of the epochs after
    the first, and the gradient bytes all-reduced per step (counted by kd
    where it compresses, else `None`)."""
    import torch

    torch.set_num_threads(1)
    import keras_distribute as kd
    from _common import EpochTimer, make_model

    x, y = _data(args)
    strategy = kd.MirroredStrategy(
        communication_options=kd.CommunicationOptions(
            compression=compression))
    with strategy.scope():
        model = make_model()
    timer = EpochTimer()
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs,
              shuffle=False, verbose=0, callbacks=[timer])
    counted = strategy._engine.gradient_bytes_reduced
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
    from keras_distribute.backend.torch import ensure_process_group
    from _common import make_model

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


def keras_single_times(args):
    """Control: plain Keras `fit` in one process on a per-rank batch."""
    import torch

    torch.set_num_threads(1)
    from _common import EpochTimer, make_model

    x, y = _data(args)
    half = len(x) // 2
    model = make_model()
    timer = EpochTimer()
    model.fit(x[:half], y[:half], batch_size=args.batch_size // 2,
              epochs=args.epochs, shuffle=False, verbose=0, callbacks=[timer])
    return timer.per_step[1:]


def torch_single_times(args):
    """Control: the hand-written loop in one process, without DDP."""
    return _torch_loop_times(args, distributed=False)


def main():
    import numpy as np

    import keras_distribute as kd

    args = parse_args()
    kd_all, native_all = [], []
    for _ in range(args.trials):
        kd_all += kd.launch(kd_times, num_processes=2, args=(args,))[0][0]
        native_all += kd.launch(native_times, num_processes=2, args=(args,))[0]
    kd_ms = 1000 * float(np.median(kd_all))
    native_ms = 1000 * float(np.median(native_all))
    keras_ms = 1000 * float(np.median(
        kd.launch(keras_single_times, num_processes=1, args=(args,))[0]))
    torch_ms = 1000 * float(np.median(
        kd.launch(torch_single_times, num_processes=1, args=(args,))[0]))
    record("fit_torch", {
        "benchmark": "fit_step_time_torch",
        "processes": 2,
        "global_batch": args.batch_size,
        "epochs_timed": len(kd_all),
        "kd_mirrored_ms": round(kd_ms, 3),
        "hand_written_ddp_ms": round(native_ms, 3),
        "ratio": round(kd_ms / native_ms, 3),
        "goal": "<= 1.05",
        "control_single_process_keras_fit_ms": round(keras_ms, 3),
        "control_single_process_torch_loop_ms": round(torch_ms, 3),
        "control_keras_fit_overhead_ratio": round(keras_ms / torch_ms, 3),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
