"""Writes the tables of docs/benchmarks.md from benchmarks/results/*.json.

Each benchmark script records its result with the date, commit and versions
it ran with (`_results.record`); this script renders them between the
`<!-- table: NAME -->` and `<!-- /table -->` markers of the page. With
`--check` it changes nothing and fails if the page's tables are not what the
results say (the test command runs that).

Usage:
    python benchmarks/make_tables.py [--check]
"""

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, os.pardir, "docs", "benchmarks.md")
RESULTS = os.path.join(HERE, "results")


def _load(name):
    with open(os.path.join(RESULTS, f"{name}.json")) as file:
        return json.load(file)


def _run(entry):
    return f"{entry['date']}, `{entry['commit']}`"


def _ms(value):
    return f"{value:.2f} ms"


def fit_table():
    rows = ["| script | kd | native (the anchor) | ratio | goal | run |",
            "|---|---|---|---|---|---|"]
    for name, script, setup, native_key, native_name in (
            ("fit_jax", "bench_fit_jax.py", "{devices} simulated devices",
             "keras_data_parallel_ms", "`keras.distribution.DataParallel`"),
            ("fit_tensorflow", "bench_fit_tf.py", "{devices} logical devices",
             "tf_distribute_mirrored_ms",
             "`tf.distribute.MirroredStrategy` + Keras `fit`"),
            ("fit_torch", "bench_fit_torch.py", "{processes} gloo processes",
             "hand_written_ddp_ms", "hand-written DDP loop")):
        entry = _load(name)
        r = entry["result"]
        rows.append(
            f"| `{script}` ({setup.format(**r)}) | {_ms(r['kd_mirrored_ms'])}"
            f"/step | {native_name} {_ms(r[native_key])} | {r['ratio']:.3f} "
            f"| {r['goal'].replace('<=', '≤')} | {_run(entry)} |")
        if "clipping_kd_ms" in r:
            rows.append(
                f"| `{script}` ({setup.format(**r)}), "
                f"`Adam(global_clipnorm=1.0)`: kd clips the summed gradient "
                f"| {_ms(r['clipping_kd_ms'])}/step | {native_name} (clips "
                f"each replica's part) {_ms(r['clipping_tf_distribute_ms'])} "
                f"| {r['clipping_ratio']:.3f} | ≤ 1.10 | {_run(entry)} |")
        if "kd_compiled_ms" in r:
            rows.append(
                f"| `{script}` ({setup.format(**r)}), `jit_compile=True` "
                f"(`torch.compile`) | {_ms(r['kd_compiled_ms'])}/step | "
                f"{native_name} (eager) {_ms(r[native_key])} | "
                f"{r['kd_compiled_over_ddp']:.3f} | ≤ 1.0 | {_run(entry)} |")
    if os.path.exists(os.path.join(RESULTS, "fit_torch_next.json")):
        entry = _load("fit_torch_next")
        r = entry["result"]
        rows.append(
            f"| `bench_fit_torch.py` ({r['processes']} gloo processes), "
            f"Keras {r['keras']} | {_ms(r['kd_mirrored_ms'])}/step | Keras' "
            f"own torch `DataParallel` {_ms(r['keras_data_parallel_ms'])} | "
            f"{r['kd_over_keras_data_parallel']:.3f} | < 1 (ahead) | "
            f"{_run(entry)} |")
    for name, script, setup, unit in (
            ("model_parallel_jax", "bench_model_parallel_jax.py",
             "4 × 2 mesh", "device"),
            ("model_parallel_torch", "bench_model_parallel_torch.py",
             "2 gloo processes, (1, 2) mesh, DTensor", "process")):
        entry = _load(name)
        r = entry["result"]
        rows.append(
            f"| `{script}` ({setup}) | sharded {_ms(r['sharded_step_ms'])}, "
            f"{r[f'sharded_variable_bytes_per_{unit}']:,} B/{unit} | "
            f"replicated {_ms(r['replicated_step_ms'])}, "
            f"{r[f'replicated_variable_bytes_per_{unit}']:,} B/{unit} | "
            f"{r['step_time_ratio']:.2f} time, {r['memory_ratio']:.2f} "
            f"memory | — | {_run(entry)} |")
    torch = _load("fit_torch")["result"]
    rows.append("")
    rows.append(
        f"Control in the same torch run: single-process Keras `fit` "
        f"{_ms(torch['control_single_process_keras_fit_ms'])}/step against "
        f"a raw torch loop "
        f"{_ms(torch['control_single_process_torch_loop_ms'])} "
        f"({torch['control_keras_fit_overhead_ratio']:.2f}×): the part of "
        "the torch ratio that is Keras' own `fit` machinery"
        + (f"; with `jit_compile=True` the same `fit` takes "
           f"{_ms(torch['control_single_process_keras_fit_compiled_ms'])}"
           if "control_single_process_keras_fit_compiled_ms" in torch
           else "") + ".")
    if "kd_over_keras_single" in torch:
        rows.append("")
        kd_adds = (torch['kd_over_keras_single']
                   / torch['ddp_over_torch_single'])
        rows.append(
            "What distribution adds, same run: kd's 2-process step over "
            "single-process Keras `fit` on one per-rank batch "
            f"{torch['kd_over_keras_single']:.3f}×, against DDP's over the "
            f"plain loop alone {torch['ddp_over_torch_single']:.3f}× (on one "
            "2-core machine both pay the all-reduce and two processes "
            "sharing the cores); kd adds "
            f"{kd_adds:.3f}"
            "× what DDP itself adds. Medians of "
            f"{torch['trials']} interleaved trials; min–max per side (ms): "
            + ", ".join(f"{name} {low:.2f}–{high:.2f}" for name, (low, high)
                        in torch["spread_ms"].items()) + ".")
    if "kd_compiled_split_ms" in torch:
        rows.append("")
        rows.append(
            "The compiled step, same run: compiled whole (kd's choice on CPU "
            f"processes) {_ms(torch['kd_compiled_ms'])}, split at DDP's "
            "buckets (dynamo's default, `optimize_ddp=\"ddp_optimizer\"` "
            f"set by the user) {_ms(torch['kd_compiled_split_ms'])}.")
    code = torch.get("kd_code_per_step_us")
    if code:
        rows.append("")
        rows.append(
            "kd's own code in each torch step, same run, timed directly "
            f"(2,000 calls each): {code['total']:.0f} µs, "
            f"{100 * torch['kd_code_share_of_step']:.1f} % of kd's step — "
            f"the metric-results hook {code['metric_results_hook']:.0f} µs "
            "over Keras' own, counting the step and finding the held DDP "
            f"{code['step_begins']:.0f} µs, taking the process's rows of a "
            f"global batch {code['process_rows_over_slicing']:.0f} µs over "
            "slicing them from an array.")
    return "\n".join(rows)


def _median(figure, digits=2, unit=""):
    low, high = figure["spread"]
    return (f"{figure['median']:.{digits}f}{unit} "
            f"({low:.{digits}f}–{high:.{digits}f})")


def checkpoint_table():
    entry = _load("checkpoint_jax")
    r = entry["result"]
    names = (("numpy", "raw numpy + fsync (the limit)"),
             ("kd", "**kd `ShardedCheckpoint`**"),
             ("orbax", "orbax-checkpoint (`StandardCheckpointer`)"),
             ("keras_save_weights", "Keras `save_weights` (no fsync)"))
    rows = [f"{r['megabytes']} MB of float32 Keras variables, rows sharded "
            f"over {r['devices']} JAX devices; median (min–max) of "
            f"{r['repeats']} runs; run {_run(entry)} ({entry['machine']}; "
            "orbax "
            f"{entry['versions'].get('orbax.checkpoint', 'not installed')}).",
            "",
            "| method | save | save / numpy | restore | restore / numpy | "
            "extra peak RSS on restore |",
            "|---|---|---|---|---|---|"]
    for key, label in names:
        if key not in r["save_s"]:
            continue
        rows.append(
            f"| {label} | {_median(r['save_s'][key], unit=' s')} | "
            f"{_median(r['save_time_vs_numpy'][key])} | "
            f"{_median(r['restore_s'][key], unit=' s')} | "
            f"{_median(r['restore_time_vs_numpy'][key])} | "
            f"{r['extra_peak_rss_mb'][key]['median']:.0f} MB |")
    a = r["async"]
    rows.append("")
    rows.append(
        f"Every restore bit-exact: {'yes' if r['bit_exact'] else '**no**'}. "
        f"Asynchronous kd save: `fit` blocked "
        f"{_median(a['blocked_s'], unit=' s')}, "
        f"{_median(a['blocked_vs_copy'])} × a plain device-to-host copy of "
        f"the same arrays in the same run "
        f"({_median(a['device_to_host_copy_s'], unit=' s')}); the whole "
        f"save {_median(a['total_s'], unit=' s')} in the background.")
    if "blocked_warm_s" in a:
        rows[-1] += (
            f" The next asynchronous save, into the host buffers the first "
            f"one kept: blocked {_median(a['blocked_warm_s'], unit=' s')}, "
            f"{_median(a['blocked_warm_vs_copy'])} × the copy; whole save "
            f"{_median(a['total_warm_s'], unit=' s')}.")
    return "\n".join(rows)


def _anchored_checkpoint_table(name, setup, anchor, anchor_label):
    entry = _load(name)
    r = entry["result"]
    rows = [f"{r['megabytes']} MB of float32 Keras variables, {setup}; "
            f"median (min–max) of {r['repeats']} trials; run {_run(entry)} "
            f"({entry['machine']}).",
            "",
            "| method | save | save / numpy | restore | restore / numpy |",
            "|---|---|---|---|---|"]
    for key, label in (("numpy", "raw numpy + fsync (the limit)"),
                       ("kd", "**kd `ShardedCheckpoint`**"),
                       (anchor, anchor_label)):
        rows.append(
            f"| {label} | {_median(r['save_s'][key], unit=' s')} | "
            f"{_median(r['save_time_vs_numpy'][key])} | "
            f"{_median(r['restore_s'][key], unit=' s')} | "
            f"{_median(r['restore_time_vs_numpy'][key])} |")
    if "kd_unchecked" in r["save_s"]:
        key = "kd_unchecked"
        rows.append(
            f"| kd, its divergence check before writing off | "
            f"{_median(r['save_s'][key], unit=' s')} | "
            f"{_median(r['save_time_vs_numpy'][key])} | "
            f"{_median(r['restore_s'][key], unit=' s')} | "
            f"{_median(r['restore_time_vs_numpy'][key])} |")
    versus = r[f"kd_vs_{anchor}"]
    rows += ["", f"kd's time over {anchor_label}'s in the same trial: save "
             f"{_median(versus['save'])}, restore "
             f"{_median(versus['restore'])}. Every restore bit-exact: "
             f"{'yes' if r['bit_exact'] else '**no**'}."]
    return "\n".join(rows)


def checkpoint_torch_table():
    return _anchored_checkpoint_table(
        "checkpoint_torch", "replicated on 2 gloo processes", "dcp",
        "`torch.distributed.checkpoint`")


def checkpoint_tf_table():
    return _anchored_checkpoint_table(
        "checkpoint_tf", "mirrored on 4 logical CPU devices", "tf",
        "`tf.train.Checkpoint`")


def checkpoint_many_table():
    entry = _load("checkpoint_many")
    r = entry["result"]
    natives = {"tensorflow": "`tf.train.Checkpoint`",
               "torch": "`torch.distributed.checkpoint`"}
    rows = [f"{r['variables']:,} float32 Keras variables (32 x 32 kernels "
            f"and 32-wide biases), one process per backend; median (min–max) "
            f"of {r['repeats']} trials after a warm-up; run {_run(entry)} "
            f"({entry['machine']}).",
            "",
            "| backend | method | save | restore | restore / save |",
            "|---|---|---|---|---|"]
    for backend, figures in r["backends"].items():
        for method, label in (("kd", "**kd `ShardedCheckpoint`**"),
                              ("keras", "Keras `save_weights` / "
                                        "`load_weights` (no fsync)"),
                              ("native", natives.get(backend))):
            if f"save/{method}" not in figures:
                continue
            rows.append(
                f"| {backend} | {label} | "
                f"{_median(figures[f'save/{method}'], unit=' s')} | "
                f"{_median(figures[f'restore/{method}'], unit=' s')} | "
                f"{_median(figures['restore_over_save'][method])} |")
    exact = all(f["bit_exact"] for f in r["backends"].values())
    rows += ["", f"Every restore bit-exact: {'yes' if exact else '**no**'}."]
    return "\n".join(rows)


def compression_table():
    entry = _load("compression_torch")
    r = entry["result"]
    rows = [f"{r['processes']} gloo processes, global batch "
            f"{r['global_batch']}, {r['parameters']:,} parameters; run "
            f"{_run(entry)} ({entry['machine']}).",
            "",
            "| compression | kd `fit` | DDP loop with torch's hook (anchor) "
            "| ratio | gradient bytes / step | kd time vs uncompressed |",
            "|---|---|---|---|---|---|"]
    for name in ("none", "fp16", "bf16"):
        row = r[name]
        rows.append(
            f"| {name} | {_ms(row['kd_ms'])}/step | "
            f"{_ms(row['native_ddp_ms'])}/step | {row['ratio']:.3f} | "
            f"{row['gradient_bytes_per_step']:,} | "
            f"{row.get('kd_step_time_vs_uncompressed', 1.0):.3f} |")
    return "\n".join(rows)


def compression_jax_table():
    entry = _load("compression_jax")
    r = entry["result"]
    rows = [f"{r['devices']} simulated devices, global batch "
            f"{r['global_batch']}, {r['parameters']:,} parameters; "
            f"`keras.distribution.DataParallel` (anchor, uncompressed): "
            f"{_ms(r['keras_data_parallel_ms'])}/step; run {_run(entry)} "
            f"({entry['machine']}).",
            "",
            "| compression | kd `fit` | ratio vs DataParallel | all-reduce "
            "bytes / step (compiled) | bytes vs uncompressed | kd time vs "
            "uncompressed |",
            "|---|---|---|---|---|---|"]
    for name in ("none", "fp16", "bf16"):
        row = r[name]
        rows.append(
            f"| {name} | {_ms(row['kd_ms'])}/step | "
            f"{row['ratio_vs_keras_data_parallel']:.3f} | "
            f"{row['all_reduce_bytes_per_step']:,} | "
            f"{row.get('bytes_vs_uncompressed', 1.0):.3f} | "
            f"{row.get('kd_step_time_vs_uncompressed', 1.0):.3f} |")
    return "\n".join(rows)


def soak_table():
    rows = ["| backend | steps (saves) | RSS after 2 saves → end | threads | "
            "file descriptors | leftovers | run |",
            "|---|---|---|---|---|---|---|"]
    for backend in ("jax", "tensorflow", "torch"):
        entry = _load(f"soak_{backend}")
        r = entry["result"]
        for p in r["per_process"]:
            rows.append(
                f"| {backend}, process {p['process']} | {p['steps']:,} "
                f"({p['saves']}) | {p['rss_mb_warm']:.0f} → "
                f"{p['rss_mb_end']:.0f} MB ({100 * p['rss_growth']:+.2f} %) "
                f"| {p['threads_warm']} → max {p['max_threads']} | "
                f"{p['fds_warm']} → max {p['max_fds']} | "
                f"{len(p['leftovers']) + len(p['new_temporaries'])} | "
                f"{_run(entry)} |")
    return "\n".join(rows)


def _bar(value, largest, width=40):
    return "█" * max(1, round(width * value / largest))


def scaling_table():
    entry = _load("scaling")
    r = entry["result"]
    rows = [f"Per-replica batch {r['per_replica_batch']} rows (the global "
            f"batch grows with the replicas), {r['steps']} steps × "
            f"{r['epochs']} epochs, median step of the epochs after the "
            f"first; run {_run(entry)} ({entry['machine']}).", "",
            "| backend | job | replicas | start-up | step | gradient bytes "
            "all-reduced / step | sent per replica (ring) |",
            "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        job = (f"{row['processes']} process" + "es" * (row["processes"] > 1)
               if "processes" in row else
               f"1 process, {row['devices']} simulated devices")
        rows.append(
            f"| {row['backend']} | {job} | {row['replicas']} | "
            f"{row['startup_s']:.1f} s | {_ms(row['step_ms'])} | "
            f"{row['gradient_bytes_per_step']:,} | "
            f"{row['ring_bytes_sent_per_replica']:,} |")
    largest_step = max(row["step_ms"] for row in r["rows"])
    largest_start = max(row["startup_s"] for row in r["rows"])
    plot = ["", "```text", "step time (ms)                                  "
            "start-up (s)"]
    for row in r["rows"]:
        label = (f"{row['backend']:5} {row['processes']} proc"
                 if "processes" in row else
                 f"jax   {row['devices']} dev ")
        plot.append(f"{label:13} {_bar(row['step_ms'], largest_step, 28):28} "
                    f"{row['step_ms']:6.1f}  "
                    f"{_bar(row['startup_s'], largest_start, 20):20} "
                    f"{row['startup_s']:5.1f}")
    plot.append("```")
    return "\n".join(rows + plot)


def divergence_table():
    rows = ["| backend | replicas (processes) | epoch (60 steps) | check | "
            "share of the epoch | goal | run |",
            "|---|---|---|---|---|---|---|"]
    for backend in ("jax", "tensorflow", "torch"):
        entry = _load(f"divergence_{backend}")
        r = entry["result"]
        rows.append(
            f"| {backend} | {r['replicas']} ({r['processes']}) | "
            f"{r['epoch_ms']:,.0f} ms | {_ms(r['check_ms'])} | "
            f"{100 * r['check_share_of_epoch']:.2f} % | {r['goal']} | "
            f"{_run(entry)} |")
    return "\n".join(rows)


def _mib(value):
    return f"{value / 2**20:.1f}"


def _memory_rows(name, unit, count_key, anchors, columns):
    """The rows of a memory table: per `unit`, for each count and each of
    `anchors` ((key, label)), the `columns` ((key, header)) in MiB, the
    step time, and params + optimizer against (model + Adam) / N × 1.2."""
    entry = _load(name)
    r = entry["result"]
    whole = r["model_bytes"] + r["adam_bytes"]
    per_unit = r.get("batch_per_process", r.get("batch_per_device"))
    headers = " | ".join(header for _, header in columns)
    rows = [f"Per {unit}, MiB (model {_mib(r['model_bytes'])} MiB, Adam "
            f"{_mib(r['adam_bytes'])} MiB; {r['layers']} × {r['width']}² "
            f"layers, {per_unit} rows per {unit} per step); "
            f"{_run(entry)}:", "",
            f"| {count_key} | | {headers} | step time | goal: (model + Adam) "
            "/ N × 1.2 |",
            "|---|---|" + "---|" * len(columns) + "---|---|"]
    for count, row in sorted(r[count_key].items(), key=lambda i: int(i[0])):
        goal = whole / int(count) * 1.2
        for key, label in anchors:
            m = row[key]
            held = m["param_bytes"] + m["optimizer_bytes"]
            cells = " | ".join(_mib(m[column]) for column, _ in columns)
            rows.append(
                f"| {count} | {label} | {cells} | {_ms(m['step_ms'])} | "
                f"{_mib(held)} {'≤' if held <= goal else '>'} "
                f"{_mib(goal)} |")
    return "\n".join(rows)


def memory_table():
    return _memory_rows(
        "memory_torch", "process", "processes",
        (("kd", "kd `fully_sharded`"), ("fsdp2", "FSDP2 loop (anchor)")),
        (("param_bytes", "params"), ("grad_bytes", "gradients"),
         ("optimizer_bytes", "optimizer"),
         ("step_peak_bytes", "step peak above rest")))


def memory_jax_table():
    return _memory_rows(
        "memory_jax", "device", "devices",
        (("kd", "kd `fully_sharded`"),
         ("model_parallel", "Keras `ModelParallel`, same map (anchor)")),
        (("param_bytes", "params"), ("optimizer_bytes", "optimizer")))


def _planned_row(entry, built):
    r = entry["result"]
    return (f"| {r['model']} ({r['parameters'] / 1e9:.1f} B parameters, "
            f"{r['variables']} variables), built {built} | {r['mesh']} | "
            f"{r['plan_s']:.2f} s; {r['first_plan_s']:.2f} s | "
            f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB "
            f"({r['planning_added_rss_bytes'] / 2**20:,.0f} MiB) | "
            f"{r['plan_bytes_per_device'] / 2**30:.2f} GiB / "
            f"{r['anchor_bytes_per_device'] / 2**30:.2f} GiB "
            f"({r['ratio']:.2f}x) | {r['variables_laid_out_differently']} of "
            f"{r['variables']} | {r['goal']} | {_run(entry)} |")


def plan_layout_table():
    entry = _load("plan_layout")
    r = entry["result"]
    rows = ["| model | mesh | plan (median; first) | peak memory "
            "(planning added) | bytes/device: plan / keras-hub's map | "
            "laid out differently | goal | run |",
            "|---|---|---|---|---|---|---|---|",
            _planned_row(entry, "by jax.eval_shape (JAX)")]
    for backend in ("tensorflow", "torch"):
        if os.path.exists(os.path.join(RESULTS,
                                       f"plan_layout_7b_{backend}.json")):
            other = _load(f"plan_layout_7b_{backend}")
            rows.append(_planned_row(other, other["result"]["built"]))
    if "plan_step_s" in r:
        d = r["max_weight_difference_from_one_device"]
        rows += ["", "| trained | laid out differently | steps | step: plan "
                 "/ keras-hub's map | weights vs one device: plan; "
                 "keras-hub's | goal |",
                 "|---|---|---|---|---|---|",
                 f"| {r['train_model']}, (2, 4) mesh | "
                 f"{r['train_variables_laid_out_differently']} | "
                 f"{r['train_steps']} | "
                 f"{r['plan_step_s'] * 1000:.0f} ms / "
                 f"{r['anchor_step_s'] * 1000:.0f} ms "
                 f"({r['step_ratio']:.2f}x) | {d['plan']:.1e}; "
                 f"{d['keras_hub']:.1e} | <= 1.05x; <= 1e-5 |"]
    for name in sorted(os.listdir(RESULTS)):
        if not name.startswith("plan_layout_torch_"):
            continue
        torch_entry = _load(name[:-len(".json")])
        t = torch_entry["result"]
        d = t["max_weight_difference_from_one_process"]
        rows.append(
            f"| {t['train_model'] if 'train_model' in t else t['model']}, "
            f"{t['mesh']}; run {_run(torch_entry)} | "
            f"{t['variables_laid_out_differently']} | {t['train_steps']} | "
            f"{t['plan_step_s'] * 1000:.0f} ms / "
            f"{t['anchor_step_s'] * 1000:.0f} ms ({t['step_ratio']:.2f}x) | "
            f"{d['plan']:.1e}; {d['keras_hub']:.1e} | <= 1.05x; <= 1e-5 |")
    return "\n".join(rows)


def checkpoint_object_store_table():
    entry = _load("checkpoint_object_store")
    r = entry["result"]
    m = r["median"]
    return "\n".join([
        f"{r['megabytes']:,.0f} MB of float32 Keras variables, one JAX "
        f"process, {r['server']}; median of {r['repeats']} runs; run "
        f"{_run(entry)} ({entry['machine']}).",
        "",
        "| transfer | kd `ShardedCheckpoint` | s3fs, same bytes (the anchor)"
        " | kd throughput / s3fs's | goal |",
        "|---|---|---|---|---|",
        f"| save (`write` / `put_file`) | {m['kd_save_s']:.2f} s, "
        f"{r['kd_save_mb_s']:.0f} MB/s | {m['s3fs_put_s']:.2f} s, "
        f"{r['s3fs_put_mb_s']:.0f} MB/s | {1 / r['save_over_put']:.2f}x | "
        "≥ 0.9x |",
        f"| restore (`read` / `get_file`) | {m['kd_restore_s']:.2f} s, "
        f"{r['kd_restore_mb_s']:.0f} MB/s | {m['s3fs_get_s']:.2f} s, "
        f"{r['s3fs_get_mb_s']:.0f} MB/s | {1 / r['restore_over_get']:.2f}x "
        "| ≥ 0.9x |"])


def loading_torch_table():
    entry = _load("loading_torch")
    r = entry["result"]
    return "\n".join([
        "| model (file) | processes | held per process | peak above, "
        "kd / Keras | kd / Keras | load time, kd / Keras | same weights | "
        "goal | run |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {r['model']} ({_mib(r['weights_file_bytes'])} MiB; largest "
        f"variable {_mib(r['largest_variable_bytes'])} MiB) | "
        f"{r['processes']} | {_mib(r['held_bytes_per_process'])} MiB | "
        f"{_mib(r['kd_peak_above_bytes'])} / "
        f"{_mib(r['keras_peak_above_bytes'])} MiB | {r['ratio']:.2f}x | "
        f"{r['kd_seconds']:.2f} s / {r['keras_seconds']:.2f} s | "
        f"{'yes' if r['same_weights'] else 'NO'} | <= 0.3x | "
        f"{_run(entry)} |"])


def memory_estimate_table():
    entry = _load("memory_estimate")
    r = entry["result"]
    rows = ["| backend | model | estimated (MiB) | real (MiB) | "
            "real, least and most of the steps (MiB) | "
            "estimated / real | the estimate's peak from | real from |",
            "|---|---|---|---|---|---|---|---|"]
    for backend, models in r["by_backend"].items():
        for model, m in models.items():
            steps = m.get("real_steps_bytes") or [m["real_transient_bytes"]]
            rows.append(
                f"| {backend} | {model} | "
                f"{_mib(m['estimated_transient_bytes'])} | "
                f"{_mib(m['real_transient_bytes'])} | "
                f"{_mib(min(steps))}–{_mib(max(steps))} | "
                f"{m['ratio']:.2f} | "
                f"{m['method']} | "
                f"{m.get('real_from', 'resident memory (VmHWM)')} |")
    rows.append("")
    rows.append(f"Goal: {r['goal']}. Keras {r['keras']}; run {_run(entry)} "
                f"({entry['machine']}).")
    return "\n".join(rows)


TABLES = {"fit": fit_table, "memory": memory_table,
          "memory_jax": memory_jax_table, "scaling": scaling_table,
          "soak": soak_table, "checkpoint": checkpoint_table,
          "checkpoint_torch": checkpoint_torch_table,
          "checkpoint_tf": checkpoint_tf_table,
          "checkpoint_many": checkpoint_many_table,
          "compression": compression_table,
          "compression_jax": compression_jax_table,
          "divergence": divergence_table,
          "plan_layout": plan_layout_table,
          "memory_estimate": memory_estimate_table,
          "loading_torch": loading_torch_table,
          "checkpoint_object_store": checkpoint_object_store_table}
_MARKED = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)",
                     re.DOTALL)


def render(text):
    def replace(match):
        return match.group(1) + TABLES[match.group(2)]() + "\n" + \
            match.group(4)
    found = {m.group(2) for m in _MARKED.finditer(text)}
    missing = set(TABLES) - found
    if missing:
        raise SystemExit(f"docs/benchmarks.md has no marker for {missing}")
    return _MARKED.sub(replace, text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the page differs; change nothing")
    args = parser.parse_args(argv)
    with open(PAGE) as file:
        text = file.read()
    rendered = render(text)
    if args.check:
        if rendered != text:
            print("docs/benchmarks.md is not what benchmarks/results/*.json "
                  "say: run python benchmarks/make_tables.py",
                  file=sys.stderr)
            return 1
        print("docs/benchmarks.md matches benchmarks/results/")
        return 0
    with open(PAGE, "w") as file:
        file.write(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
