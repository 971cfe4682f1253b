"""The join loop: read the state, ask :func:`~rendezvous.decisions.decide_join`, perform.

:class:`JoinLoop` is the executor half of the join (the pure half is
:mod:`rendezvous.decisions`), as torch's dynamic rendezvous pairs ``_RendezvousJoinOp``
with ``_RendezvousOpExecutor``. One :meth:`JoinLoop.look` reads ``P/state`` once and
performs decisions until the state must be read again: the reads a decision asks for,
the join key and the opener's pause decide the same look again; a state write (by
compare-and-swap on the version read: a lost race is just a new look), a wait, or
"look again" end the look. :meth:`rendezvous.membership.Membership.join` runs looks and
waits between them on the member's watches; a test steps them with a fake clock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Callable, Protocol

from rendezvous.api import RendezvousError
from rendezvous.decisions import (
    CheckOpener,
    CountJoins,
    Fail,
    Formed,
    JoinLook,
    JoinProgress,
    JoinRules,
    Pause,
    PutJoinKey,
    ReadAlive,
    ReadJoiners,
    Wait,
    WriteState,
    decide_join,
)
from rendezvous.kv import KV
from rendezvous.lease import LeaseSession
from rendezvous.state import JoinRecord, Keys, Member, StateStore, World, alive_members

logger = logging.getLogger(__name__)


class Clock(Protocol):
    """The join's time: monotonic (deadlines, timers), wall (join times), and a pause."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class JoinLoop:
    """One member's join, one look at a time.

    Args:
        kv, keys, states, session: the member's backend, key layout, state document and
            lease session.
        rules: what the join decides by.
        wake: set by the member's watches (the state; the opener's join-key watch).
        prepare: run before the first look (again after :meth:`restart`).
        formed: told the world formed.
        clock: the time.
    """

    def __init__(self, kv: KV, keys: Keys, states: StateStore, session: LeaseSession,
                 rules: JoinRules, wake: threading.Event, prepare: Callable[[], None],
                 formed: Callable[[World], None], clock: Clock) -> None:
        self.kv, self.keys, self.states, self.session = kv, keys, states, session
        self.rules = rules
        self.wake = wake
        self._prepare = prepare
        self._formed = formed
        self.clock = clock
        self.progress = JoinProgress()
        self._prepared = False
        self._join_watch: tuple[int, Callable[[], None]] | None = None

    def restart(self) -> None:
        """Start over (after an outage): prepare again, forget the progress."""
        self._prepared = False

    def look(self) -> World | float:
        """One look: the world formed, or how long to wait for a watch before the next
        look (0: at once). Raises RendezvousError (the decision's error) or KVError."""
        if not self._prepared:
            self._prepare()
            self._prepared, self.progress = True, JoinProgress()
        self.wake.clear()
        state, version = self.states.read()
        look = JoinLook(state, 0.0, 0.0, 0)
        while True:
            look = replace(look, now=self.clock.monotonic(), wall=self.clock.time(),
                           lease_epoch=self.session.epoch)
            action, self.progress = decide_join(self.rules, look, self.progress)
            if isinstance(action, ReadAlive):
                look = replace(look, alive=frozenset(alive_members(self.kv, self.keys)))
            elif isinstance(action, CheckOpener):
                opener_key = self.keys.alive(action.opener)
                look = replace(look, opener_alive=self.kv.get(opener_key)[0] is not None)
            elif isinstance(action, CountJoins):
                self._watch_joins(action.round)
                count = self.kv.count_prefix(self.keys.in_round(action.round, "join/"))
                look = replace(look, join_count=count)
            elif isinstance(action, ReadJoiners):
                look = replace(look, joiners=tuple(self._joiners(action.round)))
            elif isinstance(action, PutJoinKey):
                self.kv.put(self.keys.in_round(action.round, "join/") + self.rules.me.id,
                            action.record.dumps(), self.session.lease)
            elif isinstance(action, Pause):
                self.clock.sleep(action.seconds)
            elif isinstance(action, Formed):
                self.stop_watching()
                self._formed(action.world)
                return action.world
            elif isinstance(action, Fail):
                raise RendezvousError(action.message)
            elif isinstance(action, WriteState):
                if self.states.write(version, action.state):
                    self._written(action)
                return 0.0
            elif isinstance(action, Wait):
                return action.seconds
            else:  # LookAgain
                return 0.0

    def _written(self, action: WriteState) -> None:
        """Log a state write that took effect; a member listed as a spare stays one."""
        s = action.state
        if action.kind == "open":
            logger.info("opened rendezvous round %s of %s (%s)", s.round, self.rules.run_id,
                        s.reason)
        elif action.kind == "close":
            logger.info("rendezvous round %s closed with %s nodes (%s spare)", s.round,
                        len(s.participants), len(s.spares))
        elif action.kind in ("wait", "spare"):
            logger.info("rendezvous round %s already formed; %s", s.round,
                        "waiting to be admitted" if action.kind == "wait"
                        else "kept as a spare node")
            self.progress = replace(self.progress, spare=action.kind == "spare")

    def _joiners(self, rnd: int) -> list[Member]:
        items = self.kv.get_prefix(self.keys.in_round(rnd, "join/"))
        records = sorted((JoinRecord.loads(v) for v in items.values()),
                         key=lambda r: (r.t, r.member.id))
        return [r.member for r in records]

    def _watch_joins(self, rnd: int) -> None:
        if self._join_watch is not None and self._join_watch[0] == rnd:
            return
        self.stop_watching()
        self._join_watch = (rnd, self.kv.watch_prefix(self.keys.in_round(rnd, "join/"),
                                                      self.wake.set))

    def stop_watching(self) -> None:
        if self._join_watch is not None:
            self._join_watch[1]()
            self._join_watch = None
