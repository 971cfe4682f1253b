"""Agent links (tp_launch.agent.links): a node is dead when the connection this agent
opened to its published endpoint ends or is reset without ``bye``, or is refused;
anything else is no evidence. Real sockets on loopback; the last case SIGKILLs a real
process holding the other end."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO
from tp_launch.agent.links import AgentLinks, format_endpoint, parse_endpoint


class Pokes:
    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self) -> None:
        self.event.set()


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def links():
    made: list[AgentLinks] = []

    def make(poke=None) -> AgentLinks:
        made.append(AgentLinks("127.0.0.1", poke or (lambda: None)))
        return made[-1]

    yield make
    for one in made:
        one.close()


def listening() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    return sock, format_endpoint("127.0.0.1", sock.getsockname()[1])


def linked(links, poke=None) -> tuple[AgentLinks, socket.socket, socket.socket]:
    """(links watching node "b", b's listener, b's end of the connection they made)."""
    me = links(poke)
    server, endpoint = listening()
    me.watch({"b": endpoint})
    peer, _ = server.accept()
    return me, server, peer


@pytest.mark.unit
def test_endpoints_parse_or_are_refused():
    assert parse_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    assert parse_endpoint(format_endpoint("::1", 5)) == ("::1", 5)
    for bad in ("", "host", "host:", ":80", "h:0", "h:65536", "h:-1", "h:8x", "x" * 300 + ":1"):
        assert parse_endpoint(bad) is None, bad


@pytest.mark.unit
def test_a_peer_whose_socket_closes_without_bye_is_dead(links):
    poke = Pokes()
    me, server, peer = linked(links, poke)
    time.sleep(0.1)
    assert me.dead() == set() and not poke.event.is_set()  # connected, quiet: alive
    peer.close()  # what the kernel does for a process that died
    assert poke.event.wait(10)
    assert me.dead() == {"b"}
    server.close()


@pytest.mark.unit
def test_a_reset_is_death_too(links):
    me, server, peer = linked(links)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    peer.close()  # linger 0: RST
    wait_for(lambda: me.dead() == {"b"})
    server.close()


@pytest.mark.unit
def test_a_peer_that_leaves_on_purpose_says_bye_and_is_not_dead(links):
    me, other = links(), links()
    me.watch({"other": other.endpoint})
    other.watch({"me": me.endpoint})
    wait_for(lambda: len(other._accepted) == 1 and len(me._accepted) == 1)
    other.close()
    time.sleep(0.5)
    assert me.dead() == set()


@pytest.mark.unit
def test_a_refused_or_unanswered_endpoint_is_no_evidence(links):
    """A firewall that rejects answers as a host with nothing listening does (here a
    TEST-NET address is refused): only a connection made and then lost counts. Once
    the endpoint listens, the connection is made, and its loss counts."""
    me = links()
    server, endpoint = listening()
    port = server.getsockname()[1]
    server.close()  # nothing listens there for now: the kernel refuses
    me.watch({"refused": endpoint, "silent": "192.0.2.1:9", "bad": "no port"})
    time.sleep(0.5)
    assert me.dead() == set()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(4)
    server.settimeout(10)
    peer, _ = server.accept()  # tried again
    peer.close()
    wait_for(lambda: me.dead() == {"refused"})
    server.close()


@pytest.mark.unit
def test_a_loopback_endpoint_is_not_linked_from_a_routable_address(links):
    """A node whose name resolved to 127.0.1.1 on its machine: from a node listening on a
    routable address, that endpoint is some process of this machine, never linked."""
    me = AgentLinks("0.0.0.0", lambda: None)  # any routable-looking address here
    try:
        server, endpoint = listening()
        me.watch({"b": endpoint})
        server.settimeout(0.5)
        with pytest.raises(socket.timeout):
            server.accept()
        assert me.dead() == set()
        server.close()
    finally:
        me.close()


@pytest.mark.unit
def test_strangers_on_the_listener_change_nothing(links):
    me = links()
    host, port = parse_endpoint(me.endpoint)
    strangers = [socket.create_connection((host, port)) for _ in range(5)]
    strangers[0].sendall(b"bye\n" * 100)
    for s in strangers:
        s.close()
    wait_for(lambda: not me._accepted)
    assert me.dead() == set()


@pytest.mark.unit
def test_a_node_no_longer_watched_is_let_go(links):
    me, server, peer = linked(links)
    me.watch({})
    time.sleep(0.3)
    peer.close()
    time.sleep(0.3)
    assert me.dead() == set()
    server.close()


def test_an_agent_process_sigkilled_is_dead_at_once(links):
    """The other end held by a real process, SIGKILLed: its kernel closes the socket."""
    code = ("import sys, time; from tp_launch.agent.links import AgentLinks; "
            "l = AgentLinks('127.0.0.1', lambda: None); print(l.endpoint, flush=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        endpoint = proc.stdout.readline().strip()
        poke = Pokes()
        me = links(poke)
        me.watch({"b": endpoint})
        time.sleep(0.3)
        assert me.dead() == set()
        proc.send_signal(signal.SIGKILL)
        assert poke.event.wait(10)
        assert me.dead() == {"b"}
    finally:
        proc.kill()
        proc.wait()
