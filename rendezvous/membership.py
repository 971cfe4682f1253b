"""The membership protocol: agents form numbered worlds over a :class:`~rendezvous.kv.KV`.

Written once for every backend (etcd v3, c10d); the backends only provide versions,
compare-and-swap, leases and prefix watches. Keys live under ``P/`` (the job's prefix and run
id: :mod:`rendezvous.state`). Its parts:

- :mod:`rendezvous.state`: the keys and the state document (:class:`RoundState`), typed.
- :mod:`rendezvous.lease`: the member's lease session (keep-alive, keys on the lease,
  outages).
- :mod:`rendezvous.decisions`: the join and world-change rules, as pure functions;
  :mod:`rendezvous.join` performs the join's, :mod:`rendezvous.monitor` watches the
  running world with the others.
- :mod:`rendezvous.placement`: resilient mode's keys (``--spares``: the placement of
  each generation, parked counts, finished marks); a member beyond the world joins as a
  spare node (:attr:`Membership.accept_spare`) instead of waiting.
- this module: :class:`Membership`, one member's side, built on those: join, monitor,
  report a failure, the exit barrier, the round's store key, leave. (Over 400 lines:
  these share one member's world, wake-up event and pending report; each is short.)

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

Two members deciding at once (both opening the next round, both taking a dead opener's
role over) both compare-and-swap against the version they read: one wins, the other
reads the winner's state and follows it.

While a world runs, each member watches ``P/state`` and ``P/alive/``: a newer round, a
reported failure, a lost participant or a waiting member is a *world change*
(:class:`WorldChange`), pushed to the agent through a pipe it can ``select`` on. Every
write that changes the state is a compare-and-swap against the version read, and every
round-scoped write checks the round, so a stale agent from an old round cannot change
the current one.

Outages
-------
What an outage means for the lease is :mod:`rendezvous.lease`'s. A running world is not
changed by one: the monitor keeps looking. Watches break with the connection; the
backend arms them again and they fire once when it is back (the events of the gap are
lost: everyone looks again). What needs the backend waits for it: a join (hence a
restart), a failure report (:meth:`Membership.report_failure` keeps it; the next join,
or :meth:`Membership.close`, delivers it unless its round has moved on), the exit
barrier, the round's store key, and, in resilient mode, the next generation's
compare-and-swap (:mod:`tp_launch.agent.resilient_agent`). Every such wait ends
``outage_timeout`` (default 300 s) after the first request that found the backend
unreachable, with one :class:`RendezvousError` line (the exit barrier, whose member's
workers succeeded, just stops waiting). A world that needs nothing goes on, however
long the outage. Refusals (any other :class:`~rendezvous.kv.KVError`: bad credentials,
a c10d store whose host died, a malformed state document) are not outages and fail as
before.

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
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from rendezvous.api import RendezvousError
from rendezvous.decisions import (
    CHANGE_COMPLETE,
    CHANGE_FAILURE,
    CHANGE_LOST,
    CHANGE_ROUND,
    CHANGE_WAITING,
    JoinRules,
    WorldChange,
)
from rendezvous.join import Clock, JoinLoop, SystemClock
from rendezvous.kv import KV, KVError, KVUnavailable
from rendezvous.lease import OUTAGE_RETRY, LeaseSession
from rendezvous.monitor import WorldMonitor
from rendezvous.placement import ResilientPlacement
from rendezvous.state import Keys, Member, RoundState, StateStore, World, alive_members
from rendezvous.wakeup import WakeupPipe

__all__ = ["CHANGE_COMPLETE", "CHANGE_FAILURE", "CHANGE_LOST", "CHANGE_ROUND", "CHANGE_WAITING",
           "Member", "Membership", "Timeouts", "World", "WorldChange", "local_address",
           "new_member_id"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        clock: the join's time (a test's is fake).
    """

    def __init__(self, kv: KV, prefix: str, run_id: str, min_nodes: int, max_nodes: int,
                 addr: str, timeouts: Timeouts | None = None,
                 safety_poll: float = 5.0, monitor_poll: float = 30.0,
                 clock: Clock = SystemClock()) -> None:
        self.kv = kv
        self.run_id = run_id
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.addr = addr
        self.t = t = timeouts or Timeouts()
        self.safety_poll = safety_poll
        self.monitor_poll = max(monitor_poll, safety_poll)
        self.id = new_member_id(addr)
        self.clock = clock
        self.keys = Keys.of(prefix, run_id)
        self.states = StateStore(kv, self.keys)
        self.session = LeaseSession(kv, t.lease_ttl, t.keep_alive_interval,
                                    t.keep_alive_max_attempt, t.outage_timeout,
                                    self._look_again)
        self._closed = self.session.done  # the member ends with its lease's keep-alive
        self._wake = threading.Event()  # set by watches: "look again"
        self._state_watch: Callable[[], None] | None = None
        self._pending_report: tuple[int, str, bool] | None = None  # round, detail, final
        self.world: World | None = None
        # World-change notification for the agent's select loop.
        self._pipe = WakeupPipe()
        self._change: WorldChange | None = None
        self._change_lock = threading.Lock()
        self.monitor = WorldMonitor(kv, self.keys, self.states, self.session, self._wake,
                                    self._signal, t.keep_alive_max_attempt, self.monitor_poll,
                                    safety_poll)
        # Resilient mode: a member beyond the world is a spare node (join returns its
        # world at once), and every change to the world pokes fd (see watch_changes).
        self.accept_spare = False
        self.placement = ResilientPlacement(kv, self.keys, self.states, self.session,
                                            self.id, self.poke)

    # ------------------------------------------------------------------ reads

    def read_state(self) -> tuple[RoundState | None, Any]:
        return self.states.read()

    def alive_members(self) -> set[str]:
        return alive_members(self.kv, self.keys)

    @property
    def broken(self) -> str | None:
        """Why the backend refuses this member (keep-alives refused), or None."""
        return self.session.broken

    def outage_s(self) -> float:
        return self.session.outage_s()

    def cut_off_at(self) -> float:
        """monotonic: the last time this member knew itself cut off from the backend."""
        return self.session.cut_off_at()

    def outage_error(self, e: KVError) -> RendezvousError:
        return self.session.outage_error(e)

    def until_reachable(self, fn: Callable[[], T]) -> T:
        return self.session.until_reachable(fn)

    def _look_again(self) -> None:
        """Make the monitor (compatible mode) or the agent (resilient mode: it watches
        changes and drains :attr:`fd`) read the world again. Compatible mode's agent
        does not drain :attr:`fd`: only real changes may make it readable there."""
        self._wake.set()
        if self.placement.watching:
            self.poke()

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
        loop = self.begin_join(local_world_size)
        try:
            while True:
                try:
                    outcome = loop.look()
                except KVUnavailable as e:
                    self.session.wait_for_backend(e)
                    loop.restart()
                    continue
                except KVError as e:
                    raise RendezvousError(str(e)) from None
                if isinstance(outcome, World):
                    return outcome
                if outcome:
                    self._wake.wait(outcome)
        finally:
            loop.stop_watching()

    def begin_join(self, local_world_size: int) -> JoinLoop:
        """The next join, one look at a time: :meth:`join` runs it (a test steps it)."""
        rules = JoinRules(self.run_id, Member(self.id, self.addr, local_world_size),
                          self.min_nodes, self.max_nodes, self.accept_spare,
                          last_round=self.world.round if self.world is not None else -1,
                          deadline=self.clock.monotonic() + self.t.join_timeout,
                          join_timeout=self.t.join_timeout,
                          last_call_timeout=self.t.last_call_timeout,
                          safety_poll=self.safety_poll)
        self.session.broken = None

        def prepare() -> None:
            self.monitor.stop()
            self._ensure_alive(local_world_size)
            self._deliver_report()
            self.world = None

        def formed(world: World) -> None:
            self.world = world

        return JoinLoop(self.kv, self.keys, self.states, self.session, rules, self._wake,
                        prepare, formed, self.clock)

    def _ensure_alive(self, local_world_size: int) -> None:
        """The liveness key on the lease (the session puts it again on a new lease)."""
        key = self.keys.alive(self.id)
        me = json.dumps(Member(self.id, self.addr, local_world_size).to_json())
        if not self.session.holds(key, me):
            self.session.put(key, me)
        if self._state_watch is None:
            # Only the state: watching every member's liveness key while joining would
            # wake each member once per joiner. The running world watches them (monitor).
            self._state_watch = self.kv.watch_prefix(self.keys.state, self._wake.set)

    # ------------------------------------------------------------------ the running world

    def start_monitor(self) -> None:
        """Watch the formed world and signal :attr:`fd` on a change."""
        assert self.world is not None
        with self._change_lock:
            self._change = None
        self.drain()
        self.monitor.start(self.world)

    def check_world(self, world: World, ids: set[str] | None = None) -> WorldChange | None:
        """What changed since ``world`` formed (among participants ``ids``), or None."""
        return self.monitor.check(world, ids if ids is not None else
                                  {m.id for m in world.participants})

    def _signal(self, change: WorldChange) -> None:
        with self._change_lock:
            if self._change is None:
                self._change = change
        self._pipe.poke()

    @property
    def fd(self) -> int:
        """Readable when the world changed; see :meth:`world_change`."""
        return self._pipe.fd

    def world_change(self) -> WorldChange | None:
        with self._change_lock:
            return self._change

    def poke(self) -> None:
        self._pipe.poke()

    def drain(self) -> None:
        self._pipe.drain()

    # ------------------------------------------------------------------ failures, the end

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
            self.session.note_outage(e)
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
            state, version = self.states.read()
            if state is None or state.round != rnd or state.phase != "closed":
                self._pending_report = None
                return False
            if not state.failed and not self.states.write(version,
                                                          state.with_failure(detail, final)):
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
        self.monitor.stop()
        ids = {m.id for m in world.participants}
        done_prefix = self.keys.in_round(world.round, "done/")
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
                        self.mark_complete()
                        self.kv.put(self.keys.in_round(world.round, "left/") + self.id, "1")
                        return None
                    change = self.check_world(world, ids - done)
                    if change is not None and change.kind != CHANGE_WAITING:
                        if change.kind == CHANGE_COMPLETE:
                            return None
                        return change
                except KVUnavailable as e:
                    self.session.note_outage(e)
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

    def mark_complete(self) -> None:
        """The job is over: this member's round, if still the current one, is complete
        (newcomers are told so; resilient mode's spare nodes leave)."""
        if self.world is None:
            return
        state, version = self.states.read()
        if state is not None and state.round == self.world.round and state.phase == "closed":
            self.states.write(version, state.completed())

    # ------------------------------------------------------------------ resilient mode

    def publish_placement(self, expected: int, nodes: list[str],
                          placement: dict[str, Any]) -> bool:
        """:meth:`ResilientPlacement.publish` in this member's round."""
        return self.placement.publish(self.world.round if self.world is not None else None,
                                      expected, nodes, placement)

    def set_parked(self, count: int) -> None:
        self.placement.set_parked(count)

    def parked_counts(self) -> dict[str, int]:
        return self.placement.parked_counts()

    def set_status(self, doc: str) -> None:
        self.placement.set_status(doc)

    def statuses(self) -> dict[str, str]:
        return self.placement.statuses()

    def set_link(self, endpoint: str) -> None:
        self.placement.set_link(endpoint)

    def links(self) -> dict[str, str]:
        return self.placement.links()

    def mark_finished(self, generation: int) -> None:
        assert self.world is not None
        self.placement.mark_finished(self.world.round, generation)

    def finished(self) -> dict[str, int]:
        assert self.world is not None
        return self.placement.finished(self.world.round)

    def watch_changes(self) -> None:
        """Poke :attr:`fd` on every change of the state, of liveness and of the
        resilient exit barrier (the agent reads what changed itself)."""
        assert self.world is not None
        self.placement.watch(self.world.round)

    def stop_watching_changes(self) -> None:
        self.placement.stop_watching()

    # ------------------------------------------------------------------ round-scoped keys

    def put_round_key(self, name: str, value: str) -> None:
        """Put a round-scoped key (waiting for an unreachable backend, see
        :meth:`until_reachable`)."""
        assert self.world is not None
        key = self.keys.in_round(self.world.round, name)
        self.until_reachable(lambda: self.kv.put(key, value))

    def wait_round_key(self, name: str, timeout: float) -> str:
        """The value of a round-scoped key, waiting for it to appear (``timeout``; time
        spent waiting for an unreachable backend does not count, ``outage_timeout``
        bounds it)."""
        assert self.world is not None
        key = self.keys.in_round(self.world.round, name)
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
                    state, _ = self.states.read()
                except KVUnavailable as e:
                    t0 = time.monotonic()
                    self.session.wait_for_backend(e)
                    deadline += time.monotonic() - t0
                    continue
                if state is None or state.round != self.world.round:
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
        prefix = self.keys.in_round(world.round, "left/")
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
                time.sleep(OUTAGE_RETRY)
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
        self.session.stop()
        self._wake.set()
        self.monitor.stop()
        self.stop_watching_changes()
        if self.kv.hosting and self.world is not None:
            self._linger(self.world)
        if self._state_watch is not None:
            self._state_watch()
            self._state_watch = None
        self.session.revoke()
        self.kv.close()
        self._pipe.close()


def local_address(explicit: str | None) -> str:
    return explicit or socket.getfqdn()
