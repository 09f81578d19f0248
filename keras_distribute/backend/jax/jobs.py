"""JAX engines for jobs beyond one process's devices: multi-worker and TPU.

Also makes Keras' JAX `predict` work when arrays span several processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any
from typing import Optional

import jax
import numpy as np
from keras.distribution import DeviceMesh

from keras_distribute.backend.jax import engine as jax_engine
from keras_distribute.backend.jax.devices import resolve_device
from keras_distribute.common.cross_device_ops import communication_timeout_s
from keras_distribute.common.devices import parse_device_name
from keras_distribute.common.keras_services import KerasServices

if TYPE_CHECKING:
    from keras.distribution import LayoutMap

    from keras_distribute.cluster_resolver.base import ClusterResolver


def make_multi_worker_engine(resolver: ClusterResolver,
                             timeout_s: Optional[float],
                             layout_map: LayoutMap | None = None, *,
                             services: KerasServices
                             ) -> "jax_engine.JaxEngine":
    """Joins the `jax.distributed` job `resolver` describes; all devices."""
    timeout_s = int(communication_timeout_s(timeout_s))
    if resolver.num_processes == 1 and not jax.distributed.is_initialized():
        # One process: no job to join, so no jax.distributed (which must
        # start before JAX runs anything): this process's devices, at any
        # time, as TensorFlow's one-worker strategy.
        return jax_engine.make_engine(list(jax.devices()), layout_map,
                                      services=services)
    if not jax.distributed.is_initialized():
        # SIGTERM must still end a process (JAX's preemption service would
        # swallow it); a dead peer is then noticed within the timeout.
        jax.config.update("jax_enable_preemption_service", False)
        coordinator = resolver.coordinator_address
        if getattr(resolver, "master_port_taken", False):
            coordinator = _coordinator_beside_the_store(resolver,
                                                        coordinator)
        bind_address = _own_address(coordinator)
        if resolver.process_id == 0 and bind_address is not None:
            from keras_distribute.job import addresses

            # taken, JAX's coordinator died by SIGSEGV, blaming no port
            addresses.refuse_taken_port(
                bind_address.rpartition(":")[0].strip("[]"),
                int(coordinator.rpartition(":")[2]),
                "the job's JAX coordinator (hosted by process 0)",
                "give the job a free coordinator port (the launcher's "
                "--port, MASTER_PORT, JAX_COORDINATOR_ADDRESS or the chief's "
                "address in TF_CONFIG)")
        from keras_distribute.job import process_notes

        # JAX aborts from native code: the note reaches stderr even when
        # no launcher of kd reads it.
        process_notes.watch_until_exit(resolver.process_id)
        process_notes.write(
            f"joining jax.distributed at {coordinator} as process "
            f"{resolver.process_id} of {resolver.num_processes}: JAX aborts "
            f"a process (SIGABRT) when not every process joined within "
            f"{timeout_s} s. Check that every process started, with the same "
            "cluster description, and can reach the coordinator")
        try:
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=resolver.num_processes,
                process_id=resolver.process_id,
                initialization_timeout=timeout_s,
                heartbeat_timeout_seconds=max(timeout_s, 10),
                shutdown_timeout_seconds=max(timeout_s, 10),
                # Process 0 hosts the coordinator on its given address (a
                # one-host job: loopback), not on every interface.
                coordinator_bind_address=bind_address,
            )
        except RuntimeError as error:
            if "before any JAX" in str(error) or "backend" in str(error):
                raise RuntimeError(
                    "jax.distributed must start before JAX runs anything. "
                    "Create kd.MultiWorkerMirroredStrategy at the start of "
                    "the program, before any array is made.") from error
            raise TimeoutError(
                f"Not every worker joined within {timeout_s} s: process "
                f"{resolver.process_id} of {resolver.num_processes} waited "
                f"for the coordinator {coordinator}. Check "
                "that every worker started with the same cluster description."
                f" Cause: {error}") from error
        _cpu_collectives_over_own_address(resolver)
        process_notes.write(
            f"in a jax.distributed job of {resolver.num_processes} processes:"
            f" JAX's coordination service aborts a process (SIGABRT) when a "
            f"peer stops answering for {max(timeout_s, 10)} s; look for the "
            "process that died, froze or finished first")
        _check_same_cluster(resolver, timeout_s)
        from keras_distribute.job import addresses

        _watch_peers(resolver.process_id, resolver.num_processes, timeout_s,
                     host=addresses.host_of(resolver),
                     store_address=coordinator)
        # As keras.distribution.initialize does: one global seed, so that
        # every process initialises variables to the same values.
        services.seed_every_process()
    elif jax.process_count() != resolver.num_processes:
        raise ValueError(
            f"jax.distributed runs {jax.process_count()} processes but the "
            f"cluster resolver describes {resolver.num_processes}. "
            f"Received: {resolver!r}.")
    if jax.process_count() > 1:
        services.install_chief_values()
    return jax_engine.make_engine(list(jax.devices()), layout_map,
                                  services=services)


def _cpu_collectives_over_own_address(resolver: ClusterResolver) -> None:
    """Has JAX's CPU collectives (gloo) use this process's given address.

    Left to itself gloo takes the address the host name resolves to, a
    loopback address on many machines (Debian's /etc/hosts): across hosts,
    each process told the others to connect to 127.0.0.1 and the job never
    formed ("Gloo context initialization failed ... Connection refused").
    Done only before JAX made its CPU backend, with gloo as the CPU
    collectives, and when the given address is one of this machine's."""
    from jax._src import distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    from keras_distribute.job import addresses

    host = addresses.host_of(resolver)
    if (host is None or xla_bridge.backends_are_initialized()
            or jax.config.jax_cpu_collectives_implementation != "gloo"):
        return
    client = distributed.global_state.client

    def cpu_client_on_own_address():
        return xla_bridge.make_cpu_client(
            collectives=_jax.make_gloo_tcp_collectives(
                distributed_client=client, hostname=host))

    xla_bridge.register_backend_factory(
        "cpu", cpu_client_on_own_address, priority=0, fail_quietly=False)


def _own_address(address: str) -> Optional[str]:
    """`ip:port` of `address` when its host is an address of this machine
    (JAX's coordinator then listens there only), else `None` (JAX's default:
    every interface)."""
    from keras_distribute.job import addresses

    ip = addresses.local_host(address)
    if ip is None:
        return None
    port = address.rpartition(":")[2]
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def make_tpu_engine(tpu_cluster_resolver: Any, assignment: Any,
                    layout_map: LayoutMap | None = None, *,
                    services: KerasServices) -> "jax_engine.JaxTpuEngine":
    """The engine of a TPUStrategy: mesh `(replicas, logical devices)`."""
    from keras.distribution import LayoutMap

    if assignment is not None and assignment.devices is not None:
        devices = [d if isinstance(d, jax.Device) else resolve_device(
                       parse_device_name(d) if isinstance(d, str) else d)
                   for d in assignment.devices]
    elif jax.default_backend() == "tpu":
        devices = list(jax.devices())
    else:
        raise RuntimeError(
            "kd.TPUStrategy found no TPU (JAX's default backend is "
            f"'{jax.default_backend()}'). Run on a TPU VM, or simulate a "
            "slice by naming devices: kd.TPUStrategy(device_assignment="
            "kd.DeviceAssignment(num_replicas=4, computation_shape=2, "
            "devices=jax.devices())).")
    if assignment is None:
        num_replicas, logical = len(devices), 1
    else:
        num_replicas, logical = (assignment.num_replicas,
                                 assignment.num_logical_devices)
    if layout_map is None:
        mesh = DeviceMesh(
            shape=(num_replicas, logical), axis_names=["batch", "model"],
            devices=np.array([jax_engine.device_name(d) for d in devices]
                             ).reshape(num_replicas, logical))
        layout_map = LayoutMap(mesh)
    elif tuple(layout_map.device_mesh.shape) != (num_replicas, logical):
        raise ValueError(
            f"The layout_map's mesh has shape {layout_map.device_mesh.shape}"
            f" but the device assignment is {num_replicas} replicas x "
            f"{logical} logical devices. Build the LayoutMap on a "
            f"DeviceMesh of shape ({num_replicas}, {logical}).")
    return jax_engine.JaxTpuEngine(devices, layout_map, logical,
                                   services=services)


def _check_same_cluster(resolver: ClusterResolver, timeout_s: float) -> None:
    """Refuses, in every process alike, a job whose processes were given
    different cluster descriptions (#43: a worker told of 3 processes
    trained beside a coordinator told of 2, and both exited 0), through
    JAX's coordination service (`keras_distribute.job.cluster_agreement`).
    JAX itself then aborts each process at exit (a job formed with
    different task counts cannot pass its shutdown barrier)."""
    from jax._src import distributed

    from keras_distribute.job import cluster_agreement

    client = getattr(distributed.global_state, "client", None)
    if client is None or not hasattr(client, "blocking_key_value_get"):
        return  # another JAX: the process count check below remains
    store = cluster_agreement.CoordinationServiceStore(
        set_once=client.key_value_set,
        set_over=lambda key, text: client.key_value_set(
            key, text, allow_overwrite=True),
        get_waiting=client.blocking_key_value_get)
    cluster_agreement.check_same_cluster(
        store, resolver.process_id,
        min(jax.process_count(), resolver.num_processes),
        cluster_agreement.describe(resolver), max(timeout_s, 10))
    if jax.process_count() != resolver.num_processes:
        raise ValueError(
            f"jax.distributed formed a job of {jax.process_count()} "
            f"processes but the cluster resolver describes "
            f"{resolver.num_processes}. Received: {resolver!r}. Start every "
            "worker with the same cluster description.")


class _CoordinationText:
    """JAX's coordination service (its key-value store) as the peer
    board's text store."""

    def __init__(self, client: Any):
        self._client = client

    def set(self, key: str, text: str) -> None:
        self._client.key_value_set(key, text, allow_overwrite=True)

    def get(self, key: str) -> Optional[str]:
        try:
            return self._client.key_value_try_get(key)
        except Exception:  # not there (yet)
            return None


def _watch_peers(rank: int, world_size: int, timeout_s: float,
                 host: Optional[str] = None,
                 store_address: Optional[str] = None) -> None:
    """Names a peer that hangs while this process waits for it.

    JAX's coordination service aborts a process whose peer died or froze,
    but a peer that is alive and never reaches the collective (stuck in a
    callback only it runs) leaves the others waiting in native code without
    end. The peer board's watchdog sees this process's steps stall for the
    timeout while a live peer lags, says which, and ends this process (no
    Python exception can reach a thread waiting in XLA)."""
    import atexit

    from jax._src import distributed

    from keras_distribute.job import peer_board

    client = getattr(distributed.global_state, "client", None)
    if client is None or not hasattr(client, "key_value_try_get"):
        return  # another JAX: no board, the launcher's timeout remains
    peer_board.start(_CoordinationText(client), rank, world_size, timeout_s,
                     on_stall=peer_board.ending_this_process("JAX"),
                     host=host, store_address=store_address,
                     note_silent_peers=True)
    atexit.register(peer_board.stop)  # before JAX's own shutdown (LIFO)


def _coordinator_beside_the_store(resolver: Any, coordinator: str) -> str:
    """JAX's coordinator address when a store holds MASTER_PORT.

    Under torchrun, the agent's TCP store listens on MASTER_PORT (a port
    torchrun took from the kernel's ephemeral range, where the next port
    may be any connection's source port by the time process 0 binds it):
    process 0 picks a free port below that range (`job.ports`) and tells
    the others through the agent's store, under a key of this run and
    restart. Elsewhere (Ray's TorchTrainer, whose group's store holds the
    port) the coordinator takes the next port, the same on every host
    (docs/multi_worker.md).
    """
    import datetime
    import os

    host, _, port = coordinator.rpartition(":")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return f"{host}:{int(port) + 1}"
    from torch.distributed import TCPStore

    from keras_distribute.job import ports

    store = TCPStore(host.strip("[]"), int(port), is_master=False,
                     timeout=datetime.timedelta(seconds=120))
    key = (f"keras_distribute/jax_coordinator_port/{run_id}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if resolver.process_id == 0:
        chosen = ports.free_port()
        store.set(key, str(chosen))
    else:
        chosen = int(store.get(key))
    return f"{host}:{chosen}"
