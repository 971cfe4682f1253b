"""This node's processes in resilient mode: ranks and spares in slots, and the spare pool.

Every process of an attempt runs in a *slot* (a number that names one process for the
attempt: slots only grow). :class:`Processes` starts a rank or a spare in a slot, with
its worker settings (:mod:`tp_launch.worker_settings`: the agent channel, its
slot, ...) in its environment; keeps the pool of spares filled (once the script
opts in, and with an exponential backoff while spares keep dying young:
:class:`~tp_launch.agent.control.SpareRestarts`); reports a spare that died, once per
streak of such deaths; shows a spare's output as its rank's once it takes one; and at
the end of the job lets the spares leave. What it keeps across attempts is job-wide:
whether the script opted in, the backoff, and whether "spares unused" was said.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import time

from tp_launch import progress
from tp_launch.agent.attempt import Attempt, Proc
from tp_launch.agent.control import SpareRestarts
from tp_launch.agent.decisions import replacement_wait, spares_to_start
from tp_launch.agent.failures import exit_description
from tp_launch.agent.worker_env import (PER_WORKER_VARS, spare_env, without_agent_secrets,
                                        worker_argv, worker_env)
from tp_launch.config import ConfigError, LaunchConfig
from tp_launch.procs import template
from tp_launch.procs.logs import LogLayout, RankLogs, SpareOutput
from tp_launch.procs.worker import WorkerProcess, signal_main_thread, spawn, stop_workers
from tp_launch.worker_settings import (
    SettingsError,
    WorkerSettings,
    donors_from,
    recovery_wait_from,
)

logger = logging.getLogger(__name__)

# The job is over: how long spares told to exit get to do so before they are stopped.
_SPARE_EXIT_S = 5.0


def missing_spares(at: Attempt) -> int:
    """How many spare processes ``at`` lacks now (:func:`spares_to_start` over the
    attempt's processes: those started, alive, holding no rank and not retired)."""
    starting = sum(1 for p in at.procs.values()
                   if at.slot_rank(p.slot) is None and p.worker.returncode is None
                   and p.slot not in at.retired)
    waiting = sum(1 for node in at.pending.no_spare.values() if node == at.world.node)
    recovering = at.recovery is not None and \
        time.time() - at.recovery.decided < replacement_wait(at.clock.step_s)
    return spares_to_start(at.pool, len(at.unplaced), waiting, starting, recovering)


class Processes:
    """Starts and keeps this node's processes (see the module's doc).

    Args:
        config: the launch configuration.
        layout: where the processes' logs go.
        workers: the agent's list of live worker processes (shared: every process
            started here is added to it, so the agent stops them all alike).
    """

    def __init__(self, config: LaunchConfig, layout: LogLayout,
                 workers: list[WorkerProcess]) -> None:
        self.config = config
        self.layout = layout
        self.workers = workers
        # A rank of this node said hello (the script uses tp_launch.resilient); until
        # then no spare is started, since a script that does not opt in would only run
        # (and crash, or write files) beside the ranks.
        self.opted_in = False
        self._restarts = SpareRestarts()
        self._said_unused = False
        # Ranks and spares are forked from it (tp_launch.procs.template; start_template).
        self.template: template.ProcessTemplate | None = None
        try:  # the ranks' wait for a generation, which this agent's decisions allow for
            self.recovery_wait_s = recovery_wait_from()
            self.donors = donors_from()
        except SettingsError as e:
            raise ConfigError(str(e)) from None

    def spawn(self, at: Attempt, slot: int, rl: RankLogs, spare: bool = False) -> Proc:
        """Start a rank (its slot is its local rank) or a spare in ``slot``."""
        cfg = self.config
        # A rank's device is its local rank; a spare's, the lowest one no live process
        # uses.
        device = at.free_device() if spare else slot
        make_env = spare_env if spare else worker_env
        env = make_env(cfg, at.info, device, at.restart_count, rl.error_file)
        env.update(WorkerSettings(
            channel=at.control.path, slot=slot, progress=at.board.path,
            verify_every=cfg.verify_every, shard_copy_every=cfg.shard_copy_every,
            # Without hang or straggler detection nobody reads the heartbeat.
            heartbeat=bool(cfg.hang_timeout_for(resilient=True) or cfg.straggler_factor),
            spare=spare, recovery_wait_s=self.recovery_wait_s, donors=self.donors).to_env())
        argv = worker_argv(cfg, device)
        try:
            worker = WorkerProcess(argv, env, rl.stdout, rl.stderr, device, piped=spare,
                                   template=self.template)
        except OSError as e:
            raise ConfigError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        self.workers.append(worker)
        proc = Proc(slot, worker, rl, output=SpareOutput(worker.popen, rl) if spare else None)
        at.procs[slot] = proc
        at.sel.register(worker.pidfd, selectors.EVENT_READ, ("exit", proc))
        return proc

    def opt_in(self, at: Attempt) -> None:
        """A rank said hello: the script uses tp_launch.resilient, spares start now."""
        if not at.spares_wanted:
            self.opted_in = at.spares_wanted = True
            self.spawn_missing(at)

    def spawn_missing(self, at: Attempt) -> None:
        """Start the spares this node lacks (the pool, plus one per rank of this node
        that still needs a process), unless none are wanted yet or the backoff after
        young deaths says wait."""
        if not at.spares_wanted or at.exiting or not self._restarts.ready(time.monotonic()):
            return
        n = missing_spares(at)
        if n and self._template_starting():
            return  # the next tick
        for _ in range(n):
            slot = at.next_slot
            at.next_slot += 1
            self.spawn(at, slot, self.layout.spare_logs(at.logs, slot), spare=True)

    def start_template(self) -> None:
        """Start the template this node's processes are forked from, where it can serve
        (:mod:`tp_launch.procs.template`): once per job, before its first ranks."""
        argv = worker_argv(self.config, 0)
        if self.template is None and template.forkable(argv) \
                and os.environ.get(template.ENV_SWITCH, "1") != "0":
            try:
                self.template = template.ProcessTemplate(
                    argv[0], without_agent_secrets(os.environ), PER_WORKER_VARS,
                    # Its own output is what importing torch prints (a warning that
                    # numpy is missing, say), which no process forked from it prints
                    # again: dropped. A template that fails is given up (logged).
                    lambda a, env, fds: spawn(a, env, subprocess.DEVNULL, subprocess.DEVNULL,
                                              fds))
            except OSError as e:  # the workers' own start will say what is wrong
                logger.info("no process template (%s): processes start anew", e)

    def wait_for_template(self) -> None:
        """Before an attempt's ranks start: the template's imports are what theirs would
        be (bounded; a template that does not come up is given up)."""
        if self.template is not None:
            self.template.wait_ready()

    def _template_starting(self) -> bool:
        """Whether the template still imports (spares wait for it, ticking on)."""
        return self.template is not None and self.template.starting()

    def close(self) -> None:
        """The job is over, every process stopped: stop the process template."""
        if self.template is not None:
            self.template.close()
            self.template = None

    def spare_died(self, at: Attempt, proc: Proc) -> None:
        """A spare (parked or still starting) died while the job goes on: report it (the
        first of a streak of such deaths), and start its replacement when the backoff
        says so."""
        w = proc.worker
        lifetime = (w.exit_time or time.time()) - w.started
        delay = self._restarts.died(lifetime, time.monotonic())
        how = exit_description(w.returncode)
        if not self._restarts.first_of_streak:
            logger.info("spare %s (pid %s) %s; the next spare starts in %.0f s", proc.slot,
                        w.pid, how, delay)
        elif proc.hello:
            logger.warning("parked spare %s (pid %s) %s; starting a new one (later, and "
                           "later, if spares keep dying)", proc.slot, w.pid, how)
        else:
            logger.error("spare %s (pid %s) %s before reaching tp_launch.resilient.run(): "
                         "%s; new spares start with a growing delay while this repeats",
                         proc.slot, w.pid, how, _spare_error(proc.output))
        self.spawn_missing(at)

    def say_unused(self) -> None:
        """A rank ended without ever saying hello: the script does not opt in."""
        if not self.opted_in and not self._said_unused:
            self._said_unused = True
            logger.warning("--spares %s unused: a rank ended without reaching "
                           "tp_launch.resilient.run() (a script that does not call it runs "
                           "as under torchrun)", self.config.spares)

    def show_as_rank(self, at: Attempt, slot: int, rank: int) -> None:
        """A spare took ``rank``: its output from now on appears as the rank's would."""
        output = at.procs[slot].output
        if output is not None:
            output.show(self.layout.console_streams(at.local_of.get(rank, 0), rank))

    def let_spares_leave(self, at: Attempt) -> None:
        """The job is over and the parked spares were told to exit: give them a moment to
        leave by themselves; what is left (spares still starting) is stopped quietly."""
        deadline = time.monotonic() + min(self.config.shutdown_timeout, _SPARE_EXIT_S)
        for proc in at.procs.values():
            if proc.hello:
                try:
                    proc.worker.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout,
                     level=logging.INFO)

    def stack_of(self, at: Attempt, slot: int) -> str:
        """The Python stack of the process in ``slot`` (every thread; "" if it could not
        be had); the process goes on. It writes it itself
        (:mod:`tp_launch.resilient.heartbeat`): its main thread is asked with SIGUSR2
        (:func:`~tp_launch.procs.worker.signal_main_thread`, for the reason given in
        :meth:`~tp_launch.procs.worker.WorkerProcess.abort_with_stack`), the process
        continued with SIGCONT in case it is stopped, given up to :data:`_STACK_WAIT_S`.
        The dump has no end marker and is written frame by frame, the main thread last, by
        a process a loaded machine may deschedule mid-dump: it counts as written once its
        file has not grown for :data:`_STACK_QUIET_S`."""
        pid = at.procs[slot].worker.pid
        path = progress.stack_path(at.board.path, slot)
        start = _size(path)
        try:
            signal_main_thread(pid, progress.STACK_SIGNAL)
            os.kill(pid, signal.SIGCONT)
            now = time.monotonic()
            deadline, last, grew_at = now + _STACK_WAIT_S, start, now
            while time.monotonic() < deadline:
                time.sleep(0.01)
                size = _size(path)
                if size != last:
                    last, grew_at = size, time.monotonic()
                elif size > start and time.monotonic() - grew_at >= _STACK_QUIET_S:
                    break  # written, and no longer growing
        except ProcessLookupError:
            return ""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return ""
        with os.fdopen(fd, "rb") as f:
            f.seek(start)
            return f.read(_STACK_MAX).decode("utf-8", "replace").rstrip()


def _spare_error(output: SpareOutput | None) -> str:
    """What a spare that died wrote last to stderr (its error, for a crash)."""
    if output is None:
        return "no output"
    output.join(1.0)  # the exit is seen before the pipe is drained
    line = output.last_line()[:300] or "no output"
    return f"{line} (log: {output.stderr_path})" if output.stderr_path else line

# How long a process gets to write its stack; how long its file must stay the same size
# to count as written; how much of it is logged.
_STACK_WAIT_S = 2.0
_STACK_QUIET_S = 0.2
_STACK_MAX = 32 * 1024


def _size(path: str) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except OSError:
        return 0
