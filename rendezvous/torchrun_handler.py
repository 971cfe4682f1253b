"""``torchrun --rdzv-backend etcd-v3``: tp-run's etcd v3 rendezvous inside stock torchrun.

Registered through torch's ``torchrun.handlers`` entry point (setup.cfg), so an
installed tp-run gives plain ``torchrun`` an etcd backend that speaks the v3 API
(torch's own ``etcd``/``etcd-v2`` speak v2, which current etcd disables or removed).

The protocol is :mod:`rendezvous.membership`; this module only adapts it to torch's
``RendezvousHandler``: node rank 0's agent hosts a TCPStore for the round (agents and,
with ``use_agent_store``, workers share it, as with torch's c10d backend), and every
agent gets a ``PrefixStore`` of it for the round.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from rendezvous.api import RendezvousError as TpRendezvousError
from rendezvous.kv import KVError
from rendezvous.membership import Membership, local_address
from rendezvous.store_host import StoreHost

logger = logging.getLogger(__name__)

BACKEND = "etcd-v3"


class EtcdV3TorchrunHandler(RendezvousHandler):
    """torch's RendezvousHandler over :class:`Membership` on etcd v3."""

    def __init__(self, membership: Membership, read_timeout: float) -> None:
        self._m = membership
        self._read_timeout = read_timeout
        self._host: StoreHost | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        self._close_store()
        try:
            world = self._m.join(1)
            addr = world.participants[0].addr
            if world.node_rank == 0:
                self._host = StoreHost(addr, 0)
                port = self._host.port
                self._m.put_round_key("store", str(port))
            else:
                port = int(self._m.wait_round_key("store", self._read_timeout))
        except (TpRendezvousError, KVError, OSError) as e:
            if "already finished" in str(e):
                raise RendezvousClosedError(str(e)) from None
            raise RendezvousError(str(e)) from None
        self._m.start_monitor()
        client = TCPStore(addr, port, is_master=False,
                          timeout=datetime.timedelta(seconds=self._read_timeout))
        store: Store = PrefixStore(f"torch.rendezvous.{self._m.run_id}.{world.round}", client)
        return RendezvousInfo(store, world.node_rank, len(world.participants),
                              RendezvousStoreInfo(addr, port))

    def is_closed(self) -> bool:
        try:
            state, _ = self._m.read_state()
        except KVError:
            return False
        return state is not None and state.phase == "complete"

    def set_closed(self) -> None:
        try:
            self._m.mark_complete()
        except KVError as e:
            logger.warning("rendezvous: cannot mark the job complete: %s", e)

    def num_nodes_waiting(self) -> int:
        try:
            state, _ = self._m.read_state()
        except KVError:
            return 0
        if state is None or self._m.world is None or state.round != self._m.world.round:
            return 0
        return len(state.waiting)

    def get_run_id(self) -> str:
        return self._m.run_id

    def shutdown(self) -> bool:
        self._close_store()
        try:
            self._m.close()
        except KVError as e:
            logger.warning("rendezvous shutdown: %s", e)
            return False
        return True

    def _close_store(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's handler creator: ``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes``,
    ``--rdzv-conf`` as for ``tp-run --rdzv-backend etcd``."""
    from rendezvous.conf import timeouts_from_conf
    from rendezvous.etcd import PASSWORD_ENV, etcd_kv_from_conf
    from rendezvous.grammar import ConfigError

    conf = {k: str(v) for k, v in params.config.items() if v is not None}
    try:
        t = timeouts_from_conf(conf)
        kv = etcd_kv_from_conf(params.endpoint, conf, min(t.join_timeout, t.read_timeout),
                               t.read_timeout)
    except (ConfigError, KVError) as e:
        raise RendezvousError(str(e)) from None
    # torchrun's workers get a copy of this process's environment: they must not get the
    # etcd password (the client already holds it).
    os.environ.pop(PASSWORD_ENV, None)
    membership = Membership(kv, conf.get("etcd_prefix", "/tp-run"), params.run_id,
                            params.min_nodes, params.max_nodes,
                            local_address(params.local_addr), t,
                            safety_poll=min(5.0, max(0.5, t.keep_alive_interval)))
    return EtcdV3TorchrunHandler(membership, t.read_timeout)


def get_handler() -> Callable[[RendezvousParameters], Any]:
    """The ``torchrun.handlers`` entry point: returns the creator (torch calls it so)."""
    return create_handler
