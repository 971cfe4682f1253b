"""Where resilient mode's generations are published: one agent alone, or every node's.

:class:`Generations` is what the resilient agent asks of either; :func:`open_generations`
picks the one the rendezvous serves, so the agent runs one recovery path for both.

:class:`LocalGenerations` (a single-node job): the agent is the only writer; a
generation is published by deciding it. Its view is one node that is always alive and
holds every rank; nothing is ever unreachable, so nothing waits for a backend
(:meth:`~LocalGenerations.outage_s` is 0); what would tell other nodes does nothing.

:class:`SharedGenerations` (a multi-node job, ``--rdzv-backend etcd|c10d``): over the
rendezvous membership (:mod:`rendezvous.membership`). A generation is the state's
``generation`` counter plus its ``resilient`` document (:meth:`Generation.to_json`:
rank -> node, the store, the replaced ranks), written together by compare-and-swap on
the counter: when two agents both see a node die, one generation comes out of it and
the other agent adopts it. The state's participants follow the placement (the nodes
that hold ranks) and its spares list loses the spare nodes that were promoted.

Every agent watches the state, the liveness keys and the resilient exit barrier; a
change pokes :attr:`SharedGenerations.fd` and the agent reads a :class:`View`. Each
agent also hosts a store of its own: the agent that publishes a generation names its
own store, so a generation never forms on a store a dead node hosted. Parked spare
counts (``parked/<node>``, with the node's lease) tell the others where a lost node's
ranks can go.

Outages of the backend: reads (:meth:`SharedGenerations.view`, :meth:`~SharedGenerations.parked`)
and :meth:`~SharedGenerations.publish` raise :class:`~rendezvous.kv.KVUnavailable`, so
that the agent can tell "the backend is unreachable" (wait, try again) from "another
node published first" (adopt its generation): a publish is never guessed. This node's
exit-barrier mark is kept until it is written (:meth:`~SharedGenerations.flush`), and
its parked count is put again by the membership when the backend answers.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rendezvous import RendezvousError, RendezvousHandler, RendezvousInfo, bounded_json
from rendezvous.handler import MembershipRendezvous
from rendezvous.kv import KVError, KVUnavailable
from rendezvous.state import StateError
from rendezvous.store_host import StoreHost, StoreServer
from tp_launch import channel
from tp_launch.agent.control import Generation
from tp_launch.agent.links import AgentLinks

if TYPE_CHECKING:
    from rendezvous.membership import Membership
    from rendezvous.state import RoundState

logger = logging.getLogger(__name__)

LOCAL_NODE = "local"


@dataclass
class View:
    """The job as a poke finds it (multi-node)."""

    generation: Generation
    alive: set[str]
    spare_nodes: list[str]  # live spare nodes, in the redundancy list's order
    finished: dict[str, int]  # node -> generation its ranks finished in
    failed: str | None = None  # a node asked for a restart (or, final, a stop)
    final: bool = False
    complete: bool = False
    broken: str | None = None  # the backend refuses this node: its world is lost
    dead: set[str] = field(default_factory=set)  # its agent gone, its lease not expired yet

    def all_finished(self) -> bool:
        g = self.generation
        return all(self.finished.get(n) == g.gen for n in g.nodes)


class Generations(Protocol):
    """Where the agent publishes and reads generations (see the module's doc)."""

    @property
    def node(self) -> str:
        """This node's id in :attr:`Generation.ranks`."""

    @property
    def fd(self) -> int | None:
        """Readable when the job's state changed (then read :meth:`view`); None: only
        this agent changes it."""

    @property
    def store(self) -> tuple[str, int]:
        """The store a generation this agent publishes forms on."""

    def initial(self) -> Generation:
        """The attempt's first generation."""

    def view(self) -> View | None:
        """The job now; None when it cannot be read (try again later); KVUnavailable
        when the backend cannot be reached."""

    def parked(self) -> dict[str, int]:
        """node -> parked spares, for the other nodes (this node counts its own)."""

    def set_parked(self, count: int) -> None:
        """Tell the other nodes how many spares this node has parked."""

    def set_status(self, doc: channel.NodeStatus) -> None:
        """Publish what this node's ranks do, for ``tp-run status`` on other nodes."""

    def statuses(self) -> dict[str, channel.NodeStatus]:
        """node -> the status it published last (other nodes; {}: none; a malformed
        document is left out, logged once)."""

    def publish(self, g: Generation) -> bool:
        """Publish ``g`` if the job is still at ``g.gen - 1``; False if another node
        published first (KVError: the backend cannot tell)."""

    def mark_finished(self, gen: int) -> None:
        """This node's ranks finished in ``gen``: the next :meth:`view` may end the job."""

    @property
    def finish_pending(self) -> bool:
        """The :meth:`mark_finished` mark still waits for the backend."""

    def flush(self) -> None:
        """Write what waits for the backend (KVUnavailable if it still cannot)."""

    def outage_s(self) -> float:
        """How long the backend has been unreachable (0: it answers)."""

    def cut_off_at(self) -> float:
        """monotonic: the last time this node knew itself cut off from the backend."""

    @property
    def outage_timeout(self) -> float:
        """How long what needs the backend waits for it."""

    def outage_error(self, e: KVError) -> RendezvousError:
        """The error that ends the job past :attr:`outage_timeout`."""

    def mark_complete(self) -> None:
        """The job is over: every node lets its ranks go."""

    def report_failure(self, detail: str, final: bool) -> None:
        """The job restarts (or, ``final``, stops): tell the other nodes."""

    def close(self) -> None:
        """Release what the attempt held."""


def open_generations(rdzv: RendezvousHandler, info: RendezvousInfo) -> Generations:
    """The generations of the world ``info`` formed: shared through the membership of a
    multi-node rendezvous, else this agent's own."""
    membership = shared_membership(rdzv)
    if membership is None:
        return LocalGenerations(info)
    return SharedGenerations(membership, info, rdzv.store_server)


def shared_membership(rdzv: RendezvousHandler) -> Membership | None:
    """The membership a multi-node rendezvous shares generations through, if any."""
    return rdzv.membership if isinstance(rdzv, MembershipRendezvous) else None


class LocalGenerations:
    """A single node: generations are this agent's own decisions.

    Args:
        info: the formed world (its store serves every generation).
    """

    fd: int | None = None
    node = LOCAL_NODE
    outage_timeout = math.inf
    finish_pending = False

    def __init__(self, info: RendezvousInfo) -> None:
        self.info = info
        self._first = Generation(0, {r: self.node for r in range(info.world_size)},
                                 self.store)
        self._current = self._first  # the last one published
        self._finished: dict[str, int] = {}  # node -> generation its ranks finished in

    @property
    def store(self) -> tuple[str, int]:
        return self.info.master_addr, self.info.master_port

    def initial(self) -> Generation:
        return self._first

    def view(self) -> View:
        return View(self._current, {self.node}, [], dict(self._finished))

    def parked(self) -> dict[str, int]:
        return {}

    def set_parked(self, count: int) -> None:
        pass

    def set_status(self, doc: channel.NodeStatus) -> None:
        pass

    def statuses(self) -> dict[str, channel.NodeStatus]:
        return {}

    def publish(self, g: Generation) -> bool:
        self._current = g
        return True

    def mark_finished(self, gen: int) -> None:
        self._finished[self.node] = gen

    def flush(self) -> None:
        pass

    def outage_s(self) -> float:
        return 0.0

    def cut_off_at(self) -> float:
        return -1e9

    def outage_error(self, e: KVError) -> RendezvousError:
        return RendezvousError(str(e))

    def mark_complete(self) -> None:
        pass

    def report_failure(self, detail: str, final: bool) -> None:
        pass

    def close(self) -> None:
        pass


class SharedGenerations:
    """Generations of a multi-node job, over the rendezvous membership.

    Args:
        membership: this agent's member of the formed world.
        info: the formed world (its store serves the first generation).
        server: where this agent's store is served (None: in the agent).
    """

    def __init__(self, membership: Membership, info: RendezvousInfo,
                 server: StoreServer | None = None) -> None:
        self._m = membership
        self.node = membership.id
        self._round_store = (info.master_addr, info.master_port)
        try:
            # The store of the generations this agent publishes, on the address it names.
            self._host = StoreHost(membership.addr, 0, server)
        except OSError as e:
            raise RendezvousError(str(e)) from None
        self._finished_gen: int | None = None  # this node's exit-barrier mark, not yet written
        self._malformed_status: set[str] = set()  # nodes whose status was said malformed
        self._links = _open_links(membership)
        self._linked: set[str] = {self.node}  # nodes whose link endpoint was read
        try:
            membership.watch_changes()
            state, _ = membership.until_reachable(membership.read_state)
        except RendezvousError:
            self._close_links_and_store()
            raise
        except KVError as e:
            self._close_links_and_store()
            raise RendezvousError(f"the rendezvous backend failed: {e}") from None
        if state is None:
            self._close_links_and_store()
            raise RendezvousError("the rendezvous state disappeared")
        self._first = self._generation(state)

    @property
    def fd(self) -> int:
        return self._m.fd

    @property
    def store(self) -> tuple[str, int]:
        return self._m.addr, self._host.port

    def _generation(self, state: RoundState) -> Generation:
        if state.resilient is not None:
            return Generation.from_json(state.generation, state.resilient)
        ranks: dict[int, str] = {}
        for m in state.participants:  # the world as it formed: node-major ranks
            for _ in range(m.local_world_size):
                ranks[len(ranks)] = m.id
        return Generation(state.generation, ranks, self._round_store)

    def initial(self) -> Generation:
        return self._first

    def view(self) -> View | None:
        """The job now; None when the backend refuses the reads (logged; try again
        later). Raises KVUnavailable when it cannot be reached. Drains :attr:`fd`
        first, so a change made while reading pokes it again."""
        m = self._m
        m.drain()
        try:
            state, _ = m.read_state()
            alive = m.alive_members()
            finished = m.finished()
            assert m.world is not None
            if state is None or state.round != m.world.round:
                why = "the rendezvous state disappeared" if state is None else \
                    state.failed or state.reason
                return View(Generation(-1, {}, self.store), alive, [], finished, failed=why)
            generation = self._generation(state)
        except KVUnavailable:
            raise
        except StateError as e:
            # Not a refusal that passes: the job's document is gone for good (forged or
            # corrupted under its prefix). This node's world is lost, loudly.
            return View(Generation(-1, {}, self.store), set(), [], {},
                        broken=f"the job's state document is malformed ({e})")
        except KVError as e:
            logger.warning("rendezvous: cannot read the job's state: %s", e)
            return None
        dead = self._dead_agents(alive)
        alive -= dead
        return View(generation, alive, [n for n in state.spare_ids if n in alive], finished,
                    failed=state.failed, final=state.final,
                    complete=state.phase == "complete", broken=m.broken, dead=dead)

    def _dead_agents(self, alive: set[str]) -> set[str]:
        """The nodes of ``alive`` (their lease still held) whose agent is gone, by the
        links (:mod:`tp_launch.agent.links`); the links are first given the endpoints of
        live nodes not linked yet."""
        if self._links is None:
            return set()
        if alive - self._linked:
            try:
                endpoints = self._m.links()
            except KVError as e:  # the next view tries again
                logger.debug("rendezvous: cannot read the agents' links: %s", e)
            else:
                mine = {n: e for n, e in endpoints.items() if n in alive and n != self.node}
                self._linked |= set(mine)
                self._links.watch(mine)
        return self._links.dead() & alive

    def parked(self) -> dict[str, int]:
        """node -> parked spares ({} if the backend refuses; KVUnavailable raised)."""
        try:
            return self._m.parked_counts()
        except KVUnavailable:
            raise
        except KVError as e:
            logger.warning("rendezvous: cannot read the parked spares: %s", e)
            return {}

    def set_parked(self, count: int) -> None:
        try:
            self._m.set_parked(count)
        except KVUnavailable as e:
            logger.debug("rendezvous: the parked count waits for the backend: %s", e)
        except KVError as e:
            logger.warning("rendezvous: cannot publish the parked spares: %s", e)

    def set_status(self, doc: channel.NodeStatus) -> None:
        try:
            self._m.set_status(json.dumps(asdict(doc), separators=(",", ":")))
        except KVError as e:  # the session puts it again when the backend answers
            logger.debug("rendezvous: the status document waits for the backend: %s", e)

    def statuses(self) -> dict[str, channel.NodeStatus]:
        """Every other node's status; malformed documents are left out."""
        try:
            raw = self._m.statuses()
        except KVError as e:
            logger.debug("rendezvous: cannot read the nodes' status: %s", e)
            return {}
        docs: dict[str, channel.NodeStatus] = {}
        for node, text in raw.items():
            if node == self.node:
                continue
            try:
                docs[node] = channel.NodeStatus.from_json(bounded_json.loads(text))
            except ValueError as e:  # BoundsError, not JSON, ChannelError
                if node not in self._malformed_status:  # one line per node
                    self._malformed_status.add(node)
                    logger.error("rendezvous: node %.80r's status document is malformed, "
                                 "left out: %.120s", node, e)
        return docs

    def publish(self, g: Generation) -> bool:
        """Write ``g`` if the job is still at generation ``g.gen - 1``: False if another
        node published first. KVError if the backend cannot tell (KVUnavailable: an
        outage; nothing is known about the outcome until it is back)."""
        return self._m.publish_placement(g.gen - 1, g.nodes, g.to_json())

    def mark_finished(self, gen: int) -> None:
        """This node's ranks finished in ``gen``; the next :meth:`view` may end the job.
        Kept until written (:meth:`flush`) if the backend is unreachable."""
        self._finished_gen = gen
        try:
            self.flush()
        except KVUnavailable as e:
            logger.warning("rendezvous: this node's ranks finished; the mark waits for the "
                           "backend: %s", e)
        self._m.poke()  # look at once rather than at the watch's (c10d: polled) pace

    @property
    def finish_pending(self) -> bool:
        """This node's ranks finished and the backend has not been told yet."""
        return self._finished_gen is not None

    def flush(self) -> None:
        """Write what waits for the backend (the exit-barrier mark); KVUnavailable if
        it is still unreachable."""
        if self._finished_gen is None:
            return
        try:
            self._m.mark_finished(self._finished_gen)
        except KVUnavailable:
            raise
        except KVError as e:
            logger.warning("rendezvous: cannot mark this node finished: %s", e)
        self._finished_gen = None

    def outage_s(self) -> float:
        return self._m.outage_s()

    def cut_off_at(self) -> float:
        return self._m.cut_off_at()

    @property
    def outage_timeout(self) -> float:
        return self._m.t.outage_timeout

    def outage_error(self, e: KVError) -> RendezvousError:
        return self._m.outage_error(e)

    def mark_complete(self) -> None:
        try:
            self._m.mark_complete()
        except KVError as e:
            logger.warning("rendezvous: cannot mark the job complete: %s", e)

    def report_failure(self, detail: str, final: bool) -> None:
        self._m.report_failure(detail, final)

    def close(self) -> None:
        self._m.stop_watching_changes()
        self._close_links_and_store()

    def _close_links_and_store(self) -> None:
        if self._links is not None:
            self._links.close()  # says bye: leaving on purpose is not dying
        self._host.close()


def _open_links(membership: Membership) -> AgentLinks | None:
    """This agent's links, their endpoint published on its lease; None where its
    address cannot be listened on, or ``TP_RUN_AGENT_LINKS=0`` (then only the leases
    tell who is gone)."""
    if os.environ.get("TP_RUN_AGENT_LINKS", "1") == "0":
        return None
    try:
        links = AgentLinks(membership.addr, membership.poke)
    except OSError as e:
        logger.info("rendezvous: no agent link on %s (%s): a lost node is seen through "
                    "its lease only", membership.addr, e)
        return None
    try:
        membership.set_link(links.endpoint)
    except KVError as e:  # the session puts it again when the backend answers
        logger.debug("rendezvous: the agent link's endpoint waits for the backend: %s", e)
    return links
