"""The running world: a thread that watches it and says what changed.

While a world runs, the member watches ``P/state`` and ``P/alive/`` (the liveness keys,
only now: while joining, watching them would wake each member once per joiner) and
re-reads both at least every ``monitor_poll``. What it sees is decided by
:func:`~rendezvous.decisions.state_change` and
:func:`~rendezvous.decisions.lost_participant`; the first :class:`WorldChange` is handed
to ``on_change`` (the member pushes it to the agent) and the thread ends.

An outage changes nothing (nobody can be seen, so nothing is concluded: the workers keep
running). A backend that refuses ``max_errors`` reads in a row (a c10d host that died),
or that refused this member's keep-alives (:attr:`LeaseSession.broken`), is a lost world:
waiting on it would hang the job.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from rendezvous.decisions import CHANGE_LOST, WorldChange, lost_participant, state_change
from rendezvous.kv import KV, KVError, KVUnavailable
from rendezvous.lease import LeaseSession
from rendezvous.state import Keys, StateStore, World, alive_members

logger = logging.getLogger(__name__)


class WorldMonitor:
    """One member's watch over its running world.

    Args:
        kv, keys, states, session: the member's backend, key layout, state document and
            lease session (ended: the monitor ends too).
        wake: the member's "look again" event (set by the watches).
        on_change: told the first change.
        max_errors: refused reads in a row that lose the world (``keep_alive_max_attempt``).
        monitor_poll, safety_poll: seconds between re-reads with no event, normally and
            while the backend is unreachable or refusing.
    """

    def __init__(self, kv: KV, keys: Keys, states: StateStore, session: LeaseSession,
                 wake: threading.Event, on_change: Callable[[WorldChange], None],
                 max_errors: int, monitor_poll: float, safety_poll: float) -> None:
        self.kv, self.keys, self.states, self.session = kv, keys, states, session
        self.wake = wake
        self._on_change = on_change
        self.max_errors = max_errors
        self.monitor_poll, self.safety_poll = monitor_poll, safety_poll
        self._thread: threading.Thread | None = None
        self._round = -1  # the round watched; -1: stopped
        self._alive_watch: Callable[[], None] | None = None

    def start(self, world: World) -> None:
        self._round = world.round
        if self._alive_watch is None:
            self._alive_watch = self.kv.watch_prefix(self.keys.alive_prefix, self.wake.set)
        self._thread = threading.Thread(target=self._watch, args=(world,),
                                        name="tp-rdzv-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._round = -1
        self.wake.set()
        if self._alive_watch is not None:
            self._alive_watch()
            self._alive_watch = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def _watch(self, world: World) -> None:
        ids = {m.id for m in world.participants}
        errors = 0
        while not self.session.done.is_set() and self._round == world.round:
            self.wake.clear()
            change: WorldChange | None
            try:
                change = self.check(world, ids)
                errors = 0
            except KVUnavailable as e:
                self.session.note_outage(e)
                change = None
            except KVError as e:
                errors += 1
                logger.warning("rendezvous (%s/%s): %s", errors, self.max_errors, e)
                change = WorldChange(CHANGE_LOST, f"the rendezvous backend failed: {e}") \
                    if errors >= self.max_errors else None
            if change is not None and self._round == world.round:
                self._on_change(change)
                return
            self.wake.wait(self.monitor_poll if errors == 0 and self.session.outage_s() == 0
                           else self.safety_poll)

    def check(self, world: World, ids: set[str]) -> WorldChange | None:
        """What changed since ``world`` formed (among participants ``ids``), or None."""
        if self.session.broken is not None:
            return WorldChange(CHANGE_LOST, f"the rendezvous backend failed: "
                                            f"{self.session.broken}")
        change = state_change(world, self.states.read()[0])
        if change is not None:
            return change
        return lost_participant(ids, alive_members(self.kv, self.keys))
