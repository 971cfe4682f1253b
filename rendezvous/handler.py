"""The agent's multi-node rendezvous: the membership protocol plus the workers' store.

:class:`MembershipRendezvous` is what ``--rdzv-backend etcd|etcd-v2|etcd-v3|c10d`` with
more than one node gives the agent. It overrides the multi-node hooks that
:class:`~rendezvous.api.RendezvousHandler` declares (in resilient mode,
:meth:`~MembershipRendezvous.accept_spare_nodes`, and :attr:`~MembershipRendezvous.membership`
serves the generations: :mod:`tp_launch.agent.generations`):

- :attr:`~MembershipRendezvous.fd`: readable when the world changed (another node
  failed, left, or waits to be admitted); :meth:`~MembershipRendezvous.world_change`
  says how. The agent ``select``s on it next to its workers' pidfds.
- :meth:`~MembershipRendezvous.report_failure`: this node's workers failed; every node
  restarts (or, with no restarts left, stops).
- :meth:`~MembershipRendezvous.exit_barrier`: wait until every node succeeded.

Node rank 0's agent hosts a fresh workers' store each round (``StoreHost``, listening on
its own address, the one the others are told) and publishes its port under the round,
so MASTER_ADDR/MASTER_PORT always name a store that a live agent hosts and that no dead
attempt wrote to.
"""

from __future__ import annotations

import logging

from rendezvous.api import RendezvousError, RendezvousHandler, RendezvousInfo
from rendezvous.kv import KVError
from rendezvous.membership import Membership, WorldChange
from rendezvous.store_host import StoreHost

logger = logging.getLogger(__name__)


class MembershipRendezvous(RendezvousHandler):
    """A multi-node rendezvous over :class:`Membership`.

    Args:
        membership: this agent's member of the job.
        backend: the backend's name, for messages.
    """

    def __init__(self, membership: Membership, backend: str) -> None:
        self.membership = membership
        self.backend = backend
        self._host: StoreHost | None = None
        self._closed = False

    @property
    def run_id(self) -> str:
        return self.membership.run_id

    def accept_spare_nodes(self) -> None:
        self.membership.accept_spare = True

    def next_rendezvous(self, local_world_size: int) -> RendezvousInfo:
        self._close_store()
        m = self.membership
        if self.store_server is None:
            # torch before the lease: the stores need it, and importing it (on a store's
            # thread, say) holds the GIL for seconds at a time on a loaded machine,
            # which would starve the keep-alive thread past a short lease_ttl.
            from rendezvous.quiet import import_torch_quietly

            import_torch_quietly()
        world = m.join(local_world_size)
        try:
            if world.node_rank == 0:
                try:
                    # On the address the other nodes are told.
                    self._host = StoreHost(m.addr, 0, self.store_server)
                except OSError as e:
                    raise RendezvousError(str(e)) from None
                port = self._host.port
                m.put_round_key("store", str(port))
            else:
                port = int(m.wait_round_key("store", max(m.t.close_timeout, 30.0)))
        except KVError as e:
            raise RendezvousError(str(e)) from None
        m.start_monitor()
        logger.info("round %s: node rank %s of %s, generation %s, store %s:%s%s", world.round,
                    world.node_rank, len(world.participants), world.generation,
                    world.participants[0].addr, port, " (spare node)" if world.is_spare else "")
        return RendezvousInfo(
            round=world.round,
            node_rank=world.node_rank,
            nnodes=len(world.participants),
            rank_offset=world.rank_offset,
            world_size=world.world_size,
            master_addr=world.participants[0].addr,
            master_port=port,
            use_agent_store=True,
        )

    # ---------------------------------------------------------------- multi-node hooks

    @property
    def fd(self) -> int:
        return self.membership.fd

    def world_change(self) -> WorldChange | None:
        return self.membership.world_change()

    def report_failure(self, detail: str) -> None:
        self.membership.report_failure(detail)

    def exit_barrier(self) -> WorldChange | None:
        return self.membership.exit_barrier()

    # ---------------------------------------------------------------- leaving

    def _close_store(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_store()
        try:
            self.membership.close()
        except KVError as e:
            logger.warning("rendezvous shutdown: %s", e)
