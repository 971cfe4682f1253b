"""The etcd v3 backend: the membership protocol over etcd's leases, transactions, watches.

``--rdzv-backend etcd``, ``etcd-v2`` and ``etcd-v3`` all land here and all speak the v3
API (gRPC, through ``etcd-sdk-python`` / ``pyetcd``). torch's own etcd backends speak the
v2 API, which etcd 3.4 disables by default and 3.6 removed; an old torchrun command line
with ``etcd-v2`` therefore keeps working against a current etcd.

Settings (``--rdzv-conf``): ``protocol`` (http/https), ``cacert``/``ca_cert``,
``cert``/``ssl_cert``, ``key``/``ssl_cert_key``, ``etcd_prefix`` (default ``/tp-run``),
``user`` (or ``TP_RUN_ETCD_USER``); the password only from ``TP_RUN_ETCD_PASSWORD``,
never from the command line (it would show in ``ps``), only over TLS (never in clear
text), and never passed on to the workers (:mod:`tp_launch.agent.worker_env`). They are
checked in one place: :func:`etcd_settings` (the command line's rules) builds an
:class:`EtcdSettings`, which checks what every connection needs (both halves of a
client certificate and of a login, TLS files that exist); :class:`EtcdKV` builds one
from its own arguments too.

Why a version is etcd's ``mod_revision``: every write bumps it, so a compare on it in a
transaction is a compare-and-swap that no stale writer can pass.

Outages (etcd restarted, a leader election, a rolling upgrade): a request that cannot
reach etcd (gRPC ``UNAVAILABLE`` or ``DEADLINE_EXCEEDED``) raises
:class:`~rendezvous.kv.KVUnavailable`, which the protocol waits out; anything else etcd
answers is a plain :class:`~rendezvous.kv.KVError`. The channel retries its connection
every second or two (gRPC's default backoff grows to two minutes, which would add up
to two minutes to every outage). A watch whose stream breaks (etcd went away; pyetcd
also drops every watch after any failed request) is armed again in the background until
etcd answers, and then fires once, since the events of the gap are lost. An "invalid
auth token" answer (etcd forgot or expired this client's token) makes the client log in
again, once per request. Leases need nothing: etcd keeps them across
a restart and gives each its full TTL again when a leader takes over, so no lease
expires because etcd was down.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from rendezvous.grammar import split_endpoint
from rendezvous.kv import KV, KVError, KVUnavailable
from rendezvous.quiet import import_grpc_quietly

logger = logging.getLogger(__name__)

PASSWORD_ENV = "TP_RUN_ETCD_PASSWORD"
USER_ENV = "TP_RUN_ETCD_USER"


def _describe(e: BaseException) -> str:
    """A one-line reason from a gRPC error (or anything else)."""
    details = getattr(e, "details", None)
    if callable(details):
        try:
            text = details()
            code = e.code().name  # type: ignore[attr-defined]
            return f"{code}: {text}" if text else code
        except Exception:  # noqa: BLE001 - best effort only
            pass
    return str(e) or type(e).__name__


def _unavailable(e: BaseException) -> bool:
    """Whether ``e`` says etcd cannot be reached now (as opposed to a refusal)."""
    import grpc
    from pyetcd import exceptions

    if isinstance(e, (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                      exceptions.NoServerAvailableError, exceptions.WatchTimedOut)):
        return True
    code = getattr(e, "code", None)
    return isinstance(e, grpc.RpcError) and callable(code) and \
        code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# Seconds between two attempts to re-arm a broken watch, and the gRPC channel's
# reconnection backoff (milliseconds): etcd is back within a second or two of a restart.
_REARM_INTERVAL = 0.5
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500),
                    ("grpc.min_reconnect_backoff_ms", 500),
                    ("grpc.max_reconnect_backoff_ms", 2000)]


class EtcdKV(KV):
    """:class:`~rendezvous.kv.KV` over one etcd v3 endpoint.

    Args:
        host, port: the etcd client endpoint.
        timeout: seconds per request (``read_timeout``).
        connect_timeout: how long to keep trying to reach etcd at start.
        ca_cert, cert, key: TLS files (``ca_cert`` alone: server-authenticated TLS).
        user, password: etcd authentication (both or neither).
    """

    def __init__(self, host: str, port: int, *, timeout: float = 10.0,
                 connect_timeout: float = 30.0, ca_cert: str | None = None,
                 cert: str | None = None, key: str | None = None,
                 user: str | None = None, password: str | None = None) -> None:
        EtcdSettings(host, port, ca_cert, cert, key, user, password)  # raises if unusable
        # The agent forks its workers (and exec's at once): gRPC's fork handlers are not
        # needed, and with them on, every spawn logs "Other threads are currently calling
        # into gRPC, skipping fork() handlers".
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        import_grpc_quietly()
        import grpc
        import pyetcd
        from pyetcd import etcdrpc
        from pyetcd.client import Endpoint, MultiEndpointEtcd3Client

        self._timeout = timeout
        where = f"etcd at {host}:{port}"
        creds = None
        if ca_cert or cert or key:
            creds = MultiEndpointEtcd3Client.get_secure_creds(ca_cert, key, cert)
        # pyetcd marks an endpoint "failed" for 300 s after one transient error and then
        # refuses to use it; with a single endpoint that would turn a blip into an outage.
        endpoint = Endpoint(host, port, secure=creds is not None, creds=creds, time_retry=0.0,
                            opts=_CHANNEL_OPTIONS)
        deadline = time.monotonic() + connect_timeout
        last = ""
        while True:
            try:
                self._client = MultiEndpointEtcd3Client(
                    endpoints=[endpoint], timeout=timeout, user=user, password=password)
                if creds is None:
                    # pyetcd sends the auth token twice: as metadata, and as call
                    # credentials, which gRPC refuses on a plain-text channel.
                    self._client.call_credentials = None
                # The raw stub, not client.status(): pyetcd's wrapper drops gRPC's
                # details (which say "handshake failed", "connection refused"...).
                self._client.maintenancestub.Status(
                    etcdrpc.StatusRequest(), timeout, credentials=self._client.call_credentials,
                    metadata=self._client.metadata)
                break
            except grpc.RpcError as e:
                last = _describe(e)
                if e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.PERMISSION_DENIED,
                                grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.FAILED_PRECONDITION):
                    raise KVError(f"{where} refused the login: {last}") from None
            except pyetcd.exceptions.Etcd3Exception as e:
                last = _describe(e)
            if time.monotonic() > deadline:
                endpoint.close()
                raise KVError(f"cannot reach {where} within {connect_timeout:g}s "
                              f"({'TLS, ' if creds else ''}last error: {last})")
            time.sleep(0.5)
        self._tx = self._client.transactions
        self._where = where
        self._login = (user, password) if user else None
        self._closed = threading.Event()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for attempt in range(2):
            try:
                result = fn(*args, **kwargs)
                self._reached(True)
                return result
            except Exception as e:  # grpc.RpcError or pyetcd's wrappers of it
                why = _describe(e)
                if attempt == 0 and self._login and "invalid auth token" in why:
                    self._log_in_again()
                    continue
                if "user name is empty" in why:
                    why += (f" (this etcd requires a login: --rdzv-conf user=... and "
                            f"{PASSWORD_ENV})")
                if _unavailable(e):
                    self._reached(False)
                    raise KVUnavailable(f"{self._where}: {what} failed: {why}") from None
                raise KVError(f"{self._where}: {what} failed: {why}") from None
        raise AssertionError("unreachable")

    def _log_in_again(self) -> None:
        """etcd forgot (or expired) this client's token: a new one (the watcher is
        rebuilt with it on the next watch)."""
        from pyetcd import etcdrpc

        user, password = self._login  # type: ignore[misc]
        try:
            resp = self._client.authstub.Authenticate(
                etcdrpc.AuthenticateRequest(name=user, password=password), self._timeout)
        except Exception as e:  # noqa: BLE001 - the retried request reports the failure
            logger.debug("etcd login: %s", _describe(e))
            return
        self._client.metadata = (("token", resp.token),)
        self._client._clear_old_stubs()

    def get(self, key: str) -> tuple[str | None, Any]:
        value, meta = self._call("get", self._client.get, key)
        if value is None:
            return None, None
        return value.decode(), meta.mod_revision

    def cas(self, key: str, version: Any, value: str) -> bool:
        compare = (self._tx.create(key) == 0) if version is None else \
            (self._tx.mod(key) == version)
        ok, _ = self._call("transaction", self._client.transaction,
                           compare=[compare], success=[self._tx.put(key, value)], failure=[])
        return bool(ok)

    def put(self, key: str, value: str, lease: Any = None) -> None:
        self._call("put", self._client.put, key, value, lease=lease)

    def get_prefix(self, prefix: str) -> dict[str, str]:
        items = self._call("get", lambda: list(self._client.get_prefix(prefix)))
        return {meta.key.decode(): value.decode() for value, meta in items}

    def count_prefix(self, prefix: str) -> int:
        response = self._call("count", self._client.get_prefix_response, prefix,
                              count_only=True)
        return int(response.count)

    def lease_grant(self, ttl: float) -> Any:
        # etcd leases have whole-second TTLs, and etcd enforces a minimum (its
        # heartbeat x 1.5 or so); round up so a short TTL is never shorter than asked.
        lease = self._call("lease grant", self._client.lease, max(1, int(-(-ttl // 1))))
        return lease.id

    def lease_keepalive(self, lease: Any) -> bool:
        responses = self._call("keep-alive", lambda: list(self._client.refresh_lease(lease)))
        return bool(responses) and responses[-1].TTL > 0

    def lease_revoke(self, lease: Any) -> None:
        try:
            self._client.revoke_lease(lease)
        except Exception as e:  # noqa: BLE001 - an expired lease is already gone
            logger.debug("lease revoke: %s", _describe(e))

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """A watch that outlives its stream: when the stream breaks it is armed again
        (in the background, until etcd answers) and fires once more. Raises only for a
        refusal; with etcd unreachable, the watch is armed when etcd is back."""
        from pyetcd.watch import WatchResponse

        lock = threading.Lock()
        current: list[Any] = [None]  # the watch id of the live stream
        cancelled = threading.Event()

        def on_event(response: Any) -> None:
            if not isinstance(response, WatchResponse) and not cancelled.is_set():
                # None (pyetcd closed the watcher) or an error: the stream is gone.
                with lock:
                    current[0] = None
                threading.Thread(target=rearm, name="tp-etcd-rewatch", daemon=True).start()
            callback()  # either way: look again

        def arm() -> None:
            watch_id = self._call("watch", self._client.add_watch_prefix_callback, prefix,
                                  on_event)
            with lock:
                if cancelled.is_set():
                    self._cancel_watch(watch_id)
                else:
                    current[0] = watch_id

        def rearm() -> None:
            while not cancelled.is_set() and not self._closed.is_set():
                try:
                    arm()
                except KVUnavailable as e:
                    logger.debug("re-arming the watch on %s: %s", prefix, e)
                    cancelled.wait(_REARM_INTERVAL)
                    continue
                except KVError as e:  # refused: the protocol's own polls carry on
                    logger.warning("rendezvous: cannot watch %s again: %s", prefix, e)
                    return
                callback()  # the events of the gap are lost: look again
                return

        def cancel() -> None:
            cancelled.set()
            with lock:
                watch_id, current[0] = current[0], None
            if watch_id is not None:
                self._cancel_watch(watch_id)

        try:
            arm()
        except KVUnavailable:
            threading.Thread(target=rearm, name="tp-etcd-rewatch", daemon=True).start()
        return cancel

    def _cancel_watch(self, watch_id: Any) -> None:
        try:
            self._client.cancel_watch(watch_id)
        except Exception:  # noqa: BLE001 - closing anyway
            pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._client.close()
        except Exception:  # noqa: BLE001
            pass


@dataclass(frozen=True)
class EtcdSettings:
    """Where and how to reach etcd, checked on construction (:class:`EtcdKV` builds one
    from its arguments, :func:`etcd_settings` from the command line).

    Raises KVError (one line) for what no connection can use: half a client
    certificate, a TLS file that does not exist, a user without a password or a
    password without a user.
    """

    host: str
    port: int
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise KVError("--rdzv-conf: a client certificate needs both cert= and key=")
        for path in filter(None, (self.ca_cert, self.cert, self.key)):
            if not os.path.isfile(path):
                raise KVError(f"--rdzv-conf: TLS file not found: {path}")
        if bool(self.user) != bool(self.password):
            raise KVError(f"etcd authentication needs a user and a password (user via "
                          f"--rdzv-conf user=... or {USER_ENV}, password via "
                          f"{PASSWORD_ENV})")


def etcd_settings(endpoint: str, conf: dict[str, str]) -> EtcdSettings:
    """torchrun's etcd ``--rdzv-conf`` keys and ``TP_RUN_ETCD_*``, checked once.

    Raises KVError (one line) for what cannot work or is not safe: no endpoint, a
    protocol other than http/https, https without a CA, a password on the command
    line, a password that would travel in clear text (plain http), and what
    :class:`EtcdSettings` refuses. Certificates given with ``protocol=http`` (the
    default) mean TLS.
    """
    if not endpoint:
        raise KVError("--rdzv-backend etcd needs --rdzv-endpoint host:port (the etcd server)")
    if "://" in endpoint:  # accept http://host:port as torch's etcd backend does
        scheme, endpoint = endpoint.split("://", 1)
        conf = {**conf, "protocol": scheme}
    host, port = split_endpoint(endpoint.rstrip("/"), 2379)
    if "password" in conf:
        raise KVError(f"--rdzv-conf password=... would show in the process list; "
                      f"set {PASSWORD_ENV} instead")
    protocol = conf.get("protocol", "http").lower()
    if protocol not in ("http", "https"):
        raise KVError(f"--rdzv-conf protocol={protocol!r} must be http or https")
    ca_cert = conf.get("cacert") or conf.get("ca_cert")
    cert = conf.get("cert") or conf.get("ssl_cert")
    key = conf.get("key") or conf.get("ssl_cert_key")
    if protocol == "https" and not ca_cert:
        raise KVError("--rdzv-conf protocol=https needs cacert=<CA file> (etcd's CA)")
    user = conf.get("user") or os.environ.get(USER_ENV) or None
    password = os.environ.get(PASSWORD_ENV) or None
    tls = protocol == "https" or bool(cert or key or ca_cert)
    if password and not tls:
        raise KVError(f"{PASSWORD_ENV} is set but etcd is reached over plain http: the "
                      "password would travel in clear text (use protocol=https with "
                      "cacert=<CA file>)")
    return EtcdSettings(host, port, ca_cert, cert, key, user, password)


def etcd_kv_from_conf(endpoint: str, conf: dict[str, str], connect_timeout: float,
                      timeout: float) -> EtcdKV:
    """An :class:`EtcdKV` for ``--rdzv-endpoint`` and torchrun's etcd ``--rdzv-conf`` keys."""
    s = etcd_settings(endpoint, conf)
    return EtcdKV(s.host, s.port, timeout=timeout, connect_timeout=connect_timeout,
                  ca_cert=s.ca_cert, cert=s.cert, key=s.key, user=s.user, password=s.password)
