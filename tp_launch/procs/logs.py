"""Where worker output goes: torchrun's log directory, redirects, tee and filters.

One module on purpose: the layout of the files and the threads that copy them to the
console share one rule set (what is tee'd, filtered or prefixed, and the one-warning
policy for a failing log disk) that would otherwise be split across two files.

Layout (identical to torchrun's ``DefaultLogsSpecs``)::

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}
    <log_dir>/<run_id>_<random>/attempt_<n>/filtered_{stdout,stderr}.log

A redirected stream is written to its file only; a tee'd stream is written to its file
and a tail thread copies each line to the console with a ``[<role><local_rank>]:``
prefix (or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``). ``--local-ranks-filter`` hides
other ranks from the console: their untouched streams go to /dev/null, their tee'd
streams to the files only. ``--log-dir /dev/null``: no files, every stream on the
console (as torchrun), the filter applied.

Resilient mode's spares write to pipes that the agent reads (:class:`SpareOutput`): each
line goes to ``attempt_<n>/spare_<slot>/{stdout,stderr}.log``, whatever the ranks'
streams do, since a parked spare's output (or the traceback of one that could not start)
is not the job's; once the spare takes a rank, its lines also reach the console as that
rank's would. The spare itself never writes to the log disk, so a full one cannot fail it.

Without ``--log-dir`` the base is a temporary directory, removed when tp-run exits
(success, failure or signal) unless the user redirected or tee'd streams into it.

The log disk is not the job's: an unwritable or full disk during the run (a directory
that cannot be made, a write that fails) is one warning line, and the streams that
would have gone to files go to the console. Only a ``--log-dir`` that cannot be used
at all at the start is an error (exit 2): the user asked for files there.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from string import Template
from typing import IO, TYPE_CHECKING, Any, Callable, TextIO

from tp_launch import control_files
from tp_launch.config import ConfigError, LaunchConfig, Std

if TYPE_CHECKING:  # torch only where a --logs-specs plugin is used
    from torch.distributed.elastic.multiprocessing.api import LogsSpecs

logger = logging.getLogger(__name__)

_TAIL_INTERVAL = 0.1
TEMP_LOG_PREFIX = "torchelastic_"  # torchrun's name for the temporary log dir


def temp_log_dirs() -> list[str]:
    """The temporary log dirs in the temp dir (this and other tools')."""
    base = tempfile.gettempdir()
    return sorted(os.path.join(base, n) for n in os.listdir(base)
                  if n.startswith(TEMP_LOG_PREFIX))


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


_write_failed_once = threading.Event()


def log_write_failed(what: str, e: OSError) -> None:
    """A log write failed (disk full, read-only, gone): said once per agent, at
    WARNING; the caller goes on without that log."""
    if _write_failed_once.is_set():
        logger.debug("cannot write %s: %s", what, e)
        return
    _write_failed_once.set()
    logger.warning("cannot write %s (%s); going on without log files where they fail",
                   what, e.strerror or e)


class LogLayout:
    """Creates the run's log directory once and one attempt directory per restart.

    Args:
        config: the launch configuration (log dir, redirects, tee, filter).
        run_id: the job id, the prefix of the run directory.

    Raises:
        ConfigError: ``--log-dir`` is a file or cannot be written.
    """

    def __init__(self, config: LaunchConfig, run_id: str) -> None:
        self._config = config
        self._run_id = run_id
        self._plugin = _load_logs_specs(config.logs_specs, config) if config.logs_specs \
            else None
        self.run_dir = os.devnull  # no run directory: no files (see _console_attempt)
        self._temp_base: str | None = None  # made here: removed by close()
        if config.log_dir == os.devnull or self._plugin is not None:
            return
        base = config.log_dir
        try:
            if base is None:
                base = self._temp_base = tempfile.mkdtemp(prefix=TEMP_LOG_PREFIX)
                logger.info("log directory set to: %s", base)
                if not self._kept():
                    control_files.mark_owner(base)  # removed by close(), or the next agent
            elif os.path.isfile(base):
                raise ConfigError(f"--log-dir {base} is a file")
            os.makedirs(base, exist_ok=True)
            # The job id names a directory *in* the log dir: "../x" or "a/b" would put it
            # elsewhere (torchrun 2.13 does), so its slashes become underscores.
            self.run_dir = tempfile.mkdtemp(prefix=f"{run_id.replace(os.sep, '_')}_", dir=base)
        except OSError as e:
            if config.log_dir is not None:
                raise ConfigError(f"--log-dir {base}: cannot write there "
                                  f"({e.strerror or e})") from None
            log_write_failed("a temporary log directory", e)
            self.close()
            self.run_dir = os.devnull

    def attempt(self, restart_count: int) -> AttemptLogs:
        """Lay out (and empty) ``attempt_<restart_count>``."""
        if self._plugin is not None:
            return self._plugin_attempt(self._plugin, restart_count)
        if self.run_dir == os.devnull:
            return self._console_attempt()
        attempt_dir = os.path.join(self.run_dir, f"attempt_{restart_count}")
        try:
            shutil.rmtree(attempt_dir, ignore_errors=True)
            os.makedirs(attempt_dir)
            logs = AttemptLogs(attempt_dir)
            for r in range(self._config.nproc_per_node):
                logs.ranks[r] = self._rank_logs(attempt_dir, str(r), r)
            return logs
        except OSError as e:
            log_write_failed(f"the log directory {attempt_dir}", e)
            return self._console_attempt()

    def _console_attempt(self) -> AttemptLogs:
        """No files (``--log-dir /dev/null``, or the disk failed): every stream on the
        console, but for the ranks ``--local-ranks-filter`` hides."""
        shown = self._config.local_ranks_filter
        return AttemptLogs(os.devnull, {
            r: RankLogs(None, None, None, None, "") if not shown or r in shown
            else RankLogs(os.devnull, os.devnull, None, None, "")
            for r in range(self._config.nproc_per_node)
        })

    def spare_logs(self, logs: AttemptLogs, slot: int) -> RankLogs:
        """The files a spare's :class:`SpareOutput` writes: ``attempt_<n>/spare_<slot>/``,
        whatever the ranks' streams do; none without an attempt directory."""
        if logs.attempt_dir != os.devnull and self._plugin is None:
            spare_dir = os.path.join(logs.attempt_dir, f"spare_{slot}")
            try:
                os.mkdir(spare_dir)
                return RankLogs(os.path.join(spare_dir, "stdout.log"),
                                os.path.join(spare_dir, "stderr.log"), None, None,
                                os.path.join(spare_dir, "error.json"))
            except OSError as e:
                log_write_failed(f"the log directory {spare_dir}", e)
        return RankLogs(None, None, None, None, "")

    def console_streams(self, local_rank: int, rank: int) -> dict[str, str | None]:
        """For a spare that takes ``local_rank``'s place as ``rank``: stream -> the
        console prefix its lines get ("" for none), or None where that rank's stream does
        not reach the console (redirected only, or filtered out)."""
        cfg = self._config
        shown = cfg.local_ranks_filter
        out: dict[str, str | None] = {}
        for name, std in (("stdout", Std.OUT), ("stderr", Std.ERR)):
            tee = cfg.tee.get(local_rank, Std.NONE) & std
            redirected = cfg.redirects.get(local_rank, Std.NONE) & std
            if shown and local_rank not in shown or redirected and not tee:
                out[name] = None
            else:
                out[name] = _prefix(cfg, local_rank, rank) if tee else ""
        return out

    def append(self, name: str, text: str) -> None:
        """Append ``text`` to a file of the run's directory (``recovery.jsonl``); a write
        that fails costs that record, never the job."""
        if self.run_dir == os.devnull:
            return
        path = os.path.join(self.run_dir, name)
        try:
            with open(path, "a") as f:
                f.write(text)
        except OSError as e:
            log_write_failed(path, e)

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

    def _plugin_attempt(self, plugin: LogsSpecs, restart_count: int) -> AttemptLogs:
        """Ask a ``--logs-specs`` plugin (a torchrun LogsSpecs) where the streams go."""
        envs = {r: {"TORCHELASTIC_RUN_ID": self._run_id,
                    "TORCHELASTIC_RESTART_COUNT": str(restart_count)}
                for r in range(self._config.nproc_per_node)}
        dest = plugin.reify(envs)
        logs = AttemptLogs(os.path.dirname(dest.filtered_stdout) or os.devnull)
        for r in envs:
            logs.ranks[r] = RankLogs(
                dest.stdouts.get(r) or None, dest.stderrs.get(r) or None,
                dest.tee_stdouts.get(r) or None, dest.tee_stderrs.get(r) or None,
                dest.error_files.get(r, ""))
        return logs

    def _kept(self) -> bool:
        """The temporary log dir holds logs the user asked for (redirects, tee)."""
        cfg = self._config
        return any(cfg.redirects.values()) or any(cfg.tee.values())

    def close(self) -> None:
        """tp-run exits: drop the temporary log dir (error files, spare logs: nothing the
        user asked for), unless streams were redirected or tee'd into it."""
        if self._temp_base is not None and not self._kept():
            shutil.rmtree(self._temp_base, ignore_errors=True)
            self._temp_base = None


class ConsoleTail:
    """Copies tee'd log files to the console (and filtered copies) while workers run.

    Args:
        config: for the role, prefix template and duplicate filters.
        logs: this attempt's destinations.
        global_ranks: local rank -> global rank, for the prefix template.
    """

    def __init__(self, config: LaunchConfig, logs: AttemptLogs,
                 global_ranks: dict[int, int]) -> None:
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
                dup_path = os.path.join(logs.attempt_dir, filtered_name)
                try:
                    dup = open(dup_path, "w", errors="replace", buffering=1)  # noqa: SIM115
                except OSError as e:
                    log_write_failed(dup_path, e)
                    continue
                self._files.append(dup)
                for r, path in files.items():
                    self._start(path, dup, prefixes[r], _containing(filters))

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


def _containing(filters: list[str]) -> Callable[[str], bool]:
    """Whether a line contains one of ``filters``."""
    return lambda line: any(n in line for n in filters)


def _load_logs_specs(name: str, config: LaunchConfig) -> LogsSpecs:
    """Instantiate the ``torchrun.logs_specs`` entry point ``name`` (``--logs-specs``)."""
    from importlib import metadata

    eps = metadata.entry_points().select(group="torchrun.logs_specs", name=name)
    if not eps:
        raise ConfigError(
            f"--logs-specs={name!r}: no entry point of that name in the "
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
                    try:
                        dst.write(f"{prefix}{line}")
                        dst.flush()
                    except (OSError, ValueError) as e:  # a full disk, a closed console
                        if isinstance(e, OSError):
                            log_write_failed(getattr(dst, "name", "the console"), e)
                        return
            elif finished.is_set():
                return
            else:
                finished.wait(_TAIL_INTERVAL)


class SpareOutput:
    """A spare's stdout and stderr, read by the agent from pipes (see the module
    docstring): every line to the spare's log file (best effort), to the console once
    :meth:`show` says how (the spare took a rank), and stderr's last lines kept for the
    report of a spare that died before parking.

    Args:
        popen: the spare, started with both streams piped.
        rl: its log files (None: none).
    """

    def __init__(self, popen: Any, rl: RankLogs) -> None:
        self._console: dict[str, str | None] = {"stdout": None, "stderr": None}
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.stderr_path = rl.stderr
        self._threads = [
            threading.Thread(target=self._pump, args=(name, pipe, path, console),
                             name=f"tp-spare-{name}-{popen.pid}", daemon=True)
            for name, pipe, path, console in (("stdout", popen.stdout, rl.stdout, sys.stdout),
                                              ("stderr", popen.stderr, rl.stderr, sys.stderr))
        ]
        for t in self._threads:
            t.start()

    def show(self, streams: dict[str, str | None]) -> None:
        """From now on, lines also go to the console with these prefixes (from
        :meth:`LogLayout.console_streams`; None: not shown)."""
        self._console = dict(streams)

    def last_line(self) -> str:
        """The last non-empty line the spare wrote to stderr ("" if none)."""
        return next((ln.strip() for ln in reversed(self._stderr_tail) if ln.strip()), "")

    def join(self, timeout: float) -> None:
        """Wait (bounded) until everything the exited spare wrote has been passed on."""
        for t in self._threads:
            t.join(timeout)

    def _pump(self, name: str, pipe: IO[bytes], path: str | None, console: TextIO) -> None:
        f: TextIO | None = None
        if path:
            try:
                f = open(path, "w", errors="replace", buffering=1)  # noqa: SIM115
            except OSError as e:
                log_write_failed(path, e)
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace")
                if name == "stderr":
                    self._stderr_tail.append(line)
                if f is not None:
                    try:
                        f.write(line)
                    except OSError as e:  # a full log disk: the file stops, not the spare
                        log_write_failed(path or "", e)
                        _close_quietly(f)
                        f = None
                prefix = self._console[name]
                if prefix is not None:
                    try:
                        console.write(prefix + line)
                        console.flush()
                    except (OSError, ValueError):
                        pass
        _close_quietly(f)


def _close_quietly(f: TextIO | None) -> None:
    if f is not None:
        try:
            f.close()
        except OSError:
            pass  # its buffer cannot be written either
