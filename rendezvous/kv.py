"""The small key-value interface the membership protocol runs on.

:mod:`rendezvous.membership` needs only these operations, so that the protocol is
written once and the backends stay thin:

- ``get`` a key with its *version* (an opaque token that changes on every write),
- ``cas``: write a key only if its version is still the one read (the fencing step),
- ``put`` a key, optionally attached to a *lease*,
- ``get_prefix``: every key under a prefix (``count_prefix``: just how many),
- leases: ``lease_grant`` / ``lease_keepalive`` / ``lease_revoke``; keys attached to a
  lease vanish when it expires (a dead agent's liveness key),
- ``watch_prefix``: a callback on any change under a prefix (may be emulated by polling:
  the protocol re-reads on its own timer too, so a watch only makes it faster),
- ``hosting``: whether this process holds the backend's only copy of the state (the
  c10d store's host), so that the others lose it when this process leaves.

Errors: :class:`KVUnavailable` when the backend cannot be reached *now* (etcd
restarting, a leader election, a network blip): it may come back, and the protocol
waits for it (``outage_timeout``). Any other :class:`KVError` is a refusal (bad
credentials, a c10d store whose host is gone) that waiting will not fix.
:attr:`KV.outage_since` says since when the backend has been unreachable.

Implementations: :class:`rendezvous.etcd.EtcdKV` (etcd v3) and
:class:`rendezvous.c10d.C10dKV` (a TCPStore). :class:`CountingKV` wraps either and
counts requests, for the scale benchmark.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Any, Callable


class KVError(RuntimeError):
    """The backend cannot be reached or refused the request; the message says why."""


class KVUnavailable(KVError):
    """The backend cannot be reached now, and may come back (a restart, a leader
    election, the network): waiting for it is worth it."""


class KV(abc.ABC):
    """A key-value store with versions, leases and prefix watches.

    Keys and values are ``str``; versions are opaque (``None``: the key is absent).
    """

    _outage_since: float | None = None

    @property
    def outage_since(self) -> float | None:
        """``time.monotonic()`` of the first request that met :class:`KVUnavailable`
        since the last one that reached the backend; None while it is reachable."""
        return self._outage_since

    @property
    def hosting(self) -> bool:
        """True if the backend's state lives in this process (the c10d store's host):
        it is lost for everyone when this process goes. False for a separate service
        (etcd)."""
        return False

    def _reached(self, ok: bool) -> None:
        """Backends call this after each request: it reached the backend, or met
        :class:`KVUnavailable`."""
        if ok:
            self._outage_since = None
        elif self._outage_since is None:
            self._outage_since = time.monotonic()

    @abc.abstractmethod
    def get(self, key: str) -> tuple[str | None, Any]:
        """(value, version) of ``key``; (None, None) if it is absent."""

    @abc.abstractmethod
    def cas(self, key: str, version: Any, value: str) -> bool:
        """Set ``key`` to ``value`` if its version is ``version`` (None: only if absent)."""

    @abc.abstractmethod
    def put(self, key: str, value: str, lease: Any = None) -> None:
        """Set ``key``; attached to ``lease`` (from :meth:`lease_grant`) if given."""

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> dict[str, str]:
        """Every live key under ``prefix`` with its value."""

    def count_prefix(self, prefix: str) -> int:
        """How many live keys are under ``prefix`` (backends may do it without the data)."""
        return len(self.get_prefix(prefix))

    @abc.abstractmethod
    def lease_grant(self, ttl: float) -> Any:
        """A new lease that expires ``ttl`` seconds after its last keep-alive."""

    @abc.abstractmethod
    def lease_keepalive(self, lease: Any) -> bool:
        """Refresh ``lease``; False if it has already expired (it cannot come back)."""

    @abc.abstractmethod
    def lease_revoke(self, lease: Any) -> None:
        """End ``lease`` now; its keys vanish."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` (from another thread) after changes under ``prefix``;
        returns a function that cancels the watch."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection (and anything this process hosts)."""


class CountingKV(KV):
    """Forwards to another KV and counts the requests it makes (the benchmark's meter).

    A keep-alive counts as one request; a watch as one (its events are pushed).
    """

    def __init__(self, inner: KV) -> None:
        self.inner = inner
        self.requests = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.requests += 1

    def get(self, key: str) -> tuple[str | None, Any]:
        self._count()
        return self.inner.get(key)

    def cas(self, key: str, version: Any, value: str) -> bool:
        self._count()
        return self.inner.cas(key, version, value)

    def put(self, key: str, value: str, lease: Any = None) -> None:
        self._count()
        self.inner.put(key, value, lease)

    def get_prefix(self, prefix: str) -> dict[str, str]:
        self._count()
        return self.inner.get_prefix(prefix)

    def count_prefix(self, prefix: str) -> int:
        self._count()
        return self.inner.count_prefix(prefix)

    def lease_grant(self, ttl: float) -> Any:
        self._count()
        return self.inner.lease_grant(ttl)

    def lease_keepalive(self, lease: Any) -> bool:
        self._count()
        return self.inner.lease_keepalive(lease)

    def lease_revoke(self, lease: Any) -> None:
        self._count()
        self.inner.lease_revoke(lease)

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        self._count()
        return self.inner.watch_prefix(prefix, callback)

    @property
    def outage_since(self) -> float | None:
        return self.inner.outage_since

    @property
    def hosting(self) -> bool:
        return self.inner.hosting

    def close(self) -> None:
        self.inner.close()
