"""`kd.layouts.plan_layout` (#46.1): a layout map planned from variable
shapes, with its report.

The rules on an MLP (column- then row-parallel, a column kernel's bias with
it, FSDP on what stays large), a plan that never holds an indivisible
shard, keras-hub Gemma planned without values to exactly the map keras-hub
writes by hand, a JAX fit under the plan equal to one device, and the bad
inputs.
"""

import math
import os
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND
from conftest import keras_hub_or_skip
from conftest import proc_status
from conftest import reset_peak_resident
from keras.distribution import DeviceMesh

import keras_distribute as kd

ROOT = Path(__file__).resolve().parent.parent


def mesh(shape, names=("batch", "model")):
    size = int(np.prod(shape))
    return DeviceMesh(shape, list(names)[:len(shape)],
                      [f"cpu:{i}" for i in range(size)])


def mlp(compile=True):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up"),
        keras.layers.Dense(16, name="down"),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(3, name="head")], name="mlp")
    if compile:  # part of the plan's build (see below)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def uncompiled():
    return mlp(compile=False)


def assert_divisible(plan):
    sizes = dict(zip(plan.mesh.axis_names, plan.mesh.shape))
    for row in plan.variables:
        for size, axis in zip(row.shape, row.axes):
            assert axis is None or size % sizes[axis] == 0, row
        shards = math.prod(sizes[a] for a in row.axes if a is not None)
        itemsize = np.dtype(row.dtype).itemsize
        assert row.bytes_per_device * shards == math.prod(row.shape) * (
            itemsize)


def test_an_mlp_is_planned_column_then_row_parallel_with_fsdp():
    plan = kd.layouts.plan_layout(uncompiled, mesh((2, 4)),
                                  min_shard_size=0, fsdp_min_size=512)
    axes = {row.path: row.axes for row in plan.variables}
    assert axes["mlp/up/kernel"] == ("batch", "model")  # (16, 64): column
    assert axes["mlp/up/bias"] == ("model",)  # with its column kernel
    assert axes["mlp/down/kernel"] == ("model", "batch")  # (64, 16): row
    assert axes["mlp/down/bias"] == (None,)  # a row kernel's: replicated
    assert axes["mlp/norm/gamma"] == (None,)  # no rule: replicated
    assert axes["mlp/head/kernel"] == ("model", None)  # (16, 3): row, small
    reasons = {row.path: row.reason for row in plan.variables}
    assert reasons["mlp/up/kernel"].startswith("column parallel")
    assert "FSDP: dimension 0 over batch" in reasons["mlp/up/kernel"]
    assert reasons["mlp/down/kernel"].startswith("row parallel")
    assert_divisible(plan)
    assert plan.bytes_per_device < plan.replicated_bytes
    table = plan.table()
    assert table.splitlines()[0].split()[:4] == [
        "variable", "shape", "layout", "bytes/device"]
    assert "per device:" in table.splitlines()[-1]
    # The map: one exact key per sharded variable.
    assert plan.layout_map["mlp/up/kernel"].axes == ("batch", "model")
    assert plan.layout_map["mlp/norm/gamma"] is None
    assert plan.layout_map["other/mlp/up/kernel"] is None
    # A built model is planned as it is; fsdp=False leaves the batch axis.
    built = kd.layouts.plan_layout(mlp(), mesh((2, 4)), fsdp=False,
                                   min_shard_size=0)
    assert {r.path: r.axes for r in built.variables}[
        "mlp/up/kernel"] == (None, "model")


def test_a_compiled_model_is_planned_where_the_build_is_traced():
    # Every backend builds without values (jax.eval_shape, a TensorFlow
    # graph, torch's fake tensors): compile() may be part of the build.
    plan = kd.layouts.plan_layout(mlp, mesh((2, 4)), min_shard_size=0)
    assert [row.path for row in plan.variables][0] == "mlp/up/kernel"


def test_a_square_projection_is_row_parallel_when_named_as_an_output():
    # Llama's attention: q/k/v_proj split the heads (column parallel),
    # o_proj joins them (row parallel), all square.
    def attention():
        x = keras.Input((8, 32))
        q = keras.layers.Dense(32, name="q_proj")(x)
        k = keras.layers.Dense(32, name="k_proj")(x)
        out = keras.layers.Dense(32, name="o_proj")(q + k)
        return keras.Model(x, keras.layers.Dense(32, name="fc2")(out),
                           name="attn")

    plan = kd.layouts.plan_layout(attention, mesh((1, 4)), min_shard_size=0)
    axes = {row.path: row.axes for row in plan.variables}
    assert axes["q_proj/kernel"] == axes["k_proj/kernel"] == (None, "model")
    assert axes["o_proj/kernel"] == axes["fc2/kernel"] == ("model", None)
    assert axes["q_proj/bias"] == ("model",)
    assert axes["o_proj/bias"] == (None,)


def test_a_plan_never_holds_an_indivisible_shard():
    # Widths the model axis (3) does not divide: the other dimension, or
    # replicated, each said in the report.
    def odd():
        return keras.Sequential([keras.Input((9,)),
                                 keras.layers.Dense(10, name="a"),
                                 keras.layers.Dense(7, name="b"),
                                 keras.layers.Embedding(11, 6, name="e")])

    plan = kd.layouts.plan_layout(odd, mesh((2, 3)), min_shard_size=0,
                                  fsdp_min_size=0)
    assert_divisible(plan)
    rows = {row.path.split("/", 1)[1]: row for row in plan.variables}
    assert rows["a/kernel"].axes == ("model", "batch")  # 10 % 3: row
    assert "dimension 1 indivisible by 3" in rows["a/kernel"].reason
    assert rows["b/kernel"].axes == ("batch", None)  # (10, 7): no model
    assert "no dimension divisible by model=3" in rows["b/kernel"].reason
    assert rows["e/embeddings"].axes == (None, "model")  # 11 % 3: width
    assert "vocabulary 11 indivisible" in rows["e/embeddings"].reason


def tiny_gemma():
    import keras_hub

    return keras_hub.models.GemmaBackbone(
        vocabulary_size=256, num_layers=2, num_query_heads=4,
        num_key_value_heads=4, hidden_dim=64, intermediate_dim=256,
        head_dim=16)


def test_gemma_is_planned_as_keras_hub_lays_it_out_by_hand():
    keras_hub = keras_hub_or_skip()
    device_mesh = mesh((2, 4))
    plan = kd.layouts.plan_layout(tiny_gemma, device_mesh, min_shard_size=0,
                                  fsdp_min_size=1000)
    by_hand = keras_hub.models.GemmaBackbone.get_layout_map(device_mesh)
    for row in plan.variables:
        expected = by_hand[row.path]
        assert row.axes == (tuple(expected.axes) if expected is not None
                            else (None,) * len(row.shape)), row
    assert_divisible(plan)


def test_a_large_model_is_planned_without_its_values():
    # ~0.94 billion parameters, 3.7 GB in float32: never allocated.
    keras_hub = keras_hub_or_skip()

    def large():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=64000, num_layers=12, num_query_heads=16,
            num_key_value_heads=16, hidden_dim=2048, intermediate_dim=16384,
            head_dim=128, dtype="float32")

    before = reset_peak_resident()
    plan = kd.layouts.plan_layout(large, mesh((2, 4)))
    assert proc_status("VmHWM") - before < 1e9  # 3.7 GB: never made
    assert plan.replicated_bytes > 3.5e9
    assert plan.bytes_per_device < plan.replicated_bytes / 6
    assert_divisible(plan)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's devices in one process")
def test_jax_fit_under_the_plan_matches_one_device():
    import jax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    y = rng.normal(size=(64, 3)).astype("float32")
    reference = mlp()
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    device_mesh = DeviceMesh((2, 4), ["batch", "model"], jax.devices())
    plan = kd.layouts.plan_layout(mlp, device_mesh, min_shard_size=0,
                                  fsdp_min_size=512)  # compiled: traced
    keras.backend.clear_session()  # the same layer names again
    strategy = kd.MirroredStrategy(layout_map=plan.layout_map)
    with strategy.scope():
        model = mlp()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    up = model.get_layer("up").kernel
    assert {s.data.shape for s in up.value.addressable_shards} == {(8, 16)}


@pytest.mark.parametrize("call, error, match", [
    (lambda m: kd.layouts.plan_layout(mlp, "mesh"), TypeError,
     "Expected a keras.distribution.DeviceMesh.*Received: mesh='mesh'"),
    (lambda m: kd.layouts.plan_layout("model", m), TypeError,
     "built Keras model or layer, or a function.*Received: model='model'"),
    (lambda m: kd.layouts.plan_layout(lambda: 3, m), TypeError,
     "must return a Keras model or layer. It returned int"),
    (lambda m: kd.layouts.plan_layout(mlp, m, model_axis="tp"), ValueError,
     "model_axis='tp' is not an axis of the mesh.*\\['batch', 'model'\\]"),
    (lambda m: kd.layouts.plan_layout(mlp, m, model_axis="batch"),
     ValueError, "must differ.*both 'batch'"),
    (lambda m: kd.layouts.plan_layout(mlp, m, min_shard_size=-1),
     ValueError, "min_shard_size must be a non-negative int"),
    (lambda m: kd.layouts.plan_layout(keras.layers.Dense(3), m), ValueError,
     "no variables to plan: build it first"),
], ids=["mesh", "model", "builder", "model_axis", "same_axis",
        "min_shard_size", "unbuilt"])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call(mesh((2, 4)))


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="a TensorFlow graph's rule for names")
def test_a_name_a_tensorflow_graph_refuses_is_said_with_its_fix():
    def named():
        return keras.Sequential([keras.Input((16,)),
                                 keras.layers.Dense(64, name="up<b>")])

    with pytest.raises(ValueError, match="may hold only letters, digits.*"
                       "Rename the layer, or pass the model built"):
        kd.layouts.plan_layout(named, mesh((2, 4)))
    # Keras' name scope stack is as it was (its TF scope joined it before
    # TensorFlow refused the name): the next model's paths are its own.
    plan = kd.layouts.plan_layout(uncompiled, mesh((2, 4)))
    assert plan.variables[0].path == "mlp/up/kernel"
    built = named()
    plan = kd.layouts.plan_layout(built, mesh((2, 4)), min_shard_size=0)
    assert plan.variables[0].path == f"{built.name}/up<b>/kernel"


class DrawsUnseeded(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 4))
        self.noise = keras.random.normal((4,))  # Keras' global generator

    def call(self, x):
        return x @ self.w + self.noise


@pytest.mark.skipif(BACKEND == "jax", reason="JAX refuses an unseeded draw "
                    "in a traced build itself")
@pytest.mark.parametrize("generator", ["none yet", "the process's own"])
def test_an_unseeded_draw_in_the_build_leaves_keras_global_generator(
        generator):
    def drawing():
        return keras.Sequential([keras.Input((8,)), DrawsUnseeded()])

    keras.backend.clear_session()  # no global generator
    if generator != "none yet":
        keras.random.normal((2,))  # (TF: used in the graph, it raised)
    plan = kd.layouts.plan_layout(drawing, mesh((2, 4)))
    assert plan.variables[0].shape == (8, 4)
    # The draw in the build made a generator of its own, its state without
    # a value (fake, or a graph's); the process's draws are real numbers.
    draws = keras.ops.convert_to_numpy(keras.random.normal((3,)))
    assert draws.shape == (3,) and np.isfinite(draws).all()


# ---------------------------------------------- kd.layouts.check_layout


def embedding_model():
    return keras.Sequential([keras.Input((4,), dtype="int32"),
                             keras.layers.Embedding(1000, 64, name="emb"),
                             keras.layers.Dense(16, name="proj")],
                            name="emb_model")


def layout_map(entries, shape=(2, 4)):
    result = keras.distribution.LayoutMap(mesh(shape))
    for key, axes in entries.items():
        result[key] = axes
    return result


MISCONFIGURED = {
    "a mistyped key": (
        {"mlp/upp/kernel": (None, "model")}, {}, "unmatched_key"),
    "a keras-hub-style pattern that misses": (
        {".*(query|key|value)/kernal": ("model", None)}, {},
        "unmatched_key"),
    "two keys for one variable": (
        {".*up/kernel": (None, "model"), ".*/up/.*kernel": ("model", None)},
        {}, "several_keys"),
    "a layout of the wrong rank": (
        {"mlp/up/kernel": ("model",)}, {}, "rank"),
    "an indivisible shard": (
        {"mlp/head/kernel": (None, "model")}, {}, "indivisible"),
    "an indivisible shard over the batch axis": (
        {"mlp/head/kernel": ("model", "batch")}, {}, "indivisible"),
    "a global batch the replicas do not divide": (
        {}, {"global_batch_size": 33}, "batch_size"),
    "more than a device holds": (
        {}, {"device_memory": 4096}, "memory"),
    "a mesh that is not the job's devices": (
        {}, {"devices": 16}, "mesh"),
}


@pytest.mark.parametrize("name", sorted(MISCONFIGURED))
def test_check_layout_finds_each_misconfiguration(name):
    entries, kwargs, kind = MISCONFIGURED[name]
    check = kd.layouts.check_layout(layout_map(entries), uncompiled,
                                    **kwargs)
    assert [finding.kind for finding in check.findings] == [kind]
    assert not check.ok
    assert kind in check.table()
    with pytest.raises(ValueError, match="does not fit the model"):
        check.raise_if_any()


def test_check_layout_finds_a_replicated_giant_and_passes_good_maps():
    # An embedding table left replicated on a mesh that could split it.
    check = kd.layouts.check_layout(layout_map({}), embedding_model,
                                    giant_bytes=100_000)
    assert [(f.kind, f.subject) for f in check.findings] == [
        ("replicated_giant", "emb_model/emb/embeddings")]
    # What the planner proposes, FSDP in one line and a correct map by
    # hand: nothing found, and the memory per device adds up.
    planned = kd.layouts.plan_layout(uncompiled, mesh((2, 4)),
                                     min_shard_size=0, fsdp_min_size=512)
    for good in (planned.layout_map,
                 kd.layouts.fully_sharded(mesh((2, 4)), min_size=512),
                 layout_map({"mlp/up/kernel": (None, "model"),
                             "mlp/down/kernel": ("model", None)})):
        check = kd.layouts.check_layout(good, uncompiled,
                                        global_batch_size=64,
                                        device_memory=2**20, devices=8)
        assert check.ok, check.table()
    check = kd.layouts.check_layout(planned.layout_map, uncompiled,
                                    optimizer_slots=2)
    assert check.bytes_per_device == planned.bytes_per_device
    assert check.training_bytes_per_device == 4 * planned.bytes_per_device
    assert "no problem found" in check.table()


def test_check_layout_passes_keras_hubs_own_gemma_map():
    keras_hub = keras_hub_or_skip()
    device_mesh = mesh((2, 4))
    check = kd.layouts.check_layout(
        keras_hub.models.GemmaBackbone.get_layout_map(device_mesh),
        tiny_gemma, global_batch_size=8)
    assert check.ok, check.table()


@pytest.mark.parametrize("call, error, match", [
    (lambda: kd.layouts.check_layout("map", uncompiled), TypeError,
     "Expected a keras.distribution.LayoutMap.*Received: layout_map='map'"),
    (lambda: kd.layouts.check_layout(layout_map({}), uncompiled,
                                     device_memory=-1), ValueError,
     "device_memory must be a non-negative int.*device_memory=-1"),
], ids=["layout_map", "device_memory"])
def test_check_layout_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_check_layout_checks_the_checkpoint_directory(tmp_path):
    directory = tmp_path / "run"
    # Absent but creatable, then holding this model's checkpoint: fine.
    assert kd.layouts.check_layout(layout_map({}), uncompiled,
                                   checkpoint_directory=str(directory)).ok
    kd.checkpoint.ShardedCheckpoint(model=uncompiled()).save(
        str(directory / "ckpt"))
    assert kd.layouts.check_layout(layout_map({}), uncompiled,
                                   checkpoint_directory=str(directory)).ok

    def wider():
        return keras.Sequential([keras.Input((16,)),
                                 keras.layers.Dense(128, name="up"),
                                 keras.layers.Dense(16, name="down"),
                                 keras.layers.LayerNormalization(name="norm"),
                                 keras.layers.Dense(3, name="head")],
                                name="mlp")

    check = kd.layouts.check_layout(layout_map({}), wider,
                                    checkpoint_directory=str(directory))
    assert [f.kind for f in check.findings] == ["checkpoint"]
    assert "mlp/up/kernel (16, 128): saved model/0 (16, 64)" in (
        check.findings[0].message)
    # Under a file, and in object storage: no checkpoint can go there.
    (tmp_path / "file").write_text("x")
    for bad, match in ((str(tmp_path / "file" / "run"), "is not a "
                        "directory this process can write into"),
                       ("hdfs://namenode/run", "names hdfs:// storage")):
        check = kd.layouts.check_layout(layout_map({}), uncompiled,
                                        checkpoint_directory=bad)
        assert [f.kind for f in check.findings] == ["checkpoint"]
        assert match in check.findings[0].message
    assert sorted(os.listdir(directory)) == ["ckpt-1"]  # nothing written


def test_a_plan_draws_itself_as_html():
    def named():
        return keras.Sequential([keras.Input((16,)),
                                 keras.layers.Dense(64, name="up<b>"),
                                 keras.layers.Dense(16, name="down")],
                                name="m")

    # (built here: a TensorFlow graph, where a function's build runs, takes
    # no "<" in a name — said clearly, see test_bad_inputs)
    plan = kd.layouts.plan_layout(named(), mesh((2, 4)), min_shard_size=0)
    page = plan.to_html(top=3)
    assert plan._repr_html_() == plan.to_html()  # what Jupyter shows
    assert page.count(">device ") == 8  # one cell per device of the mesh
    assert "batch 2 × model 4" in page
    assert "up&lt;b&gt;" in page and "up<b>" not in page  # escaped
    assert page.count("background:#4285f4") == 3  # the 3 heaviest


def test_the_plan_pictured_in_the_docs_is_what_the_code_draws():
    # docs/tpu_and_model_parallel.md shows the picture of its planning
    # recipe: the recipe's model and plan_layout call, run here from the
    # page's text, draw exactly the HTML the page embeds (on every backend:
    # its make_model compiles, which every backend builds without values;
    # the recipe's fit on a (2, 4) mesh of one process is JAX's).
    page = (ROOT / "docs" / "tpu_and_model_parallel.md").read_text()
    block = next(b for b in page.split("```python")[1:]
                 if "plan = kd.layouts.plan_layout(make_model" in b)
    block = block.split("```")[0]
    setup, _, rest = block.partition("\nmesh = ")
    plan_line = next(line for line in rest.splitlines()
                     if line.startswith("plan = "))
    namespace = {"mesh": mesh((2, 4))}
    exec(setup, namespace)  # the imports and make_model
    exec(plan_line.split("#")[0], namespace)
    pictured = [line for line in page.splitlines()
                if line.startswith("<div><p><b>Layout plan</b>")]
    assert pictured == [namespace["plan"].to_html(top=4)]
