"""Rendezvous without a coordination service: the world is fixed by the command line.

Two torchrun setups land here:

- the embedded single-node default (``--standalone``, torchrun's automatic standalone,
  or ``c10d`` with ``--nnodes 1``): this agent is the whole world and hosts the store,
  on a free port or on the endpoint's port, listening on the endpoint's host only
  (``localhost`` by default: loopback);
- ``--rdzv-backend static`` with ``--master-addr/--master-port/--node-rank``: node 0's
  agent hosts the store on the master address and port, every node knows its rank from
  the flags, and each node runs ``--nproc-per-node`` workers (global ranks are
  node-major).

Either way the store is hosted anew for each round, so a restart never meets a dead
attempt's keys.
"""

from __future__ import annotations

from rendezvous.api import RendezvousError, RendezvousHandler, RendezvousInfo
from rendezvous.store_host import StoreHost


class StaticRendezvous(RendezvousHandler):
    """A world fixed in advance.

    Args:
        run_id: the job id.
        nnodes: number of nodes.
        node_rank: this node's rank.
        master_addr: address workers use to reach the store.
        master_port: the store's port; 0 lets the hosting agent pick a free one
            (single node only).
    """

    def __init__(self, run_id: str, nnodes: int, node_rank: int, master_addr: str,
                 master_port: int) -> None:
        if not 0 <= node_rank < nnodes:
            raise RendezvousError(f"--node-rank={node_rank} is not in 0..{nnodes - 1} "
                                  f"(--nnodes={nnodes})")
        if master_port == 0 and nnodes > 1:
            raise RendezvousError("a multi-node static rendezvous needs a fixed --master-port")
        self._run_id = run_id
        self._nnodes = nnodes
        self._node_rank = node_rank
        self._master_addr = master_addr
        self._master_port = master_port
        self._round = -1
        self._host: StoreHost | None = None

    @property
    def run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self, local_world_size: int) -> RendezvousInfo:
        self._round += 1
        port = self._master_port
        if self._node_rank == 0:
            self._close_store()
            try:
                self._host = StoreHost(self._master_addr, self._master_port,
                                       self.store_server)
            except OSError as e:
                raise RendezvousError(str(e)) from None
            port = self._host.port
        return RendezvousInfo(
            round=self._round,
            node_rank=self._node_rank,
            nnodes=self._nnodes,
            rank_offset=self._node_rank * local_world_size,
            world_size=self._nnodes * local_world_size,
            master_addr=self._master_addr,
            master_port=port,
            use_agent_store=True,
        )

    def _close_store(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None

    def shutdown(self) -> None:
        self._close_store()
