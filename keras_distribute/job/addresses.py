"""Which of a job's addresses belong to this machine (framework-free).

Used to bind a job's servers to the process's own address only, to name a
process by its address in messages, and to have gloo talk over the
interface that holds it.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING
from typing import Optional

if TYPE_CHECKING:
    from keras_distribute.cluster_resolver.base import ClusterResolver


def host_of(resolver: ClusterResolver) -> Optional[str]:
    """The host of this process's own address in `resolver`'s cluster
    description (e.g. "10.0.0.2") when it is an address of this machine,
    else `None` (then the board names the host name: a torchrun
    description lists only the coordinator's address)."""
    try:
        own = resolver.addresses[resolver.process_id]
    except IndexError:
        return None
    return local_host(own)


def local_host(address: str) -> Optional[str]:
    """The IP address that `address`'s host ("host:port") resolves to when
    it is an address of this machine, else `None`."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, kind, protocol, _, sockaddr in infos:
        with socket.socket(family, kind, protocol) as probe:
            try:
                probe.bind(sockaddr)  # port 0: only asks whether it is ours
            except OSError:
                continue
        return str(sockaddr[0])
    return None


def refuse_taken_port(host: str, port: int, server: str, fix: str) -> None:
    """Raises when `port` cannot be listened on at `host` on this machine.

    Checked before a framework starts a server there: taken, the port gave
    JAX's coordinator a segmentation fault and TensorFlow's server only
    "Could not start gRPC server", naming neither port nor cause. A bind
    with SO_REUSEADDR, as the servers do, then closed at once: a port only
    in TIME_WAIT is not refused. Nothing is checked for a host that is not
    an address of this machine ("0.0.0.0" stands for every interface).

    Args:
        host: The address the server will listen on.
        port: Its port.
        server: What will listen there, for the message (e.g. "the JAX
            coordinator of this job (process 0)").
        fix: How to choose another port, for the message.

    Raises:
        OSError: (EADDRINUSE) naming the address, the server and the fix.

    Example:

    ```python
    refuse_taken_port("127.0.0.1", 12345, "the job's store",
                      "set MASTER_PORT to a free port")
    ```
    """
    import errno

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return
    for family, kind, protocol, _, sockaddr in infos:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    continue  # not an address of this machine
                raise OSError(
                    errno.EADDRINUSE,
                    f"Port {port} on {host} is already in use on this "
                    f"machine, so {server} cannot listen there. End the "
                    f"process that holds it (another job, or an earlier run "
                    f"of this one still ending) or {fix}.") from None
            return
