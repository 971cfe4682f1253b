"""The value grammars the launcher and the rendezvous backends share, and their error.

:class:`ConfigError` is the error for a setting tp-run cannot use; its message is shown
to the user as is (``tp-run: error: ...``, exit status 2). :mod:`tp_launch.config`
re-exports it with the launcher's own grammars, which build on these.

- :func:`split_endpoint`: ``host``, ``host:port`` or ``[IPv6]:port`` (torchrun's
  ``--rdzv-endpoint``), a port in 0..65535;
- :func:`parse_duration`: a ``--rdzv-conf`` duration, a finite number of seconds
  (``nan`` would wait forever); whether it must be positive is the caller's rule.
"""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A launch option has a value tp-run cannot use; the message is shown as is."""


def split_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``"host:port"``, ``"host"``, ``"[::1]:port"`` -> (host, port)."""
    endpoint = endpoint.strip()
    host, port = endpoint, default_port
    if endpoint.startswith("["):
        close = endpoint.find("]")
        host = endpoint[1:close]
        rest = endpoint[close + 1 :]
        if rest.startswith(":"):
            port = _port(rest[1:], endpoint)
    elif endpoint.count(":") == 1:
        host, port_s = endpoint.split(":")
        port = _port(port_s, endpoint)
    if not host:
        raise ConfigError(f"rendezvous endpoint {endpoint!r} has no host")
    return host, port


def _port(value: str, endpoint: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ConfigError(
            f"rendezvous endpoint {endpoint!r}: port {value!r} is not an integer") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"rendezvous endpoint {endpoint!r}: port {port} is out of range")
    return port


def parse_duration(value: str, key: str) -> float:
    """A ``--rdzv-conf`` duration in seconds: a finite number (``nan`` would wait forever)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ConfigError(f"--rdzv-conf {key}={value!r} is not a finite number of seconds")
    return seconds
