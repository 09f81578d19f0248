"""Where the processes of a multi-worker job are, read from the environment.

Small classes with `detect()`, in the order `resolve()` tries them:

| precedence | resolver | reads |
|---|---|---|
| 1 | `SimpleClusterResolver` | explicit arguments |
| 2 | `KerasDistributionClusterResolver` | `KERAS_DISTRIBUTION_JOB_ADDRESSES`, `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID` |
| 3 | `TFConfigClusterResolver` | `TF_CONFIG` (Kubernetes, Ray, Kubeflow) |
| 4 | `TorchElasticClusterResolver` | `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` (torchrun) |
| 5 | `SlurmClusterResolver` | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_JOB_NODELIST` |
| 6 | local fallback | one process on this host |

Every resolver gives the same answers: `num_processes`, `process_id`,
`coordinator_address` (`host:port` of process 0), `task_type`, `task_id`,
`num_workers` and `cluster_spec()`. Process 0 is the chief.
"""

import json
import os
import re
from typing import Iterator, List, Mapping, Optional

from keras_distribute.cluster_spec import ClusterSpec

DEFAULT_PORT = 29500
_PORT_VARIABLE = "KERAS_DISTRIBUTE_PORT"


def _check_address(address: str, source: str) -> str:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host:
        raise ValueError(
            f"Expected an address 'host:port' in {source}. Received: "
            f"{address!r}. Write it as e.g. 'worker-0.example.com:12345'.")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"The port of {address!r} in {source} is not a number between 1 "
            f"and 65535. Received: port={port!r}. Write it as 'host:12345'.")
    return address


def int_env(environ: Mapping[str, str], name: str, minimum: int = 0) -> int:
    """The integer environment variable `name`, at least `minimum`.

    Raises:
        ValueError: if it is missing, not an integer, or too small.
    """
    value = environ.get(name)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise ValueError(
            f"Expected the environment variable {name} to be an integer "
            f">= {minimum}. Received: "
            f"{name}={value!r}{' (not set)' if value is None else ''}. Set "
            f"it as the launcher does, e.g. {name}={max(minimum, 0)}, or "
            "unset the job variables for a one-process run.") from None
    return number


_int_env = int_env


class ClusterResolver:
    """The answers every resolver gives; see the module docstring."""

    def __init__(self, addresses: List[str], process_id: int,
                 task_type: str = "worker", task_id: Optional[int] = None):
        if not addresses:
            raise ValueError("Expected at least one process address. "
                             "Received: an empty cluster.")
        if not 0 <= process_id < len(addresses):
            raise ValueError(
                f"The process index {process_id} is out of range for a "
                f"cluster of {len(addresses)} process(es). Use an index in "
                f"[0, {len(addresses)}).")
        self._addresses = list(addresses)
        self._process_id = process_id
        self._task_type = task_type
        self._task_id = process_id if task_id is None else task_id

    @classmethod
    def detect(cls, environ: Optional[Mapping[str, str]] = None) -> bool:
        """Whether this resolver's environment variables are set."""
        return False

    @property
    def num_processes(self) -> int:
        """How many processes the job has."""
        return len(self._addresses)

    @property
    def num_workers(self) -> int:
        """How many workers (processes) take part in training."""
        return len(self._addresses)

    @property
    def process_id(self) -> int:
        """This process's index, 0 for the chief."""
        return self._process_id

    @property
    def task_type(self) -> str:
        """`"chief"` or `"worker"`, as in `TF_CONFIG`."""
        return self._task_type

    @property
    def task_id(self) -> int:
        """This process's index within its task type."""
        return self._task_id

    @property
    def is_chief(self) -> bool:
        """Whether this is process 0, which writes checkpoints and logs."""
        return self._process_id == 0

    @property
    def coordinator_address(self) -> str:
        """`host:port` of process 0."""
        return self._addresses[0]

    @property
    def addresses(self) -> List[str]:
        """Every process's `host:port`, in process order."""
        return list(self._addresses)

    def cluster_spec(self) -> ClusterSpec:
        """The cluster as a `ClusterSpec` (a dict `{"worker": [addresses]}`
        with `tf.train.ClusterSpec`'s methods)."""
        return ClusterSpec({"worker": list(self._addresses)})

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} num_processes={self.num_processes}, "
                f"process_id={self.process_id}, task_type='{self.task_type}', "
                f"coordinator_address='{self.coordinator_address}'>")


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
            _check_address(address, "SimpleClusterResolver(addresses=...)")
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
            _check_address(address, "KERAS_DISTRIBUTION_JOB_ADDRESSES")
        num = _int_env(env, "KERAS_DISTRIBUTION_NUM_PROCESSES")
        if len(addresses) == 1:
            addresses = addresses * num  # only the coordinator was given
        elif len(addresses) != num:
            raise ValueError(
                f"KERAS_DISTRIBUTION_JOB_ADDRESSES lists {len(addresses)} "
                f"addresses but KERAS_DISTRIBUTION_NUM_PROCESSES={num}. List "
                "every process, or only the coordinator.")
        super().__init__(addresses,
                         _int_env(env, "KERAS_DISTRIBUTION_PROCESS_ID"))

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
            raise ValueError(
                "TF_CONFIG needs a 'cluster' object and a 'task' object. "
                f"Received keys: {sorted(config) if isinstance(config, dict) else type(config).__name__}.")
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
        if not isinstance(index, int) or not 0 <= index < len(
                cluster[task_type]):
            raise ValueError(
                f"TF_CONFIG's task index {index!r} is out of range for the "
                f"{len(cluster[task_type])} '{task_type}' task(s). Use an "
                f"index in [0, {len(cluster[task_type])}).")
        addresses = [
            _check_address(a, f"TF_CONFIG cluster '{job}'")
            for job in self._TRAINING_JOBS for a in cluster.get(job, [])]
        if task_type in self._TRAINING_JOBS:
            offset = 0 if task_type == "chief" else len(cluster.get("chief", []))
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


class TorchElasticClusterResolver(ClusterResolver):
    """Reads the environment `torchrun` (and `kd.launch`) sets."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK",
                               "WORLD_SIZE") if not env.get(k)]
        if missing:
            raise ValueError(
                "A torchrun-style job needs MASTER_ADDR, MASTER_PORT, RANK "
                f"and WORLD_SIZE; {missing} are not set. Received: "
                + ", ".join(f"{k}={env.get(k)!r}" for k in (
                    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
                + ". Start the processes with torchrun or `python -m "
                "keras_distribute.launch`, which set all four, or unset "
                "RANK/WORLD_SIZE for a one-process run.")
        world = _int_env(env, "WORLD_SIZE", minimum=1)
        rank = _int_env(env, "RANK")
        if rank >= world:
            raise ValueError(
                f"RANK must be below WORLD_SIZE. Received: RANK={rank}, "
                f"WORLD_SIZE={world}. Number the processes 0 .. "
                f"{world - 1}.")
        port = _int_env(env, "MASTER_PORT", minimum=1)
        address = _check_address(f"{env['MASTER_ADDR']}:{port}",
                                 "MASTER_ADDR/MASTER_PORT")
        super().__init__([address] * world, rank)
        self._local_rank = (_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env
                            else rank)
        # Under torchrun itself (not kd.launch) the agent's TCP store holds
        # MASTER_PORT on the master node: a coordinator of another engine
        # (jax.distributed) listens on the next port instead.
        self.master_port_taken = bool(env.get("TORCHELASTIC_RUN_ID"))

    @classmethod
    def detect(cls, environ=None) -> bool:
        # A partial torchrun environment (RANK=1 WORLD_SIZE=2 without
        # MASTER_ADDR) is detected too, so that it fails with what is
        # missing instead of running as a one-process job that acts as chief.
        env = os.environ if environ is None else environ
        return "MASTER_ADDR" in env or env.get("WORLD_SIZE", "1").strip() not in (
            "1", "") or env.get("RANK", "0").strip() not in ("0", "")

    @property
    def local_rank(self) -> int:
        """This process's index on its host."""
        return self._local_rank


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expands a SLURM node list such as `"gpu[01-03,07],cpu5"`.

    Args:
        nodelist: The value of `SLURM_JOB_NODELIST`.

    Returns:
        The host names, in order.

    Raises:
        ValueError: on an unbalanced bracket or a bad range.

    Example:

    >>> expand_slurm_nodelist("node[01-03,07],login")
    ['node01', 'node02', 'node03', 'node07', 'login']
    """
    return list(iter_slurm_nodelist(nodelist))


def iter_slurm_nodelist(nodelist: str) -> Iterator[str]:
    """The host names of a SLURM node list, one at a time (the first of
    `node[1-10000000]` without making the other ten million)."""
    for pattern in _split_slurm_nodelist(nodelist):
        yield from _expand_one(pattern, nodelist)


def _split_slurm_nodelist(nodelist: str) -> List[str]:
    patterns, depth, current = [], 0, ""
    for char in nodelist + ",":
        if char == "," and depth == 0:
            if current:
                patterns.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"Unbalanced brackets in the SLURM node list "
                             f"{nodelist!r}.")
        current += char
    if depth:
        raise ValueError(f"Unbalanced brackets in the SLURM node list "
                         f"{nodelist!r}.")
    return patterns


def _expand_one(pattern: str, nodelist: str) -> Iterator[str]:
    match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"Cannot parse {pattern!r} in the SLURM node "
                             f"list {nodelist!r}.")
        yield pattern
        return
    prefix, ranges, suffix = match.groups()
    parts = []
    for part in ranges.split(","):  # all checked before the first host
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"Bad range {part!r} in the SLURM node list "
                             f"{nodelist!r}: expected numbers like "
                             "'01-08' or '7'.")
        if high and int(high) < int(low):
            raise ValueError(
                f"The range {part!r} in the SLURM node list {nodelist!r} runs "
                f"backwards. Write it low to high: '{high}-{low}'.")
        parts.append((low, high))
    for low, high in parts:
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            yield f"{prefix}{number:0{width}d}{suffix}"


class SlurmClusterResolver(ClusterResolver):
    """Reads SLURM's variables (one task per process, e.g. via `srun`).

    The coordinator is the first node of `SLURM_JOB_NODELIST` on port
    `KERAS_DISTRIBUTE_PORT` (default 29500).
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        self._nodelist = (env.get("SLURM_JOB_NODELIST")
                          or env.get("SLURM_NODELIST", ""))
        first = next(iter_slurm_nodelist(self._nodelist), None)
        if first is None:
            raise ValueError("SLURM_JOB_NODELIST is empty; run inside a "
                             "SLURM allocation (srun / sbatch).")
        port = env.get(_PORT_VARIABLE, str(DEFAULT_PORT))
        coordinator = _check_address(f"{first}:{port}", _PORT_VARIABLE)
        super().__init__(
            [coordinator] * _int_env(env, "SLURM_NTASKS", minimum=1),
            _int_env(env, "SLURM_PROCID"))

    @property
    def nodes(self) -> List[str]:
        """Every host of the allocation (expanded when asked for)."""
        return expand_slurm_nodelist(self._nodelist)

    @classmethod
    def detect(cls, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env


_DETECTED_IN_ORDER = (
    KerasDistributionClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
    SlurmClusterResolver,
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
    for resolver in _DETECTED_IN_ORDER:
        if resolver.detect(environ):
            return resolver(environ)
    return SimpleClusterResolver([f"127.0.0.1:{DEFAULT_PORT}"], 0)
