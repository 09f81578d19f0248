"""The torch process group of a kd job: joined from the environment
(torchrun, `kd.launch`) or from a cluster resolver, keyed by torchrun's
restart attempt, and ended together at exit."""

from __future__ import annotations

import datetime
import errno
import os
import socket
from typing import TYPE_CHECKING
from typing import Any
from typing import Optional

import torch
import torch.distributed as dist

from keras_distribute.backend.torch import peers as torch_peers
from keras_distribute.common.cross_device_ops import communication_timeout_s
from keras_distribute.job import addresses
from keras_distribute.job import cluster_agreement

if TYPE_CHECKING:
    from keras_distribute.cluster_resolver.base import ClusterResolver

# How long a process leaving normally waits at exit for the others.
_EXIT_BARRIER_S = 10.0


def _destroy_own_group() -> None:
    """At exit: ends the process group kd started, every process together.

    Left to interpreter shutdown, gloo's threads were destroyed while still
    joinable ("terminate called without an active exception", SIGABRT);
    destroyed at exit by each process on its own, a process could still be
    tearing its group down when a peer had already closed its connections
    (seen in CI: the later process aborted). Processes leaving normally
    first meet at a bounded barrier (a peer that crashed or is still busy
    only delays the exit by `_EXIT_BARRIER_S`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    torch_peers.stop()
    try:
        if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            dist.monitored_barrier(timeout=datetime.timedelta(
                seconds=_EXIT_BARRIER_S), wait_all_ranks=True)
    except Exception:  # a peer is gone: leave without waiting for it
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # exiting anyway: nothing left to protect
        pass


def _init_process_group(address: str, rank: int, world_size: int,
                        timeout_s: float, store: Any = None,
                        backend: str = "gloo",
                        own_address: Optional[str] = None,
                        description: Optional[str] = None) -> None:
    """`dist.init_process_group` on a store kd holds (when `store` is
    `None`: a TCP store at `address` hosted by rank 0, or an in-process
    one for a group of one), with the
    heartbeat that names a lost peer (`torch_peers`), ended at interpreter
    exit (once). With `own_address` (this process's `host:port` in the
    cluster description), gloo talks over the interface that holds it; with
    `description` (the cluster as this process was told it), every process
    checks first that all were told the same (`cluster_agreement`)."""
    import atexit

    if backend == "gloo" and own_address and world_size > 1:
        _use_interface_of(own_address)

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None and world_size == 1:
        # Alone: nobody to meet, so no port to bind (the default 29500 may
        # be another job's, e.g. a test run beside this one).
        store = dist.HashStore()
    elif store is None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if rank == 0:
            store = dist.TCPStore(
                host, int(port), world_size, is_master=True, timeout=timeout,
                wait_for_workers=True,
                master_listen_fd=_listening_socket(host, int(port)))
        else:
            store = _store_client(host, int(port), world_size, timeout_s,
                                  f"process {rank} of {world_size}")
    if description is not None and world_size > 1:
        cluster_agreement.check_same_cluster(
            _StoreAgreement(store), rank, world_size, description, timeout_s)
    dist.init_process_group(backend=backend, store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    own_host = addresses.local_host(own_address) if own_address else None
    torch_peers.start(store, rank, world_size, timeout_s, host=own_host,
                      store_address=address)
    atexit.register(_destroy_own_group)


def _store_client(host: str, port: int, world_size: int, timeout_s: float,
                  who: str) -> Any:
    """A client of the job's TCP store at `host:port`, within the timeout.

    torch's client bounds its connection attempts but not the handshake
    after them: when the port was held by some other program (another job,
    or anything listening there while this job's process 0 could not
    start), the client waited for an answer without end (#43: > 140 s).
    It is made in a daemon thread (torch releases the GIL while it waits),
    so a store that never answers ends this call, naming the address.

    Raises:
        TimeoutError: when no store answered at `host:port` in time.
        RuntimeError: torch's own error (e.g. nothing listened there).
    """
    import threading

    made: dict = {}

    def connect():
        try:
            made["store"] = dist.TCPStore(
                host, port, world_size, is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s))
        except BaseException as error:  # handed to the waiting thread
            made["error"] = error

    thread = threading.Thread(target=connect, daemon=True,
                              name="keras_distribute-store-client")
    thread.start()
    thread.join(timeout_s + 5)
    if "error" in made:
        raise made["error"]
    if "store" not in made:
        raise TimeoutError(
            f"{who} reached the job's store at {host}:{port} but had no "
            f"answer from it within {timeout_s:.0f} s: something other than "
            "this job's process 0 seems to hold that port (another job or "
            "program, while process 0 could not start there). Read process "
            "0's error, then free the port or choose another (MASTER_PORT, "
            "or the launcher's --port).")
    return made["store"]


class _StoreAgreement:
    """torch's store as the cluster agreement's store
    (`keras_distribute.job.cluster_agreement`)."""

    def __init__(self, store: Any):
        self._store = store

    def claim(self, key: str) -> bool:
        return int(self._store.add(key, 1)) == 1

    def publish(self, key: str, text: str) -> None:
        self._store.set(key, text)

    def fetch(self, key: str, timeout_s: float) -> Optional[str]:
        # The store's own timeout (the job's) bounds the wait.
        try:
            return bytes(self._store.get(key)).decode()
        except Exception:  # torch's store timed out waiting for it
            return None


def _use_interface_of(address: str) -> None:
    """Has gloo use the network interface that holds `address`'s host.

    Gloo otherwise takes the address its host name resolves to, which is a
    loopback address on many machines (Debian's /etc/hosts): across hosts,
    each process then told the others to connect to 127.0.0.1, and the
    group never formed. Left as it is when the user set
    `GLOO_SOCKET_IFNAME`, or when the host is not an IPv4 address of this
    machine (a name, or torchrun's MASTER_ADDR for another process)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    host = address.rpartition(":")[0].strip("[]")
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return
    interface = _interface_holding(ip)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _interface_holding(ip: str) -> Optional[str]:
    """The name of this machine's interface whose IPv4 address is `ip`."""
    try:
        import fcntl
        import struct
    except ImportError:  # not POSIX
        return None
    if ip.startswith("127."):
        return "lo" if "lo" in {n for _, n in socket.if_nameindex()} else None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), siocgifaddr,
                                    struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == ip:
                return name
    return None


def _listening_socket(host: str, port: int) -> Optional[int]:
    """The file descriptor of a socket listening on `host`'s own address,
    for the job's store (torch's TCPStore otherwise listens on every
    interface, whatever its host: a one-host job then accepted connections
    from the network it never needed). `None` when `host` is not an
    address of this machine (torch's default then applies).

    Raises:
        OSError: when the port is taken, naming it as the cause (torch's
            own error said only that workers did not join).
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, kind, protocol, _, address in addresses:
        listener = socket.socket(family, kind, protocol)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(address)
        except OSError as error:
            listener.close()
            if error.errno == errno.EADDRINUSE:
                raise OSError(
                    error.errno,
                    f"The job's coordinator port {port} on {host} is "
                    "already in use, so process 0 cannot host the job's "
                    f"store there. Received: address '{host}:{port}'. End "
                    "the process that holds it (another job, or a second "
                    "process of this one also given index 0 as RANK / task "
                    "index) or choose a free port (MASTER_PORT, or the "
                    "launcher's --port)."
                ) from error
            continue  # not an address of this machine
        listener.listen(1024)
        return listener.detach()  # the store owns it from now on
    return None


def _store_of_this_attempt(address: str, timeout_s: float) -> Any:
    """Under torchrun, a client of its agent's store whose keys belong to
    this restart attempt; `None` elsewhere.

    torchrun keeps one store for the whole job, and torch's own rendezvous
    reads it without a per-attempt prefix: after `--max-restarts` restarted
    the processes, gloo found the addresses the dead attempt had published
    and every process failed connecting to them ("Connection refused").
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"keras_distribute/attempt-{attempt}", store)


def ensure_process_group() -> bool:
    """Joins the torchrun-style group of this process; `False` when alone."""
    from keras_distribute.cluster_resolver import resolvers as cluster_resolver

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if not cluster_resolver.TorchElasticClusterResolver.detect():
        return False
    # Checks every variable (a clear error for a partial environment).
    resolver = cluster_resolver.TorchElasticClusterResolver()
    if resolver.num_processes <= 1:
        return False
    local_rank = resolver.local_rank
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    timeout_s = communication_timeout_s()
    _init_process_group(
        resolver.coordinator_address, resolver.process_id,
        resolver.num_processes, timeout_s,
        store=_store_of_this_attempt(resolver.coordinator_address, timeout_s),
        backend="nccl" if use_cuda else "gloo",
        description=cluster_agreement.describe(resolver))
    return True


def join_process_group(resolver: ClusterResolver,
                       timeout_s: Optional[float]) -> None:
    """Joins (or checks) the group `resolver` describes."""
    timeout_s = communication_timeout_s(timeout_s)
    if dist.is_initialized():
        if dist.get_world_size() != resolver.num_processes:
            raise ValueError(
                f"This process already belongs to a group of "
                f"{dist.get_world_size()} processes, but the cluster "
                f"resolver describes {resolver.num_processes}. Received: "
                f"{resolver!r}.")
    else:
        local_rank = int(getattr(resolver, "local_rank", os.environ.get(
            "LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0))))
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(local_rank)
        store = _store_of_this_attempt(resolver.coordinator_address,
                                       timeout_s)
        try:
            _init_process_group(
                resolver.coordinator_address, resolver.process_id,
                resolver.num_processes, timeout_s, store=store,
                backend="nccl" if use_cuda else "gloo",
                own_address=resolver.addresses[resolver.process_id],
                description=cluster_agreement.describe(resolver))
        except (RuntimeError, TimeoutError) as error:
            raise TimeoutError(
                f"Not every worker joined within {timeout_s:.0f} s: process "
                f"{resolver.process_id} of {resolver.num_processes} waited at "
                f"the coordinator {resolver.coordinator_address}. Check that "
                "every worker was started with the same cluster description "
                "and a distinct process index, and can reach the "
                "coordinator; raise "
                "CommunicationOptions(timeout_seconds=...) for slow starts. "
                f"Cause: {error}") from error
