"""Resilient mode's part of the membership (``--spares``, :mod:`tp_launch.agent.generations`).

Over a formed world, the agents place ranks on nodes themselves; the rendezvous only
publishes their decisions:

- :meth:`ResilientPlacement.publish`: generation ``expected + 1`` places the ranks on
  some nodes (:meth:`rendezvous.state.RoundState.placed`: the participants follow, a
  promoted spare node leaves the spares, the placement is the state's ``resilient``
  document), by compare-and-swap: of two agents that saw the same node die, one
  publishes and the other adopts its generation.
- ``P/parked/<member>`` (on the member's lease: a dead node's count vanishes with it):
  how many spares each node has parked, where a lost node's ranks can go.
- ``P/status/<member>`` (on the member's lease): what its ranks do, for ``tp-run status``
  on any node (an opaque document; written every few seconds, never per step).
- ``P/link/<member>`` (on the member's lease): where its agent's link listens
  (:mod:`tp_launch.agent.links`: a node whose agent died is seen when its sockets close).
- ``P/r<round>/finished/<member>``: the resilient exit barrier, the generation in which
  the member's ranks finished.
- :meth:`ResilientPlacement.watch`: a poke on every change of the state, of liveness and
  of the exit barrier (the agent reads what changed itself).
"""

from __future__ import annotations

from typing import Any, Callable

from rendezvous.kv import KV
from rendezvous.lease import LeaseSession
from rendezvous.state import Keys, StateStore, by_member, int_value


class ResilientPlacement:
    """One member's resilient-mode keys.

    Args:
        kv, keys, states, session: the member's backend, key layout, state document and
            lease session.
        me: the member's id.
        poke: called by the watches (the member's wake-up pipe).
    """

    def __init__(self, kv: KV, keys: Keys, states: StateStore, session: LeaseSession,
                 me: str, poke: Callable[[], None]) -> None:
        self.kv, self.keys, self.states, self.session = kv, keys, states, session
        self.me = me
        self._poke = poke
        self._watches: list[Callable[[], None]] = []

    def publish(self, rnd: int | None, expected: int, nodes: list[str],
                placement: dict[str, Any]) -> bool:
        """Generation ``expected + 1`` places the ranks on ``nodes`` (member ids, in node
        rank order), with ``placement`` as the ``resilient`` document, if the state is
        still the closed round ``rnd`` (None: any) at generation ``expected``. False if it
        moved on; KVError if the backend cannot tell (KVUnavailable: nothing was written,
        or it is as if nothing was: the outcome is read back when the backend returns)."""
        state, version = self.states.read()
        if state is None or state.generation != expected or state.phase != "closed" or \
                (rnd is not None and state.round != rnd):
            return False
        return self.states.write(version, state.placed(nodes, placement))

    def set_parked(self, count: int) -> None:
        """Publish how many spares this member has parked, on its lease (if the put
        fails, the session puts the latest count again when the backend answers;
        KVError still raised)."""
        self.session.put(self.keys.parked(self.me), str(count))

    def set_status(self, doc: str) -> None:
        """Publish this member's status document, on its lease (KVError raised)."""
        self.session.put(self.keys.status(self.me), doc)

    def statuses(self) -> dict[str, str]:
        """member -> its status document."""
        return by_member(self.keys.status_prefix, self.kv.get_prefix(self.keys.status_prefix))

    def set_link(self, endpoint: str) -> None:
        """Publish where this member's agent link listens, on its lease (KVError
        raised; the session puts it again when the backend answers)."""
        self.session.put(self.keys.link(self.me), endpoint)

    def links(self) -> dict[str, str]:
        """member -> its agent link's endpoint (``host:port``, unchecked)."""
        return by_member(self.keys.link_prefix, self.kv.get_prefix(self.keys.link_prefix))

    def parked_counts(self) -> dict[str, int]:
        prefix = self.keys.parked_prefix
        return {m: int_value(prefix + m, v)
                for m, v in by_member(prefix, self.kv.get_prefix(prefix)).items()}

    def mark_finished(self, rnd: int, generation: int) -> None:
        """This member's ranks finished training in ``generation``."""
        self.kv.put(self.keys.in_round(rnd, "finished/") + self.me, str(generation))

    def finished(self, rnd: int) -> dict[str, int]:
        """member -> the generation in which its ranks finished."""
        prefix = self.keys.in_round(rnd, "finished/")
        return {m: int_value(prefix + m, v)
                for m, v in by_member(prefix, self.kv.get_prefix(prefix)).items()}

    @property
    def watching(self) -> bool:
        return bool(self._watches)

    def watch(self, rnd: int) -> None:
        """Poke on every change of the state, of liveness and of round ``rnd``'s
        resilient exit barrier."""
        self.stop_watching()
        for prefix in (self.keys.state, self.keys.alive_prefix,
                       self.keys.in_round(rnd, "finished/")):
            self._watches.append(self.kv.watch_prefix(prefix, self._poke))

    def stop_watching(self) -> None:
        for cancel in self._watches:
            cancel()
        self._watches = []
