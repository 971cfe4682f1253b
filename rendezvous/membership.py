"""The membership protocol: agents form numbered worlds over a :class:`~rendezvous.kv.KV`.

Written once for every backend (etcd v3, c10d); the backends only provide versions,
compare-and-swap, leases and prefix watches. All keys live under
``<prefix>/<run id>/`` (``P/`` below), so two jobs on one etcd never see each other.

Keys
----
``P/state``
    One JSON document, always written with compare-and-swap on its version:
    ``round`` (the rendezvous round, +1 per restart), ``phase`` (``joining``,
    ``closed`` or ``complete``), ``participants`` (the world of a closed round, in node
    rank order: id, address, local world size), ``spares`` (members beyond MAX: torchrun's
    redundancy list), ``waiting`` (members that arrived after the world formed with fewer
    than MAX nodes: compatible mode restarts to admit them), ``generation`` (+1 every
    time a world is formed or swapped: the fencing token), ``opener`` (the member that
    closes a joining round), ``reason`` and ``failures`` (why the round was opened, and
    how many rounds were opened because something failed).
``P/alive/<member>``
    Attached to the member's lease (TTL ``lease_ttl``, refreshed every
    ``keep_alive_interval``): the member is alive while this key exists. A SIGKILLed
    agent's key vanishes when its lease expires; that is how the others notice.
``P/r<round>/join/<member>``
    Attached to the lease: "I want to be in round ``round``", with the join time.
``P/r<round>/store``
    ``addr:port`` of the workers' store, written by node rank 0's agent, which hosts a
    fresh store each round.
``P/r<round>/done/<member>``
    The exit barrier: this member's workers all succeeded.

Resilient mode (``--spares``, :mod:`tp_launch.agent.generations`) adds: the state's
``resilient`` document (rank -> node of the current generation, written with the
generation by :meth:`Membership.publish_placement`), ``P/parked/<member>``
(parked spares, on the lease) and ``P/r<round>/finished/<member>`` (the generation in
which the member's ranks finished). A member beyond the world joins as a spare node
(:attr:`Membership.accept_spare`) instead of waiting.

One round
---------
1. A member reads ``P/state``. No state, or a closed round it may not join (broken:
   a participant's lease is gone, or it is this member's own old round, which it
   leaves only to restart): it opens round ``r+1`` by compare-and-swap and becomes the
   round's *opener*. Leftovers of a crashed job are such a broken round, so they never
   wedge a new job.
2. In a joining round, a member puts its join key and waits for the state to change.
3. The opener watches the join keys and closes the round (compare-and-swap) when MAX
   have joined, or ``last_call_timeout`` after MIN had joined: participants are the
   first MAX by join time (node ranks in that order), the rest are spares, and the
   generation goes up. If the opener dies, the member that sees its lease gone takes
   the role over (compare-and-swap again). Nobody else reads the join keys, so a
   member's requests do not grow with the number of members.
4. A member that finds a healthy closed round it is not in adds itself to
   ``waiting`` (fewer than MAX nodes: the agents restart to admit it) or to ``spares``.

While a world runs, each member watches ``P/state`` and ``P/alive/``: a newer round, a
reported failure, a lost participant or a waiting member is a *world change*, pushed
to the agent through a pipe it can ``select`` on. Every write that changes the state is
a compare-and-swap against the version read, and every round-scoped write checks the
round, so a stale agent from an old round cannot change the current one.

Outages
-------
The backend unreachable (:class:`~rendezvous.kv.KVUnavailable`: etcd restarting, a
leader election, a rolling upgrade, the network) is evidence of nothing: nobody can
observe anyone meanwhile, so nothing is concluded from it.

- Leases: a keep-alive that cannot reach the backend is retried every second; the lease
  is not given up. etcd keeps leases across a restart and gives each its full TTL again
  when a leader takes over, so nobody is counted lost because etcd was down. A lease that
  did expire (this member alone was cut off for longer than the TTL while the others
  could see the backend) is replaced by a new one carrying the same keys (liveness,
  parked count: the keys put with :meth:`Membership._put_leased`); if the others acted
  meanwhile (a new round, a generation without this node), the state says so, and this
  member follows it as it follows any change. Only a backend that *refuses* the
  keep-alive ``keep_alive_max_attempt`` times breaks the member's world.
- A running world is not changed by an outage: the monitor keeps looking. Watches break
  with the connection; the backend arms them again and they fire once when it is back
  (the events of the gap are lost: everyone looks again).
- What needs the backend waits for it: a join (hence a restart), a failure report
  (:meth:`Membership.report_failure` keeps it; the next join, or :meth:`Membership.close`,
  delivers it unless its round has moved on), the exit barrier, the round's store key,
  and, in resilient mode, the next generation's compare-and-swap
  (:mod:`tp_launch.agent.resilient_agent`). Every such wait ends ``outage_timeout``
  (default 300 s) after the first request that found the backend unreachable, with one
  :class:`RendezvousError` line (the exit barrier, whose member's workers succeeded,
  just stops waiting). A world that needs nothing goes on, however long the outage.
- Refusals (any other :class:`~rendezvous.kv.KVError`: bad credentials, a c10d store
  whose host died) are not outages and fail as before.

Time: the close deadline is measured by the opener's own monotonic clock; the only
wall-clock value (join time) just orders members.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from rendezvous.api import RendezvousError
from rendezvous.kv import KV, KVError, KVUnavailable
from rendezvous.wakeup import WakeupPipe

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between two attempts of something that waits for an unreachable backend.
_OUTAGE_RETRY = 0.5

# Minimum seconds between two reads of a round's join keys by its opener.
_JOIN_READ_INTERVAL = 0.05

# Kinds of world change (what the agent does about them).
CHANGE_FAILURE = "failure"        # a member's workers failed: restart, counted
CHANGE_LOST = "lost"              # a participant's lease expired: restart, counted
CHANGE_WAITING = "waiting"        # a new member waits to be admitted: restart, not counted
CHANGE_ROUND = "round"            # a newer round was opened for another reason
CHANGE_COMPLETE = "complete"      # the job finished (the exit barrier passed)


@dataclass
class Timeouts:
    """torchrun's rendezvous settings, in seconds (``--rdzv-conf``)."""

    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3
    heartbeat_timeout: float = 30.0
    read_timeout: float = 60.0
    lease_ttl: float = 30.0
    exit_barrier_timeout: float = 300.0
    outage_timeout: float = 300.0


@dataclass(frozen=True)
class Member:
    id: str
    addr: str
    local_world_size: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "addr": self.addr, "lws": self.local_world_size}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Member":
        return Member(d["id"], d["addr"], int(d["lws"]))


@dataclass
class World:
    """A closed round as one member sees it."""

    round: int
    generation: int
    participants: list[Member]
    spares: list[Member] = field(default_factory=list)
    me: str = ""
    failures: int = 0  # the state's failure count when this world formed

    @property
    def is_spare(self) -> bool:
        """This member is a spare node of the world (resilient mode), not a participant."""
        return self.me not in [m.id for m in self.participants]

    @property
    def node_rank(self) -> int:
        """This member's node rank; -1 for a spare node."""
        ids = [m.id for m in self.participants]
        return ids.index(self.me) if self.me in ids else -1

    @property
    def rank_offset(self) -> int:
        return sum(m.local_world_size for m in self.participants[: max(self.node_rank, 0)])

    @property
    def world_size(self) -> int:
        return sum(m.local_world_size for m in self.participants)


@dataclass
class WorldChange:
    kind: str
    detail: str

    @property
    def counts_as_failure(self) -> bool:
        return self.kind in (CHANGE_FAILURE, CHANGE_LOST)


def new_member_id(addr: str) -> str:
    return f"{addr}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Membership:
    """One member's side of the protocol.

    Args:
        kv: the backend.
        prefix: the key prefix (``etcd_prefix``), without the run id.
        run_id: the job id.
        min_nodes, max_nodes: ``--nnodes MIN:MAX``.
        addr: this member's address as the others reach it.
        timeouts: ``--rdzv-conf`` settings.
        safety_poll: seconds between re-reads while joining when no watch event came
            (watches only make the protocol faster; this bounds how long a lost event
            can hide a change).
        monitor_poll: the same for a running world. Longer: each re-read fetches the
            state and the liveness keys, O(members) each, so frequent polls by every
            member would cost O(members^2); etcd's watches do not lose events, and an
            emulated (c10d) watch polls anyway.
    """

    def __init__(self, kv: KV, prefix: str, run_id: str, min_nodes: int, max_nodes: int,
                 addr: str, timeouts: Timeouts | None = None,
                 safety_poll: float = 5.0, monitor_poll: float = 30.0) -> None:
        self.kv = kv
        self.run_id = run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.addr = addr
        self.t = timeouts or Timeouts()
        self.safety_poll = safety_poll
        self.monitor_poll = max(monitor_poll, safety_poll)
        self.id = new_member_id(addr)
        self.p = f"{prefix.rstrip('/')}/{run_id}/"
        self._state_key = self.p + "state"
        self._lease: Any = None
        self._local_world_size = 1
        self._closed = threading.Event()
        self._wake = threading.Event()  # set by watches: "look again"
        self._cancels: list[Callable[[], None]] = []
        self._join_watch: tuple[int, Callable[[], None]] | None = None
        self._alive_watch: Callable[[], None] | None = None
        self._keepalive: threading.Thread | None = None
        # Keys on the lease (liveness, parked spares) and their values: put again on a
        # new lease, and after an outage in which a put failed.
        self._leased: dict[str, str] = {}
        self._leased_dirty = False
        self._lease_lock = threading.Lock()
        self._lease_epoch = 0  # +1 per lease granted (join keys follow the lease)
        self._broken: str | None = None  # the backend refuses this member: a world change
        self._outage_logged: float | None = None  # when this outage was logged
        self._pending_report: tuple[int, str, bool] | None = None  # round, detail, final
        self.world: World | None = None
        # World-change notification for the agent's select loop.
        self._pipe = WakeupPipe()
        self._change: WorldChange | None = None
        self._change_lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._monitor_round = -1
        # Resilient mode: a member beyond the world is a spare node (join returns its
        # world at once), and every change to the world pokes fd (see watch_changes).
        self.accept_spare = False
        self._change_watches: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ liveness

    def _ensure_alive(self, local_world_size: int) -> None:
        """Grant the lease and put the liveness key (the first time; the keep-alive
        thread renews both when the lease expires)."""
        if self._lease is not None and local_world_size == self._local_world_size and \
                self._alive_key(self.id) in self._leased and not self._leased_dirty:
            return
        self._local_world_size = local_world_size
        if self._lease is None:
            self._lease = self.kv.lease_grant(self.t.lease_ttl)
            self._lease_epoch += 1
        if self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keep_alive, name="tp-rdzv-keepalive",
                                               daemon=True)
            self._keepalive.start()
        self._put_leased(self._alive_key(self.id), json.dumps(self._me().to_json()))
        if not self._cancels:
            # Only the state: watching every member's liveness key while joining would
            # wake each member once per joiner. The running world watches them (monitor).
            self._cancels.append(self.kv.watch_prefix(self._state_key, self._wake.set))

    def _put_leased(self, key: str, value: str) -> None:
        """Put ``key`` on this member's lease and remember it (see ``_leased``)."""
        with self._lease_lock:
            self._leased[key] = value
            try:
                self.kv.put(key, value, self._lease)
            except KVError:
                self._leased_dirty = True
                raise

    def _put_leased_again(self) -> None:
        with self._lease_lock:
            try:
                for key, value in self._leased.items():
                    self.kv.put(key, value, self._lease)
                self._leased_dirty = False
            except KVError as e:
                logger.debug("rendezvous: putting the liveness keys again: %s", e)

    def _keep_alive(self) -> None:
        """Refresh the lease every ``keep_alive_interval``.

        The backend unreachable (KVUnavailable) is an outage, not a lost lease: nobody
        can see anything meanwhile, and etcd gives every lease its full TTL again when
        it comes back; this member just retries, every second. The backend answering
        that the lease expired (this member was cut off for longer than the TTL while
        the others could see it): a new lease with the same keys; if the others acted
        meanwhile (a new round, a generation without this node), the state says so.
        Only a backend that refuses the keep-alive ``keep_alive_max_attempt`` times
        (not an outage) breaks this member's world.
        """
        failures = 0
        while not self._closed.wait(self.t.keep_alive_interval if self._outage_logged is None
                                    else min(1.0, self.t.keep_alive_interval)):
            try:
                alive = self.kv.lease_keepalive(self._lease)
            except KVUnavailable as e:
                self._note_outage(e)
                continue
            except KVError as e:
                failures += 1
                logger.warning("rendezvous keep-alive failed (%s/%s): %s", failures,
                               self.t.keep_alive_max_attempt, e)
                if failures >= self.t.keep_alive_max_attempt and not self._closed.is_set():
                    self._break(f"the keep-alive was refused {failures} times: {e}")
                    failures = 0
                continue
            failures = 0
            self._note_reached()
            if self._closed.is_set():
                return
            if not alive:
                self._renew_lease()
            elif self._leased_dirty:
                self._put_leased_again()

    def _renew_lease(self) -> None:
        with self._lease_lock:
            try:
                lease = self.kv.lease_grant(self.t.lease_ttl)
            except KVError as e:
                logger.warning("rendezvous: cannot renew the expired lease yet: %s", e)
                return
            self._lease = lease
            self._lease_epoch += 1
        self._put_leased_again()
        logger.warning("this node's rendezvous lease had expired (cut off from the backend "
                       "for longer than lease_ttl=%gs); it holds a new one with the same keys",
                       self.t.lease_ttl)
        self._look_again()

    def _break(self, reason: str) -> None:
        logger.error("rendezvous: %s", reason)
        self._broken = reason
        self._look_again()

    def _look_again(self) -> None:
        """Make the monitor (compatible mode) or the agent (resilient mode: it watches
        changes and drains :attr:`fd`) read the world again. Compatible mode's agent
        does not drain :attr:`fd`: only real changes may make it readable there."""
        self._wake.set()
        if self._change_watches:
            self.poke()

    # ------------------------------------------------------------------ outages

    def outage_s(self) -> float:
        """How long the backend has been unreachable (0: it is reachable)."""
        since = self.kv.outage_since
        return 0.0 if since is None else time.monotonic() - since

    def outage_error(self, e: KVError) -> RendezvousError:
        """The one line that ends a wait for the backend longer than ``outage_timeout``."""
        return RendezvousError(
            f"the rendezvous backend has been unreachable for {self.outage_s():.0f}s, longer "
            f"than outage_timeout={self.t.outage_timeout:g}s ({e})")

    def _note_outage(self, e: KVError) -> None:
        if self._outage_logged is None:
            self._outage_logged = time.monotonic()
            logger.warning("the rendezvous backend is unreachable (%s); the workers keep "
                           "running, and what needs the backend waits for it (outage_timeout="
                           "%gs)", e, self.t.outage_timeout)

    def _note_reached(self) -> None:
        if self._outage_logged is not None:
            logger.warning("the rendezvous backend is reachable again (after %.0fs)",
                           time.monotonic() - self._outage_logged)
            self._outage_logged = None
            self._look_again()  # the watches missed the outage's events

    def _wait_for_backend(self, e: KVError) -> None:
        """Between two tries of something that needs the backend; RendezvousError once
        it has been unreachable for longer than ``outage_timeout``."""
        self._note_outage(e)
        if self.outage_s() > self.t.outage_timeout:
            raise self.outage_error(e)
        time.sleep(_OUTAGE_RETRY)

    def until_reachable(self, fn: Callable[[], T]) -> T:
        """``fn()``, tried again while the backend is unreachable (KVUnavailable), up
        to ``outage_timeout`` (then RendezvousError)."""
        while True:
            try:
                return fn()
            except KVUnavailable as e:
                self._wait_for_backend(e)

    def _alive_key(self, member: str) -> str:
        return f"{self.p}alive/{member}"

    def _me(self) -> Member:
        return Member(self.id, self.addr, self._local_world_size)

    def alive_members(self) -> set[str]:
        n = len(self.p + "alive/")
        return {k[n:] for k in self.kv.get_prefix(self.p + "alive/")}

    # ------------------------------------------------------------------ state

    def read_state(self) -> tuple[dict[str, Any] | None, Any]:
        raw, version = self.kv.get(self._state_key)
        return (json.loads(raw) if raw is not None else None), version

    def _write_state(self, version: Any, state: dict[str, Any]) -> bool:
        state["v"] = state.get("v", 0) + 1  # values never repeat: CAS on a value is safe
        return self.kv.cas(self._state_key, version, json.dumps(state))

    def _open_round(self, state: dict[str, Any] | None, version: Any, reason: str,
                    failure: bool) -> bool:
        old = state or {"round": -1, "generation": 0, "failures": 0, "v": 0}
        new = {
            "v": old.get("v", 0), "round": old["round"] + 1, "phase": "joining",
            "participants": [], "spares": [], "waiting": [], "opener": self.id,
            "generation": old.get("generation", 0), "reason": reason,
            "failures": old.get("failures", 0) + (1 if failure else 0),
        }
        ok = self._write_state(version, new)
        if ok:
            logger.info("opened rendezvous round %s of %s (%s)", new["round"], self.run_id, reason)
        return ok

    # ------------------------------------------------------------------ joining

    def join(self, local_world_size: int) -> World:
        """Take part in the next round and return the world it formed.

        While the backend is unreachable the join waits for it (and starts over when
        it is back), up to ``outage_timeout``; a failure report that could not be
        delivered (:meth:`report_failure`) is delivered first.

        Raises:
            RendezvousError: no world within ``join_timeout``, the job is complete, the
                backend refuses, or it has been unreachable for ``outage_timeout``.
        """
        last_round = self.world.round if self.world is not None else -1
        deadline = time.monotonic() + self.t.join_timeout
        self._broken = None
        while True:
            try:
                return self._join(local_world_size, last_round, deadline)
            except KVUnavailable as e:
                self._wait_for_backend(e)
            except KVError as e:
                raise RendezvousError(str(e)) from None

    def _join(self, local_world_size: int, last_round: int, deadline: float) -> World:
        self._stop_monitor()
        self._ensure_alive(local_world_size)
        self._deliver_report()
        self.world = None
        joined: tuple[int, int] = (-1, -1)  # (round, lease epoch) of our join key
        join_time = 0.0
        spare = False
        min_seen_at: float | None = None  # opener: when MIN members had joined
        next_opener_check = 0.0
        last_join_read = 0.0
        while True:
            self._wake.clear()
            state, version = self.read_state()
            phase = state["phase"] if state else None
            if state is None:
                self._open_round(None, None, "first round", False)
                continue
            rnd = state["round"]
            if phase == "complete":
                raise RendezvousError(
                    f"rendezvous {self.run_id!r} is closed: the job already finished "
                    "(use a new --rdzv-id for a new job)")
            if phase == "closed":
                ids = [m["id"] for m in state["participants"]]
                if self.id in ids and rnd > last_round:
                    return self._formed(state)
                if self.id in ids:
                    # Our own old round: we are here to restart it.
                    # (A failed round's reason carries on: the others may read the new
                    # round before they saw the failure.)
                    self._open_round(state, version, state.get("failed") or
                                     f"restart requested by {self.id}", False)
                    continue
                alive = self.alive_members()
                dead = [i for i in ids if i not in alive]
                if dead:
                    why = f"node {dead[0]} left (its lease expired)"
                    self._open_round(state, version, why, True)
                    continue
                # A healthy world we are not in: wait (and ask to be admitted).
                listed = {m["id"] for m in state.get("waiting", []) + state.get("spares", [])}
                if self.id not in listed:
                    # Resilient mode never restarts a running world to admit a node:
                    # a late node is a spare whatever the world's size.
                    key = "waiting" if len(ids) < self.max_nodes and not self.accept_spare \
                        else "spares"
                    state[key] = state.get(key, []) + [self._me().to_json()]
                    if self._write_state(version, state):
                        spare = key == "spares"
                        logger.info("rendezvous round %s already formed; %s", rnd,
                                    "waiting to be admitted" if key == "waiting"
                                    else "kept as a spare node")
                    continue
                spare = spare or self.id in {m["id"] for m in state.get("spares", [])}
                if spare and self.accept_spare and rnd > last_round:
                    return self._formed(state)  # a spare node of this world
                self._wait(deadline, spare, state)
                continue
            # phase == "joining"
            if joined != (rnd, self._lease_epoch):
                # (Again on a renewed lease: the old one took the key with it.)
                if joined[0] != rnd:
                    join_time = time.time()
                    min_seen_at = None
                    next_opener_check = 0.0
                    spare = False
                self.kv.put(self._join_key(rnd, self.id),
                            json.dumps({**self._me().to_json(), "t": join_time}), self._lease)
                joined = (rnd, self._lease_epoch)
            opener = state.get("opener")
            if opener != self.id and time.monotonic() >= next_opener_check:
                # Rate-limited: every member looking at every wake-up would make a
                # member's requests grow with the number of members.
                next_opener_check = time.monotonic() + self.safety_poll
                if self.kv.get(self._alive_key(opener))[0] is None:
                    state["opener"] = self.id  # its lease is gone: take the round over
                    self._write_state(version, state)
                    continue
            if opener == self.id:
                self._watch_joins(rnd)
                # Coalesce a burst of joins into one read: the opener is the only member
                # that reads the join keys, and N joins must not cost it N reads.
                time.sleep(max(0.0, last_join_read + _JOIN_READ_INTERVAL - time.monotonic()))
                last_join_read = time.monotonic()
                # Only the count until the round can close: reading every join record
                # at every wake-up would cost the opener O(members^2).
                count = self.kv.count_prefix(f"{self.p}r{rnd}/join/")
                if count >= self.min_nodes and min_seen_at is None:
                    min_seen_at = time.monotonic()
                full = count >= self.max_nodes
                last_call_over = (min_seen_at is not None and
                                  time.monotonic() - min_seen_at >= self.t.last_call_timeout)
                if full or last_call_over:
                    joiners = self._joiners(rnd)
                    if len(joiners) >= self.min_nodes:  # a joiner may have left since
                        self._close(state, version, joiners)
                    continue
                timeout = self.t.last_call_timeout if min_seen_at is None else \
                    max(0.0, min_seen_at + self.t.last_call_timeout - time.monotonic())
                self._wait(deadline, False, state, timeout, count=count)
                continue
            self._wait(deadline, False, state)

    def _formed(self, state: dict[str, Any]) -> World:
        """Adopt the closed round in ``state`` as this member's world."""
        self.world = World(state["round"], state["generation"],
                           [Member.from_json(m) for m in state["participants"]],
                           [Member.from_json(m) for m in state.get("spares", [])],
                           self.id, state.get("failures", 0))
        self._unwatch_joins()
        return self.world

    def _watch_joins(self, rnd: int) -> None:
        if self._join_watch is not None and self._join_watch[0] == rnd:
            return
        self._unwatch_joins()
        self._join_watch = (rnd, self.kv.watch_prefix(f"{self.p}r{rnd}/join/", self._wake.set))

    def _unwatch_joins(self) -> None:
        if self._join_watch is not None:
            self._join_watch[1]()
            self._join_watch = None

    def _join_key(self, rnd: int, member: str) -> str:
        return f"{self.p}r{rnd}/join/{member}"

    def _joiners(self, rnd: int) -> list[Member]:
        items = self.kv.get_prefix(f"{self.p}r{rnd}/join/")
        joined = sorted((json.loads(v) for v in items.values()), key=lambda d: (d["t"], d["id"]))
        return [Member.from_json(d) for d in joined]

    def _close(self, state: dict[str, Any], version: Any, joiners: list[Member]) -> None:
        state.update(phase="closed",
                     participants=[m.to_json() for m in joiners[: self.max_nodes]],
                     spares=[m.to_json() for m in joiners[self.max_nodes:]],
                     waiting=[], generation=state.get("generation", 0) + 1)
        if self._write_state(version, state):
            logger.info("rendezvous round %s closed with %s nodes (%s spare)", state["round"],
                        len(state["participants"]), len(state["spares"]))

    def _wait(self, deadline: float, spare: bool, state: dict[str, Any],
              timeout: float | None = None, count: int | None = None) -> None:
        """Sleep until a watch fires, ``timeout`` passes, or the join deadline."""
        now = time.monotonic()
        if not spare and now >= deadline:
            joined = f"{count} of " if count is not None else ""
            raise RendezvousError(
                f"rendezvous {self.run_id!r} timed out after {self.t.join_timeout:g}s "
                f"(join_timeout): {joined}the {self.min_nodes} node(s) needed have joined "
                f"round {state['round']}")
        limit = self.safety_poll if timeout is None else min(timeout, self.safety_poll)
        if not spare:
            limit = min(limit, max(0.0, deadline - now))
        self._wake.wait(max(limit, 0.01))

    # ------------------------------------------------------------------ the running world

    def start_monitor(self) -> None:
        """Watch the formed world and signal :attr:`fd` on a change."""
        assert self.world is not None
        with self._change_lock:
            self._change = None
        self._drain()
        self._monitor_round = self.world.round
        if self._alive_watch is None:
            self._alive_watch = self.kv.watch_prefix(self.p + "alive/", self._wake.set)
        self._monitor = threading.Thread(target=self._watch_world, args=(self.world,),
                                         name="tp-rdzv-monitor", daemon=True)
        self._monitor.start()

    def _stop_monitor(self) -> None:
        self._monitor_round = -1
        self._wake.set()
        if self._alive_watch is not None:
            self._alive_watch()
            self._alive_watch = None
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5)
        self._monitor = None

    def _watch_world(self, world: World) -> None:
        ids = {m.id for m in world.participants}
        errors = 0
        while not self._closed.is_set() and self._monitor_round == world.round:
            self._wake.clear()
            try:
                change = self.check_world(world, ids)
                errors = 0
            except KVUnavailable as e:
                # An outage: nothing can be seen, so nothing is concluded; the workers
                # keep running (what needs the backend waits for it, elsewhere).
                self._note_outage(e)
                change = None
            except KVError as e:
                errors += 1
                logger.warning("rendezvous (%s/%s): %s", errors, self.t.keep_alive_max_attempt, e)
                # A backend that keeps refusing (a c10d host that died) is a lost
                # world: waiting on it would hang the job.
                change = WorldChange(CHANGE_LOST, f"the rendezvous backend failed: {e}") \
                    if errors >= self.t.keep_alive_max_attempt else None
            if change is not None and self._monitor_round == world.round:
                self._signal(change)
                return
            self._wake.wait(self.monitor_poll if errors == 0 and self.outage_s() == 0
                            else self.safety_poll)

    def check_world(self, world: World, ids: set[str] | None = None) -> WorldChange | None:
        """What changed since ``world`` formed, or None."""
        ids = ids if ids is not None else {m.id for m in world.participants}
        if self._broken is not None:
            return WorldChange(CHANGE_LOST, f"the rendezvous backend failed: {self._broken}")
        state, _ = self.read_state()
        if state is None:
            return WorldChange(CHANGE_LOST, "the rendezvous state disappeared")
        if state["round"] != world.round:
            kind = CHANGE_FAILURE if state.get("failures", 0) > self._failures_at(world) \
                else CHANGE_ROUND
            return WorldChange(kind, state.get("reason", "a new round"))
        if state["phase"] == "complete":
            return WorldChange(CHANGE_COMPLETE, "the job finished")
        if state.get("failed"):
            return WorldChange(CHANGE_FAILURE, state["failed"])
        if state.get("waiting"):
            return WorldChange(CHANGE_WAITING, f"node {state['waiting'][0]['id']} is waiting "
                                               "to join")
        dead = sorted(ids - self.alive_members())
        if dead:
            return WorldChange(CHANGE_LOST, f"node {dead[0]} left (its lease expired)")
        return None

    def _failures_at(self, world: World) -> int:
        return world.failures

    def _signal(self, change: WorldChange) -> None:
        with self._change_lock:
            if self._change is None:
                self._change = change
        self._pipe.poke()

    def _drain(self) -> None:
        self._pipe.drain()

    @property
    def fd(self) -> int:
        """Readable when the world changed; see :meth:`world_change`."""
        return self._pipe.fd

    def world_change(self) -> WorldChange | None:
        with self._change_lock:
            return self._change

    def report_failure(self, detail: str, final: bool = False) -> bool:
        """This member's workers failed: mark the current round failed, so every
        member restarts (or, ``final``, stops). False if the round is not ours any
        more (stale), or if the backend is unreachable: the report is then delivered
        by the next :meth:`join`, or by :meth:`close` (which waits for the backend up
        to ``outage_timeout``), unless the round has moved on by then."""
        if self.world is None:
            return False
        self._pending_report = (self.world.round, f"node {self.id}: {detail}", final)
        try:
            return self._deliver_report()
        except KVUnavailable as e:
            self._note_outage(e)
            logger.warning("rendezvous: the failure report waits for the backend: %s", e)
        except KVError as e:
            logger.warning("rendezvous: cannot report the failure: %s", e)
            self._pending_report = None
        return False

    def _deliver_report(self) -> bool:
        """Write the pending failure report into its round, if that is still the
        current one (KVUnavailable: it stays pending)."""
        if self._pending_report is None:
            return False
        rnd, detail, final = self._pending_report
        while True:
            state, version = self.read_state()
            if state is None or state["round"] != rnd or state["phase"] != "closed":
                self._pending_report = None
                return False
            if not state.get("failed"):
                state["failed"] = detail
                state["final"] = final
                state["failures"] = state.get("failures", 0) + 1
                if not self._write_state(version, state):
                    continue
            self._pending_report = None
            return True

    def exit_barrier(self) -> WorldChange | None:
        """This member's workers succeeded: wait until every participant's did.

        Returns None when all are done (the round is then marked complete), or the
        change that ended the wait (a failure, a lost node). After
        ``exit_barrier_timeout`` it gives up waiting and returns None, as torchrun does;
        the same after waiting ``outage_timeout`` for an unreachable backend.
        """
        world = self.world
        if world is None:
            return None
        self._stop_monitor()
        ids = {m.id for m in world.participants}
        done_prefix = f"{self.p}r{world.round}/done/"
        deadline = time.monotonic() + self.t.exit_barrier_timeout
        marked = False
        done: set[str] = set()
        try:
            cancel = self.kv.watch_prefix(done_prefix, self._wake.set)
        except KVError as e:
            logger.warning("rendezvous exit barrier: %s", e)
            return None
        try:
            while True:
                self._wake.clear()
                try:
                    if not marked:
                        self.kv.put(done_prefix + self.id, "1")
                        marked = True
                    done = {k[len(done_prefix):] for k in self.kv.get_prefix(done_prefix)}
                    if ids <= done:
                        self._mark_complete(world)
                        self.kv.put(f"{self.p}r{world.round}/left/{self.id}", "1")
                        return None
                    change = self.check_world(world, ids - done)
                    if change is not None and change.kind != CHANGE_WAITING:
                        if change.kind == CHANGE_COMPLETE:
                            return None
                        return change
                except KVUnavailable as e:
                    self._note_outage(e)
                    if self.outage_s() > self.t.outage_timeout:
                        logger.warning("exit barrier: %s; this node's workers succeeded, "
                                       "leaving without the others", self.outage_error(e))
                        return None
                except KVError as e:
                    logger.warning("rendezvous exit barrier: %s", e)
                    return None
                if time.monotonic() > deadline:
                    logger.warning("exit barrier timed out after %ss; %s",
                                   self.t.exit_barrier_timeout,
                                   "the rendezvous backend is unreachable" if not marked
                                   else f"{len(ids - done)} node(s) not done")
                    return None
                self._wake.wait(min(self.safety_poll, 1.0))
        finally:
            cancel()

    def _mark_complete(self, world: World) -> None:
        state, version = self.read_state()
        if state is not None and state["round"] == world.round and state["phase"] == "closed":
            state["phase"] = "complete"
            self._write_state(version, state)

    # ------------------------------------------------------------------ hot-spare hooks

    @property
    def generation(self) -> int:
        """The generation of the last world this member saw."""
        return self.world.generation if self.world is not None else 0

    def redundancy_list(self) -> list[Member]:
        """Members beyond MAX (spare nodes), as the state lists them now."""
        state, _ = self.read_state()
        return [Member.from_json(m) for m in (state or {}).get("spares", [])]

    def compare_and_swap_generation(self, expected: int, participants: list[Member],
                                    spares: list[Member] | None = None) -> bool:
        """Publish a new world as generation ``expected + 1`` if the current one is
        ``expected`` (the fencing token); False if another writer got there first.
        KVError if the backend cannot tell (KVUnavailable: try again when it is back)."""
        def update(state: dict[str, Any]) -> None:
            state["participants"] = [m.to_json() for m in participants]
            if spares is not None:
                state["spares"] = [m.to_json() for m in spares]

        return self._swap_generation(expected, update)

    def publish_placement(self, expected: int, nodes: list[str],
                          placement: dict[str, Any]) -> bool:
        """Resilient mode: generation ``expected + 1`` places the ranks on ``nodes``
        (member ids, in node rank order): they become the participants, a spare node
        among them leaves the redundancy list, and ``placement`` (rank -> node, the
        store, the replaced ranks) is stored as the state's ``resilient`` document.
        False if the generation is no longer ``expected``; KVError if the backend
        cannot tell (KVUnavailable: nothing was written, or it is as if nothing was:
        the outcome is read back when the backend returns)."""
        def update(state: dict[str, Any]) -> None:
            spares = state.get("spares", [])
            members = {d["id"]: d for d in state["participants"] + spares}
            state["participants"] = [members[n] for n in nodes if n in members]
            state["spares"] = [d for d in spares if d["id"] not in nodes]
            state["resilient"] = placement

        return self._swap_generation(expected, update)

    def _swap_generation(self, expected: int,
                         update: Callable[[dict[str, Any]], None]) -> bool:
        """One compare-and-swap of the state from generation ``expected`` to the next,
        with ``update`` applied to it; False if the state moved on. A KVError (the
        backend unreachable, or refusing) is raised: it is not a lost race."""
        state, version = self.read_state()
        if state is None or state.get("generation") != expected or \
                state["phase"] != "closed" or \
                (self.world is not None and state["round"] != self.world.round):
            return False
        update(state)
        state["generation"] = expected + 1
        return self._write_state(version, state)

    def set_parked(self, count: int) -> None:
        """Publish how many spares this member has parked (with its lease: a dead
        member's count vanishes with it). If the put fails, the keep-alive thread
        puts the latest count when the backend answers again (KVError still raised)."""
        self._put_leased(f"{self.p}parked/{self.id}", str(count))

    def parked_counts(self) -> dict[str, int]:
        n = len(self.p + "parked/")
        return {k[n:]: int(v) for k, v in self.kv.get_prefix(self.p + "parked/").items()}

    def mark_finished(self, generation: int) -> None:
        """Resilient exit barrier: this member's ranks finished training in
        ``generation``."""
        assert self.world is not None
        self.kv.put(f"{self.p}r{self.world.round}/finished/{self.id}", str(generation))

    def finished(self) -> dict[str, int]:
        """member -> the generation in which its ranks finished."""
        assert self.world is not None
        prefix = f"{self.p}r{self.world.round}/finished/"
        return {k[len(prefix):]: int(v) for k, v in self.kv.get_prefix(prefix).items()}

    def mark_complete(self) -> None:
        """The job is over (every rank finished): spare nodes leave."""
        if self.world is not None:
            self._mark_complete(self.world)

    def watch_changes(self) -> None:
        """Poke :attr:`fd` on every change of the state, of liveness and of the
        resilient exit barrier (the agent reads what changed itself)."""
        assert self.world is not None
        self.stop_watching_changes()
        for prefix in (self._state_key, self.p + "alive/",
                       f"{self.p}r{self.world.round}/finished/"):
            self._change_watches.append(self.kv.watch_prefix(prefix, self.poke))

    def stop_watching_changes(self) -> None:
        for cancel in self._change_watches:
            cancel()
        self._change_watches = []

    def poke(self) -> None:
        self._pipe.poke()

    def drain(self) -> None:
        self._drain()

    @property
    def broken(self) -> str | None:
        """Why the backend refuses this member (keep-alives refused), or None."""
        return self._broken

    # ------------------------------------------------------------------ round-scoped keys

    def put_round_key(self, name: str, value: str) -> None:
        """Put a round-scoped key (waiting for an unreachable backend, see
        :meth:`until_reachable`)."""
        assert self.world is not None
        key = f"{self.p}r{self.world.round}/{name}"
        self.until_reachable(lambda: self.kv.put(key, value))

    def wait_round_key(self, name: str, timeout: float) -> str:
        """The value of a round-scoped key, waiting for it to appear (``timeout``; time
        spent waiting for an unreachable backend does not count, ``outage_timeout``
        bounds it)."""
        assert self.world is not None
        key = f"{self.p}r{self.world.round}/{name}"
        deadline = time.monotonic() + timeout
        cancel = self.kv.watch_prefix(key, self._wake.set)
        try:
            delay = 0.02
            while True:
                self._wake.clear()
                try:
                    value, _ = self.kv.get(key)
                    if value is not None:
                        return value
                    state, _ = self.read_state()
                except KVUnavailable as e:
                    t0 = time.monotonic()
                    self._wait_for_backend(e)
                    deadline += time.monotonic() - t0
                    continue
                if state is None or state["round"] != self.world.round:
                    raise RendezvousError("the round moved on before node 0 published its store")
                if time.monotonic() > deadline:
                    raise RendezvousError(
                        f"node 0 did not publish the workers' store within {timeout:g}s")
                self._wake.wait(delay)
                delay = min(delay * 2, 0.5)
        finally:
            cancel()

    # ------------------------------------------------------------------ leaving

    def _linger(self, world: World) -> None:
        """This process hosts the store (c10d): keep it up until every participant has
        left the exit barrier or is gone, at most ``close_timeout``, so that nobody's
        last read meets a closed store."""
        prefix = f"{self.p}r{world.round}/left/"
        ids = {m.id for m in world.participants} - {self.id}
        deadline = time.monotonic() + self.t.close_timeout
        try:
            while time.monotonic() < deadline:
                left = {k[len(prefix):] for k in self.kv.get_prefix(prefix)}
                if not (ids - left) & self.alive_members():
                    return
                time.sleep(0.1)
        except KVError:
            return

    def _flush_report(self) -> None:
        told = False
        while self._pending_report is not None:
            try:
                self._deliver_report()
            except KVUnavailable as e:
                if self.outage_s() > self.t.outage_timeout:
                    logger.error("the other nodes were not told of this node's failure: %s",
                                 self.outage_error(e))
                    return
                if not told:
                    told = True
                    logger.warning("waiting for the rendezvous backend to tell the other "
                                   "nodes of this node's failure (outage_timeout=%gs): %s",
                                   self.t.outage_timeout, e)
                time.sleep(_OUTAGE_RETRY)
            except KVError as e:
                logger.warning("rendezvous: cannot report the failure: %s", e)
                return

    def close(self) -> None:
        """Leave: deliver a pending failure report (waiting for an unreachable backend
        up to ``outage_timeout``: the other nodes must hear of it), then revoke the
        lease (the others see this member gone at once)."""
        if self._closed.is_set():
            return
        self._flush_report()
        self._closed.set()
        self._wake.set()
        self._stop_monitor()
        self._unwatch_joins()
        self.stop_watching_changes()
        if getattr(self.kv, "hosting", False) and self.world is not None:
            self._linger(self.world)
        for cancel in self._cancels:
            cancel()
        self._cancels = []
        if self._lease is not None:
            self.kv.lease_revoke(self._lease)
        self.kv.close()
        self._pipe.close()


def local_address(explicit: str | None) -> str:
    return explicit or socket.getfqdn()
