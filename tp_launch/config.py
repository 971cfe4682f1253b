"""The launch configuration: what one ``tp-run`` invocation asks for.

The click command in :mod:`tp_launch.cli` turns a torchrun-style command line into a
:class:`LaunchConfig`; the agent and the process layer read only this object, the
rendezvous backends the part of it that :class:`rendezvous.RendezvousParams` names.
The small parsers here hold torchrun's value grammars (``--nnodes MIN:MAX``,
``-r 0:1,1:2``, ``--rdzv-conf k=v,...``) once, with errors a user can act on. The
grammars the rendezvous backends share (endpoint, duration) and the error of them all,
:class:`ConfigError`, live in :mod:`rendezvous.grammar` (imports run ``tp_launch`` ->
``rendezvous`` only); ``ConfigError`` is re-exported here.
"""

from __future__ import annotations

import enum
import math
import os
import re
import signal
from dataclasses import dataclass, field

from rendezvous.grammar import ConfigError as ConfigError  # re-exported: tp_launch's error


class Std(enum.IntFlag):
    """Which standard streams of a worker go to a file (torchrun's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


# Resilient mode's hang limit floor: well under torch's own watchdogs (10 to 30 min),
# well over a rank-0 checkpoint save that nobody marked as a long phase.
DEFAULT_HANG_TIMEOUT = 300.0


@dataclass
class LaunchConfig:
    """Everything the agent needs to run one job on this node.

    Args:
        min_nodes, max_nodes: torchrun's ``--nnodes MIN:MAX``.
        nproc_per_node: workers on this node.
        rdzv_backend: ``static``, ``c10d``, ``etcd``...; after standalone resolution.
        rdzv_endpoint: ``host:port`` of the rendezvous service ("" if none).
        run_id: the job id (``--rdzv-id``), shared by every node of the job.
        rdzv_configs: parsed ``--rdzv-conf``.
        entrypoint: the worker command up to and including the script's own arguments.
        name: the job's name in the failure summary (the script or module).
        redirects, tee: per local rank, which streams go to files (and to the console).
        log_dir: base log directory (None: a temporary one), ``os.devnull``: no files.
        signals_to_handle: signals the agent forwards to its workers, then exits 1.
        shutdown_timeout: seconds between the polite signal and SIGKILL.
        spares: parked spare processes per node (resilient mode; 0: torchrun's behaviour).
        spare_policy: no spare ready when a rank dies: ``restart`` every worker (counted
            against max_restarts, like torchrun), ``wait`` for one up to
            ``spare_wait_timeout`` seconds, or ``fail``.
        verify_every: resilient mode: compare the ranks' state digests every N
            committed steps (0: only after each recovery).
        shard_copy_every: resilient mode, sharded state: buddy copies of each rank's
            state every N committed steps (:mod:`tp_launch.resilient.copies`; 0: off).
        hang_timeout: seconds without progress after which a hung rank is killed and
            replaced (resilient mode; the floor of an adaptive limit, see
            :mod:`tp_launch.agent.hangs`), or a plain script's workers restarted (no
            output for that long); 0: off; None: the default (resilient mode
            :data:`DEFAULT_HANG_TIMEOUT`, compatible mode off).
        straggler_factor: resilient mode: a rank that needs this many times its peers'
            time per step for ``straggler_window`` seconds migrates to a spare (0: off).
        on_preempt, preempt_signal: resilient mode: what ``preempt_signal`` does
            (``migrate`` this node's ranks, ``stop`` the job, ``ignore``: not handled);
            see :mod:`tp_launch.agent.advance`.
        health_check, health_interval: resilient mode: a shell command run every
            ``health_interval`` seconds; its first failure moves this node's ranks.
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    run_id: str = "none"
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    event_log_handler: str = "null"
    role: str = "default"
    entrypoint: list[str] = field(default_factory=list)
    name: str = ""
    log_dir: str | None = None
    logs_specs: str | None = None
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: set[int] | None = None
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    numa_binding: str | None = None
    signals_to_handle: list[signal.Signals] = field(
        default_factory=lambda: [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    )
    signals_to_handle_str: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    shutdown_timeout: float = 30.0
    virtual_local_rank: bool = False
    log_line_prefix_template: str | None = None
    # Resilient mode (tp-run only): parked spare processes per node, and what happens
    # when a rank dies and none is ready.
    spares: int = 0
    spare_policy: str = "restart"
    spare_wait_timeout: float = 300.0
    verify_every: int = 0
    shard_copy_every: int = 0
    hang_timeout: float | None = None
    straggler_factor: float = 2.0
    straggler_window: float = 60.0
    on_preempt: str = "ignore"
    preempt_signal: signal.Signals = signal.SIGUSR1
    health_check: str | None = None
    health_interval: float = 30.0

    def hang_timeout_for(self, resilient: bool) -> float:
        """The hang timeout in force (0: off): given, or the mode's default."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        return DEFAULT_HANG_TIMEOUT if resilient else 0.0


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4); anything else is a ConfigError."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes={value!r} is not N or MIN:MAX (integers)") from None
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes={value!r}: need 0 < MIN <= MAX")
    return lo, hi


def parse_nproc_per_node(value: str) -> int:
    """torchrun's --nproc-per-node grammar: an integer, or auto, cpu, gpu, xpu."""
    try:
        n = int(value)
    except ValueError:
        n = _count_devices(value)
    if n < 1:
        raise ConfigError(f"--nproc-per-node={value!r} must be at least 1")
    return n


def _cpu_count() -> int:
    """CPUs this process may use (affinity and cgroups respected), as torchrun counts."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _count_devices(kind: str) -> int:
    if kind == "cpu":
        return _cpu_count()
    if kind not in ("auto", "gpu", "xpu"):
        raise ConfigError(
            f"--nproc-per-node={kind!r} is not an integer or one of auto, cpu, gpu, xpu"
        )
    import torch  # only these values need it

    if kind == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--nproc-per-node=gpu: CUDA is not available on this machine")
        return torch.cuda.device_count()
    if kind == "xpu":
        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise ConfigError("--nproc-per-node=xpu: no XPU is available on this machine")
        return torch.xpu.device_count()
    if torch.accelerator.is_available():
        return torch.accelerator.device_count()
    return _cpu_count()


_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^(\d+:[0-3],)*(\d+:[0-3])$")


def parse_std_map(value: str, option: str, nproc: int) -> dict[int, Std]:
    """``-r``/``-t`` values: ``"3"`` for every rank, or ``"0:1,10:2"`` per local rank.

    Unlike torchrun 2.13, local ranks may have several digits; a rank that this
    node does not run is an error rather than silently ignored.
    """
    value = value.strip()
    if _STD_VALUE.match(value):
        return {r: Std(int(value)) for r in range(nproc)}
    if not _STD_MAPPING.match(value):
        raise ConfigError(
            f"{option}={value!r} is not 0-3 or a map like 0:1,1:2 (local_rank:0-3)"
        )
    out = {r: Std.NONE for r in range(nproc)}
    for item in value.split(","):
        rank_s, std_s = item.split(":")
        rank = int(rank_s)
        if rank >= nproc:
            raise ConfigError(
                f"{option}={value!r} names local rank {rank}, but this node runs "
                f"ranks 0..{nproc - 1} (--nproc-per-node={nproc})"
            )
        out[rank] = Std(int(std_s))
    return out


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` -> dict; torchrun's grammar (values may contain ':' but not ',')."""
    out: dict[str, str] = {}
    if not value.strip():
        return out
    for item in value.split(","):
        key, sep, val = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--rdzv-conf={value!r}: {item!r} is not key=value "
                "(expected k1=v1,k2=v2,...)"
            )
        out[key] = val.strip()
    return out


def parse_comma_list(value: str | list[str]) -> list[str]:
    """torchrun's duplicate-filter lists: comma separated, ``,,`` escapes a comma."""
    if isinstance(value, list):
        return value
    if not value:
        return []
    hold = "\0"
    return [item.replace(hold, ",") for item in value.replace(",,", hold).split(",")]


def parse_local_ranks_filter(value: str) -> set[int] | None:
    if not value:
        return None
    try:
        ranks = {int(v) for v in value.split(",")}
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter={value!r} must be a comma-separated list of "
            "integers, e.g. 0,1,2"
        ) from None
    return ranks


def parse_signals(value: str) -> list[signal.Signals]:
    sigs: list[signal.Signals] = []
    for name in value.split(","):
        name = name.strip()
        if not name:
            continue
        sig = getattr(signal, name, None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"--signals-to-handle: {name!r} is not a signal tp-run can handle")
        sigs.append(sig)
    return sigs


def parse_preempt_signal(value: str) -> signal.Signals:
    """``--preempt-signal``: a signal name (``SIGUSR1``, ``USR1``) or number."""
    name = value.strip().upper()
    sig: object = None
    if name.isdigit():
        try:
            sig = signal.Signals(int(name))
        except ValueError:
            sig = None
    else:
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
    if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP,
                                                       signal.SIGCHLD):
        raise ConfigError(f"--preempt-signal: {value!r} is not a signal tp-run can handle")
    return sig


def check_seconds(seconds: float, what: str) -> float:
    """A duration option (already a float): finite and not negative, or a ConfigError."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{what}={seconds!r} is not a finite, non-negative number of seconds")
    return seconds
