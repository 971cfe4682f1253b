"""Where worker output goes: torchrun's log directory, redirects, tee and filters.

Layout (identical to torchrun's ``DefaultLogsSpecs``)::

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}
    <log_dir>/<run_id>_<random>/attempt_<n>/filtered_{stdout,stderr}.log

A redirected stream is written to its file only; a tee'd stream is written to its file
and a tail thread copies each line to the console with a ``[<role><local_rank>]:``
prefix (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``). ``--local-ranks-filter`` hides
other ranks from the console: their untouched streams go to /dev/null, their tee'd
streams to the files only.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from string import Template
from typing import Callable, TextIO

from tp_launch.config import LaunchConfig, Std

logger = logging.getLogger(__name__)

_TAIL_INTERVAL = 0.1


@dataclass
class RankLogs:
    """Destinations for one local rank. ``None``: the agent's console."""

    stdout: str | None
    stderr: str | None
    tee_stdout: str | None
    tee_stderr: str | None
    error_file: str


@dataclass
class AttemptLogs:
    """Destinations for one attempt of this node's workers."""

    attempt_dir: str
    ranks: dict[int, RankLogs] = field(default_factory=dict)


class LogLayout:
    """Creates the run's log directory once and one attempt directory per restart.

    Args:
        config: the launch configuration (log dir, redirects, tee, filter).
        run_id: the job id, the prefix of the run directory.
    """

    def __init__(self, config: LaunchConfig, run_id: str) -> None:
        self._config = config
        self._run_id = run_id
        self._plugin = _load_logs_specs(config) if config.logs_specs else None
        self.is_temporary = config.log_dir is None and self._plugin is None
        self.disabled = config.log_dir == os.devnull
        self.run_dir = os.devnull
        if not self.disabled and self._plugin is None:
            base = config.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
            if os.path.isfile(base):
                raise NotADirectoryError(f"--log-dir {base} is a file")
            os.makedirs(base, exist_ok=True)
            self.base_dir = base
            self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)

    def attempt(self, restart_count: int) -> AttemptLogs:
        """Lay out (and empty) ``attempt_<restart_count>``."""
        cfg = self._config
        if self._plugin is not None:
            return self._plugin_attempt(restart_count)
        if self.disabled:
            return AttemptLogs(os.devnull, {
                r: RankLogs(os.devnull, os.devnull, None, None, "")
                for r in range(cfg.nproc_per_node)
            })
        attempt_dir = os.path.join(self.run_dir, f"attempt_{restart_count}")
        shutil.rmtree(attempt_dir, ignore_errors=True)
        os.makedirs(attempt_dir)
        logs = AttemptLogs(attempt_dir)
        for r in range(cfg.nproc_per_node):
            logs.ranks[r] = self._rank_logs(attempt_dir, str(r), r)
        return logs

    def spare_logs(self, logs: AttemptLogs, slot: int) -> RankLogs:
        """Destinations for a spare process (``attempt_<n>/spare_<slot>/``), streams
        handled as local rank 0's; it keeps them when it is promoted into a rank."""
        if self._plugin is not None or self.disabled or logs.attempt_dir == os.devnull:
            rl = logs.ranks[0]
            return RankLogs(rl.stdout and os.devnull, rl.stderr and os.devnull, None, None, "")
        return self._rank_logs(logs.attempt_dir, f"spare_{slot}", 0)

    def _rank_logs(self, attempt_dir: str, name: str, r: int) -> RankLogs:
        cfg = self._config
        rank_dir = os.path.join(attempt_dir, name)
        os.mkdir(rank_dir)
        tee = cfg.tee.get(r, Std.NONE)
        to_file = cfg.redirects.get(r, Std.NONE) | tee
        out = os.path.join(rank_dir, "stdout.log") if to_file & Std.OUT else None
        err = os.path.join(rank_dir, "stderr.log") if to_file & Std.ERR else None
        tee_out = out if tee & Std.OUT else None
        tee_err = err if tee & Std.ERR else None
        if cfg.local_ranks_filter and r not in cfg.local_ranks_filter:
            tee_out = tee_err = None
            out = out or os.devnull
            err = err or os.devnull
        return RankLogs(out, err, tee_out, tee_err, os.path.join(rank_dir, "error.json"))

    def _plugin_attempt(self, restart_count: int) -> AttemptLogs:
        """Ask a ``--logs-specs`` plugin (a torchrun LogsSpecs) where the streams go."""
        envs = {r: {"TORCHELASTIC_RUN_ID": self._run_id,
                    "TORCHELASTIC_RESTART_COUNT": str(restart_count)}
                for r in range(self._config.nproc_per_node)}
        dest = self._plugin.reify(envs)
        logs = AttemptLogs(os.path.dirname(dest.filtered_stdout) or os.devnull)
        for r in envs:
            logs.ranks[r] = RankLogs(
                dest.stdouts.get(r) or None, dest.stderrs.get(r) or None,
                dest.tee_stdouts.get(r) or None, dest.tee_stderrs.get(r) or None,
                dest.error_files.get(r, ""))
        return logs

    def remove_if_temporary(self) -> None:
        """Drop a temporary log dir after a successful run (nothing in it is needed)."""
        if self.is_temporary and not self.disabled:
            shutil.rmtree(self.base_dir, ignore_errors=True)


class ConsoleTail:
    """Copies tee'd log files to the console (and filtered copies) while workers run.

    Args:
        config: for the role, prefix template and duplicate filters.
        logs: this attempt's destinations.
        global_ranks: local rank -> global rank, for the prefix template.
    """

    def __init__(self, config: LaunchConfig, logs: AttemptLogs, global_ranks: dict[int, int]) -> None:
        self._finished = threading.Event()
        self._threads: list[threading.Thread] = []
        self._files: list[TextIO] = []
        prefixes = {r: _prefix(config, r, global_ranks[r]) for r in logs.ranks}
        for stream, console, filters, filtered_name in (
            ("stdout", sys.stdout, config.duplicate_stdout_filters, "filtered_stdout.log"),
            ("stderr", sys.stderr, config.duplicate_stderr_filters, "filtered_stderr.log"),
        ):
            files = {r: getattr(rl, f"tee_{stream}") for r, rl in logs.ranks.items()}
            files = {r: path for r, path in files.items() if path}
            for r, path in files.items():
                self._start(path, console, prefixes[r], None)
            if filters and not logs.attempt_dir == os.devnull:
                dup = open(os.path.join(logs.attempt_dir, filtered_name), "w",  # noqa: SIM115
                           errors="replace", buffering=1)
                self._files.append(dup)
                for r, path in files.items():
                    self._start(path, dup, prefixes[r],
                                lambda line, f=filters: any(n in line for n in f))

    def add(self, rl: RankLogs, name: str) -> None:
        """Also copy a process started later (a spare) to the console, as ``[<name>]:``."""
        for path, console in ((rl.tee_stdout, sys.stdout), (rl.tee_stderr, sys.stderr)):
            if path:
                self._start(path, console, f"[{name}]:", None)

    def _start(self, path: str, dst: TextIO, prefix: str,
               keep: Callable[[str], bool] | None) -> None:
        t = threading.Thread(target=_tail, args=(path, dst, prefix, keep, self._finished),
                             name=f"tp-tail-{os.path.basename(os.path.dirname(path))}",
                             daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Copy what is left in the files, then stop (call after the workers exited)."""
        self._finished.set()
        for t in self._threads:
            t.join(5)
        for f in self._files:
            f.close()


def _load_logs_specs(config: LaunchConfig) -> object:
    """Instantiate the ``torchrun.logs_specs`` entry point named by ``--logs-specs``."""
    from importlib import metadata

    from tp_launch.config import ConfigError

    eps = metadata.entry_points().select(group="torchrun.logs_specs", name=config.logs_specs)
    if not eps:
        raise ConfigError(
            f"--logs-specs={config.logs_specs!r}: no entry point of that name in the "
            "'torchrun.logs_specs' group")
    cls = next(iter(eps)).load()
    from torch.distributed.elastic.multiprocessing.api import Std as TorchStd

    def torch_std(m: dict[int, Std]) -> dict[int, TorchStd]:
        return {r: TorchStd(int(v)) for r, v in m.items()}

    return cls(log_dir=config.log_dir, redirects=torch_std(config.redirects),
               tee=torch_std(config.tee), local_ranks_filter=config.local_ranks_filter)


def _prefix(config: LaunchConfig, local_rank: int, rank: int) -> str:
    if config.log_line_prefix_template:
        return Template(config.log_line_prefix_template).safe_substitute(
            role_name=config.role, rank=rank, local_rank=local_rank)
    return f"[{config.role}{local_rank}]:"


def _tail(path: str, dst: TextIO, prefix: str, keep: Callable[[str], bool] | None,
          finished: threading.Event) -> None:
    while not os.path.exists(path):
        if finished.wait(_TAIL_INTERVAL):
            if not os.path.exists(path):
                return
    with open(path, errors="replace") as fp:
        while True:
            line = fp.readline()
            if line:
                if keep is None or keep(line):
                    dst.write(f"{prefix}{line}")
                    dst.flush()
            elif finished.is_set():
                return
            else:
                finished.wait(_TAIL_INTERVAL)
