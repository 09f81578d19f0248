"""Multi-worker training on one machine: N processes, one global model.

Starts `--workers` processes with `kd.launch` (on a real cluster, run
`train()` on each host under torchrun, SLURM or TF_CONFIG instead; see
docs/multi_worker.md). Each process builds `kd.MultiWorkerMirroredStrategy`,
trains on its share of every global batch, and returns its weights: they
are identical on every worker.

Usage:
    KERAS_BACKEND=jax python examples/multi_worker.py [--workers 2] [--epochs 3]
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402


def train(epochs: int, devices_per_worker: int):
    """What every worker runs; the cluster comes from the environment."""
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices_per_worker}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    from sklearn.datasets import load_digits

    import keras_distribute as kd

    strategy = kd.MultiWorkerMirroredStrategy()  # first: before any tensor
    resolver = strategy.cluster_resolver
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)),
                                  keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(
            optimizer="adam", metrics=["accuracy"],
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=128, epochs=epochs,
                        verbose=2 if resolver.is_chief else 0)
    return (resolver.process_id, strategy.num_replicas_in_sync,
            history.history["accuracy"][-1], model.get_weights())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--devices-per-worker", type=int, default=2,
                        help="JAX only: simulated CPU devices per worker")
    args = parser.parse_args(argv)
    import keras_distribute as kd

    results = kd.launch(train, num_processes=args.workers,
                        args=(args.epochs, args.devices_per_worker))
    for process_id, replicas, accuracy, _ in results:
        print(f"worker {process_id}: {replicas} replicas in sync, final "
              f"accuracy {accuracy:.4f}")
    same = all(np.array_equal(a, b) for r in results[1:]
               for a, b in zip(results[0][3], r[3]))
    print("weights identical on every worker:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
