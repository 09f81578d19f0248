"""Every keras-hub backbone with a `get_layout_map` (#71), as tiny random
configs: Gemma, Llama, Qwen, Qwen-MoE and Qwen3-MoE, each under its own map
and under `kd.layouts.fully_sharded`, in float32, bfloat16 and
mixed_bfloat16, with and without `enable_lora` (the first ten cases below
cover every family with both maps, every dtype and LoRA on and off), and
Gemma 4 under a map as keras-hub's recipes write one (its block computes
with its sublayers' kernels itself).

Each case, on JAX's 8 simulated devices (mesh batch 4 x model 2):

- trains two steps to the weights of the same program on one device: within
  1e-5 in float32 (Adam, learning rate 1e-3); in bfloat16 and
  mixed_bfloat16, within the error one device's own bfloat16 rounding
  makes: `max |one device bf16 - one device float32|` over the same steps
  from the same weights (a sharded step sums in another order, so it
  rounds differently in the low bits; it must not stray further from the
  one-device result than bfloat16 itself strays from float32);
- lays every variable out as the map says (the MoE expert banks sharded by
  `fully_sharded`; a map that names no expert leaves them replicated);
- `save_weights` / `load_weights` round-trip bit-exactly into a sharded and
  an unsharded model; `save_to_preset` / `from_preset(local directory)`
  into a sharded backbone; with LoRA, keras-hub's adapter-only files
  (`save_lora_weights` / `load_lora_weights`) and kd's own adapter
  checkpoint (`ShardedCheckpoint` of the trainable variables) restore the
  adapters bit-exactly into a fresh sharded model;
- in float32, `generate()` (greedy) gives the tokens one device gives with
  the same weights.

TensorFlow refuses sharded layouts (documented; tested in
test_strategy_layouts); torch's sharded families run across processes in
test_keras_hub_families_torch.
"""

import os

import keras
import keras_hub_families as families
import numpy as np
import pytest

import keras_distribute as kd

if keras.backend.backend() != "jax":
    pytest.skip("the families run sharded on JAX's simulated devices here",
                allow_module_level=True)
try:
    import keras_hub

    keras_hub.models.GemmaBackbone  # (its modules load lazily)
except ImportError as error:  # keras-hub 0.32 predates Keras 3.16
    pytest.skip(f"keras-hub does not import with Keras {keras.__version__}: "
                f"{error}", allow_module_level=True)

CASES = [
    ("gemma", "own", "float32", False),
    ("gemma", "fully_sharded", "bfloat16", True),
    ("llama", "own", "mixed_bfloat16", True),
    ("llama", "fully_sharded", "float32", False),
    ("qwen", "own", "bfloat16", False),
    ("qwen", "fully_sharded", "mixed_bfloat16", True),
    ("qwen_moe", "own", "float32", True),
    ("qwen_moe", "fully_sharded", "bfloat16", False),
    ("qwen3_moe", "own", "mixed_bfloat16", False),
    ("qwen3_moe", "fully_sharded", "float32", True),
    # Gemma 4 has no get_layout_map: a map as keras-hub's recipes write one
    ("gemma4", "own", "float32", False),
]


_make = families.make
_values = families.values
_worst = families.worst
_data = families.data


def _trained(family, dtype, lora, start):
    model = _make(family, dtype, lora)
    model.set_weights(start)
    x, y = _data(family)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def _worst(a, b):
    return max((float(np.max(np.abs(p - q))) if p.size else 0.0)
               for p, q in zip(a, b))


def _layout_map(family, mapname, mesh):
    return families.layout_map(family, mapname, mesh)


_GENERATE_IN_BF16 = (("gemma", "fully_sharded"), ("qwen3_moe", "own"))


def _check_generate(plain, again, family, dtype):
    prompt = {"token_ids": np.array([[5, 9, 17, 3] + [0] * 8] * 2),
              "padding_mask": np.array([[True] * 4 + [False] * 8] * 2)}
    tokens = []
    for each in (plain, again):
        each.compile(sampler="greedy")
        tokens.append(each.generate(dict(prompt), max_length=12,
                                    stop_token_ids=None)["token_ids"])
    if dtype == "float32":
        np.testing.assert_array_equal(tokens[0], tokens[1])
    else:
        families.assert_first_within_rounding(plain, family, tokens[1], 4)


def _spec(variable):
    spec = tuple(variable.value.sharding.spec)
    return spec + (None,) * (len(variable.shape) - len(spec))


@pytest.mark.parametrize("family,mapname,dtype,lora", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_a_keras_hub_family_trains_saves_and_loads_sharded(
        family, mapname, dtype, lora, tmp_path):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    reference = _make(family, dtype, lora)
    start = reference.get_weights()
    x, y = _data(family)
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = _values(reference)
    if dtype == "float32":
        bound = 1e-5
    else:  # what bfloat16 itself changes on one device
        as_float32 = _trained(family, "float32", lora,
                              [np.asarray(w, "float32") for w in start])
        bound = _worst(expected, _values(as_float32))
        assert bound > 0
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"],
                                         keras.distribution.list_devices())
    layout_map = _layout_map(family, mapname, mesh)
    strategy = kd.MirroredStrategy(layout_map=layout_map)

    def sharded():
        with strategy.scope():
            return _make(family, dtype, lora)

    model = sharded()
    model.set_weights(start)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    got = _values(model)
    assert _worst(got, expected) <= bound, (_worst(got, expected), bound)

    # Laid out as the map says.
    for variable in model.weights:
        if mapname == "own":
            layout = layout_map[variable.path]
            want = (tuple(layout.axes) if layout is not None
                    else (None,) * len(variable.shape))
            assert _spec(variable) == want, variable.path
        elif "experts/" in variable.path:  # an expert bank: (experts, ...)
            assert any(_spec(variable)), variable.path

    # save_weights / load_weights, sharded and unsharded, bit-exactly.
    weights_file = str(tmp_path / "model.weights.h5")
    model.save_weights(weights_file)
    plain = _make(family, dtype, lora)
    plain.load_weights(weights_file)
    again = sharded()
    again.load_weights(weights_file)
    saved_merged = _values(plain)  # (LoRA: Keras merges the adapters)
    for merged, loaded in zip(saved_merged, _values(again)):
        np.testing.assert_array_equal(merged, loaded)
    # generate() (greedy): the sharded model's tokens are one device's
    # with the same weights; in bfloat16, each token it chose is one that
    # one device's logits rank first within bfloat16's rounding (logits
    # summed in another order may break a near-tie). (Two of the bfloat16
    # cases: each generate() compiles for ~10 s.)
    if dtype == "float32" or (family, mapname) in _GENERATE_IN_BF16:
        _check_generate(plain, again, family, dtype)
    if not lora:
        for mine, loaded in zip(got, saved_merged):
            np.testing.assert_array_equal(mine, loaded)
        # A preset: save_to_preset, then from_preset(local dir) sharded.
        preset = str(tmp_path / "preset")
        model.backbone.save_to_preset(preset)
        with strategy.scope():
            restored = model.backbone.__class__.from_preset(preset)
        for mine, loaded in zip(_values(model.backbone),
                                _values(restored)):
            np.testing.assert_array_equal(mine, loaded)
        return
    # Adapters only: keras-hub's file (the LoRA kernels; not the biases
    # Qwen's attention leaves trainable) and kd's checkpoint (every
    # trainable variable), into fresh sharded models.
    adapters = [np.asarray(v.value).astype("float32")
                for v in model.trainable_variables]
    lora_file = str(tmp_path / "adapters.lora.h5")
    model.backbone.save_lora_weights(lora_file)
    fresh = sharded()
    fresh.backbone.load_lora_weights(lora_file)
    for want, variable in zip(adapters, fresh.trainable_variables):
        if "lora_kernel" in variable.path:
            np.testing.assert_array_equal(
                want, np.asarray(variable.value).astype("float32"))
    path = kd.checkpoint.ShardedCheckpoint(
        lora=list(model.trainable_variables)).write(
            os.path.join(tmp_path, "adapters"))
    fresh = sharded()
    kd.checkpoint.ShardedCheckpoint(
        lora=list(fresh.trainable_variables)).read(path).assert_consumed()
    for want, variable in zip(adapters, fresh.trainable_variables):
        np.testing.assert_array_equal(
            want, np.asarray(variable.value).astype("float32"))


def test_the_planner_and_the_estimate_count_the_moe_expert_banks():
    # A Qwen3-MoE's expert banks ((experts, in, out) per layer): the plan
    # shards each over the batch axis (FSDP) and counts its bytes per
    # device; the estimate of a step under the plan's map (the model built
    # again after clear_session: keras-hub names the MoE blocks by a
    # counter) holds exactly the plan's parameter bytes.
    keras.backend.clear_session()
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"],
                                         keras.distribution.list_devices())

    def make():
        return families.make("qwen3_moe", "float32", False)

    plan = kd.layouts.plan_layout(make, mesh, fsdp_min_size=256,
                                  min_shard_size=256)
    banks = [row for row in plan.variables if "/experts/" in row.path]
    assert len(banks) == 4, [row.path for row in plan.variables]
    for row in banks:
        assert "batch" in row.axes, row
        assert row.bytes_per_device == 4 * int(np.prod(row.shape)) // 4
    keras.backend.clear_session()
    estimate = kd.layouts.estimate_memory(
        make, plan.layout_map, batch_size=8,
        input_shape={"token_ids": (16,), "padding_mask": (16,)})
    assert estimate.parameters == sum(
        row.bytes_per_device for row in plan.variables)
