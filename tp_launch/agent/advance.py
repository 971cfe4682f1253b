"""Advance warnings (issue 13): a node about to go away moves its ranks first.

Two sources warn that this node will fail before it does:

- a **preemption notice**, a signal (``--preempt-signal``, SIGUSR1 by default; under
  Slurm ``--signal=USR1@120`` sends it two minutes before the end of the allocation).
  ``--on-preempt`` says what it does: ``migrate`` (move every rank of this node to
  parked spares elsewhere, handing each rank's state directly to its replacement),
  ``stop`` (stop the job at once with one error line, exit 1: the script's own last
  checkpoint is what a restart resumes from) or ``ignore`` (the default: the signal is
  not handled by tp-run, as before; SIGUSR1's default action ends the agent);
- a **health check** (``--health-check CMD``): the agent runs ``CMD`` through the shell
  every ``--health-interval`` seconds, with the interval as its timeout; the first
  failure (a non-zero exit, or the timeout) counts as a preemption notice with
  ``migrate``, once, and logs one line with the command's last output line.

A node that holds no rank (a spare node) has nothing to move or stop: a warning there
only takes its spares out of the pool. ``migrate`` that cannot happen (no spare parked
on another node, nor, on a job of one node, enough on this one) falls back to ``stop``.
A migration that cannot happen *yet* (a recovery in progress, another node's generation
published meanwhile, the rendezvous backend unreachable) is tried again every
:data:`RETRY_S` seconds. The signal is never forwarded to the workers, and they start
with it ignored (:func:`tp_launch.procs.worker.ignore_in_workers`).

:class:`Advance` is the pure decision (what to do now, what a migration's outcome
means); :func:`health_verdict` reads one run of the check. :class:`HealthCheck` is the
only I/O here: a thread that runs the command and keeps the first failure for the
agent's loop to pick up (the agent acts on both in
:meth:`tp_launch.agent.resilient_agent.ResilientAgent._advance`; the node's migration
itself is :meth:`tp_launch.agent.recovery.Recoverer.migrate_node`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

ON_PREEMPT = ("migrate", "stop", "ignore")
# Seconds between two tries of a node migration that could not happen yet.
RETRY_S = 1.0

Action = Literal["migrate", "stop"]
# A node migration's outcome: done, not yet (try again), or impossible (no spare).
Outcome = Literal["ok", "retry", "impossible"]


@dataclass
class Advance:
    """What to do about advance warnings, once per job.

    Args:
        on_preempt: ``--on-preempt`` (``migrate``, ``stop`` or ``ignore``).
        retry_s: seconds between two tries of a migration that could not happen yet.
    """

    on_preempt: str = "ignore"
    retry_s: float = RETRY_S
    why: str | None = None  # the warning acted on (None: none yet)
    mode: Action | None = None
    done: bool = False  # acted on: no later warning changes anything
    next_try: float = 0.0

    def notice(self, why: str, now: float, mode: Action | None = None) -> bool:
        """A warning (``mode``: what it asks for; None: ``--on-preempt``). False when it
        changes nothing: ignored, or a warning is already being acted on."""
        mode = mode or (None if self.on_preempt == "ignore" else
                        "migrate" if self.on_preempt == "migrate" else "stop")
        if mode is None or self.why is not None:
            return False
        self.why, self.mode, self.next_try = why, mode, now
        return True

    def due(self, now: float) -> Action | None:
        """The action to take now, if any."""
        if self.why is None or self.done or now < self.next_try:
            return None
        return self.mode

    def outcome(self, outcome: Outcome, now: float) -> Action | None:
        """A migration's ``outcome``: None (done, or tried again later) or ``stop``
        (impossible: the fallback)."""
        if outcome == "retry":
            self.next_try = now + self.retry_s
            return None
        self.done = True
        return "stop" if outcome == "impossible" else None

    def stopped(self) -> None:
        self.done = True


def health_verdict(command: str, returncode: int | None, output: str,
                   timeout_s: float) -> str | None:
    """One run of the health check: None if healthy, else the line that says why
    (``returncode`` None: it ran past ``timeout_s``), with the output's last line."""
    if returncode == 0:
        return None
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    last = lines[-1] if lines else "(no output)"
    what = (f"timed out after {timeout_s:g} s" if returncode is None else
            f"exited with {returncode}" if returncode > 0 else
            f"was killed by {_signal_name(-returncode)}")
    return f"health check {command!r} {what}: {last[:200]}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class HealthCheck:
    """Runs ``command`` (shell) every ``interval`` seconds in a thread until it fails
    once; :meth:`failure` hands that failure's line to the agent, once.

    The command runs in a session of its own, so that a timeout kills it with its
    children.
    """

    def __init__(self, command: str, interval: float) -> None:
        self.command = command
        self.interval = interval
        self._failure: str | None = None
        self._taken = False
        self._stop = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._run, name="tp-run-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def failure(self) -> str | None:
        """The first failure's line, the first time it is asked for after it."""
        if self._failure is None or self._taken:
            return None
        self._taken = True
        return self._failure

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            verdict = self._once()
            if verdict is not None and not self._stop.is_set():
                self._failure = verdict
                return

    def _once(self) -> str | None:
        try:
            self._proc = proc = subprocess.Popen(
                self.command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        except OSError as e:
            return f"health check {self.command!r} cannot run: {e}"
        try:
            output, _ = proc.communicate(timeout=self.interval)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            output, _ = proc.communicate()
            code = None
        self._proc = None
        return health_verdict(self.command, code, output or "", self.interval)

    def stop(self) -> None:
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        self._thread.join(timeout=5.0) if self._thread.is_alive() else None


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
