"""Hosting the workers' TCPStore from the agent, one fresh store per round.

The listening socket is bound at once (so the port is known and reserved), and
``torch.distributed.TCPStore`` takes it over through ``master_listen_fd`` on a
background thread. The agent can therefore spawn its workers before it has imported
torch itself: the workers' own ``import torch`` (1-2 s) overlaps the agent's, and their
store connections wait in the socket's backlog until the store serves them.

A TCPStore has no authentication: whoever reaches its port can read and write every
key. So the store listens only on the address its clients are told (the workers'
MASTER_ADDR, or this node's ``--local-addr`` for a multi-node job's stores), never on
every interface: a single-node job's store (MASTER_ADDR ``localhost`` by default) is
reachable from this machine only.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
from typing import Any

# Workers may take long to reach init_process_group; the store must not give up first.
_STORE_TIMEOUT = datetime.timedelta(hours=2)


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to the first address ``host`` resolves to that this machine
    has (IPv6 or IPv4, as the resolver orders them), never to every interface: only
    the workers and agents that are told ``host`` need to reach the store, and a
    TCPStore serves anyone who can connect.

    A client that resolves ``host`` the same way reaches it: torch's TCPStore client
    tries every address of the name (IPv4 ones also as IPv4-mapped IPv6 addresses).
    """
    if not host:
        raise OSError("cannot host the store: no address to bind")
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot host the store on {host}:{port}: {e.strerror}") from None
    error = "no address"
    for family, kind, proto, _, sockaddr in addrs:
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.set_inheritable(False)
        try:
            sock.bind(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e.strerror or str(e)
    raise OSError(f"cannot host the store on {host}:{port}: {error}")


def loopback_only(host: str) -> bool:
    """True if every address ``host`` resolves to here is a loopback address (a
    machine whose own name maps to 127.0.1.1, say); False if it does not resolve."""
    try:
        addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


class StoreHost:
    """A TCPStore server on ``(host, port)``; port 0 picks a free port.

    Args:
        host: the name or address its clients are given (MASTER_ADDR, this node's
            ``--local-addr``): the store listens on that address only.
        port: port to bind, 0 for any free port.

    Raises:
        OSError: ``host`` does not resolve to an address of this machine, or the port
            is taken (one line).
    """

    def __init__(self, host: str, port: int) -> None:
        self._sock = _bound_socket(host, port)
        self._sock.listen(1024)
        self.addr: str = self._sock.getsockname()[0]  # the address bound, numeric
        self.port: int = self._sock.getsockname()[1]
        self._store: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tp-store-host", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            from torch.distributed import TCPStore

            self._store = TCPStore(
                self.addr,  # the server's own client connects here: the bound address
                self.port,
                is_master=True,
                master_listen_fd=self._sock.fileno(),
                wait_for_workers=False,
                timeout=_STORE_TIMEOUT,
            )
        except BaseException as e:  # reported by wait_ready()
            self._error = e
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> Any:
        """Block until the store serves; return it (usable as a client by the agent)."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the store did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the store failed to start: {self._error}") from self._error
        return self._store

    def close(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        self._ready.wait()
        self._store = None  # the C++ destructor stops the server
        try:
            self._sock.close()
        except OSError:
            pass
