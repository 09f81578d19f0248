"""`TPUClusterResolver`: tf.distribute's TPU detection idiom, on every backend.

keras-io examples and Kaggle notebooks open with::

    try:
        tpu = TPUClusterResolver.connect()   # or TPUClusterResolver()
        strategy = TPUStrategy(tpu)
    except ValueError:
        strategy = MirroredStrategy()

TensorFlow raises `ValueError("Please provide a TPU Name to connect to.")`
where there is no TPU; so does this resolver, without a network call: a TPU
is named by `tpu`, by `TPU_NAME`, or found on this host (a TPU VM: a PCI
device of Google's vendor id, 0x1ae0, as JAX's own TPU detection reads it).
A TPU VM pod's hosts come from `TPU_WORKER_HOSTNAMES` and `TPU_WORKER_ID`
(set on every host of a pod slice). No framework is imported here.
"""

from __future__ import annotations

import glob
import os
from typing import Any
from typing import List
from typing import Mapping
from typing import Optional

from keras_distribute.cluster_resolver.base import ClusterResolver

# Google's PCI vendor id: every TPU chip of a TPU VM shows it in sysfs.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_SYSFS_PCI_DEVICES = "/sys/bus/pci/devices"
# The port TPU VM hosts talk on (TensorFlow's default for a TPU worker).
_TPU_WORKER_PORT = 8470


def local_tpu_chips(pci_devices: Optional[str] = None) -> int:
    """How many TPU chips this host has (0 off a TPU VM): PCI devices whose
    vendor is Google's.

    Args:
        pci_devices: The sysfs folder of PCI devices. Defaults to
            `/sys/bus/pci/devices`.

    Returns:
        The number of TPU chips found.
    """
    pci_devices = _SYSFS_PCI_DEVICES if pci_devices is None else pci_devices
    chips = 0
    for vendor_file in glob.glob(os.path.join(pci_devices, "*", "vendor")):
        try:
            with open(vendor_file) as handle:
                vendor = handle.read().strip().lower()
        except OSError:
            continue
        chips += vendor == _GOOGLE_PCI_VENDOR
    return chips


class TPUClusterResolver(ClusterResolver):
    """Finds the TPU this job runs on (tf.distribute's `TPUClusterResolver`).

    Args:
        tpu: The TPU to use: `"local"` (or `""`) for this TPU VM, or the
            name of a TPU (kept as `master()`; on the TensorFlow backend
            `kd.TPUStrategy` hands it to TensorFlow's own resolver).
            Defaults to the `TPU_NAME` environment variable, else this host
            when it is a TPU VM.
        zone: Accepted for compatibility (a Cloud TPU's zone).
        project: Accepted for compatibility (a Cloud TPU's project).
        job_name: The job's name in the cluster spec. Defaults to
            `"worker"`.
        coordinator_name: Accepted for compatibility.
        coordinator_address: Accepted for compatibility.
        credentials: Accepted for compatibility.
        service: Accepted for compatibility.
        discovery_url: Accepted for compatibility.
        environ: The environment to read (`TPU_NAME`, `TPU_WORKER_ID`,
            `TPU_WORKER_HOSTNAMES`). Defaults to `os.environ`.

    Raises:
        ValueError: when no TPU is named and this host has none (the error
            TensorFlow raises, so `except ValueError:` falls back).

    Example:

    ```python
    try:
        tpu = kd.cluster_resolver.TPUClusterResolver.connect()
        strategy = kd.TPUStrategy(tpu)
    except ValueError:
        strategy = kd.MirroredStrategy()   # no TPU here
    ```
    """

    def __init__(self, tpu: Optional[str] = None, zone: Optional[str] = None,
                 project: Optional[str] = None, job_name: str = "worker",
                 coordinator_name: Optional[str] = None,
                 coordinator_address: Optional[str] = None,
                 credentials: Any = "default", service: Any = None,
                 discovery_url: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None):
        environ = os.environ if environ is None else environ
        if tpu is None:
            tpu = environ.get("TPU_NAME") or None
        if tpu is None and local_tpu_chips():
            tpu = "local"
        if tpu is None:
            raise ValueError(
                "Please provide a TPU Name to connect to. No TPU was named "
                "and this host has none. Received: tpu=None, TPU_NAME unset, "
                "no TPU chip on this host. On a TPU VM call "
                "TPUClusterResolver() there (or pass tpu='local'); "
                "elsewhere fall back to another strategy: `except "
                "ValueError: strategy = kd.MirroredStrategy()`.")
        if not isinstance(tpu, str):
            raise ValueError(
                "Expected `tpu` to be a TPU name (a string) or None. "
                f"Received: tpu={tpu!r}. Pass e.g. tpu='local' on a TPU VM.")
        self._tpu = tpu or "local"
        self._zone, self._project = zone, project
        self._job_name = job_name
        hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
                 if h.strip()]
        worker_id = environ.get("TPU_WORKER_ID", "0")
        if not worker_id.isdigit() or (hosts and int(worker_id) >= len(hosts)):
            raise ValueError(
                "Expected TPU_WORKER_ID to be this host's index among "
                f"TPU_WORKER_HOSTNAMES. Received: TPU_WORKER_ID={worker_id!r}"
                f", {len(hosts)} host(s). Leave both as the TPU VM sets "
                "them, or unset both on a single host.")
        addresses = [f"{h.strip()}:{_TPU_WORKER_PORT}" for h in hosts] or [
            f"localhost:{_TPU_WORKER_PORT}"]
        super().__init__(addresses, int(worker_id), task_type=job_name)

    @classmethod
    def connect(cls, tpu: Optional[str] = None, zone: Optional[str] = None,
                project: Optional[str] = None) -> "TPUClusterResolver":
        """Finds the TPU and connects to it, as TensorFlow's `connect()`.

        Args:
            tpu: As in the constructor.
            zone: As in the constructor.
            project: As in the constructor.

        Returns:
            The resolver, with the TPU system ready (see
            `kd.experimental_connect_to_cluster` and
            `kd.initialize_tpu_system`).

        Raises:
            ValueError: where there is no TPU (as the constructor).

        Example:

        ```python
        tpu = kd.cluster_resolver.TPUClusterResolver.connect()
        ```
        """
        resolver = cls(tpu=tpu, zone=zone, project=project)
        experimental_connect_to_cluster(resolver)
        initialize_tpu_system(resolver)
        return resolver

    def master(self, task_type: Optional[str] = None,
               task_id: Optional[int] = None,
               rpc_layer: Optional[str] = None) -> str:
        """The TPU's name: `"local"` on a TPU VM."""
        return self._tpu

    get_master = master

    @property
    def tpu_name(self) -> str:
        """The TPU this resolver names (`"local"`: this TPU VM)."""
        return self._tpu

    def num_accelerators(self, task_type: Optional[str] = None,
                         task_id: Optional[int] = None,
                         config_proto: Any = None) -> dict:
        """`{"TPU": chips on this host}` (0 where the TPU is remote)."""
        return {"TPU": local_tpu_chips()}

    def __repr__(self) -> str:
        return (f"<TPUClusterResolver tpu='{self._tpu}', "
                f"num_processes={self.num_processes}, "
                f"process_id={self.process_id}>")


def experimental_connect_to_cluster(cluster_spec_or_resolver: Any,
                                    *args: Any, **kwargs: Any) -> None:
    """`tf.config.experimental_connect_to_cluster` of the TPU idiom.

    On the TensorFlow backend it calls TensorFlow's own. On JAX a TPU VM's
    runtime connects on first use (a pod's hosts through
    `jax.distributed`, which `kd.TPUStrategy` starts), so there is nothing
    to do: a documented no-op. On torch (no TPUs) it is a no-op too;
    `kd.TPUStrategy` then raises its clear error.

    Args:
        cluster_spec_or_resolver: A `TPUClusterResolver` (or what
            TensorFlow's function takes).
        *args: Passed to TensorFlow's function on that backend.
        **kwargs: Passed to TensorFlow's function on that backend.

    Example:

    ```python
    kd.experimental_connect_to_cluster(tpu)
    ```
    """
    if _keras_backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental_connect_to_cluster(
            _tensorflow_resolver(cluster_spec_or_resolver), *args, **kwargs)


def initialize_tpu_system(cluster_resolver: Any = None) -> Any:
    """`tf.tpu.experimental.initialize_tpu_system` of the TPU idiom.

    On the TensorFlow backend it calls TensorFlow's own (and returns its
    topology). On JAX the TPU system is initialised when JAX first uses
    its TPU backend: a documented no-op returning `None`; on torch also a
    no-op.

    Args:
        cluster_resolver: A `TPUClusterResolver`, or `None`.

    Returns:
        TensorFlow's TPU topology on that backend, else `None`.

    Example:

    ```python
    kd.initialize_tpu_system(tpu)
    ```
    """
    if _keras_backend() == "tensorflow":
        import tensorflow as tf

        return tf.tpu.experimental.initialize_tpu_system(
            _tensorflow_resolver(cluster_resolver))
    return None


def _keras_backend() -> str:
    import keras  # the idiom runs in a Keras program: already imported

    return str(keras.backend.backend())


def _tensorflow_resolver(resolver: ClusterResolver) -> Any:
    """TensorFlow's resolver for a kd one (others pass through)."""
    if isinstance(resolver, TPUClusterResolver):
        import tensorflow as tf

        return tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=resolver.tpu_name)
    return resolver


__all__: List[str] = ["TPUClusterResolver", "experimental_connect_to_cluster",
                      "initialize_tpu_system", "local_tpu_chips"]
