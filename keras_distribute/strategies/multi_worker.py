"""`MultiWorkerMirroredStrategy`: synchronous training over many processes."""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Optional

from keras_distribute.backend import get_backend
from keras_distribute.cluster_resolver import resolvers as cluster_resolver_lib
from keras_distribute.common.cross_device_ops import CommunicationOptions
from keras_distribute.common.cross_device_ops import (
    checked_communication_options,
)
from keras_distribute.common.cross_device_ops import communication_timeout_s
from keras_distribute.strategies.strategy import Strategy

if TYPE_CHECKING:
    from keras.distribution import LayoutMap


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the processes of several hosts.

    Every process's devices form one group; `fit` takes the **global** batch
    and gives the same result as one device on it, as `MirroredStrategy`
    does. Process 0 is the chief. Where the processes are is read from
    `cluster_resolver`, else from the environment (see
    `kd.cluster_resolver`: `KERAS_DISTRIBUTION_*`, `TF_CONFIG`, torchrun,
    SLURM).

    The engine is `jax.distributed` (JAX), tf.distribute's
    `MultiWorkerMirroredStrategy` (TensorFlow) or `torch.distributed` with
    one process per device (torch).

    Args:
        cluster_resolver: A `kd.cluster_resolver.ClusterResolver`. Defaults
            to the one the environment describes.
        communication_options: A `kd.CommunicationOptions` (timeouts,
            gradient compression).
        layout_map: Optional `keras.distribution.LayoutMap`.

    Raises:
        TimeoutError: if not every worker joined within the timeout.
        ValueError: on a malformed cluster description.

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
                 *, layout_map: LayoutMap | None = None):
        backend = get_backend()
        communication_options = checked_communication_options(
            communication_options)
        resolver = cluster_resolver or cluster_resolver_lib.resolve()
        if not isinstance(resolver, cluster_resolver_lib.ClusterResolver):
            raise ValueError(
                "Expected `cluster_resolver` to be a "
                "`kd.cluster_resolver.ClusterResolver`. Received: "
                f"{type(resolver).__name__}.")
        self._cluster_resolver = resolver
        timeout_s = communication_timeout_s(
            communication_options.timeout_seconds)
        from keras_distribute import integration

        super().__init__(backend.make_multi_worker_engine(
            resolver, timeout_s, layout_map,
            services=integration.services()))
        self._set_communication_options(communication_options)

    @property
    def cluster_resolver(self):
        """The `kd.cluster_resolver.ClusterResolver` of this job."""
        return self._cluster_resolver
