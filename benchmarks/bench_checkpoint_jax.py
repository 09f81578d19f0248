"""Save / restore throughput of the sharded checkpoint, against the others.

The same state (`--megabytes` of float32 Keras variables, ~1 GB by default,
their rows sharded over `--devices` simulated JAX devices through
`keras.distribution.ModelParallel`) is saved and restored by kd's
`ShardedCheckpoint`, orbax-checkpoint (if
installed: `pip install orbax-checkpoint`), Keras `save_weights` /
`load_weights`, and raw `numpy.save` / `numpy.load` of the same bytes (the
limit of the disk). Also: how long an asynchronous kd save blocks (the
first, and a second one reusing its host buffers), against a plain copy of
the state's shards to host memory (timed after a first such copy was freed:
the allocator's state the save meets); and the peak memory of each restore
(each in a fresh process: peak RSS minus the state it restores into).
The whole cycle runs `--repeats` times; prints one JSON object with every
run and the medians, ratios (each method's time over numpy's in the same
run) with their spread.

    KERAS_BACKEND=jax python benchmarks/bench_checkpoint_jax.py --megabytes 1024
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from _args import checkpoint_args
from _results import record

os.environ.setdefault("KERAS_BACKEND", "jax")


def use_devices(count: int) -> None:
    """Shards every benchmark variable's rows over `count` JAX devices
    (before JAX starts: simulated CPU devices)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                               f"--xla_force_host_platform_device_count="
                               f"{count}")
    import jax
    import keras

    mesh = keras.distribution.DeviceMesh((count,), ["rows"],
                                         jax.devices()[:count])
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*w[0-9]+"] = ("rows", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layouts))


def make_state(megabytes: int, seed=None):
    """`_common.make_checkpoint_state`, imported once the devices are set."""
    from _common import make_checkpoint_state

    return make_checkpoint_state(megabytes, seed)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def save_all(model, directory: str) -> dict:
    import numpy as np

    import keras_distribute as kd

    arrays = [v.value for v in model.weights]
    times = {}
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    times["kd"] = timed(lambda: checkpoint.write(f"{directory}/kd"))
    # Asynchronous kd save: how long fit would be blocked, against a plain
    # copy of each distinct shard to new host memory (what the save must
    # do). The first asynchronous save allocates its host buffers; the
    # second copies into the same ones (kept between saves).
    # The copy is timed twice: into fresh memory, then again once that was
    # freed (the allocator's state an asynchronous save meets: the one
    # compared with).
    copies, copy_times = [], []
    for _ in range(2):
        copy_times.append(timed(lambda: copies.extend(
            np.asarray(shard.data).copy() for a in arrays  # a view, a copy
            for shard in a.addressable_shards if shard.replica_id == 0)))
        del copies[:]
    first_copy, copy = copy_times
    options = kd.checkpoint.CheckpointOptions(enable_async=True)
    blocked, total = [], []
    for name in ("kd_async", "kd_async_warm"):
        start = time.perf_counter()
        checkpoint.write(f"{directory}/{name}", options=options)
        blocked.append(time.perf_counter() - start)
        checkpoint.sync()
        total.append(time.perf_counter() - start)
    shutil.rmtree(f"{directory}/kd_async")
    shutil.rmtree(f"{directory}/kd_async_warm")
    times["keras_save_weights"] = timed(
        lambda: model.save_weights(f"{directory}/keras.weights.h5"))

    def numpy_save():
        os.makedirs(f"{directory}/numpy")
        for i, a in enumerate(arrays):
            with open(f"{directory}/numpy/{i}.npy", "wb") as f:
                np.save(f, np.asarray(a))
                f.flush()
                os.fsync(f.fileno())

    times["numpy"] = timed(numpy_save)
    try:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        state = {f"w{i}": a for i, a in enumerate(arrays)}

        def orbax_save():
            checkpointer.save(f"{directory}/orbax", state)
            checkpointer.wait_until_finished()

        times["orbax"] = timed(orbax_save)
        checkpointer.close()
    except ImportError:
        times["orbax"] = None

    return {"save_s": times, "async": {
        "blocked_s": blocked[0], "total_s": total[0],
        "blocked_warm_s": blocked[1], "total_warm_s": total[1],
        "device_to_host_copy_s": copy, "first_copy_s": first_copy}}


def restore_one(method: str, directory: str, megabytes: int) -> dict:
    """Runs in a fresh process: restore once, report time and peak RSS."""
    import numpy as np

    import keras_distribute as kd

    model = make_state(megabytes)  # zeros: the restore must overwrite them
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if method == "kd":
        fn = lambda: kd.checkpoint.ShardedCheckpoint(model=model).read(  # noqa
            f"{directory}/kd").assert_consumed()
    elif method == "keras_save_weights":
        fn = lambda: model.load_weights(f"{directory}/keras.weights.h5")  # noqa
    elif method == "numpy":
        def fn():
            for i, v in enumerate(model.weights):
                v.assign(np.load(f"{directory}/numpy/{i}.npy"))
    else:
        import orbax.checkpoint as ocp

        def fn():
            checkpointer = ocp.StandardCheckpointer()
            target = {f"w{i}": v.value for i, v in enumerate(model.weights)}
            restored = checkpointer.restore(f"{directory}/orbax", target)
            for i, v in enumerate(model.weights):
                v.assign(restored[f"w{i}"])
            checkpointer.close()
    seconds = timed(fn)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reference = make_state(megabytes, seed=0).weights[0]
    exact = bool(np.array_equal(np.asarray(model.weights[0].value),
                                np.asarray(reference.value)))
    return {"restore_s": seconds, "extra_peak_rss_mb": (peak - baseline) / 1024,
            "bit_exact": exact}


def one_run(args) -> dict:
    """One save of every method, then each restore in a fresh process."""
    directory = tempfile.mkdtemp(dir=args.directory, prefix="kd-bench-")
    try:
        model = make_state(args.megabytes, seed=0)
        result = save_all(model, directory)
        del model
        result["restore"] = {}
        for method, seconds in result["save_s"].items():
            if seconds is None:
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--megabytes", str(args.megabytes),
                 "--devices", str(args.devices),
                 "--restore-one", method, directory],
                capture_output=True, text=True, check=True)
            result["restore"][method] = json.loads(out.stdout.splitlines()[-1])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    numpy_save = result["save_s"]["numpy"]
    numpy_restore = result["restore"]["numpy"]["restore_s"]
    result["save_time_vs_numpy"] = {
        k: v / numpy_save for k, v in result["save_s"].items()
        if v is not None}
    result["restore_time_vs_numpy"] = {
        k: v["restore_s"] / numpy_restore
        for k, v in result["restore"].items()}
    for kind in ("", "_warm"):
        result["async"][f"blocked{kind}_vs_copy"] = (
            result["async"][f"blocked{kind}_s"]
            / result["async"]["device_to_host_copy_s"])
    return result


def summarise(runs: list) -> dict:
    """Median and [min, max] over the runs of every figure (ratios are per
    run, then summarised)."""
    def figures(run):
        out = {f"save_s/{k}": v for k, v in run["save_s"].items()
               if v is not None}
        out.update({f"restore_s/{k}": v["restore_s"]
                    for k, v in run["restore"].items()})
        out.update({f"extra_peak_rss_mb/{k}": v["extra_peak_rss_mb"]
                    for k, v in run["restore"].items()})
        out.update({f"save_time_vs_numpy/{k}": v
                    for k, v in run["save_time_vs_numpy"].items()})
        out.update({f"restore_time_vs_numpy/{k}": v
                    for k, v in run["restore_time_vs_numpy"].items()})
        out.update({f"async/{k}": v for k, v in run["async"].items()})
        return out

    from _common import median_spread

    table = [figures(run) for run in runs]
    summary = {}
    for name in table[0]:
        group, key = name.split("/")
        summary.setdefault(group, {})[key] = median_spread(
            [t[name] for t in table])
    summary["bit_exact"] = all(v["bit_exact"] for run in runs
                               for v in run["restore"].values())
    return summary


def main():
    parser = checkpoint_args(__doc__, devices=8)
    parser.add_argument("--restore-one", nargs=2, metavar=("METHOD", "DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_devices(args.devices)
    if args.restore_one:
        print(json.dumps(restore_one(*args.restore_one, args.megabytes)))
        return
    runs = [one_run(args) for _ in range(args.repeats)]
    record("checkpoint_jax", {
        "megabytes": args.megabytes, "devices": args.devices,
        "repeats": args.repeats, **summarise(runs), "runs": runs})


if __name__ == "__main__":
    main()
