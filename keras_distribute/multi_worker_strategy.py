"""`MultiWorkerMirroredStrategy`: synchronous training over many processes."""

import dataclasses
from typing import Any, Optional

from keras_distribute import cluster_resolver as cluster_resolver_lib
from keras_distribute.backend import get_backend
from keras_distribute.cross_device_ops import CommunicationImplementation
from keras_distribute.strategy import Strategy

DEFAULT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How the workers of a multi-worker strategy talk.

    Args:
        timeout_seconds: How long start-up (every worker joining) and each
            collective may take before every process fails with an error
            instead of hanging. Defaults to 60.
        implementation: A `kd.CommunicationImplementation` (or its name),
            kept for `tf.distribute` compatibility; the backend's engine
            picks the algorithm. Defaults to `"AUTO"`.

    Raises:
        ValueError: if `timeout_seconds` is not positive, or
            `implementation` names no implementation.

    Example:

    >>> CommunicationOptions(timeout_seconds=30).timeout_seconds
    30
    """

    timeout_seconds: Optional[float] = DEFAULT_TIMEOUT_S
    implementation: str = "AUTO"

    def __post_init__(self):
        CommunicationImplementation.from_value(self.implementation)  # checks
        timeout = self.timeout_seconds
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or timeout <= 0):
            raise ValueError(
                "Expected `timeout_seconds` to be a positive number of "
                f"seconds. Received: timeout_seconds={timeout!r}.")


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the processes of several hosts.

    Every process's devices form one group; `fit` takes the **global** batch
    and gives the same result as one device on it, as `MirroredStrategy`
    does. Process 0 is the chief. Where the processes are is read from
    `cluster_resolver`, else from the environment (see
    `kd.cluster_resolver`: `KERAS_DISTRIBUTION_*`, `TF_CONFIG`, torchrun,
    SLURM).

    Supported now on the torch backend (one process per device); the JAX
    and TensorFlow engines raise `NotImplementedError` naming what works.

    Args:
        cluster_resolver: A `kd.cluster_resolver.ClusterResolver`. Defaults
            to the one the environment describes.
        communication_options: A `kd.CommunicationOptions` (timeouts).
        layout_map: Optional `keras.distribution.LayoutMap`.

    Raises:
        TimeoutError: if not every worker joined within the timeout.
        ValueError: on a malformed cluster description.
        NotImplementedError: on a backend without a multi-worker engine yet.

    Example:

    ```python
    # On every worker, with TF_CONFIG (or torchrun / SLURM) set:
    strategy = kd.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model()
    model.fit(x, y, batch_size=64 * strategy.num_replicas_in_sync)
    ```
    """

    def __init__(self, cluster_resolver: Any = None,
                 communication_options: Optional[CommunicationOptions] = None,
                 *, layout_map: Any = None):
        backend = get_backend()
        if communication_options is None:
            communication_options = CommunicationOptions()
        if not isinstance(communication_options, CommunicationOptions):
            raise ValueError(
                "Expected `communication_options` to be a "
                "`kd.CommunicationOptions`. Received: "
                f"{type(communication_options).__name__}.")
        resolver = cluster_resolver or cluster_resolver_lib.resolve()
        if not isinstance(resolver, cluster_resolver_lib.ClusterResolver):
            raise ValueError(
                "Expected `cluster_resolver` to be a "
                "`kd.cluster_resolver.ClusterResolver`. Received: "
                f"{type(resolver).__name__}.")
        make = getattr(backend, "make_multi_worker_engine", None)
        if make is None:
            raise NotImplementedError(
                "kd.MultiWorkerMirroredStrategy is not available on the "
                f"'{backend.name}' Keras backend yet. It works on the 'torch' "
                "backend; on one host, kd.MirroredStrategy works on every "
                "backend.")
        self._cluster_resolver = resolver
        super().__init__(make(resolver, communication_options.timeout_seconds,
                              layout_map))

    @property
    def cluster_resolver(self):
        """The `kd.cluster_resolver.ClusterResolver` of this job."""
        return self._cluster_resolver
