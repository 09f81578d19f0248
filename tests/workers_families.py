"""The torch process of test_keras_hub_families_torch: keras-hub families
trained, saved and loaded under a sharded layout over 2 processes."""

import os


def train_families(cases, starts, directory, prompt, options=None):
    """Each case `(family, map, dtype, lora)` on a (2, 1) mesh (batch axis
    2; `options` go to Qwen3-MoE's backbone): one epoch from `starts[i]`,
    its weights, the file it saved loaded into a fresh sharded model,
    which variables it holds sharded, and greedy `generate()` of
    `prompt`."""
    import torch

    torch.set_num_threads(1)
    import keras
    import keras_hub_families as families

    import keras_distribute as kd

    results = []
    for index, (family, mapname, dtype, lora) in enumerate(cases):
        mesh = keras.distribution.DeviceMesh((2, 1), ["batch", "model"],
                                             ["cpu:0", "cpu:1"])
        strategy = kd.MirroredStrategy(
            layout_map=families.layout_map(family, mapname, mesh))
        with strategy.scope():
            model = families.make(family, dtype, lora, **_options(
                family, options))
        model.set_weights(starts[index])
        x, y = families.data(family)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        path = os.path.join(directory, f"{index}.weights.h5")
        model.save_weights(path)
        with strategy.scope():
            again = families.make(family, dtype, lora, **_options(
                family, options))
        again.load_weights(path)
        result = {
            "trained": families.values(model),
            "reloaded": families.values(again),
            "sharded": sorted(
                v.path for v in model.weights
                if hasattr(v.value, "to_local")
                and tuple(v.value.to_local().shape) != tuple(v.shape)),
            "path": path,
        }
        if prompt is not None:
            again.compile(sampler="greedy")
            result["tokens"] = again.generate(
                dict(prompt), max_length=12,
                stop_token_ids=None)["token_ids"]
        results.append(result)
    return results


def _options(family, options):
    return dict(options or {}) if family == "qwen3_moe" else {}
