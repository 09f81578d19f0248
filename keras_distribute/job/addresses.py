"""Which of a job's addresses belong to this machine (framework-free).

Used to bind a job's servers to the process's own address only, to name a
process by its address in messages, and to have gloo talk over the
interface that holds it.
"""

import socket
from typing import Any, Optional


def host_of(resolver: Any) -> Optional[str]:
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
