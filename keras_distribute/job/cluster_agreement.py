"""Every process of a job was told the same cluster (framework-free).

When a job forms, each process claims its index and publishes the cluster
as it was told it (process count and addresses) on the job's key-value
store (torch's TCP store, JAX's or TensorFlow's coordination service).
Each process compares its own with process 0's, and process 0 with every
other's, so every process that finds a difference refuses, naming it,
before a step runs (#43: workers told of 2 and of 3 processes trained and
exited 0 on JAX, waited out the timeout on torch, and failed on TensorFlow
inside a collective, in its words).

Each backend hands in its store as an `AgreementStore`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Optional
from typing import Protocol

if TYPE_CHECKING:
    from keras_distribute.cluster_resolver.base import ClusterResolver

_PREFIX = "keras_distribute/cluster/"

_HOW_TO_FIX = (
    "Start every worker with the same cluster (TF_CONFIG's cluster, "
    "KERAS_DISTRIBUTION_JOB_ADDRESSES / NUM_PROCESSES, or the torchrun "
    "variables) and a distinct process index.")


class AgreementStore(Protocol):
    """A job's key-value store, as the agreement check uses it."""

    def claim(self, key: str) -> bool:
        """Records `key`; `True` when no process recorded it before."""

    def publish(self, key: str, text: str) -> None:
        """Sets `key` to `text` for every process of the job to read."""

    def fetch(self, key: str, timeout_s: float) -> Optional[str]:
        """`key`'s text, waiting up to `timeout_s` for another process to
        set it; `None` when it was not set in time."""


class CoordinationServiceStore:
    """A coordination service's key-value store (JAX's, TensorFlow's) as an
    `AgreementStore`, from the service's own three calls.

    Args:
        set_once: `set_once(key, text)` sets `key`, raising an error that
            says it already exists when it was set before.
        set_over: `set_over(key, text)` sets `key`, replacing its text.
        get_waiting: `get_waiting(key, timeout_ms)` returns `key`'s text,
            waiting for it; raises when it was not set in time.
    """

    def __init__(self, set_once: Callable[[str, str], Any],
                 set_over: Callable[[str, str], Any],
                 get_waiting: Callable[[str, int], Any]):
        self._set_once = set_once
        self._set_over = set_over
        self._get_waiting = get_waiting

    def claim(self, key: str) -> bool:
        try:
            self._set_once(key, "1")
        except Exception as error:  # the service's ALREADY_EXISTS
            if "exist" not in str(error).lower():
                raise
            return False
        return True

    def publish(self, key: str, text: str) -> None:
        self._set_over(key, text)

    def fetch(self, key: str, timeout_s: float) -> Optional[str]:
        try:
            text = self._get_waiting(key, int(1000 * timeout_s))
        except Exception:  # the service's DEADLINE_EXCEEDED
            return None
        return text.decode() if isinstance(text, bytes) else text


def describe(resolver: ClusterResolver) -> str:
    """The cluster as `resolver` describes it: its process count and
    addresses, as text that compares equal only for the same cluster.

    Args:
        resolver: a kd cluster resolver (`num_processes`, `addresses`).

    Returns:
        A JSON string.

    Example:

    >>> from keras_distribute.cluster_resolver import SimpleClusterResolver
    >>> describe(SimpleClusterResolver(["10.0.0.1:2222", "10.0.0.2:2222"], 1))
    '{"num_processes": 2, "addresses": ["10.0.0.1:2222", "10.0.0.2:2222"]}'
    """
    return json.dumps({"num_processes": resolver.num_processes,
                       "addresses": list(resolver.addresses)})


def check_same_cluster(store: AgreementStore, rank: int, world_size: int,
                       description: str, timeout_s: float) -> None:
    """Refuses a job whose processes were told different clusters or the
    same process index.

    Process `rank` claims its index and publishes `description`; it then
    compares it with process 0's (process 0: with every other process's,
    waiting up to `timeout_s` for each). Call it in every process of the
    job once the store is reachable, before training.

    Args:
        store: the job's key-value store (see `AgreementStore`).
        rank: this process's index, as it was told it.
        world_size: the process count, as this process was told it.
        description: `describe(resolver)` of this process's resolver.
        timeout_s: how long to wait for another process's description.

    Raises:
        ValueError: another process claimed the same index, or was told a
            different cluster (both descriptions are named).
        TimeoutError: a process did not publish its description in time.

    Example:

    ```python
    check_same_cluster(store, resolver.process_id, resolver.num_processes,
                       describe(resolver), timeout_s=60)
    ```
    """
    from keras_distribute.job import process_notes

    if not store.claim(f"{_PREFIX}claims/{rank}"):
        raise _refused(
            f"Two processes of this job were both given process index "
            f"{rank} (the task index, RANK or KERAS_DISTRIBUTION_PROCESS_ID)"
            f". Received: a second claim of index {rank} in a job of "
            f"{world_size}. Give each process its own index, 0 to N-1.",
            process_notes)
    store.publish(f"{_PREFIX}{rank}", description)
    others = [0] if rank != 0 else range(1, world_size)
    for other in others:
        theirs = store.fetch(f"{_PREFIX}{other}", timeout_s)
        if theirs is None:
            raise TimeoutError(
                f"Process {other} did not publish its cluster description "
                f"within {timeout_s:.0f} s (this process {rank} of "
                f"{world_size} waited for it on the job's store). Check that "
                "every worker started with the same cluster description.")
        if theirs != description:
            raise _refused(
                "The processes of this job were given different cluster "
                f"descriptions. Received: process {rank}: {description}; "
                f"process {other}: {theirs}. {_HOW_TO_FIX}", process_notes)


def _refused(message: str, process_notes: Any) -> ValueError:
    # A runtime may end a job formed this way from native code at exit
    # (JAX's shutdown barrier aborts it): the note says why first.
    process_notes.write(message)
    return ValueError(message)
