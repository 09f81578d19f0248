"""Device selection and every error message of strategy creation."""

import numpy as np
import pytest
from conftest import BACKEND
from conftest import NUM_DEVICES

import keras_distribute as kd

pytestmark = pytest.mark.needs_strategy


def test_default_devices_are_all_local_devices():
    strategy = kd.MirroredStrategy()
    assert strategy.num_replicas_in_sync == NUM_DEVICES
    assert repr(strategy).startswith("<MirroredStrategy devices=['cpu:0'")
    assert strategy.device_mesh.shape == (NUM_DEVICES,)
    assert strategy.cluster_resolver is None


@pytest.mark.parametrize("devices", [
    ["CPU:0", "/cpu:1"],
    ["cpu:0", "/job:localhost/replica:0/task:0/device:CPU:1"],
    ["/device:CPU:0", "CPU:1"],
])
def test_device_name_forms(devices):
    strategy = kd.MirroredStrategy(devices)
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1")
    extended = strategy.extended  # one process: it is the chief
    assert extended.should_checkpoint and extended.should_save_summary
    assert extended.should_init


@pytest.mark.skipif(BACKEND != "jax", reason="jax.Device objects: JAX only")
def test_jax_device_objects():
    import jax

    strategy = kd.MirroredStrategy(jax.devices()[2:4])
    assert strategy.extended.worker_devices == ("cpu:2", "cpu:3")


@pytest.mark.parametrize("devices, match", [
    (["CPU:0", "CPU:99"], "Unknown device 'CPU:99'"),
    (["GPU:0"], "Unknown device 'GPU:0'"),
    (["CPU:0", "/cpu:0"], "listed twice"),
    ([], "at least one device"),
    ("CPU:0", "Wrap a single device in a list"),
    (["TPX:0"], "unknown device type"),
    (["/job:worker/task:3/device:CPU:0"], "not local to this process"),
    ([3.5], "Expected a device name"),
])
def test_bad_devices(devices, match):
    with pytest.raises(ValueError, match=match):
        kd.MirroredStrategy(devices)


def test_tf_distribute_names_port_by_an_import_change():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ops in (kd.NcclAllReduce(), kd.HierarchicalCopyAllReduce(2),
                    kd.ReductionToOneDevice()):
            strategy = kd.MirroredStrategy(["CPU:0"], cross_device_ops=ops)
            assert strategy.cross_device_ops is ops
    with pytest.raises(TypeError, match="cross_device_ops.*kd.NcclAllReduce"):
        kd.MirroredStrategy(["CPU:0"], cross_device_ops=object())
    with pytest.raises(ValueError, match="num_packs=0"):
        kd.NcclAllReduce(num_packs=0)
    assert kd.OneDeviceStrategy("CPU:0").num_replicas_in_sync == 1
    with pytest.raises(ValueError, match="takes one device"):
        kd.OneDeviceStrategy(["CPU:0", "CPU:1"])
    options = kd.CommunicationOptions(
        implementation=kd.CommunicationImplementation.NCCL)
    assert options.implementation is kd.CommunicationImplementation.NCCL
    with pytest.raises(ValueError, match="implementation='fast'"):
        kd.CommunicationOptions(implementation="fast")


def test_one_communication_timeout_setting(monkeypatch):
    from keras_distribute.common.cross_device_ops import communication_timeout_s

    monkeypatch.delenv("KERAS_DISTRIBUTE_TIMEOUT", raising=False)
    assert kd.CommunicationOptions().timeout_seconds is None  # the default:
    assert communication_timeout_s(None) == 60.0
    monkeypatch.setenv("KERAS_DISTRIBUTE_TIMEOUT", "15")  # the job's
    assert communication_timeout_s(None) == 15.0
    assert communication_timeout_s(30) == 30.0  # a strategy's options win
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("KERAS_DISTRIBUTE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="KERAS_DISTRIBUTE_TIMEOUT="
                           f"'{bad}'. Unset it"):
            communication_timeout_s(None)


@pytest.mark.skipif(BACKEND != "jax", reason="ModelParallel: JAX only here")
def test_layout_map_shards_variables_and_checks_rank():
    import keras
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    mesh = DeviceMesh((4, 2), ["batch", "model"],
                      [f"cpu:{i}" for i in range(8)])
    layout_map = LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    strategy = kd.MirroredStrategy(layout_map=layout_map)
    assert strategy.num_replicas_in_sync == 4
    with strategy.scope():
        layer = keras.layers.Dense(8, name="dense")
        layer.build((None, 4))
    shards = {s.data.shape for s in layer.kernel.value.addressable_shards}
    assert shards == {(4, 4)}

    bad = LayoutMap(mesh)
    bad["dense_1/kernel"] = ("model",)
    with pytest.raises(ValueError, match="has rank 1 but the variable"):
        with kd.MirroredStrategy(layout_map=bad).scope():
            keras.layers.Dense(8, name="dense_1").build((None, 4))
    with pytest.raises(ValueError, match="differ"):
        kd.MirroredStrategy(["CPU:0"], layout_map=layout_map)
    with pytest.raises(ValueError, match="LayoutMap"):
        kd.MirroredStrategy(layout_map=object())


def test_options_type_error():
    strategy = kd.MirroredStrategy(["CPU:0"])
    with pytest.raises(ValueError, match="kd.InputOptions"):
        strategy.experimental_distribute_dataset([np.ones(2)], options={})
    with pytest.raises(ValueError, match="value_fn"):
        strategy.experimental_distribute_values_from_function(3)
    with pytest.raises(ValueError, match="dataset_fn"):
        strategy.distribute_datasets_from_function(3)
    with pytest.raises(ValueError, match="leading"):
        list(strategy.experimental_distribute_dataset(
            [(np.ones(2), np.ones(3))]))
    with pytest.raises(ValueError, match="iterable"):
        strategy.experimental_distribute_dataset(3)


def test_simulate_cpu_devices_after_initialisation():
    kd.simulate_cpu_devices(NUM_DEVICES)  # same count again: harmless
    with pytest.raises(RuntimeError, match="already initialised"):
        kd.simulate_cpu_devices(NUM_DEVICES + 1)
    with pytest.raises(ValueError, match="positive int"):
        kd.simulate_cpu_devices(0)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF layout_map limits")
def test_tf_sharded_layout_map_is_refused_replicated_is_fine():
    from keras.distribution import DeviceMesh
    from keras.distribution import LayoutMap

    mesh = DeviceMesh((NUM_DEVICES // 2, 2), ["batch", "model"],
                      [f"cpu:{i}" for i in range(NUM_DEVICES)])
    sharded = LayoutMap(mesh)
    sharded["dense/kernel"] = (None, "model")
    with pytest.raises(NotImplementedError, match="'tensorflow' Keras backend"):
        kd.MirroredStrategy(layout_map=sharded)
    replicated = LayoutMap(mesh)
    replicated["dense/kernel"] = (None, None)
    assert kd.MirroredStrategy(
        layout_map=replicated).num_replicas_in_sync == NUM_DEVICES


@pytest.mark.skipif(BACKEND == "torch", reason="start-up order: JAX and TF")
def test_multi_worker_strategy_after_the_backend_started_is_a_clear_error():
    import keras

    keras.ops.ones((1,))  # the backend is up: too late for a multi-worker job
    with pytest.raises(RuntimeError, match="at the start of the program"):
        kd.MultiWorkerMirroredStrategy(kd.cluster_resolver.SimpleClusterResolver(
            ["127.0.0.1:1", "127.0.0.1:2"], process_id=0))


def test_multi_worker_strategy_of_one_worker_works_at_any_time(monkeypatch):
    """#30: the TF distributed-training guide creates one after a
    MirroredStrategy, with no cluster configured; kd raised 'must start
    before JAX/TensorFlow runs anything'. One worker joins no job, so it
    works at any time (TensorFlow's own strategy does too)."""
    import os

    import keras

    for name in list(os.environ):
        if name == "TF_CONFIG" or name.startswith(
                ("KERAS_DISTRIBUTION_", "SLURM_", "JAX_COORDINATOR")) or (
                name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            monkeypatch.delenv(name)
    kd.MirroredStrategy()
    keras.ops.ones((1,))  # the backend is up
    one = kd.cluster_resolver.SimpleClusterResolver(["127.0.0.1:1"],
                                                    process_id=0)
    for strategy in (kd.MultiWorkerMirroredStrategy(),
                     kd.MultiWorkerMirroredStrategy(one)):
        assert strategy.cluster_resolver.num_processes == 1
        assert strategy.num_replicas_in_sync == (
            NUM_DEVICES if BACKEND == "jax" else 1)  # TF: its CPU, as TF
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(1)])
            model.compile(optimizer="sgd", loss="mse")
        history = model.fit(np.ones((16, 3)), np.ones((16, 1)),
                            batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"]).all()


def test_communication_options_type_is_checked():
    with pytest.raises(ValueError, match="kd.CommunicationOptions"):
        kd.MultiWorkerMirroredStrategy(communication_options={"timeout": 1})


def _mesh_4x2():
    from keras.distribution import DeviceMesh

    return DeviceMesh((4, 2), ["batch", "model"],
                      [f"cpu:{i}" for i in range(8)])


@pytest.mark.skipif(BACKEND != "jax", reason="sharded layouts: JAX")
def test_layout_map_validation_errors():
    import keras
    from keras.distribution import LayoutMap

    unknown_axis = LayoutMap(_mesh_4x2())
    with pytest.raises(ValueError, match="Invalid axis names"):
        unknown_axis[".*kernel"] = (None, "tensor")  # Keras checks this one

    indivisible = LayoutMap(_mesh_4x2())
    indivisible["dense_odd/kernel"] = (None, "model")
    with pytest.raises(ValueError, match="size 5, which does not divide"):
        with kd.MirroredStrategy(layout_map=indivisible).scope():
            keras.layers.Dense(5, name="dense_odd").build((None, 4))

    # The DESIGN trap: "d1/kernel" is not the variable path
    # "sequential/d1/kernel", so Keras would silently replicate: kd warns,
    # naming the key (and, as Keras, ignores it: #30, the keras-io guide).
    unmatched = LayoutMap(_mesh_4x2())
    unmatched["d1/kernel"] = (None, "model")
    strategy = kd.MirroredStrategy(layout_map=unmatched)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, name="d1")])
        with pytest.warns(UserWarning, match="key 'd1/kernel' matches none "
                          "of the variables .* it lays out nothing"):
            model.compile(optimizer="sgd", loss="mse")


@pytest.mark.needs_strategy
def test_describe_layout_lists_every_variable():
    import keras

    if BACKEND == "jax":
        from keras.distribution import LayoutMap

        layout_map = LayoutMap(_mesh_4x2())
        layout_map[".*d1/kernel"] = (None, "model")
        strategy = kd.MirroredStrategy(layout_map=layout_map)
        expected = "(None, 'model')"
        kernel_bytes = "64 B"  # 4 x 8 float32 split over 2 model devices
    else:
        strategy = kd.MirroredStrategy()
        expected = "(None, None)"
        kernel_bytes = "128 B"
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, name="d1")])
    lines = []
    text = strategy.describe_layout(model, print_fn=lines.append)
    kernel = next(line for line in text.splitlines() if "d1/kernel" in line)
    assert "(4, 8)" in kernel and expected in kernel and kernel_bytes in kernel
    assert "total per device" in text and lines == [text]
    # The same description draws itself: a cell per device of the mesh
    # with the bytes it holds, the heaviest variables as bars (Jupyter
    # shows `_repr_html_` for a description that ends a cell).
    picture = text.to_html(top=1)
    assert text._repr_html_() == text.to_html()
    devices = strategy.num_replicas_in_sync * (2 if BACKEND == "jax" else 1)
    assert picture.count(">device ") == devices
    per_device = "96 B" if BACKEND == "jax" else "160 B"  # + 32 B of bias
    assert picture.count(f"<b>{per_device}</b>") == devices
    assert "d1/kernel" in picture and "d1/bias" not in picture  # top=1
    assert f"{kernel_bytes}</td>" in picture
    assert text.replicated_bytes == 160
    assert strategy.describe_layout(model, print_fn=None) == text
    with pytest.raises(TypeError, match="Expected `model` to be a built "
                       "Keras model or layer. Received: str"):
        strategy.describe_layout("model")


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF's TPUStrategy path")
def test_tf_tpu_strategy_wiring_with_a_stand_in_tpu_system(monkeypatch):
    """No TPU here: TensorFlow's TPU calls are replaced by recorders and the
    TPUStrategy by a MirroredStrategy, to check what kd passes to them."""
    import keras
    import tensorflow as tf

    calls = {}
    resolver = object()
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster",
                        lambda r: calls.setdefault("connect", r))
    monkeypatch.setattr(tf.tpu.experimental, "initialize_tpu_system",
                        lambda r: calls.setdefault("init", r) and "topology")

    def build(topology, computation_shape, num_replicas):
        calls["build"] = (topology, computation_shape, num_replicas)
        return "tf-assignment"

    class StandIn(tf.distribute.MirroredStrategy):
        """Takes TPUStrategy's arguments; one CPU device."""

        def __init__(self, r, experimental_device_assignment=None):
            calls["strategy"] = (r, experimental_device_assignment)
            super().__init__(["/cpu:0"])

        def experimental_split_to_logical_devices(self, t, parts):
            calls["split"] = parts
            return t

        def experimental_replicate_to_logical_devices(self, t):
            calls["replicate"] = True
            return t

        def experimental_assign_to_logical_device(self, t, i):
            calls["assign"] = i
            return t

    monkeypatch.setattr(tf.tpu.experimental.DeviceAssignment, "build",
                        staticmethod(build))
    monkeypatch.setattr(tf.distribute, "TPUStrategy", StandIn)
    strategy = kd.TPUStrategy(
        tpu_cluster_resolver=resolver,
        device_assignment=kd.DeviceAssignment(1, computation_shape=2))
    assert calls["connect"] is resolver and calls["init"] is resolver
    assert calls["build"] == ("topology", [1, 1, 1, 2], 1)
    assert calls["strategy"] == (resolver, "tf-assignment")
    assert strategy.num_logical_devices == 2
    x = tf.ones((4, 6))
    strategy.experimental_split_to_logical_devices(x, [1, 2])
    strategy.experimental_replicate_to_logical_devices(x)
    strategy.experimental_assign_to_logical_device(x, 1)
    assert (calls["split"], calls["replicate"], calls["assign"]) == (
        [1, 2], True, 1)
    with strategy.scope():  # fit runs through the (stand-in) tf strategy
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((8, 6)), np.ones((8, 2)), batch_size=4,
                        epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert history.history["loss"][1] < history.history["loss"][0]
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        strategy.experimental_assign_to_logical_device(x, 2)


@pytest.mark.parametrize("env", [
    {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "RANK": "1",
     "WORLD_SIZE": "2"},
    {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, '
                  '"task": {"type": "worker", "index": 0}}'},
    {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
     "JOB_COMPLETION_INDEX": "0"},
])
def test_mirrored_strategy_in_a_job_of_several_processes_warns(
        monkeypatch, env):
    # #18: each process of the job would train alone (e.g. under Ray's
    # JaxTrainer): say so and name the strategy that trains one model.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning, match="every process would train its "
                      "own model. Use kd.MultiWorkerMirroredStrategy"):
        kd.MirroredStrategy()
    for name in env:
        monkeypatch.delenv(name)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kd.MirroredStrategy()  # alone: no warning


def test_the_tpu_detection_idiom_falls_back_without_a_tpu(monkeypatch):
    # keras-io's idiom, ported by the import change (tf.distribute -> kd,
    # tf.config / tf.tpu.experimental -> kd): no TPU here, so the resolver
    # raises ValueError and the program takes its fallback.
    monkeypatch.delenv("TPU_NAME", raising=False)
    try:
        tpu = kd.cluster_resolver.TPUClusterResolver.connect()
        kd.experimental_connect_to_cluster(tpu)
        kd.initialize_tpu_system(tpu)
        strategy = kd.TPUStrategy(tpu)
    except ValueError:
        strategy = kd.get_strategy()
    assert not isinstance(strategy, kd.TPUStrategy)
    try:
        tpu = kd.cluster_resolver.TPUClusterResolver()
        strategy = kd.TPUStrategy(tpu)
    except ValueError:
        strategy = kd.MirroredStrategy()
    assert isinstance(strategy, kd.MirroredStrategy)
