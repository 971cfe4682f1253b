"""Hosting the workers' TCPStore from the agent, one fresh store per round.

The listening socket is bound at once (so the port is known and reserved), and
``torch.distributed.TCPStore`` takes it over through ``master_listen_fd`` on a
background thread. The agent can therefore spawn its workers before it has imported
torch itself: the workers' own ``import torch`` (1-2 s) overlaps the agent's, and their
store connections wait in the socket's backlog until the store serves them.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from typing import Any

logger = logging.getLogger(__name__)

# Workers may take long to reach init_process_group; the store must not give up first.
_STORE_TIMEOUT = datetime.timedelta(hours=2)


def _bound_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to ``addr``; "" (every interface) is dual-stack where possible,
    so workers reach the store whether MASTER_ADDR is an IPv4 or an IPv6 address."""
    if ":" in addr or (not addr and socket.has_dualstack_ipv6()):
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        if not addr:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            addr = "::"
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.set_inheritable(False)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot host the store on {addr}:{port}: {e.strerror}") from None
    return sock


class StoreHost:
    """A TCPStore server on ``(addr, port)``; port 0 picks a free port.

    Args:
        addr: address to bind ("" or "0.0.0.0": every interface).
        port: port to bind, 0 for any free port.
    """

    def __init__(self, addr: str, port: int) -> None:
        self._sock = _bound_socket(addr, port)
        self._sock.listen(1024)
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
                "localhost",
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
