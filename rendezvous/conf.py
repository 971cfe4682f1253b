"""torchrun's ``--rdzv-conf`` keys for the multi-node backends, parsed once.

Known keys (seconds unless noted): ``join_timeout`` (etcd's old ``timeout`` too),
``last_call_timeout``, ``close_timeout``, ``keep_alive_interval``,
``keep_alive_max_attempt`` (a count), ``heartbeat_timeout``, ``read_timeout``,
``lease_ttl`` (etcd lease / c10d heartbeat TTL; default ``heartbeat_timeout``),
``exit_barrier_timeout``, ``outage_timeout`` (how long what needs an unreachable
rendezvous backend waits for it: :mod:`rendezvous.membership`, "Outages"); the backends'
own keys are read by :mod:`rendezvous.etcd` and :mod:`rendezvous.c10d`. Durations are
finite numbers (``nan`` would wait forever). Unknown keys are ignored, as torchrun
ignores them, unless they look like a misspelled known key (``ca-cert``,
``join_timout``): that is an error, since the setting the user meant would silently
not apply.

Resilient mode (``--spares K``) leases are short (:func:`with_resilient_lease`): TTL 3 s,
a keep-alive every 0.5 s, unless ``--rdzv-conf`` names ``lease_ttl``, ``ttl``,
``heartbeat_timeout`` or ``keep_alive_interval``: a lost node is then noticed in about 3 s
(torchrun's 30 s is for jobs that restart everything anyway). See docs/architecture.md,
"Hosts that vanish (issue 23)", for why this gives no false alarm on a slow node.
"""

from __future__ import annotations

import difflib
import logging

from rendezvous.grammar import ConfigError, parse_duration, split_endpoint
from rendezvous.kv import KVError
from rendezvous.membership import Timeouts

logger = logging.getLogger(__name__)

_DURATIONS = ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval",
              "heartbeat_timeout", "read_timeout", "lease_ttl", "exit_barrier_timeout",
              "outage_timeout")
_ALIASES = {"timeout": "join_timeout", "ttl": "lease_ttl"}
BACKEND_KEYS = {"protocol", "cacert", "ca_cert", "cert", "ssl_cert", "key", "ssl_cert_key",
                "etcd_prefix", "user", "is_host", "store_type", "use_libuv",
                "rank", "local_addr"}


# Resilient mode's lease (issue 23). etcd's own floor is ~2 s (1.5 election timeouts,
# rounded up); 3 s leaves the keep-alive five tries (and 2.5 s of a stalled thread or
# network) before a live node is taken for lost.
RESILIENT_LEASE_TTL = "3"
RESILIENT_KEEP_ALIVE = "0.5"
_LEASE_KEYS = frozenset({"lease_ttl", "ttl", "heartbeat_timeout", "keep_alive_interval"})


def with_resilient_lease(conf: dict[str, str]) -> dict[str, str]:
    """``conf`` with resilient mode's short lease, unless it says anything about the
    lease itself (then it is the user's, as given)."""
    if _LEASE_KEYS & conf.keys():
        return conf
    return {**conf, "lease_ttl": RESILIENT_LEASE_TTL, "keep_alive_interval": RESILIENT_KEEP_ALIVE}


def timeouts_from_conf(conf: dict[str, str]) -> Timeouts:
    """:class:`Timeouts` from ``--rdzv-conf``; a bad value is a ConfigError."""
    t = Timeouts()
    given: set[str] = set()
    for raw_key, value in conf.items():
        key = _ALIASES.get(raw_key, raw_key)
        if key in _DURATIONS:
            seconds = parse_duration(value, raw_key)
            if seconds <= 0:
                raise ConfigError(f"--rdzv-conf {raw_key}={value!r} must be positive")
            setattr(t, key, seconds)
            given.add(key)
        elif key == "keep_alive_max_attempt":
            try:
                t.keep_alive_max_attempt = int(value)
            except ValueError:
                raise ConfigError(f"--rdzv-conf {key}={value!r} is not an integer") from None
            if t.keep_alive_max_attempt < 1:
                raise ConfigError(f"--rdzv-conf {key}={value!r} must be at least 1")
        elif key not in BACKEND_KEYS:
            logger.debug("ignoring unknown --rdzv-conf key %r", raw_key)
    if "lease_ttl" not in given:
        t.lease_ttl = t.heartbeat_timeout
    if t.keep_alive_interval >= t.lease_ttl:
        raise ConfigError(
            f"--rdzv-conf keep_alive_interval={t.keep_alive_interval:g} must be shorter than "
            f"the lease TTL ({t.lease_ttl:g}s: lease_ttl, or heartbeat_timeout)")
    return t


def _check_spelling(conf: dict[str, str]) -> None:
    """An unknown key that looks like a known one is a typo, not a key for some other
    backend: ``ca-cert=`` silently ignored would mean no TLS at all."""
    known = sorted({*_DURATIONS, *_ALIASES, *BACKEND_KEYS, "keep_alive_max_attempt",
                    "password"})
    for key in conf:
        if key in known:
            continue
        near = difflib.get_close_matches(key.lower().replace("-", "_"), known, n=1,
                                         cutoff=0.8)
        if near:
            raise ConfigError(f"--rdzv-conf: unknown key {key!r}; did you mean {near[0]!r}?")


def validate(backend: str, endpoint: str, conf: dict[str, str]) -> None:
    """Check a multi-node etcd/c10d setup before anything starts (ConfigError if bad).

    What needs the service itself (reachability, TLS handshake, password) is checked
    when the agent connects, within the configured timeout.
    """
    _check_spelling(conf)
    timeouts_from_conf(conf)
    if backend not in ("etcd", "etcd-v2", "etcd-v3", "c10d"):
        return
    if not endpoint:
        raise ConfigError(f"--rdzv-backend {backend} needs --rdzv-endpoint host:port")
    split_endpoint(endpoint.split("://", 1)[-1].rstrip("/"), 0)
    if backend == "c10d":
        from rendezvous.c10d import parse_bool

        try:
            parse_bool(conf.get("is_host"), "is_host")
        except KVError as e:
            raise ConfigError(str(e)) from None
        return
    from rendezvous.etcd import etcd_settings

    try:
        etcd_settings(endpoint, conf)
    except KVError as e:
        raise ConfigError(str(e)) from None
