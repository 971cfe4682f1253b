"""The c10d backend: the membership protocol over a TCPStore, for users without etcd.

As torchrun's c10d rendezvous: the store runs on the endpoint host (port 29400 if the
endpoint has none), hosted by the agent that can bind it (``is_host`` forces the choice),
and every agent, the host included, talks to it as a client with ``read_timeout``.

What c10d cannot survive: the rendezvous state lives in the hosting agent's memory, so
losing that agent loses it for good. Its errors are therefore refusals
(:class:`~rendezvous.kv.KVError`), never outages (:class:`~rendezvous.kv.KVUnavailable`):
nothing waits ``outage_timeout`` for a store that cannot come back, and the other agents
stop (one error line) as soon as they notice. A host that is only frozen (stopped,
swapping) or cut off blocks every other agent's requests until it serves again (a
TCPStore request has no deadline of its own, and ``list_keys`` holds the GIL meanwhile:
an agent caught listing keys freezes whole, its workers running on), so
``outage_timeout`` cannot bound that wait; the job then goes on, nobody counted lost
for the stall (above).

A TCPStore has no revisions, leases or watches, so they are emulated:

- a key's *version* is its value; ``cas`` is ``compare_set``. The protocol's values carry
  a counter that every write increases, so a value never comes back (no ABA);
- a lease is a heartbeat key holding the writer's wall-clock time; a key put under a
  lease carries the lease id and reads as absent once the heartbeat is older than the
  TTL (clocks of the nodes must agree to well under the TTL, as for torchrun's c10d);
- a *stall* (a request that took longer than half a TTL, or as long a silence between
  two of this client's requests, which the keep-alive makes far more often: the store
  was not serving, its host frozen or cut off, or this process was frozen) is no
  evidence against anyone: for one TTL after it, a reader counts a lease alive if it
  was alive when the stall began, as etcd gives every lease a full TTL when it comes
  back. (The holder's own keep-alive gets no such grace: a lease it could not refresh
  in time is renewed, see :mod:`rendezvous.membership`.)
- a watch polls the prefix and calls back when it changed.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import socket
import threading
import time
import uuid
from typing import Any, Callable

from rendezvous import bounded_json
from rendezvous.grammar import split_endpoint
from rendezvous.kv import KV, KVError
from rendezvous.quiet import import_torch_quietly

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29400
_LEASE_TAG = "\x00lease:"
# compare_set(k, X, X) on a missing key returns X without writing: a non-blocking get.
_ABSENT = "\x00absent\x00"


class C10dKV(KV):
    """:class:`~rendezvous.kv.KV` over a TCPStore at ``host:port``.

    Args:
        host, port: the store's endpoint.
        is_host: True: host the store here (fail if the port is taken); False: only
            connect; None: host it if this machine can bind the endpoint, else connect.
        timeout: seconds per request and for the first connection (``read_timeout``).
        namespace: prefix of the emulation's own keys (leases).
        poll_interval: how often an emulated watch looks for changes.
    """

    def __init__(self, host: str, port: int, *, is_host: bool | None = None,
                 timeout: float = 60.0, namespace: str = "/tp-run",
                 poll_interval: float = 0.5) -> None:
        import_torch_quietly()
        from torch.distributed import TCPStore

        from rendezvous.store_host import StoreHost

        self._server: StoreHost | None = None
        self._ns = namespace.rstrip("/")
        self._poll = poll_interval
        self._closed = threading.Event()
        where = f"c10d store at {host}:{port}"
        if is_host is not False:
            try:
                self._server = StoreHost(host, port)
                self._server.wait_ready(timeout)
                logger.info("hosting the c10d rendezvous store on %s:%s", host, self._server.port)
                port = self._server.port
            except (OSError, RuntimeError, TimeoutError) as e:
                if self._server is not None:
                    self._server.close()
                    self._server = None
                if is_host:
                    raise KVError(f"is_host=true but cannot host the {where}: {e}") from None
        if self._server is None:
            _wait_connectable(host, port, timeout, where)
        try:
            self._store = TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
            self.close()
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KVError(f"cannot reach the {where} within {timeout:g}s ({first})") from None
        self._where = where
        self._lock = threading.Lock()  # one TCPStore client: one request at a time
        self._ttl: float | None = None  # of this client's lease: sets the stall threshold
        self._last_done = time.time()
        self._stall: tuple[float, float] | None = None  # the latest stall (wall clock)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.time()
        try:
            with self._lock:
                return fn(*args)
        except Exception as e:  # noqa: BLE001
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise KVError(f"{self._where}: {what} failed: {first}") from None
        finally:
            self._note_stall(start)

    def _note_stall(self, start: float) -> None:
        end, last = time.time(), self._last_done
        self._last_done = end
        if self._ttl is None:
            return
        began = last if start - last > self._ttl / 2 else start
        if end - began > self._ttl / 2:
            self._stall = (began, end)

    # ------------------------------------------------------------ leases

    def _lease_key(self, lease: str) -> str:
        return f"{self._ns}/__lease/{lease}"

    def _beat(self, raw: str | bytes) -> dict[str, float] | None:
        """A lease's heartbeat record, or None (with one line) if it is malformed: a
        lease whose record anyone overwrote with garbage is a lease gone."""
        try:
            beat = bounded_json.loads(raw, max_bytes=1024)
        except bounded_json.BoundsError as e:
            logger.error("rendezvous: a malformed lease record, taken as expired: %s", e)
            return None
        if not (isinstance(beat, dict) and set(beat) == {"t", "ttl"} and all(
                type(v) in (int, float) and math.isfinite(v) for v in beat.values())):
            logger.error("rendezvous: a malformed lease record, taken as expired: %.80r", raw)
            return None
        return beat

    def _lease_alive(self, lease: str, now: float) -> bool:
        raw = self._raw_get(self._lease_key(lease))
        if raw is None:
            return False
        beat = self._beat(raw)
        if beat is None or beat["t"] <= 0:
            return False  # revoked
        if now - beat["t"] <= beat["ttl"]:
            return True
        stall = self._stall  # alive when the stall began, and one TTL since it ended
        return stall is not None and stall[0] - beat["t"] <= beat["ttl"] and \
            now - stall[1] <= beat["ttl"]

    def lease_grant(self, ttl: float) -> Any:
        self._ttl = ttl if self._ttl is None else min(self._ttl, ttl)
        lease = uuid.uuid4().hex
        self._call("lease", self._store.set, self._lease_key(lease),
                   json.dumps({"t": time.time(), "ttl": ttl}))
        return lease

    def lease_keepalive(self, lease: Any) -> bool:
        key = self._lease_key(lease)
        raw = self._raw_get(key)
        if raw is None:
            return False
        beat = self._beat(raw)
        if beat is None or beat["t"] <= 0 or time.time() - beat["t"] > beat["ttl"]:
            return False  # expired: others may already have acted on it
        beat["t"] = time.time()
        return self._raw_cas(key, raw, json.dumps(beat))

    def lease_revoke(self, lease: Any) -> None:
        try:
            self._call("lease revoke", self._store.set, self._lease_key(lease),
                       json.dumps({"t": 0, "ttl": 0}))
        except KVError as e:
            logger.debug("%s", e)

    # ------------------------------------------------------------ keys

    def _raw_get(self, key: str) -> str | None:
        value = self._call("get", self._store.compare_set, key, _ABSENT, _ABSENT).decode()
        return None if value == _ABSENT else value

    def _raw_cas(self, key: str, expected: str | None, value: str) -> bool:
        got = self._call("compare_set", self._store.compare_set, key, expected or "", value)
        return got.decode() == value

    def _unwrap(self, raw: str | None, now: float) -> str | None:
        if raw is None or not raw.startswith(_LEASE_TAG):
            return raw
        lease, _, value = raw[len(_LEASE_TAG):].partition("\x00")
        return value if self._lease_alive(lease, now) else None

    def get(self, key: str) -> tuple[str | None, Any]:
        raw = self._raw_get(key)
        value = self._unwrap(raw, time.time())
        return (value, raw) if value is not None else (None, None)

    def cas(self, key: str, version: Any, value: str) -> bool:
        return self._raw_cas(key, version, value)

    def put(self, key: str, value: str, lease: Any = None) -> None:
        raw = value if lease is None else f"{_LEASE_TAG}{lease}\x00{value}"
        self._call("set", self._store.set, key, raw)

    def get_prefix(self, prefix: str) -> dict[str, str]:
        keys = sorted(k for k in self._call("list", self._store.list_keys)
                      if k.startswith(prefix))
        if not keys:
            return {}
        # multi_get would wait for a key deleted since the listing; our prefixes only
        # grow, and a missing key reads as absent.
        now = time.time()
        out = {}
        for key in keys:
            value = self._unwrap(self._raw_get(key), now)
            if value is not None:
                out[key] = value
        return out

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        stop = threading.Event()

        def poll() -> None:
            last: dict[str, str] | None = None
            while not stop.wait(self._poll) and not self._closed.is_set():
                try:
                    now = self.get_prefix(prefix)
                except KVError:
                    now = None
                if now != last:
                    last = now
                    callback()

        threading.Thread(target=poll, name="tp-c10d-watch", daemon=True).start()
        return stop.set

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def hosting(self) -> bool:
        return self._server is not None


def _wait_connectable(host: str, port: int, timeout: float, where: str) -> None:
    """Retry a plain TCP connect until ``timeout``: a clear error, and no C++ log walls
    from TCPStore's own retries."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(2.0, timeout))).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise KVError(f"cannot reach the {where} within {timeout:g}s "
                              f"({e.strerror or e})") from None
            time.sleep(0.2)


def parse_bool(value: str | None, key: str) -> bool | None:
    if value is None or value == "":
        return None
    v = value.strip().lower()
    if v in ("1", "true", "t", "yes", "y"):
        return True
    if v in ("0", "false", "f", "no", "n"):
        return False
    raise KVError(f"--rdzv-conf {key}={value!r} is not a boolean")


def c10d_kv_from_conf(endpoint: str, conf: dict[str, str], timeout: float,
                      namespace: str) -> C10dKV:
    """A :class:`C10dKV` for ``--rdzv-endpoint`` and torchrun's c10d ``--rdzv-conf`` keys."""
    if not endpoint:
        raise KVError("--rdzv-backend c10d needs --rdzv-endpoint host[:port]")
    host, port = split_endpoint(endpoint, DEFAULT_PORT)
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        raise KVError(f"rendezvous endpoint {endpoint!r}: cannot resolve {host!r} "
                      f"({e.strerror})") from None
    return C10dKV(host, port, is_host=parse_bool(conf.get("is_host"), "is_host"),
                  timeout=timeout, namespace=namespace)
