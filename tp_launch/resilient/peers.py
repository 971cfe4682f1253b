"""Shut this process's TCP connections to lost nodes: a vanished peer made to look closed.

A node that loses power or its network closes nothing: no FIN, no RST reaches its
peers. A survivor blocked in a gloo collective with one of its ranks (or in a store
request to a store it hosted) waits for gloo's own timeout (30 min by default), while
on one machine a dead peer's sockets close and gloo raises at once. When the agent
announces a generation that replaced lost nodes
(:attr:`tp_launch.channel.NewGeneration.lost_addrs`), the worker's link thread calls
:func:`shut_connections_to`: every TCP connection of this process whose remote address
is one of them is shut down (``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor,
so the owner's descriptor stays valid and is closed by its owner as usual). gloo's
reader then sees the end of the stream, the collective fails, and the rank goes on to
the new generation as after a peer's death on one machine.

Addresses are compared as IP addresses: a name is resolved once (numeric first; a
name that does not resolve is skipped). Known limit: only connections whose remote
address is the lost node's registered address (``--local-addr``, or its name) are
found; a node whose gloo traffic uses another interface (``GLOO_SOCKET_IFNAME``) is
waited for until gloo's timeout, as before.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Iterable

import psutil

logger = logging.getLogger(__name__)


def resolve(addrs: Iterable[str]) -> set[str]:
    """The IP addresses ``addrs`` name (unresolvable ones left out)."""
    ips: set[str] = set()
    for addr in addrs:
        try:
            infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError, OSError) as e:
            logger.warning("cannot resolve the lost node's address %r: %s", addr, e)
            continue
        ips.update(str(info[4][0]) for info in infos)
    return ips


def shut_connections_to(addrs: Iterable[str]) -> int:
    """Shut down every TCP connection of this process to ``addrs``; how many were."""
    ips = resolve(addrs)
    if not ips:
        return 0
    shut = 0
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except psutil.Error as e:
        logger.warning("cannot list this process's connections: %s", e)
        return 0
    for c in conns:
        if not c.raddr or c.raddr.ip not in ips or c.fd < 0:
            continue
        try:
            dup = os.dup(c.fd)
        except OSError:
            continue  # closed since it was listed
        try:
            with socket.socket(fileno=dup) as s:
                # The descriptor may have been closed and reused since it was listed:
                # shut it only if it still is that connection.
                if s.getpeername()[:2] != (c.raddr.ip, c.raddr.port):
                    continue
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:
            continue
    if shut:
        logger.warning("shut %d connection(s) to the lost node(s) %s", shut,
                       ", ".join(sorted(ips)))
    return shut
