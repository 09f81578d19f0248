"""FSDP memory per process on torch: kd against a hand-written FSDP2 loop.

In the same gloo processes, trials interleaved, the same MLP (width -> width,
4 layers, ReLU, MSE) trains on the same per-process batches twice:

- kd: `kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(mesh,
  min_size=0))` over a 1-D mesh of the N processes, `model.fit`;
- the anchor: `torch.nn.Sequential` of `Linear`s, each and the root under
  torch's own `fully_shard` (FSDP2), `torch.optim.Adam`, a plain loop.

For N = 1, 2, 4 processes it records per process: the bytes of the
parameters, gradients and optimizer state the process holds (its local
shards, counted exactly), the peak of a training step above the resident
memory before it (RSS sampled every 0.5 ms during the steps: the gathered
parameters and the activations), and the median step time. Prints one
JSON object and writes benchmarks/results/memory_torch.json.

Usage:
    python benchmarks/bench_memory_torch.py [--width 1024] [--steps 8]
        [--trials 2] [--processes 1 2 4]
"""

import argparse
import os
import sys
import threading
import time

from _results import record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["KERAS_BACKEND"] = "torch"

BATCH_PER_PROCESS = 64
LAYERS = 4


class PeakResident:
    """The highest resident set size (bytes) seen while in the block, by a
    thread reading /proc/self/statm every 0.5 ms."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.before = 0
        self._stop = threading.Event()

    def resident(self):
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.resident())
            time.sleep(0.0005)

    def __enter__(self):
        self.before = self.peak = self.resident()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.resident())

    @property
    def above_before(self):
        return self.peak - self.before


def _local_bytes(tensors):
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _data(width, steps, rank, world):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = BATCH_PER_PROCESS * world * steps
    x = rng.normal(size=(rows, width)).astype("float32")
    y = rng.normal(size=(rows, width)).astype("float32")
    return x, y


def _kd_trial(width, steps, world):
    import keras
    from _common import EpochTimer

    import keras_distribute as kd

    x, y = _data(width, steps, 0, world)
    mesh = keras.distribution.DeviceMesh(
        (world,), ["batch"], [f"cpu:{r}" for r in range(world)])
    strategy = kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(
        mesh, min_size=0)) if world > 1 else kd.MirroredStrategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu")
               for _ in range(LAYERS - 1)] + [keras.layers.Dense(width)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    batch = BATCH_PER_PROCESS * world  # each replica: BATCH_PER_PROCESS
    model.fit(x[:2 * batch], y[:2 * batch], batch_size=batch, epochs=1,
              shuffle=False, verbose=0)  # optimizer slots, gradients exist
    timer = EpochTimer()
    with PeakResident() as resident:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False,
                  verbose=0, callbacks=[timer])
    result = {
        "param_bytes": _local_bytes(v.value for v in model.trainable_weights),
        "grad_bytes": _local_bytes(v.value.grad
                                   for v in model.trainable_weights),
        "optimizer_bytes": _local_bytes(v.value for v in
                                        model.optimizer.variables),
        "step_peak_bytes": resident.above_before,
        "step_ms": 1000 * timer.per_step[0],
    }
    model = None  # frees it (the closures above are done with it)
    keras.backend.clear_session()
    return result


def _fsdp2_trial(width, steps, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank() if dist.is_initialized() else 0
    x, y = _data(width, steps, rank, world)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    torch.manual_seed(0)
    layers = []
    for index in range(LAYERS):
        layers.append(torch.nn.Linear(width, width))
        if index < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(index):
        start = (index * world + rank) * BATCH_PER_PROCESS  # its rows
        xb = x[start:start + BATCH_PER_PROCESS]
        yb = y[start:start + BATCH_PER_PROCESS]
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()

    for index in range(2):
        step(index)
    started = time.perf_counter()
    with PeakResident() as resident:
        for index in range(steps):
            step(index)
    elapsed = time.perf_counter() - started
    state = [t for s in optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    result = {
        "param_bytes": _local_bytes(model.parameters()),
        "grad_bytes": _local_bytes(p.grad for p in model.parameters()),
        "optimizer_bytes": _local_bytes(state),
        "step_peak_bytes": resident.above_before,
        "step_ms": 1000 * elapsed / steps,
    }
    model = optimizer = None  # frees them (the closures are done)
    return result


def measure(width, steps, trials):
    """Runs in each process: kd and the FSDP2 loop, trials interleaved."""
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import keras_distribute as kd  # noqa: F401 (joins the process group)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        kd.MirroredStrategy()  # joins the launcher's group
    runs = {"kd": [], "fsdp2": []}
    for _ in range(trials):
        runs["kd"].append(_kd_trial(width, steps, world))
        runs["fsdp2"].append(_fsdp2_trial(width, steps, world))
    summary = {}
    for name, trial_results in runs.items():
        summary[name] = {
            key: (float(np.median([r[key] for r in trial_results]))
                  if key == "step_ms" else
                  int(np.median([r[key] for r in trial_results])))
            for key in trial_results[0]}
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--processes", type=int, nargs="+",
                        default=[1, 2, 4])
    args = parser.parse_args()
    import keras_distribute as kd

    rows = {}
    for world in args.processes:
        results = kd.launch(measure, num_processes=world,
                            args=(args.width, args.steps, args.trials),
                            timeout=1800)
        rows[str(world)] = results[0]
        print(world, results[0], flush=True)
    whole = LAYERS * (args.width * args.width + args.width) * 4
    record("memory_torch", {
        "benchmark": "fsdp_memory_per_process_torch",
        "width": args.width, "layers": LAYERS,
        "batch_per_process": BATCH_PER_PROCESS,
        "model_bytes": whole, "adam_bytes": 2 * whole,
        "processes": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
