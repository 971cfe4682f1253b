"""Hosting the workers' TCPStore from the agent, one fresh store per round.

The listening socket is bound at once (so the port is known and reserved), and
``torch.distributed.TCPStore`` takes it over through ``master_listen_fd``: the workers'
store connections wait in the socket's backlog until the store serves them. Where it is
served:

- in another process that has imported torch already, when the agent was given a
  :class:`StoreServer` (the resilient agent's process template: a child forked from it
  serves the store, :mod:`tp_launch.procs.template`). The agent then never imports
  torch: 2.5-3 s of CPU per node per start, taken from the ranks starting beside it.
  If that process turns out unable to (it is given up before it served), the store is
  served here after all;
- else in the agent, on a background thread: the agent spawns its workers before torch
  is imported, and their own ``import torch`` overlaps the agent's.

A TCPStore has no authentication: whoever reaches its port can read and write every
key. So the store listens only on the address its clients are told (the workers'
MASTER_ADDR, or this node's ``--local-addr`` for a multi-node job's stores), never on
every interface: a single-node job's store (MASTER_ADDR ``localhost`` by default) is
reachable from this machine only.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

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


class StoreServer(Protocol):
    """Another process that serves stores (so that this one need not import torch)."""

    def serve_store(self, sock: socket.socket, addr: str, port: int,
                    fallback: Callable[[], None]) -> Callable[[], None] | None:
        """Serve the bound, listening ``sock`` (``addr``:``port``) as a TCPStore.

        Returns how to stop serving it (the port is free once it returns), or None if
        it cannot (the caller serves it). Calls ``fallback`` (once at most) if it turns
        out it cannot after all, before it served a connection.
        """


def serve(addr: str, port: int, fd: int) -> Any:
    """A TCPStore server taking over the listening socket ``fd`` (in whichever process
    serves it); it serves until the returned object is dropped."""
    from torch.distributed import TCPStore

    return TCPStore(
        addr,  # the server's own client connects here: the bound address
        port,
        is_master=True,
        master_listen_fd=fd,
        wait_for_workers=False,
        timeout=_STORE_TIMEOUT,
    )


class StoreHost:
    """A TCPStore server on ``(host, port)``; port 0 picks a free port.

    Args:
        host: the name or address its clients are given (MASTER_ADDR, this node's
            ``--local-addr``): the store listens on that address only.
        port: port to bind, 0 for any free port.
        server: serves it in another process (None: on a thread of this one).

    Raises:
        OSError: ``host`` does not resolve to an address of this machine, or the port
            is taken (one line).
    """

    def __init__(self, host: str, port: int, server: StoreServer | None = None) -> None:
        self._sock = _bound_socket(host, port)
        self._sock.listen(1024)
        self.addr: str = self._sock.getsockname()[0]  # the address bound, numeric
        self.port: int = self._sock.getsockname()[1]
        self._store: Any = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_elsewhere: Callable[[], None] | None = None
        if server is not None:
            self._stop_elsewhere = server.serve_store(self._sock, self.addr, self.port,
                                                      self.serve_here)
        if self._stop_elsewhere is None:
            self.serve_here()

    def serve_here(self) -> None:
        """Serve it on a thread of this process (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="tp-store-host",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        try:
            self._store = serve(self.addr, self.port, self._sock.fileno())
        except BaseException as e:  # reported by wait_ready(), else logged
            self._error = e
            logger.error("the store on %s:%s did not start: %s", self.addr, self.port, e)
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> Any:
        """Block until the store serves (here: a host made without a server); return it
        (usable as a client by this process)."""
        if self._thread is None:
            raise RuntimeError("the store is served by another process")
        if not self._ready.wait(timeout):
            raise TimeoutError("the store did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the store failed to start: {self._error}") from self._error
        return self._store

    def close(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        if self._stop_elsewhere is not None:
            self._stop_elsewhere()
            self._stop_elsewhere = None
        if self._thread is not None:
            self._ready.wait()
            self._store = None  # the C++ destructor stops the server
        try:
            self._sock.close()
        except OSError:
            pass
