"""Loading Keras weights into a fully sharded model: kd against Keras' own
path, per process.

N gloo processes (`kd.launch`) each make the same MLP (`--layers` Dense
layers of `--width` x `--width`, float32) under one-line FSDP
(`kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(mesh))`: each
process holds 1/N of every variable), then load a Keras `.weights.h5`
of it twice, in turn (after one unmeasured load each): through
`model.load_weights` (kd: each process reads only its own rows of each
variable, HDF5 hyperslabs) and through
Keras' own `saving_lib.load_weights_only` (the anchor: each variable read
whole, then cut). For each, the process's peak resident memory during the
load above its resident memory before (Linux `VmHWM`, reset through
`/proc/self/clear_refs`; glibc maps every block over 64 KiB on its own, so
freed arrays leave the resident set) and the load's time; the two loads
leave the same weights. Prints one JSON object and writes
benchmarks/results/loading_torch.json.

Usage:
    python benchmarks/bench_loading_torch.py [--processes 4] [--width 2048]
        [--layers 6]
"""

import argparse
import os
import sys
import tempfile
import time

from _memory import proc_status
from _memory import reset_peak_resident
from _results import record

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model(width, layers):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width, name=f"dense_{i}")
           for i in range(layers)], name="mlp")


def worker(path, width, layers):
    """In each process: the two loads' peak memory and time."""
    import gc

    import keras
    import numpy as np

    import keras_distribute as kd
    from keras_distribute.integration import registry

    size = int(os.environ["WORLD_SIZE"])  # (set by kd.launch)
    mesh = keras.distribution.DeviceMesh(
        (size,), ["batch"], [f"cpu:{i}" for i in range(size)])
    strategy = kd.MirroredStrategy(
        layout_map=kd.layouts.fully_sharded(mesh))
    with strategy.scope():
        model = make_model(width, layers)
    held = sum(int(np.prod(v.value.to_local().shape)) * 4
               for v in model.weights)
    keras_load = registry.resolve("saving_lib").load_weights_only
    found = {}
    loads = (("kd", model.load_weights),
             ("keras", lambda p: keras_load(model, p)))
    for _, load in loads:  # warm-up: imports, HDF5's own buffers
        load(path)
    for name, load in loads:
        gc.collect()
        before = reset_peak_resident()
        started = time.perf_counter()
        load(path)
        found[name] = {"seconds": time.perf_counter() - started,
                       "peak_above_bytes": proc_status("VmHWM") - before}
        found[name]["first_weight_sum"] = float(np.sum(
            model.weights[0].value.to_local().detach().numpy()))
    return {"held_bytes": held, "loads": found}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "torch"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    import keras  # noqa: F401

    import keras_distribute as kd

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "mlp.weights.h5")
        make_model(args.width, args.layers).save_weights(path)
        whole = os.path.getsize(path)
        results = kd.launch(worker, num_processes=args.processes,
                            args=(path, args.width, args.layers),
                            timeout=900)
    peak = {name: max(r["loads"][name]["peak_above_bytes"] for r in results)
            for name in ("kd", "keras")}
    record("loading_torch", {
        "model": f"MLP, {args.layers} Dense {args.width}x{args.width}, "
                 "float32",
        "weights_file_bytes": whole,
        "processes": args.processes,
        "held_bytes_per_process": results[0]["held_bytes"],
        "largest_variable_bytes": args.width * args.width * 4,
        "kd_peak_above_bytes": peak["kd"],
        "keras_peak_above_bytes": peak["keras"],
        "ratio": peak["kd"] / peak["keras"] if peak["keras"] else None,
        "kd_seconds": max(r["loads"]["kd"]["seconds"] for r in results),
        "keras_seconds": max(r["loads"]["keras"]["seconds"]
                             for r in results),
        "same_weights": all(r["loads"]["kd"]["first_weight_sum"]
                            == r["loads"]["keras"]["first_weight_sum"]
                            for r in results),
        "goal": "kd's loading peak <= 0.3x Keras' own",
    })


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main()
