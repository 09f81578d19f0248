"""Cluster resolvers on mocked environments (no processes started)."""

import json

import pytest

from keras_distribute import cluster_resolver as cr


def tf_config(cluster, task_type="worker", index=0):
    return {"TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": task_type, "index": index}})}


def test_tf_config_chief_is_process_zero():
    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}
    chief = cr.resolve(tf_config(cluster, "chief", 0))
    assert isinstance(chief, cr.TFConfigClusterResolver)
    assert (chief.process_id, chief.num_workers, chief.is_chief) == (0, 3, True)
    worker = cr.resolve(tf_config(cluster, "worker", 1))
    assert (worker.task_type, worker.task_id, worker.process_id) == (
        "worker", 1, 2)
    assert worker.coordinator_address == "c:2222"
    assert worker.cluster_spec() == cluster
    assert not worker.is_chief
    # The CTL multi-worker tutorial's _is_chief reads it as TF's ClusterSpec.
    spec = worker.cluster_spec()
    assert "chief" in spec.as_dict() and spec.jobs == ["chief", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_address("worker", 1) == "w1:2222"
    with pytest.raises(ValueError, match="No job 'ps'.*'chief', 'worker'"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match="tasks 0..1. Received: task_index=2"):
        spec.task_address("worker", 2)


def test_tf_config_without_chief_worker_zero_leads():
    env = tf_config({"worker": ["a:1", "b:1"]}, "worker", 0)
    resolver = cr.TFConfigClusterResolver(env)
    assert resolver.is_chief and resolver.coordinator_address == "a:1"


@pytest.mark.parametrize("env, match", [
    ({"TF_CONFIG": "{not json"}, "not valid JSON"),
    ({"TF_CONFIG": json.dumps({"task": {}})}, "'cluster' object"),
    (tf_config({"worker": ["a:1"]}, "worker", 3), "index 3 is not an integer "
     "or is out of range"),
    (tf_config({"worker": ["a:1", "b:1"]}, "worker", True),
     "index True is not an integer"),
    (tf_config({"worker": ["a:1", "b:1"]}, "worker", "1"),
     "index '1' is not an integer"),
    (tf_config({"worker": ["a:1"]}, "chief", 0), "'chief' needs a 'chief' job"),
    (tf_config({"worker": ["a:port"]}), "port of 'a:port'"),
    (tf_config({"worker": ["a"]}), "Expected an address 'host:port'"),
    (tf_config({"chief": ["a:1", "b:1"], "worker": []}, "chief"), "2 chiefs"),
])
def test_tf_config_errors(env, match):
    with pytest.raises(ValueError, match=match):
        cr.resolve(env)


def test_torchrun_environment():
    env = {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400", "RANK": "3",
           "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    resolver = cr.resolve(env)
    assert isinstance(resolver, cr.TorchElasticClusterResolver)
    assert (resolver.process_id, resolver.num_processes, resolver.local_rank) \
        == (3, 4, 1)
    assert resolver.coordinator_address == "10.1.1.1:29400"
    with pytest.raises(ValueError, match="WORLD_SIZE='four'"):
        cr.resolve(dict(env, WORLD_SIZE="four"))


def test_slurm_environment_and_node_lists():
    assert cr.expand_slurm_nodelist("node[01-03,07],login") == [
        "node01", "node02", "node03", "node07", "login"]
    assert cr.expand_slurm_nodelist("a[8-10]-ib") == [
        "a8-ib", "a9-ib", "a10-ib"]
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "gpu[3-4]", "KERAS_DISTRIBUTE_PORT": "4000"}
    resolver = cr.resolve(env)
    assert isinstance(resolver, cr.SlurmClusterResolver)
    assert resolver.coordinator_address == "gpu3:4000"
    assert resolver.nodes == ["gpu3", "gpu4"] and resolver.process_id == 1
    with pytest.raises(ValueError, match="Unbalanced"):
        cr.expand_slurm_nodelist("gpu[1-2")
    with pytest.raises(ValueError, match="Bad range"):
        cr.expand_slurm_nodelist("gpu[a-b]")


def test_keras_distribution_variables():
    env = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "h0:1234,h1:1234",
           "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
           "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
    resolver = cr.resolve(env)
    assert isinstance(resolver, cr.KerasDistributionClusterResolver)
    assert (resolver.process_id, resolver.coordinator_address) == (1, "h0:1234")
    with pytest.raises(ValueError, match="lists 2 addresses"):
        cr.resolve(dict(env, KERAS_DISTRIBUTION_NUM_PROCESSES="3"))


def test_precedence_and_local_fallback():
    both = dict(tf_config({"worker": ["a:1", "b:1"]}, "worker", 1),
                MASTER_ADDR="x", MASTER_PORT="1", RANK="0", WORLD_SIZE="2")
    assert isinstance(cr.resolve(both), cr.TFConfigClusterResolver)
    local = cr.resolve({})
    assert (local.num_processes, local.process_id,
            local.is_chief) == (1, 0, True)


def test_simple_resolver_validation():
    resolver = cr.SimpleClusterResolver(["a:1", "b:2"], process_id=1)
    assert repr(resolver).startswith("<SimpleClusterResolver num_processes=2")
    with pytest.raises(ValueError, match="out of range"):
        cr.SimpleClusterResolver(["a:1"], process_id=1)
    with pytest.raises(ValueError, match="not a number"):
        cr.SimpleClusterResolver(["a:99999"])


@pytest.mark.parametrize("env, match", [
    ({"RANK": "1", "WORLD_SIZE": "2"},
     "\\['MASTER_ADDR', 'MASTER_PORT'\\] are not set"),
    ({"WORLD_SIZE": "two"}, "\\['MASTER_ADDR', 'MASTER_PORT', 'RANK'\\]"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0",
      "WORLD_SIZE": "two"}, "WORLD_SIZE to be an integer >= 1.*'two'"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "2",
      "WORLD_SIZE": "2"}, "RANK must be below WORLD_SIZE"),
    ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2",
      "LOCAL_RANK": "x"}, "LOCAL_RANK to be an integer"),
])
def test_partial_or_malformed_torchrun_environment_is_an_error(env, match):
    # Regression: RANK=1 WORLD_SIZE=2 without MASTER_ADDR ran as a
    # one-process job acting as chief; WORLD_SIZE=two was a bare int() error.
    with pytest.raises(ValueError, match=match):
        cr.resolve(env)


def test_a_one_process_torchrun_style_environment_is_not_a_job():
    assert isinstance(cr.resolve({"WORLD_SIZE": "1", "RANK": "0"}),
                      cr.SimpleClusterResolver)


def test_slurm_node_lists_backwards_and_huge():
    import time
    import tracemalloc

    with pytest.raises(ValueError, match="'3-1'.*runs backwards.*'1-3'"):
        cr.expand_slurm_nodelist("node[3-1]")
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "node[1-10000000]"}
    tracemalloc.start()
    started = time.perf_counter()
    resolver = cr.resolve(env)
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert resolver.coordinator_address == "node1:29500"
    assert peak < 1 << 20, peak  # only the first host is made
    assert seconds < 1.0  # not a timing assertion of speed: 3.6 s before
    with pytest.raises(ValueError, match="SLURM_NTASKS to be an integer "
                       ">= 1"):
        cr.resolve(dict(env, SLURM_NTASKS="0"))


def test_jax_kubernetes_environment():
    # An indexed Job: the pod's JOB_COMPLETION_INDEX is its process index.
    env = {"JAX_COORDINATOR_ADDRESS": "train-0.train:1234",
           "JAX_NUM_PROCESSES": "4", "JOB_COMPLETION_INDEX": "2"}
    resolver = cr.resolve(env)
    assert isinstance(resolver, cr.JaxEnvClusterResolver)
    assert (resolver.process_id, resolver.num_processes,
            resolver.coordinator_address) == (2, 4, "train-0.train:1234")
    # An explicit JAX_PROCESS_ID wins; a SLURM step under it is not read.
    resolver = cr.resolve(dict(env, JAX_PROCESS_ID="3", SLURM_PROCID="0",
                               SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1"))
    assert isinstance(resolver, cr.JaxEnvClusterResolver)
    assert resolver.process_id == 3
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES=None"):
        cr.resolve({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="must be below JAX_NUM_PROCESSES"):
        cr.resolve(dict(env, JOB_COMPLETION_INDEX="4"))
    with pytest.raises(ValueError, match="Expected an address 'host:port'"):
        cr.resolve(dict(env, JAX_COORDINATOR_ADDRESS="train-0"))


def test_ray_train_resolver_only_inside_a_ray_train_worker():
    # This process is no Ray Train worker (Ray imported or not): not a job;
    # an environment given to read is never this process's Ray context.
    assert not cr.RayTrainClusterResolver.detect()
    assert not cr.RayTrainClusterResolver.detect({})
    with pytest.raises(ValueError, match="not a Ray Train worker"):
        cr.RayTrainClusterResolver()
    assert cr.resolve({}).num_processes == 1


def test_submitit_local_executor_variables():
    env = {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_JOB_ID": "4242"}
    resolver = cr.resolve(env)
    assert isinstance(resolver, cr.SubmititLocalClusterResolver)
    assert (resolver.process_id, resolver.num_processes,
            resolver.local_rank) == (1, 2, 1)
    # The same port in every task of the job, or the one named.
    assert resolver.coordinator_address == "127.0.0.1:24242"
    assert cr.resolve(dict(env, KERAS_DISTRIBUTE_PORT="4000")
                      ).coordinator_address == "127.0.0.1:4000"
    with pytest.raises(ValueError, match="must be below SUBMITIT_LOCAL_NTASKS"):
        cr.resolve(dict(env, SUBMITIT_LOCAL_GLOBALID="2"))


def _fake_pci(tmp_path, vendors):
    for index, vendor in enumerate(vendors):
        device = tmp_path / f"0000:00:0{index}.0"
        device.mkdir()
        (device / "vendor").write_text(vendor + "\n")
    return str(tmp_path)


def test_tpu_resolver_raises_tensorflows_value_error_without_a_tpu(
        monkeypatch, tmp_path):
    # TensorFlow's message, so that the TPU idiom's `except ValueError:`
    # falls back; and what was received and what to do.
    from keras_distribute.cluster_resolver import tpu

    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.setattr(tpu, "_SYSFS_PCI_DEVICES",
                        _fake_pci(tmp_path, ["0x8086", "0x10de"]))
    with pytest.raises(ValueError, match="Please provide a TPU Name to "
                       "connect to.*Received: tpu=None.*MirroredStrategy"):
        cr.TPUClusterResolver()
    with pytest.raises(ValueError, match="Please provide a TPU Name"):
        cr.TPUClusterResolver.connect()
    with pytest.raises(ValueError, match="Received: tpu=3"):
        cr.TPUClusterResolver(tpu=3)


def test_tpu_resolver_finds_this_tpu_vm_and_its_pod(monkeypatch, tmp_path):
    from keras_distribute.cluster_resolver import tpu

    monkeypatch.delenv("TPU_NAME", raising=False)
    pci = _fake_pci(tmp_path, ["0x1ae0", "0x1ae0", "0x1AE0", "0x8086",
                               "0x1ae0"])
    monkeypatch.setattr(tpu, "_SYSFS_PCI_DEVICES", pci)
    assert tpu.local_tpu_chips(pci) == 4
    resolver = cr.TPUClusterResolver()
    assert resolver.master() == resolver.get_master() == "local"
    assert resolver.num_accelerators() == {"TPU": 4}
    assert (resolver.num_processes, resolver.process_id) == (1, 0)
    pod = cr.TPUClusterResolver(environ={
        "TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1,t1v-2,t1v-3",
        "TPU_WORKER_ID": "2"})
    assert (pod.num_processes, pod.process_id, pod.is_chief) == (4, 2, False)
    assert pod.cluster_spec() == {"worker": [
        f"t1v-{i}:8470" for i in range(4)]}
    named = cr.TPUClusterResolver(environ={"TPU_NAME": "my-tpu"})
    assert named.master() == "my-tpu"
    with pytest.raises(ValueError, match="TPU_WORKER_ID='7', 2 host"):
        cr.TPUClusterResolver(environ={"TPU_WORKER_HOSTNAMES": "a,b",
                                       "TPU_WORKER_ID": "7"})
