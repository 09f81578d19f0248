"""`ShardedCheckpoint` with tf.train.Checkpoint's object-graph semantics
(the TF "Training checkpoints" guide): variables reached by attribute
paths, restores through a stand-in object graph, deferred restoration of
objects attached after a restore, and lists and dicts that grow (#30)."""

import json
import os

import keras
import numpy as np
import pytest

import keras_distribute as kd

ShardedCheckpoint = kd.checkpoint.ShardedCheckpoint


class Net(keras.Model):
    """The guide's subclassed model."""

    def __init__(self):
        super().__init__()
        self.l1 = keras.layers.Dense(5)

    def call(self, x):
        return self.l1(x)


def trained_net():
    keras.utils.set_random_seed(2)
    net = Net()
    net(np.ones((1, 1), "float32"))
    net.l1.bias.assign(np.arange(5, dtype="float32") + 1.0)
    return net


def zeros(shape):
    return keras.Variable(np.zeros(shape, "float32"))


def test_index_records_attribute_paths(tmp_path):
    net = trained_net()
    optimizer = keras.optimizers.Adam(0.1)
    path = ShardedCheckpoint(
        step=keras.Variable(1.0, trainable=False), optimizer=optimizer,
        net=net).save(str(tmp_path / "ckpt"))
    index = json.load(open(os.path.join(path, "index.json")))
    paths = index["object_paths"]
    # `Dense._kernel` is saved under its public name.
    assert paths["net/l1/kernel"] == "net/0"
    assert paths["net/l1/bias"] == "net/1"
    assert paths["optimizer/iterations"] in index["variables"]


def test_the_reader_answers_to_tensorflows_names(tmp_path):
    # The TF checkpoint guide's cell, ported by the import change:
    # reader = tf.train.load_checkpoint('./tf_ckpts/') ...
    net = trained_net()
    ShardedCheckpoint(step=keras.Variable(1.0, trainable=False),
                      optimizer=keras.optimizers.Adam(0.1),
                      net=net).save(str(tmp_path / "ckpt"))
    reader = kd.checkpoint.load_checkpoint(str(tmp_path))
    shape_from_key = reader.get_variable_to_shape_map()
    dtype_from_key = reader.get_variable_to_dtype_map()
    key = "net/l1/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    assert "net/0" in sorted(shape_from_key.keys())  # kd's keys listed
    assert shape_from_key[key] == (1, 5)
    assert shape_from_key.get("net/l9/kernel" + key[13:]) is None
    assert dtype_from_key[key].name == "float32"
    np.testing.assert_array_equal(reader.get_tensor(key),
                                  net.l1.kernel.numpy())
    np.testing.assert_array_equal(
        reader.get_tensor("net/l1/bias/.ATTRIBUTES/VARIABLE_VALUE"),
        np.arange(5, dtype="float32") + 1.0)
    assert reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 1.0
    assert reader.has_tensor("net/0") and reader.has_tensor(key)
    assert not reader.has_tensor("net/l9/kernel/.ATTRIBUTES/VARIABLE_VALUE")
    assert kd.checkpoint.load_variable(str(tmp_path), key).shape == (1, 5)


def test_restore_through_a_stand_in_object_graph(tmp_path):
    # The guide: a stand-in graph restores the one bias it names; the kernel
    # attached afterwards is restored as it is attached.
    net = trained_net()
    path = ShardedCheckpoint(step=keras.Variable(1.0, trainable=False),
                             net=net).save(str(tmp_path / "ckpt"))
    to_restore = zeros(5)
    fake_layer = ShardedCheckpoint(bias=to_restore)
    fake_net = ShardedCheckpoint(l1=fake_layer)
    new_root = ShardedCheckpoint(net=fake_net)
    status = new_root.restore(path)
    np.testing.assert_array_equal(to_restore.numpy(), [1, 2, 3, 4, 5])
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError):
        status.assert_consumed()  # the kernel and step were not restored

    delayed_restore = zeros((1, 5))
    fake_layer.kernel = delayed_restore  # deferred restoration
    np.testing.assert_array_equal(delayed_restore.numpy(),
                                  net.l1.kernel.numpy())


def test_a_stand_in_checkpoint_attached_after_the_restore_is_restored(
        tmp_path):
    # `fake_net.l1 = ShardedCheckpoint(bias=v)` after the restore: v gets
    # its value as it is attached, and later attachments to it too.
    net = trained_net()
    path = ShardedCheckpoint(net=net).save(str(tmp_path / "ckpt"))
    fake_net = ShardedCheckpoint()
    ShardedCheckpoint(net=fake_net).restore(path)
    bias = zeros(5)
    fake_layer = ShardedCheckpoint(bias=bias)
    fake_net.l1 = fake_layer
    np.testing.assert_array_equal(bias.numpy(), [1, 2, 3, 4, 5])
    kernel = zeros((1, 5))
    fake_layer.kernel = kernel
    np.testing.assert_array_equal(kernel.numpy(), net.l1.kernel.numpy())


def test_a_stand_in_graph_save_restores_into_the_model(tmp_path):
    net = trained_net()
    path = ShardedCheckpoint(net=ShardedCheckpoint(l1=ShardedCheckpoint(
        kernel=net.l1.kernel, bias=net.l1.bias))).save(str(tmp_path / "c"))
    other = Net()
    other(np.ones((1, 1), "float32"))
    ShardedCheckpoint(net=other).restore(path).assert_consumed()
    for a, b in zip(net.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_model_built_after_the_restore_by_attribute_paths(tmp_path):
    net = trained_net()
    path = ShardedCheckpoint(net=ShardedCheckpoint(l1=ShardedCheckpoint(
        kernel=net.l1.kernel, bias=net.l1.bias))).save(str(tmp_path / "c"))
    later = Net()
    status = ShardedCheckpoint(net=later).restore(path)
    later(np.ones((1, 1), "float32"))  # built: restored now
    status.assert_consumed()
    np.testing.assert_array_equal(later.l1.bias.numpy(), [1, 2, 3, 4, 5])


def test_lists_and_dicts_restore_items_added_later(tmp_path):
    # The guide's "Python list/dict" example.
    save = ShardedCheckpoint()
    save.listed = [keras.Variable(1.0)]
    save.listed.append(keras.Variable(2.0))
    save.mapped = {"one": save.listed[0]}
    save.mapped["two"] = save.listed[1]
    save_path = save.save(str(tmp_path / "tf_list_example"))

    restore = ShardedCheckpoint()
    v2 = keras.Variable(0.0)
    restore.mapped = {"two": v2}
    restore.restore(save_path)
    assert float(v2.numpy()) == 2.0
    restore.listed = []
    v1 = keras.Variable(0.0)
    restore.listed.append(v1)  # restored from the earlier restore()
    assert float(v1.numpy()) == 1.0
    v_one = keras.Variable(0.0)
    restore.mapped["one"] = v_one
    assert float(v_one.numpy()) == 1.0
    with pytest.raises(TypeError, match="only append or extend"):
        restore.listed.insert(0, keras.Variable(0.0))


def test_a_checkpoint_not_restored_attaches_without_restoring(tmp_path):
    net = trained_net()
    ShardedCheckpoint(net=net).save(str(tmp_path / "ckpt"))
    fresh = ShardedCheckpoint()
    variable = zeros(5)
    fresh.bias = variable
    np.testing.assert_array_equal(variable.numpy(), np.zeros(5))


def test_positional_keys_win_over_attribute_paths(tmp_path):
    # A model restored into its own kind of object matches by position, as
    # before; attribute paths only fill what positions do not match.
    net = trained_net()
    path = ShardedCheckpoint(net=net).save(str(tmp_path / "ckpt"))
    other = Net()
    other(np.ones((1, 1), "float32"))
    ShardedCheckpoint(net=other).restore(path).assert_consumed()
    for a, b in zip(net.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("object_paths", [
    ["net/0"], {"net/l1/bias": "elsewhere"}, {"net/l1/bias": 3}])
def test_crafted_object_paths_are_refused(tmp_path, object_paths):
    net = trained_net()
    path = ShardedCheckpoint(net=net).save(str(tmp_path / "ckpt"))
    index_path = os.path.join(path, "index.json")
    index = json.load(open(index_path))
    index["object_paths"] = object_paths
    with open(index_path, "w") as f:
        json.dump(index, f)
    variable = zeros(5)
    with pytest.raises(kd.checkpoint.CheckpointError,
                       match="object_paths"):
        ShardedCheckpoint(net=ShardedCheckpoint(l1=ShardedCheckpoint(
            bias=variable))).restore(path)
    np.testing.assert_array_equal(variable.numpy(), np.zeros(5))
