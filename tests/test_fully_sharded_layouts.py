"""`kd.layouts.fully_sharded`: FSDP in one line (#45.2).

The rule (which dimension of which variable is sharded over the batch
axis), its bad inputs, a JAX fit equal to one device with the variables
and their optimizer slots held 1/N per device, alone and composed with a
model-axis map, and TensorFlow's refusal. The torch processes' fits are in
test_torch_multiprocess.py (`test_fully_sharded_variables_...`).
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND
from keras.distribution import DeviceMesh
from keras.distribution import LayoutMap

import keras_distribute as kd


def mesh(shape, names):
    size = int(np.prod(shape))
    return DeviceMesh(shape, names, [f"cpu:{i}" for i in range(size)])


def test_the_largest_dimension_the_batch_axis_divides_is_sharded():
    fsdp = kd.layouts.fully_sharded(mesh((4,), ["batch"]), min_size=64)
    assert isinstance(fsdp, LayoutMap)
    assert fsdp.layout_for("d/kernel", (16, 64)).axes == (None, "batch")
    assert fsdp.layout_for("d/kernel", (64, 16)).axes == ("batch", None)
    assert fsdp.layout_for("d/kernel", (32, 32)).axes == ("batch", None)
    # Not divisible by 4 on the larger dimension: the next one.
    assert fsdp.layout_for("d/kernel", (8, 66)).axes == ("batch", None)
    assert fsdp.layout_for("d/kernel", (3, 33)) is None  # none divides
    assert fsdp.layout_for("d/bias", (63,)) is None  # under min_size
    assert fsdp.layout_for("e/embeddings", (5, 8, 16)).axes == (
        None, None, "batch")
    # The default threshold keeps small variables replicated.
    default = kd.layouts.fully_sharded(mesh((4,), ["batch"]))
    assert default.min_size == 2**16
    assert default.layout_for("d/kernel", (64, 64)) is None
    assert default.layout_for("d/kernel", (256, 256)).axes == ("batch", None)


def test_a_model_axis_map_is_kept_and_the_batch_axis_added():
    base = LayoutMap(mesh((2, 2), ["batch", "model"]))
    base[".*up/kernel"] = (None, "model")
    base[".*down/kernel"] = ("model", None)
    base[".*gemma/kernel"] = ("model", "batch")  # names the batch axis
    fsdp = kd.layouts.fully_sharded(base, min_size=0)
    assert sorted(fsdp.keys()) == sorted(base.keys())
    assert fsdp.layout_for("m/up/kernel", (16, 64)).axes == ("batch", "model")
    assert fsdp.layout_for("m/down/kernel", (64, 3)).axes == ("model", None)
    assert fsdp.layout_for("m/gemma/kernel", (8, 8)).axes == ("model",
                                                             "batch")
    assert fsdp.layout_for("m/other/bias", (6,)).axes == ("batch",)
    assert fsdp["m/up/kernel"].axes == (None, "model")  # entries as given
    # A batch axis of one: nothing to shard over.
    alone = kd.layouts.fully_sharded(mesh((1, 2), ["batch", "model"]),
                                     min_size=0)
    assert alone.layout_for("d/kernel", (4, 4)) is None
    assert alone.shards_over == []


@pytest.mark.parametrize("args, kwargs, error, match", [
    (("mesh",), {}, TypeError, "Expected a keras.distribution.DeviceMesh"
     ".*Received: 'mesh' of type str"),
    ((None,), {}, TypeError, "Received: None"),
    ((), {"min_size": -1}, ValueError, "non-negative int.*min_size=-1"),
    ((), {"min_size": 1.5}, ValueError, "min_size=1.5"),
    ((), {"min_size": True}, ValueError, "min_size=True"),
])
def test_bad_inputs(args, kwargs, error, match):
    args = args or (mesh((2,), ["batch"]),)
    with pytest.raises(error, match=match):
        kd.layouts.fully_sharded(*args, **kwargs)


def make_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up"),
        keras.layers.Dense(3, name="down")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(64, 16)).astype("float32"),
            rng.normal(size=(64, 3)).astype("float32"))


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's devices in one process")
@pytest.mark.parametrize("shape", [(8,), (4, 2)])
def test_jax_fit_with_fully_sharded_variables_matches_one_device(shape):
    import jax

    x, y = data()
    reference = make_model()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    names = ["batch", "model"][:len(shape)]
    device_mesh = DeviceMesh(shape, names, jax.devices())
    if len(shape) == 1:
        layout_map = kd.layouts.fully_sharded(device_mesh, min_size=100)
    else:
        base = LayoutMap(device_mesh)
        base[".*up/kernel"] = (None, "model")
        layout_map = kd.layouts.fully_sharded(base, min_size=100)
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    assert strategy.num_replicas_in_sync == shape[0]
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)

    def shard_shapes(variable):
        return {s.data.shape for s in variable.value.addressable_shards}

    up, down = model.get_layer("up"), model.get_layer("down")
    if len(shape) == 1:
        assert shard_shapes(up.kernel) == {(16, 8)}  # 64 over 8
        assert shard_shapes(down.kernel) == {(8, 3)}
    else:
        assert shard_shapes(up.kernel) == {(4, 32)}  # batch x model
        assert shard_shapes(down.kernel) == {(16, 3)}
    assert shard_shapes(up.bias) == {(64,)}  # under min_size: replicated
    slots = {v.path: shard_shapes(v) for v in model.optimizer.variables}
    momentum = next(k for k in slots if k.endswith("up_kernel_momentum"))
    assert slots[momentum] == shard_shapes(up.kernel)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's refusal")
def test_tensorflow_refuses_it_clearly():
    with pytest.raises(NotImplementedError, match="'tensorflow' Keras "
                       "backend.*every variable of at least 65536 elements, "
                       "over 'batch'"):
        kd.MirroredStrategy(layout_map=kd.layouts.fully_sharded(
            mesh((2,), ["batch"])))
