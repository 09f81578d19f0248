"""A complete custom training loop under kd.MirroredStrategy, per backend.

JAX: `jax.grad` with the stateless Keras API; TensorFlow: `tf.GradientTape`
in a `tf.function`; PyTorch: `backward` in each of N processes. Each replica
gets its slice of the global batch, losses are scaled by the global batch
size, gradients are summed across replicas, and every replica applies the
same update.

Usage:
    KERAS_BACKEND=jax python examples/custom_training_loop.py [--epochs 5]
    KERAS_BACKEND=torch python examples/custom_training_loop.py --processes 2
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_distribute as kd  # noqa: E402

GLOBAL_BATCH = 64


def batches():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    return [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH])
            for i in range(0, len(x), GLOBAL_BATCH)]


def make_model():
    keras.utils.set_random_seed(0)  # the same initial weights every time
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(64, activation="tanh"),
                             keras.layers.Dense(10)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                  reduction=None)


def train_jax(strategy, epochs):
    import jax

    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    def step(x, y, global_batch):
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss_of(trainable):
            logits, _ = model.stateless_call(trainable, non_trainable, x)
            return kd.compute_average_loss(LOSS(y, logits),
                                           global_batch_size=global_batch)

        loss, grads = jax.value_and_grad(loss_of)(trainable)
        grads = kd.get_replica_context().all_reduce("sum", grads)
        # Assigned inside `run`, written back into the model after it.
        optimizer.apply(grads, model.trainable_variables)
        return loss

    data = batches()
    dist = strategy.experimental_distribute_dataset(data)
    for epoch in range(epochs):
        total = 0.0
        for (xb, _), (x, y) in zip(data, dist):
            loss = strategy.run(step, args=(x, y, len(xb)))
            total += float(strategy.reduce("sum", loss, axis=None))
        print(f"epoch {epoch + 1}: mean loss {total / len(data):.4f}")
    return model


def train_tensorflow(strategy, epochs):
    import tensorflow as tf

    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)

    def step(inputs, global_batch):
        x, y = inputs
        with tf.GradientTape() as tape:
            loss = kd.compute_average_loss(LOSS(y, model(x, training=True)),
                                           global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_step(inputs, global_batch):
        return strategy.reduce("sum", strategy.run(
            step, args=(inputs, global_batch)), axis=None)

    data = batches()
    x = np.concatenate([b[0] for b in data])
    y = np.concatenate([b[1] for b in data])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    for epoch in range(epochs):
        total = 0.0
        distributed = strategy.experimental_distribute_dataset(dataset)
        for (xb, yb), inputs in zip(data, distributed):
            total += float(distributed_step(inputs, tf.constant(len(xb))))
        print(f"epoch {epoch + 1}: mean loss {total / len(data):.4f}")
    return model


def train_torch_process(epochs):
    import torch

    torch.set_num_threads(1)
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)

    def step(x, y, global_batch):
        loss = kd.compute_average_loss(LOSS(y, model(x)),
                                       global_batch_size=global_batch)
        model.zero_grad()
        loss.backward()
        grads = kd.get_replica_context().all_reduce(
            "sum", [v.value.grad for v in model.trainable_variables])
        with torch.no_grad():
            optimizer.apply(grads, model.trainable_variables)
        return loss

    data = batches()
    for epoch in range(epochs):
        total = 0.0
        distributed = strategy.experimental_distribute_dataset(data)
        for (xb, _), (x, y) in zip(data, distributed):
            total += float(strategy.reduce(
                "sum", strategy.run(step, args=(x, y, len(xb))), axis=None))
        if os.environ.get("RANK", "0") == "0":
            print(f"epoch {epoch + 1}: mean loss {total / len(data):.4f}")
    return [w.tolist() for w in model.get_weights()[:1]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2,
                        help="torch only: number of processes (replicas)")
    args = parser.parse_args(argv)
    backend = keras.backend.backend()
    if backend == "torch":
        weights = kd.launch(train_torch_process, num_processes=args.processes,
                            args=(args.epochs,))
        assert all(w == weights[0] for w in weights), "replicas diverged"
        print(f"{args.processes} processes finished with identical weights")
        return
    if backend == "tensorflow":
        kd.simulate_cpu_devices(4)
    strategy = kd.MirroredStrategy()
    print(f"{backend}: {strategy.num_replicas_in_sync} replicas")
    untrained = make_model()  # the loop's model as it starts
    model = (train_jax if backend == "jax" else train_tensorflow)(
        strategy, args.epochs)
    # The loop trained the model itself (its variables hold the result).
    x = np.concatenate([b[0] for b in batches()])
    y = np.concatenate([b[1] for b in batches()])
    before, after = (float(np.mean(LOSS(y, m.predict(x, verbose=0))))
                     for m in (untrained, model))
    print(f"model loss before {before:.4f}, after {after:.4f}")
    assert after < before, "the loop did not train the model"


if __name__ == "__main__":
    main()
