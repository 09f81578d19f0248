"""Ports for a job's servers, chosen where no other connection takes them.

Framework-free: the launcher (`launch.processes`) and the engines (a JAX
coordinator under torchrun) choose ports here.
"""

import random
import socket
from typing import Optional

# Where ports for a job are looked for: below the kernel's ephemeral range.
PORT_SEARCH_SPAN = 16384
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low() -> Optional[int]:
    """The first port of Linux's ephemeral range, or None where unknown."""
    try:
        with open(_EPHEMERAL_RANGE) as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, for a job to bind later.

    A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from its
    ephemeral range, the range it also takes the source port of every
    outgoing connection from: between this call and the moment a process
    of the job binds the port, any connection on the machine could take
    it (seen in CI: "the job's coordinator port ... is already in use").
    On Linux the port is therefore drawn at random from the
    `PORT_SEARCH_SPAN` ports below that range, which the kernel never hands
    out by itself, and checked to be free; elsewhere (or when none of the
    tries is free) the kernel picks one.

    Returns:
        A port number.

    Example:

    >>> port = free_port()
    """
    low = _ephemeral_low()
    if low is not None and low > 1024 + 64:
        start = max(1024, low - PORT_SEARCH_SPAN)
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(start, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
