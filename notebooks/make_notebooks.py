"""Writes the notebooks of this folder from the cells below, executed.

Edit the cells here, then run `python notebooks/make_notebooks.py` (in the
project's environment: `.venv/bin/python`). Each notebook is written and run
top to bottom on a fresh kernel, and saved **with** its outputs (the plots
show on GitHub). The test suite (tests/test_notebooks.py) checks that the
committed cells are the ones below, runs every notebook again and compares
the outputs of the cells marked `checked` (the deterministic ones).

Usage:
    python notebooks/make_notebooks.py [--no-execute] [NAME ...]
"""

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
CHECKED = "kd-checked-output"  # tag: the test compares this cell's output
# The cells whose output is deterministic (shapes, replica ids, layouts,
# "identical: True"); losses and timings are not compared.
CHECKED_CELLS = {"01-01", "01-03", "02-01", "02-03", "02-05", "03-04",
                 "04-03", "04-07", "04-09"}

QUICKSTART = [
    new_markdown_cell(
        "# Quickstart: `kd.MirroredStrategy`\n\n"
        "Train a classifier on scikit-learn's digits over 8 simulated CPU "
        "devices, and check that 8 replicas on a global batch learn exactly "
        "what one device learns on the same batch."),
    new_code_cell(
        "import os\n"
        "os.environ['KERAS_BACKEND'] = 'jax'\n"
        "# 8 simulated devices; must be set before JAX is imported.\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
        "import keras\n"
        "import numpy as np\n"
        "import keras_distribute as kd\n"
        "from sklearn.datasets import load_digits\n"
        "digits = load_digits()\n"
        "x = (digits.data / 16).astype('float32')\n"
        "y = digits.target\n"
        "x.shape"),
    new_markdown_cell(
        "Create the strategy, then build and compile the model **inside** "
        "its scope: every variable is laid out over the 8 devices. "
        "`describe_layout` prints each variable's layout and bytes per "
        "device; ending a cell, it also draws the mesh with the bytes each "
        "device holds and the heaviest variables."),
    new_code_cell(
        "strategy = kd.MirroredStrategy()\n"
        "print(strategy, strategy.num_replicas_in_sync)\n"
        "\n"
        "def make_model():\n"
        "    keras.utils.set_random_seed(0)\n"
        "    model = keras.Sequential([\n"
        "        keras.Input((64,)),\n"
        "        keras.layers.Dense(64, activation='tanh'),\n"
        "        keras.layers.Dense(10)])\n"
        "    model.compile(optimizer=keras.optimizers.SGD(0.1),\n"
        "                  loss=keras.losses.SparseCategoricalCrossentropy("
        "from_logits=True),\n"
        "                  metrics=['accuracy'])\n"
        "    return model\n"
        "\n"
        "with strategy.scope():\n"
        "    model = make_model()\n"
        "strategy.describe_layout(model)"),
    new_markdown_cell(
        "`batch_size` is the **global** batch: each step splits it 8 ways "
        "and combines the gradients. The last batch (1797 % 64 = 5 rows) "
        "does not divide by 8, and still works."),
    new_code_cell(
        "history = model.fit(x, y, batch_size=64, epochs=5, shuffle=False, "
        "verbose=2)"),
    new_markdown_cell("The same model on one device, for comparison:"),
    new_code_cell(
        "reference = make_model()\n"
        "reference_history = reference.fit(x, y, batch_size=64, epochs=5, "
        "shuffle=False, verbose=0)\n"
        "difference = max(np.abs(a - b).max() for a, b in "
        "zip(model.get_weights(), reference.get_weights()))\n"
        "print(f'largest weight difference: {difference:.2e}')\n"
        "assert difference < 1e-5"),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "plt.plot(reference_history.history['loss'], 'o-', label='1 device')\n"
        "plt.plot(history.history['loss'], 'x--', label='8 replicas')\n"
        "plt.xlabel('epoch'); plt.ylabel('loss'); plt.legend()\n"
        "plt.title('The curves coincide: same updates, split 8 ways')\n"
        "plt.show()"),
    new_markdown_cell(
        "The model remembers its strategy: `evaluate` and `predict` "
        "distribute outside the scope too, and `predict` returns rows in "
        "input order."),
    new_code_cell(
        "print(model.evaluate(x, y, batch_size=64, verbose=0))\n"
        "predictions = model.predict(x, batch_size=64, verbose=0)\n"
        "predictions.shape"),
]

CUSTOM_LOOP = [
    new_markdown_cell(
        "# Custom training loops: `run`, `reduce`, replica contexts\n\n"
        "The tf.distribute way on JAX: each replica runs the step on its "
        "slice; losses are scaled by the **global** batch size and gradients "
        "summed across replicas."),
    new_code_cell(
        "import os\n"
        "os.environ['KERAS_BACKEND'] = 'jax'\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
        "import jax\n"
        "import keras\n"
        "import numpy as np\n"
        "import keras_distribute as kd\n"
        "strategy = kd.MirroredStrategy()\n"
        "strategy.num_replicas_in_sync"),
    new_markdown_cell("`run` calls a function once per replica:"),
    new_code_cell(
        "ids = strategy.run(lambda: "
        "kd.get_replica_context().replica_id_in_sync_group)\n"
        "print(ids)\n"
        "print('sum of ids:', strategy.reduce('sum', ids, axis=None))"),
    new_markdown_cell(
        "A distributed dataset splits each global batch across replicas:"),
    new_code_cell(
        "batches = [np.arange(8.0) + 8 * i for i in range(2)]\n"
        "for x in strategy.experimental_distribute_dataset(batches):\n"
        "    print(strategy.experimental_local_results(x))"),
    new_markdown_cell("A complete training loop:"),
    new_code_cell(
        "from sklearn.datasets import load_digits\n"
        "digits = load_digits()\n"
        "x_all = (digits.data / 16).astype('float32')[:1792]\n"
        "y_all = digits.target[:1792]\n"
        "GLOBAL_BATCH = 64\n"
        "data = [(x_all[i:i + GLOBAL_BATCH], y_all[i:i + GLOBAL_BATCH])\n"
        "        for i in range(0, len(x_all), GLOBAL_BATCH)]\n"
        "with strategy.scope():\n"
        "    model = keras.Sequential([keras.Input((64,)), "
        "keras.layers.Dense(64, activation='tanh'), keras.layers.Dense(10)])\n"
        "    optimizer = keras.optimizers.SGD(0.1)\n"
        "    optimizer.build(model.trainable_variables)\n"
        "loss_fn = keras.losses.SparseCategoricalCrossentropy("
        "from_logits=True, reduction=None)\n"
        "\n"
        "def train_step(x, y):\n"
        "    trainable = [v.value for v in model.trainable_variables]\n"
        "    non_trainable = [v.value for v in model.non_trainable_variables]\n"
        "    def loss_of(trainable):\n"
        "        logits, _ = model.stateless_call(trainable, non_trainable, x)\n"
        "        return kd.compute_average_loss(loss_fn(y, logits), "
        "global_batch_size=GLOBAL_BATCH)\n"
        "    loss, grads = jax.value_and_grad(loss_of)(trainable)\n"
        "    grads = kd.get_replica_context().all_reduce('sum', grads)\n"
        "    # Assigned inside `run`, written back into the model after it.\n"
        "    optimizer.apply(grads, model.trainable_variables)\n"
        "    return loss\n"
        "\n"
        "for epoch in range(3):\n"
        "    total = 0.0\n"
        "    for xb, yb in strategy.experimental_distribute_dataset(data):\n"
        "        loss = strategy.run(train_step, args=(xb, yb))\n"
        "        total += float(strategy.reduce('sum', loss, axis=None))\n"
        "    print(f'epoch {epoch + 1}: loss {total / len(data):.4f}')"),
    new_markdown_cell(
        "The loop trained the model itself: its variables hold the result."),
    new_code_cell(
        "logits = model.predict(x_all, verbose=0)\n"
        "print('training accuracy:', float(np.mean(logits.argmax(-1) == "
        "y_all)))"),
]

MULTI_WORKER = [
    new_markdown_cell(
        "# Multi-worker training from a notebook\n\n"
        "`kd.notebook_launcher` runs a function defined in a cell in N "
        "processes that form a group. On PyTorch one process is one "
        "replica; every process trains on its share of each global batch "
        "and ends with the same weights."),
    new_code_cell(
        "import os\n"
        "os.environ['KERAS_BACKEND'] = 'torch'\n"
        "import numpy as np\n"
        "import keras_distribute as kd"),
    new_code_cell(
        "def train(epochs):\n"
        "    import torch\n"
        "    torch.set_num_threads(1)\n"
        "    import keras\n"
        "    from sklearn.datasets import load_digits\n"
        "    strategy = kd.MultiWorkerMirroredStrategy()\n"
        "    digits = load_digits()\n"
        "    x = (digits.data / 16).astype('float32')\n"
        "    with strategy.scope():\n"
        "        model = keras.Sequential([keras.Input((64,)), "
        "keras.layers.Dense(32, activation='relu'), keras.layers.Dense(10)])\n"
        "        model.compile(optimizer='adam', metrics=['accuracy'], loss="
        "keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "    history = model.fit(x, digits.target, batch_size=128, "
        "epochs=epochs, verbose=0)\n"
        "    return (strategy.cluster_resolver.process_id, "
        "strategy.num_replicas_in_sync,\n"
        "            history.history['accuracy'], model.get_weights())"),
    new_code_cell(
        "results = kd.notebook_launcher(train, num_processes=2, args=(3,))\n"
        "for process_id, replicas, accuracy, _ in results:\n"
        "    print(f'process {process_id}: {replicas} replicas, accuracy per "
        "epoch {np.round(accuracy, 3)}')"),
    new_code_cell(
        "same = all(np.array_equal(a, b) for a, b in "
        "zip(results[0][3], results[1][3]))\n"
        "print('identical weights on both processes:', same)\n"
        "assert same"),
]


CHECKPOINT = [
    new_markdown_cell(
        "# Checkpoint and resume\n\n"
        "Interrupt a distributed `fit` half-way, run it again, and get exactly "
        "the weights of a run that was never interrupted; then look inside a "
        "sharded checkpoint."),
    new_code_cell(
        "import os, tempfile\n"
        "os.environ['KERAS_BACKEND'] = 'jax'\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=4'\n"
        "import json\n"
        "import keras\n"
        "import numpy as np\n"
        "import keras_distribute as kd\n"
        "from sklearn.datasets import load_digits\n"
        "digits = load_digits()\n"
        "x = (digits.data / 16).astype('float32')  # 1797 rows: a short last batch\n"
        "y = digits.target.astype('int32')\n"
        "strategy = kd.MirroredStrategy()\n"
        "directory = tempfile.mkdtemp()\n"
        "\n"
        "def train(callbacks):\n"
        "    keras.utils.set_random_seed(0)\n"
        "    with strategy.scope():\n"
        "        model = keras.Sequential([\n"
        "            keras.Input((64,)),\n"
        "            keras.layers.Dense(64, activation='relu'),\n"
        "            keras.layers.Dropout(0.2),\n"
        "            keras.layers.Dense(10)])\n"
        "        model.compile(optimizer='adam', metrics=['accuracy'],\n"
        "                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=True,\n"
        "                        verbose=0, callbacks=callbacks)\n"
        "    return model, history\n"
        "\n"
        "reference, _ = train([])  # never interrupted"),
    new_markdown_cell(
        "A callback that raises after 31 steps (epoch 2, batch 2) stands in for a crash. "
        "`BackupAndRestore` backs up every 10 steps: model, optimizer, metric "
        "state, RNG states and the other callbacks' progress."),
    new_code_cell(
        "class Crash(keras.callbacks.Callback):\n"
        "    steps = 0\n"
        "    def on_train_batch_end(self, batch, logs=None):\n"
        "        self.steps += 1\n"
        "        if self.steps == 31:\n"
        "            raise KeyboardInterrupt('crash')\n"
        "\n"
        "backup_dir = os.path.join(directory, 'backup')\n"
        "try:\n"
        "    train([kd.callbacks.BackupAndRestore(backup_dir, save_freq=10), Crash()])\n"
        "except KeyboardInterrupt:\n"
        "    print('crashed; backups:', [os.path.basename(p) for p in\n"
        "                                kd.checkpoint.checkpoints_in(backup_dir)])"),
    new_markdown_cell(
        "Inside a checkpoint: `index.json` (shapes, dtypes, logical layouts, "
        "which file and slice holds each piece, checksums) and one HDF5 shard "
        "file per writing process."),
    new_code_cell(
        "latest = kd.checkpoint.latest_checkpoint(backup_dir)\n"
        "print(sorted(os.listdir(latest)))\n"
        "index = json.load(open(os.path.join(latest, 'index.json')))\n"
        "print('format version', index['format_version'], '| mesh', index['mesh_shape'])\n"
        "print('resume at epoch', index['metadata']['epoch'], 'step', index['metadata']['step'])\n"
        "for key, shape in kd.checkpoint.list_variables(latest)[:6]:\n"
        "    print(f'{key:14s} {shape}')\n"
        "print(json.dumps(index['variables']['model/1'], indent=1)[:400])"),
    new_markdown_cell(
        "Run the same `fit` again, with the same callback: it restores the "
        "backup and skips what was already done."),
    new_code_cell(
        "resumed, history = train([kd.callbacks.BackupAndRestore(backup_dir, save_freq=10)])\n"
        "print('epochs run after the resume:', len(history.history['loss']))\n"
        "same = all(np.array_equal(a, b) for a, b in\n"
        "           zip(reference.get_weights(), resumed.get_weights()))\n"
        "print('identical to the uninterrupted run:', same)\n"
        "assert same"),
    new_markdown_cell(
        "Checkpoints restore anywhere: onto another number of devices (here "
        "one, no strategy) and into a plain Keras `.weights.h5` file."),
    new_code_cell(
        "checkpoint = kd.checkpoint.ShardedCheckpoint(model=resumed)\n"
        "path = checkpoint.write(os.path.join(directory, 'final'))\n"
        "single = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation='relu'),\n"
        "                           keras.layers.Dropout(0.2), keras.layers.Dense(10)])\n"
        "kd.checkpoint.ShardedCheckpoint(model=single).read(path).assert_consumed()\n"
        "print('1 device equals 4 replicas:', all(np.array_equal(a, b) for a, b in\n"
        "      zip(single.get_weights(), resumed.get_weights())))\n"
        "kd.checkpoint.export_weights(path, single, os.path.join(directory, 'final.weights.h5'))\n"
        "print(sorted(os.listdir(directory)))"),
]


NOTEBOOKS = {"01_quickstart": QUICKSTART,
             "02_custom_training_loop": CUSTOM_LOOP,
             "03_multi_worker_locally": MULTI_WORKER,
             "04_checkpoint_and_resume": CHECKPOINT}


def build(name):
    """The notebook `name` from its cells, without outputs."""
    cells = NOTEBOOKS[name]
    for number, cell in enumerate(cells):  # stable ids: no diff churn
        cell["id"] = f"{name[:2]}-{number:02d}"
        if cell["id"] in CHECKED_CELLS:
            cell.metadata["tags"] = [CHECKED]
    return new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3",
                       "language": "python"}})


def execute(notebook):
    """Runs `notebook` top to bottom on a fresh kernel (in this folder)."""
    import nbclient

    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # timings: no diff churn
        if cell.cell_type == "code":  # TensorFlow's start-up log lines
            cell.outputs = [o for o in cell.outputs if not (
                o.output_type == "stream" and o.name == "stderr"
                and all(_is_log_line(line)
                        for line in o.text.splitlines()))]
    return notebook


def _is_log_line(line):
    return not line.strip() or line.startswith((
        "WARNING: All log messages before absl", "I0000 ", "W0000 ",
        "E0000 "))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(NOTEBOOKS))
    parser.add_argument("--no-execute", action="store_true",
                        help="write the cells only (no outputs)")
    args = parser.parse_args(argv)
    for name in args.names:
        notebook = build(name)
        if not args.no_execute:
            print(f"executing {name} ...", file=sys.stderr)
            execute(notebook)
        nbformat.write(notebook, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
