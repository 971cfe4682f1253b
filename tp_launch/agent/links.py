"""Agent-to-agent links: a node whose agent died is seen as soon as its sockets close.

A node's lease (:mod:`rendezvous.lease`) says it is gone only when it expires:
``lease_ttl``, 3 s in resilient mode. That is the only evidence a host that *vanished*
gives (its link cut, its power gone: no FIN, no RST). A host whose processes *died* (the
host SIGKILLed, the OOM killer, a crashed agent; its ranks and spares die with its agent)
gives more, at once: its kernel closes every socket the agent held.

Each agent of a multi-node resilient job listens on its node's address (the one the
other nodes reach it at) and publishes the endpoint on its lease (``P/link/<node>``,
:meth:`rendezvous.membership.Membership.set_link`). Each agent connects to every other
node's endpoint and reads from that connection; the other end never writes, except
``bye`` when its agent closes its links on purpose (an attempt ending, the job done, a
stop). So, on a connection this agent made to the endpoint a node published:

- end of stream or a reset without ``bye`` first, once connected: that node's agent
  process is gone (only its kernel closes a socket it did not close itself, and nothing
  is ever sent on it that a middlebox could answer with a reset). The node is *dead*: :meth:`AgentLinks.dead` lists it and the agent
  is poked (``poke``), so that it reads the job's view at once, where the node counts as
  not alive (:meth:`tp_launch.agent.generations.SharedGenerations.view`): its ranks move
  as they would once its lease expired, about ``lease_ttl`` sooner.
- anything else: no evidence; the lease decides, as before. A connection that never
  completes, a network error, and also a *refused* connection: a firewall that rejects
  answers the same as a host with nothing listening (measured here: a TEST-NET address
  was refused). Such a connection is tried again every :data:`RETRY_S`. A vanished host
  is still seen through its lease only.

Why this cannot take a live node for lost: the only bytes that matter are an end of
stream or a reset on a connection *this* agent opened to the endpoint the node
published in the rendezvous (whoever can write there can already forge the job's
state); a stranger connecting to a listener is only read and dropped (and capped). A
node whose agent is gone loses its lease within ``lease_ttl`` anyway: the link only
brings the same decision forward. If it were ever wrong (an on-path reset forged
between two live agents), the node is treated exactly as a node back from a partition:
fenced, its ranks stopped, the job right (see docs/architecture.md).

A node's dead mark holds for the life of the links object (an attempt); a restarted
agent is a new member with a new id.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import selectors
import socket
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

BYE = b"bye\n"
# Connections accepted from anyone at most (each node opens one; the rest are strangers).
MAX_ACCEPTED = 1024
# Seconds before a connection that could not be made is tried again.
RETRY_S = 1.0


def parse_endpoint(text: str) -> tuple[str, int] | None:
    """``host:port`` (the host may be a bracketed IPv6 address); None if malformed."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or len(host) > 255 or not port.isdigit() or \
            not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Out:
    """A connection this agent opened to a node's published endpoint."""

    def __init__(self, node: str, endpoint: str, sock: socket.socket) -> None:
        self.node, self.endpoint, self.sock = node, endpoint, sock
        self.connected = False
        self.said_bye = False
        self.buf = b""


class AgentLinks:
    """This agent's listener and its connections to the other nodes' agents.

    Args:
        addr: the address the other nodes reach this node at (the listener binds it).
        poke: called (from the links' thread) when a node is found dead.
    """

    def __init__(self, addr: str, poke: Callable[[], None]) -> None:
        self._poke = poke
        self._lock = threading.Lock()
        self._dead: set[str] = set()
        self._want: dict[str, str] = {}  # node -> its endpoint (set by watch())
        self._closing = False
        # The thread's own:
        self._out: dict[str, _Out] = {}
        self._retry_at: dict[str, float] = {}  # node -> when to try connecting again
        self._accepted: set[socket.socket] = set()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind(sockaddr[:2])
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            raise
        self._listener.setblocking(False)
        self.endpoint = format_endpoint(str(sockaddr[0]), self._listener.getsockname()[1])
        self._loopback = _is_loopback(str(sockaddr[0]))
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="tp-run-links", daemon=True)
        self._thread.start()

    def dead(self) -> set[str]:
        """The nodes whose agent is gone (their sockets closed without ``bye``)."""
        with self._lock:
            return set(self._dead)

    def watch(self, endpoints: dict[str, str]) -> None:
        """Hold a connection to each node's published endpoint (node -> ``host:port``;
        this node's own is left out by the caller). A node not listed any more is let go;
        a node whose endpoint changed is connected to afresh."""
        with self._lock:
            self._want = dict(endpoints)
        self._wake()

    def close(self) -> None:
        """Say ``bye`` on every accepted connection (the others' agents must not take
        this node for dead when it leaves on purpose), then close everything."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout=5)
        for sock in list(self._accepted):
            try:
                sock.setblocking(True)
                sock.settimeout(0.2)
                sock.sendall(BYE)
            except OSError:
                pass
            sock.close()
        self._accepted.clear()
        for out in self._out.values():
            out.sock.close()
        self._out.clear()
        self._listener.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ the thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"!")
        except OSError:  # full: already awake; closed: closing
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closing:
                    return
                want, dead = dict(self._want), set(self._dead)
            self._reconcile(want, dead)
            for key, events in self._sel.select(timeout=RETRY_S):
                try:
                    self._handle(key, events)
                except Exception:  # noqa: BLE001 - the thread must outlive one socket
                    logger.debug("links: %s", key.data, exc_info=True)

    def _handle(self, key: selectors.SelectorKey, events: int) -> None:
        what = key.data
        if what == "wake":
            try:
                while self._wake_r.recv(512):
                    pass
            except OSError:
                pass
        elif what == "accept":
            self._accept()
        elif isinstance(what, _Out):
            self._on_out(what, events)
        else:  # an accepted connection: read and drop; gone when it ends
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._sel.unregister(sock)
                self._accepted.discard(sock)
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: try at the next readiness
                logger.debug("links: accept: %s", e)
                return
            if len(self._accepted) >= MAX_ACCEPTED:
                sock.close()
                continue
            sock.setblocking(False)
            self._accepted.add(sock)
            self._sel.register(sock, selectors.EVENT_READ, "in")

    def _reconcile(self, want: dict[str, str], dead: set[str]) -> None:
        """Connections to exactly the wanted endpoints (none to a dead node)."""
        for node in [n for n, out in self._out.items() if want.get(n) != out.endpoint]:
            self._drop(node)
        now = time.monotonic()
        for node, endpoint in want.items():
            if node not in self._out and node not in dead and \
                    now >= self._retry_at.get(node, 0.0):
                self._connect(node, endpoint)

    def _connect(self, node: str, endpoint: str) -> None:
        self._retry_at[node] = time.monotonic() + RETRY_S
        where = parse_endpoint(endpoint)
        if where is None:
            return
        try:
            infos = socket.getaddrinfo(where[0], where[1], type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            logger.debug("links: %s at %s: %s", node, endpoint, e)
            return
        if _is_loopback(str(sockaddr[0])) and not self._loopback:
            # Another node's name resolved to a loopback address there (127.0.1.1 on
            # Debian): here it would be some process of this machine's. Not its agent.
            sock.close()
            return
        sock.setblocking(False)
        out = _Out(node, endpoint, sock)
        err = sock.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS):
            sock.close()  # refused, unreachable...: no evidence; tried again later
            return
        out.connected = err == 0
        self._out[node] = out
        events = selectors.EVENT_READ if out.connected else selectors.EVENT_WRITE
        self._sel.register(sock, events, out)

    def _on_out(self, out: _Out, events: int) -> None:
        sock = out.sock
        if not out.connected:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err == 0:
                out.connected = True
                self._sel.modify(sock, selectors.EVENT_READ, out)
                return
            self._drop(out.node)
            if err == errno.ECONNRESET:  # connected, then reset (a refusal: ECONNREFUSED)
                self._found_dead(out.node, "its agent's connection was reset")
            return  # else no evidence; tried again later
        try:
            data = sock.recv(64)
        except BlockingIOError:
            return
        except OSError as e:
            self._drop(out.node)
            if e.errno == errno.ECONNRESET and not out.said_bye:
                self._found_dead(out.node, "its agent's connection was reset")
            return
        if data:
            out.buf = (out.buf + data)[-len(BYE):]
            out.said_bye = out.said_bye or out.buf == BYE
            return
        self._drop(out.node)
        if not out.said_bye:
            self._found_dead(out.node, "its agent's connection closed")

    def _drop(self, node: str) -> None:
        out = self._out.pop(node, None)
        if out is not None:
            self._sel.unregister(out.sock)
            out.sock.close()

    def _found_dead(self, node: str, why: str) -> None:
        with self._lock:
            if node in self._dead:
                return
            self._dead.add(node)
        logger.warning("node %s: %s: its agent is gone", node, why)
        self._poke()
