"""Where the processes of a multi-worker job are, read from the environment.

Small classes with `detect()`, in the order `resolve()` tries them:

1. `SimpleClusterResolver`: explicit arguments.
2. `KerasDistributionClusterResolver`: `KERAS_DISTRIBUTION_JOB_ADDRESSES`,
   `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID`.
3. `TFConfigClusterResolver`: `TF_CONFIG` (Kubernetes, Ray, Kubeflow).
4. `TorchElasticClusterResolver`: `MASTER_ADDR`, `MASTER_PORT`, `RANK`,
   `WORLD_SIZE` (torchrun, Kubeflow PyTorchJob, Ray's TorchTrainer).
5. `JaxEnvClusterResolver`: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
   `JAX_PROCESS_ID` or `JOB_COMPLETION_INDEX` (JAX on Kubernetes).
6. `RayTrainClusterResolver`: Ray Train's worker context (Ray's JaxTrainer
   and generic trainers, which set no variables).
7. `SlurmClusterResolver`: `SLURM_PROCID`, `SLURM_NTASKS`,
   `SLURM_JOB_NODELIST` (srun, submitit on SLURM).
8. `SubmititLocalClusterResolver`: `SUBMITIT_LOCAL_NTASKS`,
   `SUBMITIT_LOCAL_GLOBALID` (submitit's LocalExecutor).
9. The local fallback: one process on this host.

Every resolver gives the same answers: `num_processes`, `process_id`,
`coordinator_address` (`host:port` of process 0), `task_type`, `task_id`,
`num_workers` and `cluster_spec()`. Process 0 is the chief.
"""

import json
import os
from typing import List
from typing import Mapping
from typing import Optional

from keras_distribute.cluster_resolver.base import DEFAULT_PORT
from keras_distribute.cluster_resolver.base import ClusterResolver
from keras_distribute.cluster_resolver.base import check_address
from keras_distribute.cluster_resolver.base import int_env
from keras_distribute.cluster_resolver.cluster_spec import ClusterSpec
from keras_distribute.cluster_resolver.schedulers import JaxEnvClusterResolver
from keras_distribute.cluster_resolver.schedulers import RayTrainClusterResolver
from keras_distribute.cluster_resolver.schedulers import SlurmClusterResolver
from keras_distribute.cluster_resolver.schedulers import (
    SubmititLocalClusterResolver,
)
from keras_distribute.cluster_resolver.schedulers import (
    TorchElasticClusterResolver,
)
from keras_distribute.cluster_resolver.schedulers import expand_slurm_nodelist
from keras_distribute.cluster_resolver.schedulers import iter_slurm_nodelist

__all__ = ("ClusterResolver", "JaxEnvClusterResolver",
           "KerasDistributionClusterResolver", "RayTrainClusterResolver",
           "SimpleClusterResolver", "SlurmClusterResolver",
           "SubmititLocalClusterResolver",
           "TFConfigClusterResolver", "TorchElasticClusterResolver",
           "expand_slurm_nodelist", "iter_slurm_nodelist", "resolve")


class SimpleClusterResolver(ClusterResolver):
    """A cluster given explicitly.

    Args:
        addresses: Every process's `"host:port"`; process 0 first.
        process_id: This process's index. Defaults to `0`.
        task_type: Defaults to `"worker"`.
        task_id: Defaults to `process_id`.

    Raises:
        ValueError: on a malformed address or an index out of range.

    Example:

    >>> r = SimpleClusterResolver(["10.0.0.1:1234", "10.0.0.2:1234"], 1)
    >>> r.num_workers, r.coordinator_address
    (2, '10.0.0.1:1234')
    """

    def __init__(self, addresses: List[str], process_id: int = 0,
                 task_type: str = "worker", task_id: Optional[int] = None):
        for address in addresses:
            check_address(address, "SimpleClusterResolver(addresses=...)")
        super().__init__(addresses, process_id, task_type, task_id)


class KerasDistributionClusterResolver(ClusterResolver):
    """Reads Keras' own `KERAS_DISTRIBUTION_*` variables.

    `KERAS_DISTRIBUTION_JOB_ADDRESSES` lists every process (comma-separated)
    or only the coordinator; `KERAS_DISTRIBUTION_NUM_PROCESSES` and
    `KERAS_DISTRIBUTION_PROCESS_ID` complete it.
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        raw = env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "")
        addresses = [a.strip() for a in raw.split(",") if a.strip()]
        for address in addresses:
            check_address(address, "KERAS_DISTRIBUTION_JOB_ADDRESSES")
        num = int_env(env, "KERAS_DISTRIBUTION_NUM_PROCESSES")
        if len(addresses) == 1:
            addresses = addresses * num  # only the coordinator was given
        elif len(addresses) != num:
            raise ValueError(
                f"KERAS_DISTRIBUTION_JOB_ADDRESSES lists {len(addresses)} "
                f"addresses but KERAS_DISTRIBUTION_NUM_PROCESSES={num}. List "
                "every process, or only the coordinator.")
        super().__init__(addresses,
                         int_env(env, "KERAS_DISTRIBUTION_PROCESS_ID"))

    @classmethod
    def detect(cls, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return "KERAS_DISTRIBUTION_JOB_ADDRESSES" in env


class TFConfigClusterResolver(ClusterResolver):
    """Reads `TF_CONFIG`, the JSON that Kubernetes, Ray and Kubeflow set.

    `{"cluster": {"chief": [...], "worker": [...]}, "task": {"type":
    "worker", "index": 0}}`. The chief (if any) is process 0, then the
    workers in order. Evaluator and parameter-server tasks do not train.

    Raises:
        ValueError: on invalid JSON, a missing `cluster` or `task`, a task
            type the cluster lacks, an index out of range, or a bad address.
    """

    _TRAINING_JOBS = ("chief", "worker")

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        raw = env.get("TF_CONFIG", "")
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"TF_CONFIG is not valid JSON ({error}). Received: "
                f"TF_CONFIG={raw[:200]!r}. Expected e.g. "
                '{"cluster": {"worker": ["host:port", ...]}, '
                '"task": {"type": "worker", "index": 0}}.') from None
        if not isinstance(config, dict) or not isinstance(
                config.get("cluster"), dict) or not isinstance(
                config.get("task"), dict):
            received = (sorted(config) if isinstance(config, dict)
                        else type(config).__name__)
            raise ValueError(
                "TF_CONFIG needs a 'cluster' object and a 'task' object. "
                f"Received keys: {received}.")
        cluster, task = config["cluster"], config["task"]
        if len(cluster.get("chief", [])) > 1:
            raise ValueError(
                f"TF_CONFIG lists {len(cluster['chief'])} chiefs; a cluster "
                "has at most one. Make the others workers.")
        task_type = str(task.get("type", ""))
        if task_type not in cluster:
            raise ValueError(
                f"TF_CONFIG's task type {task_type!r} is not a job of its "
                f"cluster {sorted(cluster)}. Add the job to 'cluster', or fix "
                "'task.type' (e.g. 'chief' needs a 'chief' job).")
        index = task.get("index", 0)
        count = len(cluster[task_type])
        if isinstance(index, bool) or not isinstance(index, int) or not (
                0 <= index < count):
            raise ValueError(
                f"TF_CONFIG's task index {index!r} is not an integer or is out "
                f"of range for the {count} '{task_type}' task(s). Use an "
                f"integer index in [0, {count}).")
        addresses = [
            check_address(a, f"TF_CONFIG cluster '{job}'")
            for job in self._TRAINING_JOBS for a in cluster.get(job, [])]
        if task_type in self._TRAINING_JOBS:
            offset = (0 if task_type == "chief"
                      else len(cluster.get("chief", [])))
            process_id = offset + index
        else:
            process_id = 0  # evaluators and ps tasks read the chief's data
        self._rpc_layer = config.get("rpc_layer", "grpc")
        self._raw_cluster = {job: list(v) for job, v in cluster.items()}
        super().__init__(addresses, process_id, task_type, index)
        self._training = task_type in self._TRAINING_JOBS

    @classmethod
    def detect(cls, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return bool(env.get("TF_CONFIG"))

    @property
    def is_chief(self) -> bool:
        return self._training and self.process_id == 0

    def cluster_spec(self) -> ClusterSpec:
        return ClusterSpec(
            {job: list(v) for job, v in self._raw_cluster.items()})


DETECTED_IN_ORDER = (
    KerasDistributionClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
    JaxEnvClusterResolver,
    RayTrainClusterResolver,
    SlurmClusterResolver,
    SubmititLocalClusterResolver,
)


def resolve(environ: Optional[Mapping[str, str]] = None) -> ClusterResolver:
    """The resolver for this process, by the precedence table above.

    Args:
        environ: The environment to read. Defaults to `os.environ`.

    Returns:
        The first resolver whose variables are set, else a one-process
        local cluster.

    Raises:
        ValueError: when the detected variables are malformed.
    """
    for resolver in DETECTED_IN_ORDER:
        if resolver.detect(environ):
            if resolver is RayTrainClusterResolver:
                return RayTrainClusterResolver.for_this_worker()
            return resolver(environ)
    return SimpleClusterResolver([f"127.0.0.1:{DEFAULT_PORT}"], 0)
