"""The rendezvous store a run hosts, listening on the one interface its ranks use.

torch's ``TCPStore`` server listens on every interface of the machine, and anyone who reaches the port can read
and write the run's keys. A run on one machine needs loopback only; a run across machines needs the interface
that its launcher named (``MASTER_ADDR``). The store is handed a socket already bound there
(``master_listen_fd``).
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"


def hosted_store(host: str, port: int, world_size: int | None = None, timeout: timedelta = timedelta(seconds=300),
                 wait_for_workers: bool = False, one_machine: bool = True) -> Any:
    """A ``TCPStore`` server on ``host:port`` (0: a free port, then ``store.port``) listening on the address
    ``host`` resolves to. Where that is a loopback address of a run across machines (a host name that this
    machine's hosts file maps to 127.0.1.1), or not an address of this machine, it listens on every interface,
    as torch does: the other machines reach it by another address."""
    from torch.distributed import TCPStore

    listener = _bound(host, port, one_machine)
    if listener is None:
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers)
    bound_port = listener.getsockname()[1]
    return TCPStore(host, bound_port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                    master_listen_fd=listener.detach())  # the store closes it when it is destroyed


def _bound(host: str, port: int, one_machine: bool) -> socket.socket | None:
    """A socket listening on ``host``'s address and ``port``; None where it should listen everywhere."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError):
        return None
    if ipaddress.ip_address(address[0].split("%")[0]).is_loopback and not one_machine:
        return None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError:  # not an address of this machine (a NAT's), or the port is taken: torch's own error then
        listener.close()
        return None
    return listener
