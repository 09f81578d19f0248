"""Compressed gradient all-reduce on 2 gloo processes: kd vs DDP's hooks.

For each of no compression, fp16 and bf16: `model.fit` under
`kd.MirroredStrategy(communication_options=kd.CommunicationOptions(
compression=...))` against the hand-written DDP loop of
bench_fit_torch.py with torch's own `fp16_compress_hook` /
`bf16_compress_hook` (the native engine doing the same). Reports the
median step time of each, the ratio kd/native, the gradient bytes each
step all-reduces (kd's count; 4 bytes per parameter uncompressed) and the
step-time effect of compressing (compressed / uncompressed, kd). Trials
alternate. Prints one JSON object.

Usage:
    python benchmarks/bench_compression_torch.py [--steps 60] [--trials 3]
"""

import os
import sys

from _results import record

os.environ["KERAS_BACKEND"] = "torch"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def native_times(args, compression):
    """Hand-written DDP loop on 2 processes, with torch's hook."""
    from bench_fit_torch import _torch_loop_times

    return _torch_loop_times(args, distributed=True, compression=compression)


def main():
    import numpy as np
    from _common import make_model
    from bench_fit_torch import kd_times
    from bench_fit_torch import parse_args

    import keras_distribute as kd

    args = parse_args()
    params = make_model().count_params()
    rows = {}
    for compression in (None, "fp16", "bf16"):
        kd_all, native_all, wire = [], [], None
        for _ in range(args.trials):
            times, wire = kd.launch(kd_times, num_processes=2,
                                    args=(args, compression))[0]
            kd_all += times
            native_all += kd.launch(native_times, num_processes=2,
                                    args=(args, compression))[0]
        kd_ms = 1000 * float(np.median(kd_all))
        native_ms = 1000 * float(np.median(native_all))
        rows[compression or "none"] = {
            "kd_ms": round(kd_ms, 3), "native_ddp_ms": round(native_ms, 3),
            "ratio": round(kd_ms / native_ms, 3),
            "gradient_bytes_per_step": int(wire or 4 * params)}
    plain = rows["none"]["kd_ms"]
    for name in ("fp16", "bf16"):
        rows[name]["kd_step_time_vs_uncompressed"] = round(
            rows[name]["kd_ms"] / plain, 3)
        rows[name]["bytes_vs_uncompressed"] = round(
            rows[name]["gradient_bytes_per_step"]
            / rows["none"]["gradient_bytes_per_step"], 3)
    record("compression_torch", {
        "benchmark": "compressed_all_reduce_torch",
        "processes": 2,
        "global_batch": args.batch_size,
        "parameters": params,
        "epochs_timed_per_trial": args.epochs - 1,
        "trials": args.trials,
        **rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
