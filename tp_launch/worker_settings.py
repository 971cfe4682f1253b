"""What a resilient agent hands each of its processes: one typed, versioned record.

The agent (:mod:`tp_launch.agent.processes`) builds a :class:`WorkerSettings` for every
process it starts in resilient mode (``--spares``) and writes it into the process's
environment with :meth:`WorkerSettings.to_env`; the worker
(:mod:`tp_launch.resilient.runtime`) reads it back once with :func:`from_env`. This
module is the one place for those variables and for the constants both sides use
(:data:`RECOVERY_WAIT_S`); it imports nothing of ``tp_launch.agent`` or
``tp_launch.resilient`` (both import it), nor torch.

The variables (their names are part of the interface: scripts and tests read
``TP_RUN_CHANNEL`` and ``TP_RUN_SPARE``). An empty value is the same as an absent one.
:meth:`~WorkerSettings.to_env` writes every one of them, defaults included (so nothing
the agent itself inherited leaks through to its processes), except ``TP_RUN_PROGRESS``
when there is no board.

``TP_RUN_CHANNEL`` (:data:`ENV_SOCKET`)
    The path of the agent's Unix socket (:mod:`tp_launch.channel`). Absent: the process
    was not started by a resilient agent (plain torchrun, tp-run without ``--spares``):
    :func:`from_env` returns None and no other variable is read.
``TP_RUN_SETTINGS_VERSION`` (:data:`ENV_VERSION`)
    The record's format, an integer; this module reads :data:`VERSION` only, any other
    is an error (an agent and a worker of different tp_launch releases). Absent: 1 (the
    agents before the variable existed wrote exactly version 1's variables).
``TP_RUN_SLOT`` (:data:`ENV_SLOT`)
    The process's slot on its node, an integer >= 0. Required once the channel is set.
``TP_RUN_PROGRESS`` (:data:`ENV_PROGRESS`)
    The path of the agent's progress board (:mod:`tp_launch.progress`); each worker's
    per-rank record lies beside it. Default: none (no board, no record).
``TP_RUN_VERIFY_EVERY`` (:data:`ENV_VERIFY_EVERY`)
    ``--verify-every``: compare the ranks' state digests every N committed steps, an
    integer >= 0. Default 0: never.
``TP_RUN_SHARD_COPY_EVERY`` (:data:`ENV_SHARD_COPY_EVERY`)
    ``--shard-copy-every``: buddy copies of sharded state every N committed steps, an
    integer >= 0. Default 0: none.
``TP_RUN_HEARTBEAT`` (:data:`ENV_HEARTBEAT`)
    ``1``: the worker beats on the progress board; ``0``: it does not (hang and
    straggler detection are off, nobody reads it). Default 1.
``TP_RUN_SPARE`` (:data:`ENV_SPARE`)
    ``1``: the process starts as a parked spare (no ``RANK``, holds no state); ``0``: it
    starts as a rank. Default 0.
``TP_RUN_RECOVERY_WAIT_S`` (:data:`ENV_RECOVERY_WAIT`)
    How long a rank whose collective failed waits for the next generation, seconds (a
    positive number). Default :data:`RECOVERY_WAIT_S`. Also read by the agent from its own
    environment (:func:`recovery_wait_from`): set it there to change both sides at once
    (keep it above the rendezvous lease TTL; the tests shorten it to prove the outage
    paths in seconds).

``TP_RUN_DONORS`` (:data:`ENV_DONORS`)
    The most ranks that send the state to one newcomer at once, each a share of its large
    tensors, an integer >= 0. Default 0: every rank that holds it. Read by the agent from
    its own environment (:func:`donors_from`) and passed on: set it for tp-run (the
    benchmarks compare one donor with several this way).

Any other value (a slot that is not a non-negative integer, ``TP_RUN_HEARTBEAT=yes``, a
version this module does not know) is a :class:`SettingsError`: one line naming the
variable, raised by :func:`from_env` before the worker does anything.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

# How long a rank whose collective failed waits for its agent's next generation before
# it takes the error for the script's own and fails (the agent announces within
# milliseconds). The agent uses it too: ranks of other nodes that gave up waiting while
# the rendezvous backend was unreachable fail together, and that is not a crash loop.
RECOVERY_WAIT_S = 60.0

# The record's format: bump it when a variable changes meaning or a required one is added.
VERSION = 1

ENV_SOCKET = "TP_RUN_CHANNEL"
ENV_VERSION = "TP_RUN_SETTINGS_VERSION"
ENV_SLOT = "TP_RUN_SLOT"
ENV_PROGRESS = "TP_RUN_PROGRESS"
ENV_VERIFY_EVERY = "TP_RUN_VERIFY_EVERY"
ENV_SHARD_COPY_EVERY = "TP_RUN_SHARD_COPY_EVERY"
ENV_HEARTBEAT = "TP_RUN_HEARTBEAT"
ENV_SPARE = "TP_RUN_SPARE"
ENV_RECOVERY_WAIT = "TP_RUN_RECOVERY_WAIT_S"
ENV_DONORS = "TP_RUN_DONORS"

_COUNT = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() takes "²", which int() refuses
_FLAGS = {"0": False, "1": True}


class SettingsError(ValueError):
    """A worker setting in the environment that this process cannot use: one line that
    names the variable."""


@dataclass(frozen=True)
class WorkerSettings:
    """Everything a resilient agent tells one of its processes (see the module's
    docstring for each variable).

    Attributes:
        channel: the agent's socket path.
        slot: the process's slot on its node (>= 0).
        progress: the progress board's path; None: no board.
        verify_every: state digests compared every N commits; 0: never.
        shard_copy_every: buddy copies every N commits; 0: none.
        heartbeat: whether the worker beats on the progress board.
        spare: whether the process starts as a parked spare.
        recovery_wait_s: how long a rank waits for the next generation after a failed
            collective.
        donors: the most ranks sending the state to one newcomer; 0: all that hold it.
        version: the record's format (:data:`VERSION`).
    """

    channel: str
    slot: int
    progress: str | None = None
    verify_every: int = 0
    shard_copy_every: int = 0
    heartbeat: bool = True
    spare: bool = False
    recovery_wait_s: float = RECOVERY_WAIT_S
    donors: int = 0
    version: int = VERSION

    def __post_init__(self) -> None:
        if not self.channel:
            raise SettingsError(f"{ENV_SOCKET}: the agent's socket path is empty")
        for name, value in ((ENV_SLOT, self.slot), (ENV_VERIFY_EVERY, self.verify_every),
                            (ENV_SHARD_COPY_EVERY, self.shard_copy_every),
                            (ENV_DONORS, self.donors)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SettingsError(f"{name}={value!r}: not an integer >= 0")
        wait = self.recovery_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or \
                not 0 < wait < float("inf"):
            raise SettingsError(f"{ENV_RECOVERY_WAIT}={wait!r}: not a positive number of "
                                "seconds")

    def to_env(self) -> dict[str, str]:
        """The variables that carry this record (every one, defaults included; the board
        only when there is one)."""
        env = {
            ENV_SOCKET: self.channel,
            ENV_VERSION: str(self.version),
            ENV_SLOT: str(self.slot),
            ENV_VERIFY_EVERY: str(self.verify_every),
            ENV_SHARD_COPY_EVERY: str(self.shard_copy_every),
            ENV_HEARTBEAT: "1" if self.heartbeat else "0",
            ENV_SPARE: "1" if self.spare else "0",
            ENV_RECOVERY_WAIT: repr(float(self.recovery_wait_s)),
            ENV_DONORS: str(self.donors),
        }
        if self.progress:
            env[ENV_PROGRESS] = self.progress
        return env


def from_env(environ: Mapping[str, str] | None = None) -> WorkerSettings | None:
    """This process's settings, read from ``environ`` (default: :data:`os.environ`).

    Returns:
        None when ``TP_RUN_CHANNEL`` is absent or empty (not started by a resilient
        agent), else the record.

    Raises:
        SettingsError: a variable is malformed, ``TP_RUN_SLOT`` is missing, or the
            version is not :data:`VERSION`.
    """
    env = os.environ if environ is None else environ
    channel = env.get(ENV_SOCKET)
    if not channel:
        return None
    version = _count(env, ENV_VERSION, default=1)
    if version != VERSION:
        raise SettingsError(f"{ENV_VERSION}={version}: this process's tp_launch reads "
                            f"worker settings version {VERSION} only (the agent runs another "
                            f"tp_launch release?)")
    if not env.get(ENV_SLOT):
        raise SettingsError(f"{ENV_SLOT} is not set, but {ENV_SOCKET} is "
                            f"(the agent sets both)")
    return WorkerSettings(
        channel=channel,
        slot=_count(env, ENV_SLOT, default=0),
        progress=env.get(ENV_PROGRESS) or None,
        verify_every=_count(env, ENV_VERIFY_EVERY, default=0),
        shard_copy_every=_count(env, ENV_SHARD_COPY_EVERY, default=0),
        heartbeat=_flag(env, ENV_HEARTBEAT, default=True),
        spare=_flag(env, ENV_SPARE, default=False),
        recovery_wait_s=recovery_wait_from(env),
        donors=donors_from(env),
        version=version,
    )


def recovery_wait_from(environ: Mapping[str, str] | None = None) -> float:
    """``TP_RUN_RECOVERY_WAIT_S`` from ``environ`` (default: :data:`os.environ`), or
    :data:`RECOVERY_WAIT_S` when it is absent or empty.

    Raises:
        SettingsError: not a positive, finite number.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_RECOVERY_WAIT)
    if not raw:
        return RECOVERY_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise SettingsError(f"{ENV_RECOVERY_WAIT}={raw!r}: not a positive number of seconds")
    return value


def donors_from(environ: Mapping[str, str] | None = None) -> int:
    """``TP_RUN_DONORS`` from ``environ`` (default: :data:`os.environ`); 0 when absent.

    Raises:
        SettingsError: not an integer >= 0.
    """
    return _count(os.environ if environ is None else environ, ENV_DONORS, 0)


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if not raw:
        return default
    if not _COUNT.fullmatch(raw):
        raise SettingsError(f"{name}={raw!r}: not an integer >= 0")
    return int(raw)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if not raw:
        return default
    if raw not in _FLAGS:
        raise SettingsError(f"{name}={raw!r}: must be 0 or 1")
    return _FLAGS[raw]
