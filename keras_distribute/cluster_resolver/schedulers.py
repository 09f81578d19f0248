"""Resolvers for the environments schedulers and launchers set: torchrun
(and Kubeflow's PyTorchJob), `JAX_COORDINATOR_ADDRESS` (JAX on Kubernetes),
Ray Train's worker context, SLURM.

`kd.cluster_resolver` re-exports them and documents the order they are
tried in.
"""

import os
import re
import socket
import sys
from typing import Any
from typing import Iterator
from typing import List
from typing import Mapping
from typing import Optional

from keras_distribute.cluster_resolver.base import DEFAULT_PORT
from keras_distribute.cluster_resolver.base import PORT_VARIABLE
from keras_distribute.cluster_resolver.base import ClusterResolver
from keras_distribute.cluster_resolver.base import check_address
from keras_distribute.cluster_resolver.base import int_env


def ray_train_context() -> Any:
    """Ray Train's `TrainContext` when this process is a Ray Train worker,
    else `None`. Never imports Ray into a process that has not."""
    if "ray" not in sys.modules:
        return None
    try:
        import ray.train

        return ray.train.get_context()
    except Exception:  # a Ray driver, a plain Ray task, an old Ray
        return None


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
        world = int_env(env, "WORLD_SIZE", minimum=1)
        rank = int_env(env, "RANK")
        if rank >= world:
            raise ValueError(
                f"RANK must be below WORLD_SIZE. Received: RANK={rank}, "
                f"WORLD_SIZE={world}. Number the processes 0 .. "
                f"{world - 1}.")
        port = int_env(env, "MASTER_PORT", minimum=1)
        address = check_address(f"{env['MASTER_ADDR']}:{port}",
                                 "MASTER_ADDR/MASTER_PORT")
        super().__init__([address] * world, rank)
        self._local_rank = (int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env
                            else rank)
        # Under torchrun itself (not kd.launch) the agent's TCP store holds
        # MASTER_PORT on the master node: a coordinator of another engine
        # (jax.distributed) listens on the next port instead.
        # So does Ray's TorchTrainer, whose workers' group uses it.
        self.master_port_taken = bool(env.get("TORCHELASTIC_RUN_ID")) or (
            environ is None and ray_train_context() is not None)

    @classmethod
    def detect(cls, environ=None) -> bool:
        # A partial torchrun environment (RANK=1 WORLD_SIZE=2 without
        # MASTER_ADDR) is detected too, so that it fails with what is
        # missing instead of running as a one-process job that acts as chief.
        env = os.environ if environ is None else environ
        return ("MASTER_ADDR" in env
                or env.get("WORLD_SIZE", "1").strip() not in ("1", "")
                or env.get("RANK", "0").strip() not in ("0", ""))

    @property
    def local_rank(self) -> int:
        """This process's index on its host."""
        return self._local_rank


class JaxEnvClusterResolver(ClusterResolver):
    """Reads `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` (JAX on Kubernetes and other schedulers).

    On a Kubernetes indexed Job, `JAX_PROCESS_ID` may be left out: the pod's
    `JOB_COMPLETION_INDEX` is its process index.

    Raises:
        ValueError: when the address is malformed or the process count or
            index is missing or out of range.
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        address = check_address(env.get("JAX_COORDINATOR_ADDRESS", ""),
                                "JAX_COORDINATOR_ADDRESS")
        count = int_env(env, "JAX_NUM_PROCESSES", minimum=1)
        index_name = ("JAX_PROCESS_ID" if "JAX_PROCESS_ID" in env
                      or "JOB_COMPLETION_INDEX" not in env
                      else "JOB_COMPLETION_INDEX")
        index = int_env(env, index_name)
        if index >= count:
            raise ValueError(
                f"{index_name} must be below JAX_NUM_PROCESSES. Received: "
                f"{index_name}={index}, JAX_NUM_PROCESSES={count}. Set "
                "JAX_NUM_PROCESSES to the Job's `completions`.")
        super().__init__([address] * count, index)

    @classmethod
    def detect(cls, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return bool(env.get("JAX_COORDINATOR_ADDRESS"))


_ray_resolver: Optional["RayTrainClusterResolver"] = None


class RayTrainClusterResolver(ClusterResolver):
    """Reads Ray Train's worker context (`ray.train.get_context()`).

    For the trainers that set no environment of their own: Ray's
    `JaxTrainer` on CPU and its generic data-parallel trainer
    (`TorchTrainer` sets `MASTER_ADDR`/`RANK`/`WORLD_SIZE` and
    `TensorflowTrainer` sets `TF_CONFIG`, which come first). The worker
    of world rank 0 is the coordinator: it takes a free port on its node
    and sends the address to the others with
    `ray.train.collective.broadcast_from_rank_zero`, so every worker makes
    this resolver at the same point (as it makes its strategy).

    Raises:
        ValueError: outside a Ray Train worker.
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        context = ray_train_context()
        if context is None:
            raise ValueError(
                "RayTrainClusterResolver reads Ray Train's worker context. "
                "Received: a process that is not a Ray Train worker. Create "
                "the strategy inside the `train_loop_per_worker` a Ray "
                "trainer runs.")
        from ray.train.collective import broadcast_from_rank_zero

        rank, world = context.get_world_rank(), context.get_world_size()
        address = broadcast_from_rank_zero(
            _free_address() if rank == 0 else None)
        super().__init__([address] * world, rank)
        self._local_rank = context.get_local_rank()

    @classmethod
    def detect(cls, environ=None) -> bool:
        if environ is not None and environ is not os.environ:
            return False  # an environment given to read: not this process
        context = ray_train_context()
        return context is not None and context.get_world_size() > 1

    @classmethod
    def for_this_worker(cls) -> "RayTrainClusterResolver":
        """One resolver per worker process: the coordinator's address is
        agreed once (a collective), whoever asks for it later."""
        global _ray_resolver
        if _ray_resolver is None:
            _ray_resolver = cls()
        return _ray_resolver

    @property
    def local_rank(self) -> int:
        """This worker's index on its node."""
        return self._local_rank


def _free_address() -> str:
    """`host:port` of a port free on this node, on the address Ray uses."""
    import ray.util

    host = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return f"{host}:{port}"


class SubmititLocalClusterResolver(ClusterResolver):
    """Reads the variables of submitit's `LocalExecutor` (`SUBMITIT_LOCAL_*`):
    the tasks of one job on this host.

    (submitit's SLURM executor runs its tasks as a SLURM step, read by
    `SlurmClusterResolver`.) The coordinator is 127.0.0.1 on
    `KERAS_DISTRIBUTE_PORT`, else on a port derived from the job id, the
    same in every task.
    """

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        env = os.environ if environ is None else environ
        count = int_env(env, "SUBMITIT_LOCAL_NTASKS", minimum=1)
        index = int_env(env, "SUBMITIT_LOCAL_GLOBALID")
        if index >= count:
            raise ValueError(
                f"SUBMITIT_LOCAL_GLOBALID must be below SUBMITIT_LOCAL_NTASKS."
                f" Received: {index} and {count}. Let submitit set both.")
        if PORT_VARIABLE in env:
            port = int_env(env, PORT_VARIABLE, minimum=1)
        else:
            port = 20000 + int_env(env, "SUBMITIT_LOCAL_JOB_ID") % 40000
        super().__init__([f"127.0.0.1:{port}"] * count, index)
        self._local_rank = int(env.get("SUBMITIT_LOCAL_LOCALID", index))

    @classmethod
    def detect(cls, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return ("SUBMITIT_LOCAL_NTASKS" in env
                and "SUBMITIT_LOCAL_GLOBALID" in env)

    @property
    def local_rank(self) -> int:
        """This task's index on the host."""
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
        self._nodelist: str = (env.get("SLURM_JOB_NODELIST")
                               or env.get("SLURM_NODELIST") or "")
        first = next(iter_slurm_nodelist(self._nodelist), None)
        if first is None:
            raise ValueError("SLURM_JOB_NODELIST is empty; run inside a "
                             "SLURM allocation (srun / sbatch).")
        port = env.get(PORT_VARIABLE, str(DEFAULT_PORT))
        coordinator = check_address(f"{first}:{port}", PORT_VARIABLE)
        super().__init__(
            [coordinator] * int_env(env, "SLURM_NTASKS", minimum=1),
            int_env(env, "SLURM_PROCID"))

    @property
    def nodes(self) -> List[str]:
        """Every host of the allocation (expanded when asked for)."""
        return expand_slurm_nodelist(self._nodelist)

    @classmethod
    def detect(cls, environ=None) -> bool:
        env = os.environ if environ is None else environ
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env
