"""An in-memory :class:`~rendezvous.kv.KV` on a fake clock, for the membership's unit tests.

:class:`MemStore` is the server: keys with versions (a global revision, as etcd's
``mod_revision``), leases that expire when :class:`FakeClock` passes their TTL without a
keep-alive (their keys vanish, watches fire), prefix watches whose callbacks run at once
in the writer's thread, and an outage switch (``unreachable``: every request raises
:class:`~rendezvous.kv.KVUnavailable`). :class:`MemKV` is one member's client: closing
it leaves the store to the others. No thread, no sleep: time moves only when a test
(or a member's pause) advances the clock.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from rendezvous.kv import KV, KVError, KVUnavailable


class FakeClock:
    """Monotonic and wall time that move only when told; a pause advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._on_advance: list[Callable[[], None]] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for f in self._on_advance:
            f()


class MemStore:
    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.clock._on_advance.append(self.expire_leases)
        self.lock = threading.RLock()
        self.data: dict[str, tuple[str, int, int | None]] = {}  # key -> value, version, lease
        self.leases: dict[int, tuple[float, float]] = {}  # id -> ttl, expiry
        self.watches: dict[int, tuple[str, Callable[[], None]]] = {}
        self._ids = itertools.count(1)
        self.revision = 0
        self.unreachable = False
        self.cas_hook: Callable[[str], None] | None = None  # runs before each cas (races)

    def client(self) -> MemKV:
        return MemKV(self)

    def _fire(self, keys: list[str]) -> None:
        callbacks = [cb for prefix, cb in list(self.watches.values())
                     if any(k.startswith(prefix) for k in keys)]
        for cb in callbacks:
            cb()

    def set(self, key: str, value: str, lease: Any = None) -> None:
        with self.lock:
            self.revision += 1
            self.data[key] = (value, self.revision, lease)
        self._fire([key])

    def expire(self, lease: int) -> None:
        """The lease ends now (as its TTL passing without a keep-alive)."""
        with self.lock:
            self.leases.pop(lease, None)
            gone = [k for k, (_, _, le) in self.data.items() if le == lease]
            for k in gone:
                del self.data[k]
        self._fire(gone)

    def expire_leases(self) -> None:
        for lease, (_, expiry) in list(self.leases.items()):
            if expiry <= self.clock.now:
                self.expire(lease)


class MemKV(KV):
    """One client of a :class:`MemStore`."""

    def __init__(self, store: MemStore) -> None:
        self.store = store
        self.requests = 0
        self._watches: list[int] = []

    def _request(self) -> MemStore:
        self.requests += 1
        if self.store.unreachable:
            self._reached(False)
            raise KVUnavailable("the in-memory store is unreachable")
        self._reached(True)
        return self.store

    def get(self, key: str) -> tuple[str | None, Any]:
        s = self._request()
        with s.lock:
            value, version, _ = s.data.get(key, (None, None, None))
        return value, version

    def cas(self, key: str, version: Any, value: str) -> bool:
        s = self._request()
        if s.cas_hook is not None:
            hook, s.cas_hook = s.cas_hook, None
            hook(key)
        with s.lock:
            current = s.data.get(key)
            if (current[1] if current is not None else None) != version:
                return False
            s.revision += 1
            s.data[key] = (value, s.revision, None)
        s._fire([key])
        return True

    def put(self, key: str, value: str, lease: Any = None) -> None:
        s = self._request()
        if lease is not None and lease not in s.leases:
            raise KVError(f"lease {lease} not found")  # etcd refuses a put on a lost lease
        s.set(key, value, lease)

    def get_prefix(self, prefix: str) -> dict[str, str]:
        s = self._request()
        with s.lock:
            return {k: v for k, (v, _, _) in s.data.items() if k.startswith(prefix)}

    def lease_grant(self, ttl: float) -> Any:
        s = self._request()
        with s.lock:
            lease = next(s._ids)
            s.leases[lease] = (ttl, s.clock.now + ttl)
        return lease

    def lease_keepalive(self, lease: Any) -> bool:
        s = self._request()
        with s.lock:
            if lease not in s.leases:
                return False
            ttl, _ = s.leases[lease]
            s.leases[lease] = (ttl, s.clock.now + ttl)
        return True

    def lease_revoke(self, lease: Any) -> None:
        self._request().expire(lease)

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        s = self._request()
        wid = next(s._ids)
        s.watches[wid] = (prefix, callback)
        self._watches.append(wid)
        return lambda: s.watches.pop(wid, None) and None

    def close(self) -> None:
        for wid in self._watches:
            self.store.watches.pop(wid, None)
