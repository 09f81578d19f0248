"""Born sharded on torch, in one process: `draw_region` gives the slice of
the value Keras' initializer makes for the whole shape, bit for bit, and
only in the thread that makes the variable (other threads drawing Keras
random numbers meanwhile get Keras' own values)."""

import threading

import numpy as np
import pytest
from conftest import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="Keras' torch random functions")


def _random_module():
    import keras

    return keras.src.backend.torch.random


@pytest.mark.parametrize("initializer_name", [
    "GlorotUniform", "HeNormal", "TruncatedNormal", "RandomUniform"])
@pytest.mark.parametrize("region", [((3, 40), (0, 600)),
                                    ((0, 97), (250, 517)),
                                    ((40, 41), (7, 9))])
def test_a_region_equals_the_slice_of_the_whole_value(initializer_name,
                                                      region):
    import keras

    from keras_distribute.backend.torch import born_sharded

    shape = (97, 600)
    initializer = getattr(keras.initializers, initializer_name)(seed=11)
    whole = keras.ops.convert_to_numpy(initializer(shape, dtype="float32"))
    part = born_sharded.draw_region(_random_module(), initializer, shape,
                                    "float32", region)
    assert part is not None
    np.testing.assert_array_equal(
        part.numpy(), whole[tuple(slice(a, b) for a, b in region)])


def test_orthogonal_and_a_subclass_are_made_whole():
    import keras

    from keras_distribute.backend.torch import born_sharded

    class Mine(keras.initializers.GlorotUniform):
        pass

    for initializer in (keras.initializers.Orthogonal(seed=1), Mine(seed=1),
                        keras.initializers.Zeros()):
        assert born_sharded.draw_region(
            _random_module(), initializer, (64, 64), "float32",
            ((0, 32), (0, 64))) is None


def test_another_thread_drawing_meanwhile_gets_keras_own_values(
        monkeypatch):
    import keras

    from keras_distribute.backend.torch import born_sharded

    module = _random_module()
    originals = (module.normal, module.uniform, module.truncated_normal)
    expected = keras.ops.convert_to_numpy(
        keras.random.normal((5, 7), seed=3))
    inside, other_done = threading.Event(), threading.Event()
    seed_generator = module.torch_seed_generator

    def held_inside(seed):  # the region's draw waits here for the other
        inside.set()
        assert other_done.wait(60)
        return seed_generator(seed)

    monkeypatch.setattr(module, "torch_seed_generator", held_inside)
    shape, region = (128, 96), ((64, 128), (0, 96))
    initializer = keras.initializers.GlorotNormal(seed=5)
    made = {}
    maker = threading.Thread(target=lambda: made.setdefault(
        "part", born_sharded.draw_region(module, initializer, shape,
                                         "float32", region)))
    maker.start()
    try:
        assert inside.wait(60)
        # (Keras' own normal of another shape, while the region is drawn)
        monkeypatch.setattr(module, "torch_seed_generator", seed_generator)
        got = keras.ops.convert_to_numpy(keras.random.normal((5, 7), seed=3))
    finally:
        other_done.set()
        maker.join(60)
    np.testing.assert_array_equal(got, expected)
    whole = keras.ops.convert_to_numpy(initializer(shape, dtype="float32"))
    np.testing.assert_array_equal(made["part"].numpy(), whole[64:])
    assert (module.normal, module.uniform,
            module.truncated_normal) == originals
