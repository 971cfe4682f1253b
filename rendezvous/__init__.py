"""Membership and generations for tp-run agents, over pluggable backends.

Backends register a factory under one or more names; :func:`create_handler` picks the
one a launch asks for, reading only the settings :class:`RendezvousParams` names (which
``tp_launch``'s ``LaunchConfig`` has: this package never imports ``tp_launch``, imports
run the other way). A single-node job always runs
on the embedded default (:mod:`rendezvous.static`), whatever backend was named for it,
exactly as torchrun's standalone does: nothing external is needed.

Multi-node backends: ``etcd`` (also ``etcd-v2`` and ``etcd-v3``: all speak the etcd v3
API, :mod:`rendezvous.etcd`) and ``c10d`` (a TCPStore on the endpoint host,
:mod:`rendezvous.c10d`), both running the one protocol of :mod:`rendezvous.membership`
through :class:`rendezvous.handler.MembershipRendezvous`; ``static`` keeps the world
fixed by the command line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Protocol

from rendezvous.api import RendezvousError, RendezvousHandler, RendezvousInfo
from rendezvous.grammar import split_endpoint
from rendezvous.static import StaticRendezvous

if TYPE_CHECKING:
    from rendezvous.kv import KV

__all__ = [
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParams",
    "create_handler",
    "register_backend",
]

logger = logging.getLogger(__name__)


class RendezvousParams(Protocol):
    """What a backend reads of the launch configuration (torchrun's flags), as
    ``tp_launch.config.LaunchConfig`` has it."""

    rdzv_backend: str  # static, c10d, etcd...; after standalone resolution
    rdzv_endpoint: str  # host:port of the rendezvous service ("" if none)
    rdzv_configs: dict[str, str]  # parsed --rdzv-conf
    run_id: str  # --rdzv-id
    min_nodes: int  # --nnodes MIN:MAX
    max_nodes: int
    node_rank: int  # --node-rank (static only)
    master_port: int | None  # --master-port (static only; None: 29500)
    local_addr: str | None  # --local-addr (None: this machine's name)


BackendFactory = Callable[[RendezvousParams], RendezvousHandler]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(names: list[str], factory: BackendFactory) -> None:
    """Make ``--rdzv-backend NAME`` build its handler with ``factory(config)``."""
    for name in names:
        _BACKENDS[name] = factory


def create_handler(config: RendezvousParams) -> RendezvousHandler:
    """The rendezvous handler for this launch.

    Raises:
        RendezvousError: unknown backend, or a setup it cannot run.
    """
    if config.rdzv_backend == "static":
        host, port = split_endpoint(config.rdzv_endpoint, config.master_port or 29500)
        return StaticRendezvous(config.run_id, config.max_nodes, config.node_rank, host, port)
    factory = _BACKENDS.get(config.rdzv_backend)
    if factory is None:  # (also on one node, where the backend is not used: a typo)
        raise RendezvousError(unknown_backend(config.rdzv_backend))
    if config.max_nodes == 1:
        # Single node: the embedded default. c10d's endpoint names the store (this
        # machine hosts it there, as torchrun does); etcd's names etcd, whose address is
        # not this machine's: the store is then this machine's own, on a free port.
        endpoint = config.rdzv_endpoint if config.rdzv_backend == "c10d" else ""
        host, port = split_endpoint(endpoint or "localhost:0", 29400)
        return StaticRendezvous(config.run_id, 1, 0, host, port)
    return factory(config)


def unknown_backend(name: str) -> str | None:
    """The error line for ``--rdzv-backend NAME``, or None if it is a known backend."""
    if name == "static" or name in _BACKENDS:
        return None
    known = ", ".join(sorted({"static", *_BACKENDS}))
    return f"unknown --rdzv-backend {name!r} (known: {known})"


def _membership_handler(config: RendezvousParams) -> RendezvousHandler:
    """etcd (v3, whatever the name says) or c10d: the membership protocol over a KV."""
    from rendezvous.conf import timeouts_from_conf
    from rendezvous.handler import MembershipRendezvous
    from rendezvous.kv import KVError
    from rendezvous.membership import Membership, local_address
    from rendezvous.store_host import loopback_only

    conf = config.rdzv_configs
    t = timeouts_from_conf(conf)
    prefix = conf.get("etcd_prefix", "/tp-run")
    backend = config.rdzv_backend
    # Reaching the service counts against join_timeout: an unreachable endpoint is an
    # error within the configured timeout, never a hang.
    connect = min(t.join_timeout, t.read_timeout)
    kv: KV
    try:
        if backend == "c10d":
            from rendezvous.c10d import c10d_kv_from_conf

            kv = c10d_kv_from_conf(config.rdzv_endpoint, conf, connect, prefix)
        else:
            from rendezvous.etcd import etcd_kv_from_conf

            kv = etcd_kv_from_conf(config.rdzv_endpoint, conf, connect, t.read_timeout)
    except KVError as e:
        raise RendezvousError(str(e)) from None
    addr = local_address(config.local_addr)
    if config.local_addr is None and loopback_only(addr):
        # The stores this node hosts listen on this address only (rendezvous.store_host).
        logger.warning("this node's name %s resolves to a loopback address here: other "
                       "machines cannot reach the stores it hosts; pass --local-addr with "
                       "the address they reach it at", addr)
    membership = Membership(kv, prefix, config.run_id, config.min_nodes, config.max_nodes,
                            addr, t,
                            safety_poll=min(5.0, max(0.5, t.keep_alive_interval)))
    return MembershipRendezvous(membership, backend)


# etcd-v2 is torchrun's name for its v2-API backend; etcd 3.4 disables that API by
# default and 3.6 removed it, so every etcd name here speaks v3.
register_backend(["etcd", "etcd-v2", "etcd-v3", "c10d"], _membership_handler)
