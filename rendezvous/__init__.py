"""Membership and generations for tp-run agents, over pluggable backends.

Backends register a factory under one or more names; :func:`create_handler` picks the
one a :class:`~tp_launch.config.LaunchConfig` asks for. A single-node job always runs
on the embedded default (:mod:`rendezvous.static`), whatever backend was named for it,
exactly as torchrun's standalone does: nothing external is needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from rendezvous.api import RendezvousError, RendezvousHandler, RendezvousInfo
from rendezvous.static import StaticRendezvous

if TYPE_CHECKING:
    from tp_launch.config import LaunchConfig

__all__ = [
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "create_handler",
    "register_backend",
]

BackendFactory = Callable[["LaunchConfig"], RendezvousHandler]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(names: list[str], factory: BackendFactory) -> None:
    """Make ``--rdzv-backend NAME`` build its handler with ``factory(config)``."""
    for name in names:
        _BACKENDS[name] = factory


def create_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous handler for this launch.

    Raises:
        RendezvousError: unknown backend, or a setup it cannot run.
    """
    from tp_launch.config import split_endpoint

    if config.rdzv_backend == "static":
        host, port = split_endpoint(config.rdzv_endpoint, config.master_port or 29500)
        return StaticRendezvous(config.run_id, config.max_nodes, config.node_rank, host, port)
    if config.max_nodes == 1:
        # Single node: the embedded default, on the endpoint's port (0: a free one).
        host, port = split_endpoint(config.rdzv_endpoint or "localhost:0", 29400)
        return StaticRendezvous(config.run_id, 1, 0, host, port)
    factory = _BACKENDS.get(config.rdzv_backend)
    if factory is None:
        known = ", ".join(sorted({"static", *_BACKENDS}))
        if config.rdzv_backend in ("c10d", "etcd", "etcd-v2", "etcd-v3"):
            raise RendezvousError(
                f"multi-node rendezvous over {config.rdzv_backend!r} is not available in "
                "this tp-run yet; use --rdzv-backend static with --master-addr/--master-port/"
                "--node-rank, or --nnodes 1"
            )
        raise RendezvousError(f"unknown --rdzv-backend {config.rdzv_backend!r} (known: {known})")
    return factory(config)
