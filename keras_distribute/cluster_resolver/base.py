"""The base of every cluster resolver: the answers each one gives.

`kd.cluster_resolver` documents the resolvers and the order they are tried.
"""

from typing import List
from typing import Mapping
from typing import Optional

from keras_distribute.cluster_resolver.cluster_spec import ClusterSpec

DEFAULT_PORT = 29500
PORT_VARIABLE = "KERAS_DISTRIBUTE_PORT"


def check_address(address: str, source: str) -> str:
    """`address` when it is `host:port`; `source` names where it came from.

    Raises:
        ValueError: without a host or with a port outside 1..65535.
    """
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
    number: Optional[int]
    try:
        number = int(value) if value is not None else None
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(
            f"Expected the environment variable {name} to be an integer "
            f">= {minimum}. Received: "
            f"{name}={value!r}{' (not set)' if value is None else ''}. Set "
            f"it as the launcher does, e.g. {name}={max(minimum, 0)}, or "
            "unset the job variables for a one-process run.") from None
    return number


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
