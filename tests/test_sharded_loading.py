"""`model.load_weights()` of a model made in a strategy's scope reads only
each process's regions of every variable (issue #45, item 4).

Keras' `.weights.h5`, Keras' sharded `.weights.json` and a keras-hub preset
directory are loaded into sharded models: the weights equal the file's
bit for bit, and the regions read (recorded at `LazyH5Array.read_regions`)
are the device slices, never a sharded variable whole; on torch, two
processes under one-line FSDP each read only their half. Outside a
strategy, Keras' own path runs untouched.
"""

import os

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import keras_hub_or_skip
from worker_common import recorded_regional_reads

import keras_distribute as kd


def make_model(seed=3, dtype=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up", dtype=dtype),
        keras.layers.Dense(32, name="down", dtype=dtype),
        keras.layers.LayerNormalization(name="norm", dtype=dtype),
        keras.layers.Dense(8, name="head", dtype=dtype)], name="mlp")


@pytest.fixture
def reads():
    """`[(dataset shape, region)]` of every read through a LazyH5Array."""
    with recorded_regional_reads() as found:
        yield found


def strategy_for_this_backend():
    if BACKEND == "jax":  # tensor parallel on 4 of the 8 devices x 2
        mesh = keras.distribution.DeviceMesh(
            (2, 4), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["mlp/up/kernel"] = ("batch", "model")
        layout_map["mlp/down/kernel"] = ("model", None)
        return kd.MirroredStrategy(layout_map=layout_map), True
    # One process: torch and TensorFlow keep every variable whole here.
    return kd.MirroredStrategy(), False


@pytest.mark.parametrize("sharded_file", [False, True],
                         ids=["weights.h5", "weights.json"])
def test_load_weights_reads_each_devices_regions_bit_exactly(
        tmp_path, reads, sharded_file):
    saved = make_model(seed=3)
    path = str(tmp_path / ("model.weights.json" if sharded_file
                           else "model.weights.h5"))
    if sharded_file:  # Keras' sharded weights: a manifest and shard files
        saved.save_weights(path, max_shard_size=1e-5)  # (GB: 10 kB shards)
        assert len(list(tmp_path.glob("*.h5"))) > 1
    else:
        saved.save_weights(path)
    strategy, sharded = strategy_for_this_backend()
    with strategy.scope():
        model = make_model(seed=4)
    model.load_weights(path)
    for expected, found in zip(saved.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(expected, found)
    assert len(reads) >= len(saved.weights)  # every variable went lazily
    whole = {shape for shape, region in reads
             if region == tuple((0, n) for n in shape)}
    if sharded:
        # up/kernel (16, 64): 2 x 4 slices of (8, 16), each read once;
        # down/kernel (64, 32): 4 row slices of (16, 32); never whole.
        assert (16, 64) not in whole and (64, 32) not in whole
        up = sorted(r for s, r in reads if s == (16, 64))
        assert len(up) == 8 and all(
            (b - a, d - c) == (8, 16) for (a, b), (c, d) in up)
        assert len([r for s, r in reads if s == (64, 32)]) == 4
    assert (8,) in whole  # a replicated variable: read whole, once


@pytest.mark.parametrize("dtype", ["bfloat16", "mixed_bfloat16"])
@pytest.mark.parametrize("sharded_file", [False, True],
                         ids=["weights.h5", "weights.json"])
def test_bfloat16_weights_load_bit_exactly(tmp_path, reads, dtype,
                                           sharded_file):
    # Keras stores bfloat16 variables as 2-byte opaque values marked
    # `dtype="bfloat16"` (keras-hub's large presets are bfloat16): they
    # are read region by region as bfloat16, as Keras reads them whole.
    saved = make_model(seed=3, dtype=dtype)
    path = str(tmp_path / ("model.weights.json" if sharded_file
                           else "model.weights.h5"))
    if sharded_file:
        saved.save_weights(path, max_shard_size=1e-5)
    else:
        saved.save_weights(path)
    strategy, _ = strategy_for_this_backend()
    with strategy.scope():
        model = make_model(seed=4, dtype=dtype)
    model.load_weights(path)
    for variable, expected, found in zip(saved.weights, saved.get_weights(),
                                         model.get_weights()):
        assert found.dtype == expected.dtype, variable.path
        np.testing.assert_array_equal(expected.astype("float32"),
                                      found.astype("float32"))
    assert len(reads) >= len(saved.weights)  # every variable went lazily
    if dtype == "bfloat16":
        assert str(model.get_weights()[0].dtype) == "bfloat16"


def test_a_bfloat16_mark_on_other_values_is_refused(tmp_path):
    import h5py

    path = str(tmp_path / "model.weights.h5")
    make_model(seed=3, dtype="bfloat16").save_weights(path)
    with h5py.File(path, "a") as file:
        names = []
        file.visititems(lambda name, item: names.append(name) if getattr(
            item, "shape", None) == (16, 64) else None)
        (kernel,) = names
        del file[kernel]
        file.create_dataset(kernel, data=np.zeros((16, 64), "V4"))
        file[kernel].attrs["dtype"] = "bfloat16"
    strategy, _ = strategy_for_this_backend()
    with strategy.scope():
        model = make_model(seed=4, dtype="bfloat16")
    with pytest.raises(ValueError, match="bfloat16 takes 2"):
        model.load_weights(path)


def test_a_file_replaced_while_it_loads_is_never_read(tmp_path):
    # The file Keras opened and checked is the only one read: a file that
    # replaces it mid-load (an atomic save's os.replace), whose kernel is
    # a virtual dataset onto a file outside the directory, gives nothing.
    import h5py

    from keras_distribute.integration import sharded_loading

    directory = tmp_path / "weights"
    directory.mkdir()
    path = str(directory / "model.weights.h5")
    saved = make_model(seed=3)
    saved.save_weights(path)
    outside = str(tmp_path / "outside.h5")
    with h5py.File(outside, "w") as file:
        file["secret"] = np.full((16, 64), 42.0, "float32")
    swapped = str(directory / "swapped.weights.h5")
    make_model(seed=5).save_weights(swapped)
    with h5py.File(swapped, "a") as file:
        names = []
        file.visititems(lambda name, item: names.append(name) if getattr(
            item, "shape", None) == (16, 64) else None)
        (kernel,) = names  # (up/kernel)
        layout = h5py.VirtualLayout(shape=(16, 64), dtype="float32")
        layout[...] = h5py.VirtualSource(outside, "secret", (16, 64))
        del file[kernel]
        file.create_virtual_dataset(kernel, layout)
    original = sharded_loading.LazyH5Array.read_regions
    replaced = []

    def replacing_mid_load(self, regions, into=None):
        if not replaced:
            os.replace(swapped, path)
            replaced.append(True)
        return original(self, regions, into)

    strategy, _ = strategy_for_this_backend()
    with strategy.scope():
        model = make_model(seed=4)
    sharded_loading.LazyH5Array.read_regions = replacing_mid_load
    try:
        model.load_weights(path)
    finally:
        sharded_loading.LazyH5Array.read_regions = original
    assert replaced
    for expected, found in zip(saved.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(expected, found)


def test_outside_a_strategy_keras_loads_as_it_always_did(tmp_path, reads):
    saved = make_model(seed=3)
    path = str(tmp_path / "model.weights.h5")
    saved.save_weights(path)
    model = make_model(seed=4)
    model.load_weights(path)
    assert reads == []  # Keras' own path
    for expected, found in zip(saved.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(expected, found)


def test_layers_that_keep_what_they_load_get_whole_arrays(tmp_path, reads):
    # Discretization keeps the array it loads as its summary: it gets
    # Keras' array, never a view of the file (deleted after the load).
    data = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")

    def make():
        normalize = keras.layers.Normalization(name="normalize")
        bins = keras.layers.Discretization(num_bins=4, name="bins")
        normalize.adapt(data)
        bins.adapt(data)
        inputs = keras.Input((4,))
        joined = keras.layers.Concatenate()(
            [normalize(inputs), keras.ops.cast(bins(inputs), "float32")])
        outputs = keras.layers.Dense(8, name="dense")(joined)
        return keras.Model(inputs, outputs, name="kept")

    saved = make()
    path = str(tmp_path / "kept.weights.h5")
    saved.save_weights(path)
    strategy, _ = strategy_for_this_backend()
    with strategy.scope():
        model = keras.models.clone_model(saved)
    model.load_weights(path)
    (tmp_path / "kept.weights.h5").unlink()  # nothing may still read it
    np.testing.assert_allclose(model.predict(data, verbose=0),
                               saved.predict(data, verbose=0), atol=1e-6)
    # Variables were read by region (the Dense's, Normalization's mean,
    # variance and count); the bins' summary is Keras' own array.
    assert {shape for shape, _ in reads} == {(8, 8), (8,), (4,), ()}
    assert isinstance(model.get_layer("bins").summary, np.ndarray)


def test_a_mismatched_file_fails_as_keras_fails(tmp_path):
    keras.utils.set_random_seed(1)
    other = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(65, name="up"),
                              keras.layers.Dense(32, name="down"),
                              keras.layers.LayerNormalization(name="norm"),
                              keras.layers.Dense(8, name="head")],
                             name="mlp")
    path = str(tmp_path / "other.weights.h5")
    other.save_weights(path)
    strategy, _ = strategy_for_this_backend()
    with strategy.scope():
        model = make_model(seed=4)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="shape"):
        model.load_weights(path)
    # The layer that did not fit is left as it was.
    np.testing.assert_array_equal(model.get_weights()[0], before[0])


def test_a_keras_hub_preset_directory_loads_region_by_region(tmp_path,
                                                              reads):
    if BACKEND != "jax":
        pytest.skip("keras-hub's map shards on this process's devices on "
                    "JAX; torch's two-process FSDP load: "
                    "test_torch_processes_each_read_only_their_half")
    keras_hub = keras_hub_or_skip()

    def gemma():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=256, num_layers=2, num_query_heads=4,
            num_key_value_heads=4, hidden_dim=64, intermediate_dim=256,
            head_dim=16)

    keras.utils.set_random_seed(5)
    saved = gemma()
    saved.save_to_preset(str(tmp_path / "preset"))
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"],
                                         [f"cpu:{i}" for i in range(8)])
    strategy = kd.MirroredStrategy(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh))
    with strategy.scope():
        loaded = keras_hub.models.GemmaBackbone.from_preset(
            str(tmp_path / "preset"))
    for expected, found in zip(saved.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(expected, found)
    # The token embedding (256, 64) is sharded over the model axis: read
    # as its slices, never whole.
    embedding = [r for s, r in reads if s == (256, 64)]
    assert len(embedding) > 1 and ((0, 256), (0, 64)) not in embedding


def test_torch_processes_each_read_only_their_half(tmp_path):
    if BACKEND != "torch":
        pytest.skip("one process per device on torch (JAX and TensorFlow: "
                    "the tests above)")
    if os.environ.get("KD_KERAS_STACK") == "next":
        pytest.skip("kd's regional reads between processes, on the release "
                    "stack; this stack runs Keras' store and assign hooks "
                    "in the tests above (tests/conftest.py)")
    import workers_torch

    model, _, _, _ = workers_torch.make_sharded_parts(seed=3, dropout=False)
    model.build((None, 5))
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    results = kd.launch(workers_torch.fully_sharded_load_weights,
                        num_processes=2, args=(path,), timeout=120)
    for result in results:
        for expected, found in zip(model.get_weights(), result["weights"]):
            np.testing.assert_array_equal(expected, found)
    sharded = [(tuple(w.shape), local) for w, local in zip(
        model.weights, results[0]["local_shapes"])
        if local is not None and local != tuple(w.shape)]
    assert sharded  # FSDP cut the variables of 32 elements or more
    for shape, local in sharded:
        halves = [sorted(r for s, r in result["read"] if s == shape)
                  for result in results]
        # Each process read one region, its own half; the two differ.
        assert [len(h) for h in halves] == [1, 1]
        assert halves[0] != halves[1]
        region = halves[0][0]
        assert tuple(b - a for a, b in region) == local


def test_torch_processes_load_bfloat16_weights_into_their_shards(tmp_path):
    # #71.1 on torch's FSDP: each process reads its half of each bfloat16
    # variable (Keras' 2-byte opaque values) into its shard, bit-exactly.
    if BACKEND != "torch":
        pytest.skip("one process per device on torch (JAX and TensorFlow: "
                    "test_bfloat16_weights_load_bit_exactly)")
    if os.environ.get("KD_KERAS_STACK") == "next":
        pytest.skip("kd's regional reads between processes, on the release "
                    "stack; this stack runs Keras' store and assign hooks "
                    "in the tests above (tests/conftest.py)")
    import workers_torch

    saved = workers_torch._bfloat16_model(seed=3)
    path = str(tmp_path / "model.weights.h5")
    saved.save_weights(path)
    results = kd.launch(workers_torch.fully_sharded_load_bfloat16,
                        num_processes=2, args=(path,), timeout=120)
    expected = [w.astype("float32") for w in saved.get_weights()]
    for result in results:
        assert set(result["dtypes"]) == {"bfloat16"}
        assert (32, 32) in result["local_shapes"]  # up/kernel, cut in two
        for a, b in zip(expected, result["weights"]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(expected, result["restored"]):
            np.testing.assert_array_equal(a, b)
