"""keras-hub families under a sharded layout on torch (#71): 2 processes,
a (2, 1) mesh whose batch axis shards the variables (FSDP-style), the
families' own maps (Gemma 4's as keras-hub's recipes write one: its block
computes with its sublayers' kernels itself), `kd.layouts.fully_sharded`,
float32, bfloat16 and mixed_bfloat16, LoRA on and off.

Each case trains one epoch (2 steps) to the weights of one process on the
same batches (float32 within 1e-5; bfloat16 within what one process's own
bfloat16 rounding makes, as in test_keras_hub_families), every process
identical; its `save_weights` file loads bit-exactly into a fresh sharded
model and into a plain one; greedy `generate()` of the sharded model gives
one process's tokens (in bfloat16: tokens one process's logits rank first
within bfloat16's rounding). The JAX side, with presets and adapter
files: test_keras_hub_families.

Qwen3-MoE runs without its router's load-balancing loss here: that loss
is a product of two batch means, so each replica's (torch DDP's and
tf.distribute's semantics, kd's on torch and TensorFlow) differs from the
global batch's (JAX's SPMD step; measured here: 2.5e-3 after two steps),
as docs/large_models.md says.
"""

import keras
import numpy as np
import pytest

import keras_distribute as kd

if keras.backend.backend() != "torch":
    pytest.skip("torch's sharded families run here; JAX's in "
                "test_keras_hub_families", allow_module_level=True)
try:
    import keras_hub

    keras_hub.models.GemmaBackbone  # (its modules load lazily)
except ImportError as error:  # keras-hub 0.32 predates Keras 3.16
    pytest.skip(f"keras-hub does not import with Keras {keras.__version__}: "
                f"{error}", allow_module_level=True)

import keras_hub_families as families  # noqa: E402
import workers_families as workers  # noqa: E402

CASES = [
    ("gemma", "own", "float32", False),
    ("gemma4", "own", "float32", False),
    ("gemma4", "own", "bfloat16", True),
    ("llama", "own", "mixed_bfloat16", True),
    ("qwen", "fully_sharded", "bfloat16", False),
    ("qwen_moe", "own", "float32", True),
    ("qwen3_moe", "fully_sharded", "float32", False),
]
# (see the module docstring)
OPTIONS = {"router_aux_loss_coefficient": 0.0}
PROMPT = {"token_ids": np.array([[5, 9, 17, 3] + [0] * 8] * 2),
          "padding_mask": np.array([[True] * 4 + [False] * 8] * 2)}


def _reference(family, dtype, lora):
    """One process: the start weights, the trained weights and the bound."""
    keras.utils.set_random_seed(0)
    options = OPTIONS if family == "qwen3_moe" else {}
    model = families.make(family, dtype, lora, **options)
    start = model.get_weights()
    x, y = families.data(family)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = families.values(model)
    if dtype == "float32":
        return start, expected, 1e-5
    as_float32 = families.make(family, "float32", lora, **options)
    as_float32.set_weights([np.asarray(w, "float32") for w in start])
    as_float32.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    bound = families.worst(expected, families.values(as_float32))
    assert bound > 0
    return start, expected, bound


def test_keras_hub_families_train_save_and_load_sharded_on_torch(tmp_path):
    references = [_reference(family, dtype, lora)
                  for family, _, dtype, lora in CASES]
    results = kd.launch(
        workers.train_families, num_processes=2,
        args=(CASES, [r[0] for r in references], str(tmp_path), PROMPT,
              OPTIONS),
        timeout=400)
    for index, (family, mapname, dtype, lora) in enumerate(CASES):
        case = f"{family}/{mapname}/{dtype}/lora={lora}"
        _, expected, bound = references[index]
        mine = [result[index] for result in results]
        worst = families.worst(mine[0]["trained"], expected)
        assert worst <= bound, (case, worst, bound)
        for other in mine[1:]:  # every process identical
            for a, b in zip(other["trained"], mine[0]["trained"]):
                np.testing.assert_array_equal(a, b, err_msg=case)
        sharded = mine[0]["sharded"]
        if mapname == "fully_sharded":
            assert any("kernel" in p for p in sharded), (case, sharded)
        elif family == "gemma4":
            assert "token_embedding/embeddings" in sharded, (case, sharded)
            assert sum("ffw_gating" in p for p in sharded) == 4, case
            assert sum("ffw_linear" in p for p in sharded) == 2, case
        else:
            assert "token_embedding/embeddings" in sharded, (case, sharded)
        # The saved file: into a plain model and a fresh sharded one.
        plain = families.make(family, dtype, lora,
                              **(OPTIONS if family == "qwen3_moe" else {}))
        plain.load_weights(mine[0]["path"])
        loaded = families.values(plain)
        for a, b in zip(loaded, mine[0]["reloaded"]):
            np.testing.assert_array_equal(a, b, err_msg=case)
        if not lora:  # (with LoRA, Keras merges the adapters at save)
            for a, b in zip(loaded, mine[0]["trained"]):
                np.testing.assert_array_equal(a, b, err_msg=case)
        if "tokens" in mine[0]:
            plain.compile(sampler="greedy")
            want = plain.generate(dict(PROMPT), max_length=12,
                                  stop_token_ids=None)["token_ids"]
            for result in mine:
                if dtype == "float32":
                    np.testing.assert_array_equal(result["tokens"], want,
                                                  err_msg=case)
                else:  # (a near-tie may break the other way)
                    families.assert_first_within_rounding(
                        plain, family, result["tokens"], 4)


def test_the_estimate_runs_a_block_that_computes_with_its_sublayers_kernels():
    # Gemma 4's block reads its feed-forward kernels itself: the estimate's
    # step (one process, fake tensors) gathers them whole for that call, as
    # the engine does; it had computed with the shards (a shape error).
    mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"],
                                         ["cpu:0", "cpu:1"])
    layout_map = families.gemma4_layout_map(mesh)

    def make():
        return families.make("gemma4", "float32", False)

    estimate = kd.layouts.estimate_memory(
        make, layout_map, batch_size=8,
        input_shape={"token_ids": (16,), "padding_mask": (16,),
                     "position_ids": (16,)})
    keras.backend.clear_session()
    model = make()
    sharded = ("token_embedding/embeddings", "ffw_gating", "ffw_linear")
    want = sum(4 * int(np.prod(v.shape)) // (
        2 if any(key in v.path for key in sharded) else 1)
        for v in model.weights)
    assert estimate.parameters == want, (estimate.parameters, want)
    assert estimate.peak > estimate.parameters
