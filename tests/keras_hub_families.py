"""Tiny random keras-hub causal LMs of every family with a layout map, for
the families' tests on JAX (test_keras_hub_families) and torch
(test_keras_hub_families_torch, through workers_families)."""

import numpy as np

VOCABULARY = 128
_COMMON = dict(vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=8,
               num_key_value_heads=4, hidden_dim=32, intermediate_dim=64)

TASKS = {"gemma": "GemmaCausalLM", "gemma4": "Gemma4CausalLM",
         "llama": "LlamaCausalLM", "qwen": "QwenCausalLM",
         "qwen_moe": "QwenMoeCausalLM", "qwen3_moe": "Qwen3MoeCausalLM"}


def backbone(family, dtype, **options):
    import keras_hub

    models = keras_hub.models
    if family == "gemma":
        return models.GemmaBackbone(head_dim=8, dtype=dtype, **_COMMON)
    if family == "gemma4":  # text only, sliding and global layers
        return models.Gemma4Backbone(
            image_size=None, head_dim=8, sliding_window_size=4,
            sliding_window_pattern=2, dtype=dtype, **_COMMON)
    if family == "llama":
        return models.LlamaBackbone(dtype=dtype, **_COMMON)
    if family == "qwen":
        return models.QwenBackbone(dtype=dtype, **_COMMON)
    if family == "qwen_moe":
        return models.QwenMoeBackbone(
            moe_intermediate_dim=16, shared_expert_intermediate_dim=32,
            num_experts=4, top_k=2, dtype=dtype, **_COMMON)
    return models.Qwen3MoeBackbone(moe_intermediate_dim=16, num_experts=4,
                                   top_k=2, head_dim=8, dtype=dtype,
                                   **_COMMON, **options)


def make(family, dtype, lora, **options):
    """The family's causal LM (no preprocessor), compiled with Adam;
    `options` go to Qwen3-MoE's backbone."""
    import keras
    import keras_hub

    model = getattr(keras_hub.models, TASKS[family])(
        backbone=backbone(family, dtype, **options), preprocessor=None)
    if lora:
        model.backbone.enable_lora(rank=2)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), weighted_metrics=[])
    return model


def data(family="gemma"):
    """16 sequences of 16 tokens and their next tokens."""
    tokens = np.random.default_rng(0).integers(1, VOCABULARY, (16, 17))
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 16), bool)}
    if family == "gemma4":  # (its backbone takes the positions)
        x["position_ids"] = np.tile(np.arange(16, dtype="int32"), (16, 1))
    return x, tokens[:, 1:]


def gemma4_layout_map(mesh):
    """A Gemma-4-style map, as keras-hub's recipes write one for a family
    without `get_layout_map`: the token embedding with the feed-forward
    gating and output kernels (which Gemma 4's block computes with itself,
    not through their layers' calls)."""
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = ("model", "batch")
    layout_map[".*ffw_gating.*/kernel"] = ("batch", "model")
    layout_map[".*ffw_linear/kernel"] = ("model", "batch")
    return layout_map


def layout_map(family, mapname, mesh):
    """The family's own map, or `kd.layouts.fully_sharded`."""
    import keras_hub

    import keras_distribute as kd

    if mapname == "fully_sharded":
        return kd.layouts.fully_sharded(mesh, min_size=256)
    if family == "gemma4":
        return gemma4_layout_map(mesh)
    task = getattr(keras_hub.models, TASKS[family])
    return task.backbone_cls.get_layout_map(mesh)


def values(model):
    """Every weight as float32 numpy (bfloat16 included)."""
    import keras

    return [keras.ops.convert_to_numpy(v.value).astype("float32")
            for v in model.weights]


def worst(a, b):
    """The largest absolute difference between two lists of arrays."""
    return max((float(np.max(np.abs(p - q))) if p.size else 0.0)
               for p, q in zip(a, b))


def assert_first_within_rounding(model, family, tokens, prompt_length):
    """Each token of `tokens` (greedy `generate()` of a sharded model in
    bfloat16) after the prompt is one that `model`'s own logits (the
    sequence fed whole) rank first within 8 bfloat16 units of the largest
    logit's magnitude: logits summed in another order may break a
    near-tie, by that much at most. (A tiny random model has 1.2-1.3 of
    its 128 tokens within that slack on average, so a token chosen
    otherwise fails.)"""
    import keras

    inputs = {"token_ids": tokens,
              "padding_mask": np.ones(tokens.shape, bool)}
    if family == "gemma4":
        inputs["position_ids"] = np.tile(np.arange(tokens.shape[1]),
                                         (len(tokens), 1))
    logits = keras.ops.convert_to_numpy(model(inputs)).astype("float32")
    for row in range(len(tokens)):
        for position in range(prompt_length, tokens.shape[1]):
            scores = logits[row, position - 1]
            slack = 8 * 2.0 ** -8 * float(np.max(np.abs(scores)))
            chosen = scores[tokens[row, position]]
            assert chosen >= np.max(scores) - slack, (row, position)
