"""What a rendezvous gives the agent, whatever the backend.

A rendezvous round turns "these agents want to run job J" into a world: how many nodes,
which node rank this agent has, where the workers' store is. The agent calls
:meth:`RendezvousHandler.next_rendezvous` once per attempt (the first start and every
restart) and :meth:`RendezvousHandler.shutdown` once at the end.

A multi-node backend also tells the agent, while its workers run, that the world changed
under them and hears from it that this node's workers failed; those hooks are declared
here with what a backend of one fixed world does (nothing): :attr:`~RendezvousHandler.fd`,
:meth:`~RendezvousHandler.world_change`, :meth:`~RendezvousHandler.report_failure`,
:meth:`~RendezvousHandler.exit_barrier` and :meth:`~RendezvousHandler.accept_spare_nodes`.
:class:`rendezvous.handler.MembershipRendezvous` overrides them.

Every round hosts a *fresh* store for the workers: a restart never reuses a store that a
dead attempt wrote to (torchrun 2.13 does, and its restarts then fail in gloo's
``connectFullMesh`` with stale peer addresses).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rendezvous.store_host import StoreServer


class RendezvousError(RuntimeError):
    """The rendezvous cannot form a world; the message says why, in one line."""


@dataclass(frozen=True)
class RendezvousInfo:
    """One formed world, as this node sees it.

    Args:
        round: the round number (0 for the first attempt, +1 per restart).
        node_rank: this node's rank (GROUP_RANK); -1 for a spare node (resilient mode).
        nnodes: number of nodes in the world (GROUP_WORLD_SIZE).
        rank_offset: global rank of this node's local rank 0.
        world_size: total number of workers (WORLD_SIZE).
        master_addr, master_port: the workers' store (MASTER_ADDR, MASTER_PORT).
        use_agent_store: True only if an agent hosts that store
            (TORCHELASTIC_USE_AGENT_STORE): workers then connect as clients.
    """

    round: int
    node_rank: int
    nnodes: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    use_agent_store: bool


class WorldChange(Protocol):
    """How the world changed under a running attempt (multi-node), as the agent reads it
    (the backend's type: :class:`rendezvous.membership.WorldChange`)."""

    @property
    def detail(self) -> str:
        """What happened, in words (another node failed, left, waits to join...)."""

    @property
    def counts_as_failure(self) -> bool:
        """Whether a restart for it counts against ``--max-restarts``."""


class RendezvousHandler(abc.ABC):
    """One agent's view of the job's membership."""

    @property
    @abc.abstractmethod
    def run_id(self) -> str:
        """The job id every node shares (TORCHELASTIC_RUN_ID)."""

    @abc.abstractmethod
    def next_rendezvous(self, local_world_size: int) -> RendezvousInfo:
        """Join the next round and return the world it formed.

        Args:
            local_world_size: how many workers this node brings.

        Raises:
            RendezvousError: the world cannot form (timeout, bad endpoint...).
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Leave the job and release what this agent hosts; safe to call twice."""

    # ---------------------------------------------------------------- multi-node hooks

    @property
    def fd(self) -> int | None:
        """A file descriptor that becomes readable when the world changed (the agent
        ``select``s on it beside its workers); None: the world never changes."""
        return None

    def world_change(self) -> WorldChange | None:
        """How the world changed since this round formed; None if it did not."""
        return None

    def report_failure(self, detail: str) -> None:
        """This node's workers failed (``detail``: how, one line): every node restarts
        (or, with no restarts left, stops)."""

    def exit_barrier(self) -> WorldChange | None:
        """This node's workers succeeded: wait until every node's did; the change that
        stopped the wait if one did not."""
        return None

    # Where the stores this agent hosts are served (None: in the agent itself).
    store_server: StoreServer | None = None

    def host_stores_with(self, server: StoreServer | None) -> None:
        """Serve the stores this agent hosts from now on in ``server``'s process
        (:class:`rendezvous.store_host.StoreServer`), so the agent need not import torch."""
        self.store_server = server

    def accept_spare_nodes(self) -> None:
        """Resilient mode: a node beyond the world joins as a spare node
        (:attr:`RendezvousInfo.node_rank` -1) instead of waiting for the next round."""
