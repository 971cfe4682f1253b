"""The node agent in torchrun-compatible mode: rendezvous, spawn, monitor, restart, stop.

One attempt runs as follows:

1. ``next_rendezvous`` forms the world and hosts a fresh store for it.
2. The agent lays out ``attempt_<n>`` and spawns this node's workers (from the main
   thread: see :mod:`tp_launch.procs.worker` for why).
3. It waits on the workers' pidfds and on a signal wake-up fd, so a worker's death or a
   signal is seen at once; ``--monitor-interval`` only bounds the wait.
4. All workers exit 0: the job succeeded (exit 0). A worker fails: the others get
   SIGTERM and, after ``--shutdown-timeout``, SIGKILL; then either a restart (a new
   round, a new store, ``TORCHELASTIC_RESTART_COUNT`` + 1) or, with no restarts left,
   the failure summary and exit 1. A handled signal is forwarded to the workers, which
   get the same grace period; the agent then exits 1.

Signals are honoured in every phase: in the select loop through the wake-up fd, and in
the blocking phases outside it (connecting to the rendezvous service, waiting for the
other nodes, the exit barrier, leaving) by raising at once (:class:`SignalWatch`). Log
lines keep torchrun's levels: restarts are INFO, as in torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

from rendezvous import RendezvousHandler, RendezvousInfo
from rendezvous.api import WorldChange
from rendezvous.wakeup import WakeupPipe
from tp_launch.agent.events import EventLog
from tp_launch.agent.failures import (
    ProcessFailure,
    copy_root_cause,
    first_observed,
    format_summary,
)
from tp_launch.agent.hangs import HangPolicy, OutputClock
from tp_launch.agent.worker_env import worker_argv, worker_env
from tp_launch.config import ConfigError, LaunchConfig
from tp_launch.procs.logs import AttemptLogs, ConsoleTail, LogLayout
from tp_launch.procs.worker import WorkerProcess, abort_with_stacks, stop_workers

logger = logging.getLogger(__name__)

_WORLD_CHANGED = object()  # selector tag of the rendezvous' world-change fd


class SignalReceived(BaseException):
    """A handled signal arrived. A BaseException, like KeyboardInterrupt: raised from the
    handler in a blocking phase, it must get through the backends' ``except Exception``
    (which turn errors into KVError) to the agent."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(f"received {sig.name}")
        self.sig = sig


@dataclass
class AttemptResult:
    """How one attempt ended: ``failures`` empty means every worker exited 0."""

    failures: list[ProcessFailure] = field(default_factory=list)
    root: ProcessFailure | None = None
    # Multi-node: the world changed under the attempt (another node failed, left, or
    # waits to be admitted).
    change: WorldChange | None = None


class SignalWatch:
    """Turns handled signals into a readable fd and a queue, for the agent's select.

    Outside the select loop the agent blocks elsewhere: connecting to the rendezvous
    service, waiting for the other nodes (up to ``join_timeout``), in the exit barrier.
    There it enters :meth:`interruptible`: a signal then raises :class:`SignalReceived`
    at once in the main thread, out of whatever wait it is in (``Event.wait``,
    ``time.sleep`` and gRPC's waits all run signal handlers), as torchrun's handler does.

    ``notices`` (a preemption notice, :mod:`tp_launch.agent.advance`) are signals of
    another kind: never forwarded, never raised, only queued for the agent's loop
    (:meth:`take_notices`); one that is also in ``signals`` is a notice.
    """

    def __init__(self, signals: list[signal.Signals],
                 notices: list[signal.Signals] | None = None) -> None:
        self._pipe = WakeupPipe()
        self.pending: list[signal.Signals] = []
        self._notices: list[signal.Signals] = []
        self._raise = False
        notices = notices or []
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in signals
                     if sig not in notices}
        self._old.update({sig: signal.signal(sig, self._on_notice) for sig in notices})
        self._old_wakeup = signal.set_wakeup_fd(self._pipe.write_fd, warn_on_full_buffer=False)

    @property
    def fd(self) -> int:
        return self._pipe.fd

    def _on_signal(self, signum: int, _frame: object) -> None:
        sig = signal.Signals(signum)
        self.pending.append(sig)
        if self._raise:
            self._raise = False  # once: the shutdown that follows runs to its end
            raise SignalReceived(sig)

    def _on_notice(self, signum: int, _frame: object) -> None:
        self._notices.append(signal.Signals(signum))

    def take_notices(self) -> list[signal.Signals]:
        """The notices received since the last call."""
        taken, self._notices = self._notices, []
        return taken

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A blocking phase: a handled signal (or one already pending) raises
        :class:`SignalReceived` in it."""
        self.raise_pending()
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def drain(self) -> None:
        self._pipe.drain()

    def raise_pending(self) -> None:
        if self.pending:
            raise SignalReceived(self.pending[0])

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._pipe.close()


class NodeAgent:
    """Runs this node's share of the job until it succeeds, fails, or is signalled.

    Args:
        config: the launch configuration.
        rdzv: the rendezvous handler for this job.
    """

    def __init__(self, config: LaunchConfig, rdzv: RendezvousHandler,
                 layout: LogLayout | None = None) -> None:
        self.config = config
        self.rdzv = rdzv
        self.workers: list[WorkerProcess] = []
        self.events = EventLog(config.event_log_handler)
        self.layout = layout or LogLayout(config, rdzv.run_id)

    def run(self, watch: SignalWatch) -> int:
        """The agent's whole life; returns tp-run's exit status."""
        cfg = self.config
        code = 1
        try:
            restart_count = 0
            while True:
                with watch.interruptible():
                    info = self.rdzv.next_rendezvous(cfg.nproc_per_node)
                result = self._run_attempt(info, restart_count, watch)
                self.events.record(
                    f"torchelastic.worker.status.{'FAILED' if result.failures else 'SUCCEEDED'}",
                    run_id=self.rdzv.run_id, role=cfg.role, group_rank=info.node_rank,
                    restart_count=restart_count,
                    failed_ranks=sorted(f.rank for f in result.failures))
                if not result.failures and result.change is None:
                    with watch.interruptible():
                        result.change = self._exit_barrier()
                if not result.failures and result.change is None:
                    logger.info("[%s] worker group successfully finished", cfg.role)
                    code = 0
                    return code
                if result.change is not None and not result.change.counts_as_failure:
                    # A node waits to be admitted: torchrun restarts the group to let it
                    # in, and does not count that against --max-restarts.
                    logger.info("[%s] %s; restarting the worker group", cfg.role,
                                result.change.detail)
                    continue
                if restart_count < cfg.max_restarts and self._may_restart():
                    if result.change is not None:
                        logger.info("[%s] worker group stopped: %s", cfg.role,
                                    result.change.detail)
                    restart_count += 1
                    logger.info(
                        "[%s] Worker group FAILED. %s/%s attempts left; will restart worker group",
                        cfg.role, cfg.max_restarts - restart_count + 1, cfg.max_restarts)
                    continue
                if result.change is not None:
                    logger.error("[%s] worker group stopped: %s", cfg.role, result.change.detail)
                if result.root is not None:  # None: another node failed, ours were done
                    print(format_summary(cfg.name, result.root, result.failures),
                          file=sys.stderr)
                    copy_root_cause(result.root)
                return code
        except SignalReceived as e:
            print(f"tp-run: stopped by {e.sig.name}; workers shut down", file=sys.stderr)
            return code
        finally:
            stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
            self._release_workers()
            try:
                with watch.interruptible():
                    self.rdzv.shutdown()
            except SignalReceived:
                pass  # leaving now: a lease expires, a hosted store closes with this process

    def _may_restart(self) -> bool:
        """Whether a failed attempt may be restarted (resilient mode can say no)."""
        return True

    def _run_attempt(self, info: RendezvousInfo, restart_count: int,
                     watch: SignalWatch) -> AttemptResult:
        cfg = self.config
        logs = self.layout.attempt(restart_count)
        global_ranks = {r: info.rank_offset + r for r in range(cfg.nproc_per_node)}
        tail = ConsoleTail(cfg, logs, global_ranks)
        try:
            self._spawn(info, restart_count, logs)
            return self._monitor(watch, global_ranks)
        except SignalReceived as e:
            logger.warning("Received %s death signal, shutting down workers", e.sig.name)
            stop_workers(self.workers, e.sig, cfg.shutdown_timeout)
            raise
        finally:
            stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
            tail.stop()
            self._release_workers()

    def _spawn(self, info: RendezvousInfo, restart_count: int, logs: AttemptLogs) -> None:
        # Every command line and environment first: one that cannot be built (a
        # ConfigError) must stop the launch before any worker has started.
        plans = [
            (local_rank,
             worker_argv(self.config, local_rank),
             worker_env(self.config, info, local_rank, restart_count,
                        logs.ranks[local_rank].error_file))
            for local_rank in range(self.config.nproc_per_node)
        ]
        for local_rank, argv, env in plans:
            rl = logs.ranks[local_rank]
            try:
                self.workers.append(WorkerProcess(argv, env, rl.stdout, rl.stderr, local_rank))
            except OSError as e:
                raise ConfigError(f"cannot start {argv[0]}: {e.strerror or e}") from None

    def _monitor(self, watch: SignalWatch, global_ranks: dict[int, int]) -> AttemptResult:
        """Wait until every worker exited 0, or one failed (then stop the others)."""
        cfg = self.config
        sel = selectors.DefaultSelector()
        sel.register(watch.fd, selectors.EVENT_READ, None)
        if self.rdzv.fd is not None:
            # Multi-node: readable when another node failed, left, or waits to join.
            sel.register(self.rdzv.fd, selectors.EVENT_READ, _WORLD_CHANGED)
        for w in self.workers:
            sel.register(w.pidfd, selectors.EVENT_READ, w)
        quiet = OutputClock(time.monotonic())
        hang_timeout = cfg.hang_timeout_for(resilient=False)
        try:
            running = set(self.workers)
            while running:
                world_changed = False
                for key, _ in sel.select(timeout=max(cfg.monitor_interval, 0.01)):
                    if key.data is None:
                        watch.drain()
                    elif key.data is _WORLD_CHANGED:
                        world_changed = self.rdzv.world_change() is not None
                    else:
                        sel.unregister(key.fd)
                watch.raise_pending()
                failed = []
                for w in list(running):
                    code = w.returncode
                    if code is None:
                        continue
                    running.discard(w)
                    if code != 0:
                        failed.append(w)
                if failed:
                    return self._fail(failed, global_ranks)
                if world_changed:
                    return self._world_changed(global_ranks)
                if hang_timeout:
                    self.abort_if_quiet(quiet, hang_timeout)
            return AttemptResult()
        finally:
            sel.close()

    def abort_if_quiet(self, quiet: OutputClock, timeout: float) -> None:
        """``--hang-timeout`` for a plain script: no worker wrote anything for that long:
        end them all with their stacks; their deaths are the attempt's failure."""
        running = [w for w in self.workers if w.returncode is None]
        silent = quiet.observe(time.monotonic(), sum(w.written() for w in running))
        # Before its first output (imports, data loading) a script gets the startup
        # budget, as a resilient one does before its first step.
        if not quiet.spoke:
            timeout = HangPolicy(timeout).startup
        if silent < timeout or not running:
            return
        logger.error("hang: no worker wrote anything for %.0f s (--hang-timeout %g); "
                     "ending them with their stacks (in their stderr)", silent, timeout)
        abort_with_stacks(running)

    def _fail(self, first: list[WorkerProcess], global_ranks: dict[int, int]) -> AttemptResult:
        cfg = self.config
        self._report_failure(first[0], global_ranks)
        stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
        # torchrun's order (its summary numbers failures so): the failures that ended
        # the attempt, then the peers it stopped, each by local rank.
        first_pids = {w.pid for w in first}
        ordered = sorted(self.workers, key=lambda w: (w.pid not in first_pids, w.local_rank))
        failures = [ProcessFailure.of_exit(w, global_ranks[w.local_rank])
                    for w in ordered if w.returncode]
        root = first_observed([f for f in failures if f.pid in first_pids])
        assert root is not None  # the first failures exited non-zero
        # torchrun's order: the peers' closing signals, then the first failure, once.
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                     root.exitcode, root.local_rank, root.pid, cfg.entrypoint[0])
        return AttemptResult(failures, root)

    def _report_failure(self, first: WorkerProcess, global_ranks: dict[int, int]) -> None:
        """Multi-node: tell the other nodes at once, so they stop their workers too."""
        self.rdzv.report_failure(f"rank {global_ranks[first.local_rank]} (local_rank "
                                 f"{first.local_rank}) exited with {first.returncode}")

    def _world_changed(self, global_ranks: dict[int, int]) -> AttemptResult:
        """Another node failed, left, or waits: stop ours; the caller re-rendezvouses."""
        cfg = self.config
        change = self.rdzv.world_change()
        assert change is not None  # the caller saw it; only the next round clears it
        # WARNING: torchrun's user learns of it from a local worker's failure (ERROR);
        # here the local workers are stopped first and would fail silently.
        logger.warning("[%s] %s: stopping the worker group", cfg.role, change.detail)
        stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
        failures = [ProcessFailure.of_exit(w, global_ranks[w.local_rank])
                    for w in sorted(self.workers, key=lambda w: w.local_rank) if w.returncode]
        return AttemptResult(failures, first_observed(failures), change)

    def _exit_barrier(self) -> WorldChange | None:
        """Multi-node: wait until every node succeeded (the change if one did not)."""
        if self.rdzv.fd is None:
            return None  # one fixed world: nothing to wait for
        logger.info("Local worker group finished (SUCCEEDED). Waiting for other agents to "
                    "finish")
        return self.rdzv.exit_barrier()

    def _release_workers(self) -> None:
        for w in self.workers:
            w.close()
        self.workers.clear()  # the list itself is shared (resilient mode's Processes)
