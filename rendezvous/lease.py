"""One member's lease session: the lease, its keep-alive, the keys put on it, outages.

Like etcd's ``concurrency.Session``: the membership protocol is built on one. The lease
is granted with the first key put on it (:meth:`LeaseSession.put`, TTL ``ttl``) and
refreshed every ``keep_alive_interval`` by a thread; every key put on it (liveness,
parked count) is remembered, so that it can be put again.

Outages
-------
The backend unreachable (:class:`~rendezvous.kv.KVUnavailable`: etcd restarting, a
leader election, a rolling upgrade, the network) is evidence of nothing: nobody can
observe anyone meanwhile, so nothing is concluded from it.

- A keep-alive that cannot reach the backend is retried every second; the lease is not
  given up. etcd keeps leases across a restart and gives each its full TTL again when a
  leader takes over, so nobody is counted lost because etcd was down.
- But etcd's own host cut off from every node (etcd up, unreachable) for longer than
  the TTL expires every lease: each node comes back at its own time (its TCP
  retransmission backoff), and the first back must not take the others, still missing,
  for lost. :meth:`LeaseSession.cut_off_at` is the last time this member knew itself
  cut off (a request met the backend unreachable, its lease had expired, no keep-alive
  answered for longer than the TTL less one keep-alive interval: exactly when a cut
  that began with this member's could have expired another's lease); the agent takes
  nobody for lost within :data:`tp_launch.agent.decisions.LOST_GRACE_S` of it.
- A lease that did expire (this member alone was cut off for longer than the TTL while
  the others could see the backend) is replaced by a new one carrying the same keys
  (:attr:`LeaseSession.epoch` goes up); if the others acted meanwhile, the state says so,
  and the member follows it as it follows any change.
- A put that failed is done again, with every other key on the lease, when a keep-alive
  reaches the backend.
- Only a backend that *refuses* the keep-alive ``max_attempts`` times in a row breaks
  the session (:attr:`LeaseSession.broken`).
- What needs the backend waits for it (:meth:`LeaseSession.until_reachable`) up to
  ``outage_timeout`` after the first request that found it unreachable, then fails with
  one :class:`~rendezvous.api.RendezvousError` line (:meth:`LeaseSession.outage_error`).

Whenever the member should look at the world again (a new lease, the backend reachable
again after an outage, the session broken), ``on_change`` is called.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from rendezvous.api import RendezvousError
from rendezvous.kv import KV, KVError, KVUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between two attempts of something that waits for an unreachable backend.
OUTAGE_RETRY = 0.5


class LeaseSession:
    """A lease with its keys, kept alive until :meth:`stop`.

    Args:
        kv: the backend.
        ttl: the lease's TTL (``lease_ttl``).
        keep_alive_interval, max_attempts: ``keep_alive_interval``,
            ``keep_alive_max_attempt``.
        outage_timeout: how long a wait for an unreachable backend may last.
        on_change: called (from the keep-alive thread) when the member should look again.
    """

    def __init__(self, kv: KV, ttl: float, keep_alive_interval: float, max_attempts: int,
                 outage_timeout: float, on_change: Callable[[], None]) -> None:
        self.kv = kv
        self.ttl = ttl
        self.keep_alive_interval = keep_alive_interval
        self.max_attempts = max_attempts
        self.outage_timeout = outage_timeout
        self._on_change = on_change
        # Set by stop(): no more keep-alives (the lease stays until revoked or expired).
        self.done = threading.Event()
        self.lease: Any = None
        self.epoch = 0  # +1 per lease granted (keys put on the old one are gone)
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}  # on the lease: put again on a new one
        self._dirty = False  # a put failed: put them all again when the backend answers
        self._thread: threading.Thread | None = None
        self.broken: str | None = None  # the backend refuses the keep-alive
        self._outage_logged: float | None = None  # when this outage was logged
        # monotonic: the last time this member knew itself cut off from the backend
        # (see cut_off_at()), and the last keep-alive answered.
        self._cut_off_at = -1e9
        self._last_ok: float | None = None

    # ---------------------------------------------------------------- keys

    def holds(self, key: str, value: str) -> bool:
        """``key`` is on the lease with ``value`` (and no put of it failed since)."""
        return self.lease is not None and self._keys.get(key) == value and not self._dirty

    def put(self, key: str, value: str) -> None:
        """Put ``key`` on the lease (granted now if there is none) and remember it. If
        the put fails (KVError raised), the keep-alive puts it again once the backend
        answers."""
        if self.lease is None:
            self.lease = self.kv.lease_grant(self.ttl)
            self.epoch += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._keep_alive, name="tp-rdzv-keepalive",
                                            daemon=True)
            self._thread.start()
        with self._lock:
            self._keys[key] = value
            try:
                self.kv.put(key, value, self.lease)
            except KVError:
                self._dirty = True
                raise

    def _put_again(self) -> None:
        with self._lock:
            try:
                for key, value in self._keys.items():
                    self.kv.put(key, value, self.lease)
                self._dirty = False
            except KVError as e:
                logger.debug("rendezvous: putting the liveness keys again: %s", e)

    # ---------------------------------------------------------------- keep-alive

    def cut_off_at(self) -> float:
        """monotonic: the last time this member knew itself cut off from the backend: a
        request met it unreachable, its lease had expired, or no keep-alive was answered
        for longer than ``ttl - keep_alive_interval`` (now, if that is so now: a
        member's lease may have expired meanwhile whose cut began when this one's did).
        Until the others had time to come back too, what this member sees missing is no
        evidence (see Outages, above)."""
        now = time.monotonic()
        if self._last_ok is not None and not self.done.is_set() and \
                now - self._last_ok > self.ttl - self.keep_alive_interval:
            return now
        return self._cut_off_at

    def _keep_alive(self) -> None:
        failures = 0
        self._last_ok = time.monotonic()
        while not self.done.wait(self.keep_alive_interval if self._outage_logged is None
                                 else min(1.0, self.keep_alive_interval)):
            try:
                alive = self.kv.lease_keepalive(self.lease)
                # A network that drops everything makes a request hang rather than fail:
                # an answer this late says this member was cut off (see cut_off_at).
                now = time.monotonic()
                if self._last_ok is not None and \
                        now - self._last_ok > self.ttl - self.keep_alive_interval:
                    self._cut_off_at = now
                self._last_ok = now
            except KVUnavailable as e:
                self.note_outage(e)
                continue
            except KVError as e:
                failures += 1
                logger.warning("rendezvous keep-alive failed (%s/%s): %s", failures,
                               self.max_attempts, e)
                if failures >= self.max_attempts and not self.done.is_set():
                    self._break(f"the keep-alive was refused {failures} times: {e}")
                    failures = 0
                continue
            failures = 0
            self.note_reached()
            if self.done.is_set():
                return
            if not alive:
                self._renew()
            elif self._dirty:
                self._put_again()

    def _renew(self) -> None:
        with self._lock:
            try:
                lease = self.kv.lease_grant(self.ttl)
            except KVError as e:
                logger.warning("rendezvous: cannot renew the expired lease yet: %s", e)
                return
            self.lease = lease
            self.epoch += 1
            self._cut_off_at = time.monotonic()
        self._put_again()
        logger.warning("this node's rendezvous lease had expired (cut off from the backend "
                       "for longer than lease_ttl=%gs); it holds a new one with the same keys",
                       self.ttl)
        self._on_change()

    def _break(self, reason: str) -> None:
        logger.error("rendezvous: %s", reason)
        self.broken = reason
        self._on_change()

    def stop(self) -> None:
        """No more keep-alives: the lease expires after its TTL unless revoked."""
        self.done.set()

    def revoke(self) -> None:
        """End the lease now: its keys vanish."""
        if self.lease is not None:
            self.kv.lease_revoke(self.lease)

    # ---------------------------------------------------------------- outages

    def outage_s(self) -> float:
        """How long the backend has been unreachable (0: it is reachable)."""
        since = self.kv.outage_since
        return 0.0 if since is None else time.monotonic() - since

    def outage_error(self, e: KVError) -> RendezvousError:
        """The one line that ends a wait for the backend longer than ``outage_timeout``."""
        return RendezvousError(
            f"the rendezvous backend has been unreachable for {self.outage_s():.0f}s, longer "
            f"than outage_timeout={self.outage_timeout:g}s ({e})")

    def note_outage(self, e: KVError) -> None:
        self._cut_off_at = time.monotonic()
        if self._outage_logged is None:
            self._outage_logged = time.monotonic()
            logger.warning("the rendezvous backend is unreachable (%s); the workers keep "
                           "running, and what needs the backend waits for it (outage_timeout="
                           "%gs)", e, self.outage_timeout)

    def note_reached(self) -> None:
        if self._outage_logged is not None:
            logger.warning("the rendezvous backend is reachable again (after %.0fs)",
                           time.monotonic() - self._outage_logged)
            self._outage_logged = None
            self._on_change()  # the watches missed the outage's events

    def wait_for_backend(self, e: KVError) -> None:
        """Between two tries of something that needs the backend; RendezvousError once
        it has been unreachable for longer than ``outage_timeout``."""
        self.note_outage(e)
        if self.outage_s() > self.outage_timeout:
            raise self.outage_error(e)
        time.sleep(OUTAGE_RETRY)

    def until_reachable(self, fn: Callable[[], T]) -> T:
        """``fn()``, tried again while the backend is unreachable (KVUnavailable), up
        to ``outage_timeout`` (then RendezvousError)."""
        while True:
            try:
                return fn()
            except KVUnavailable as e:
                self.wait_for_backend(e)
