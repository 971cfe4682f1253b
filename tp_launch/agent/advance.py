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
only takes its spares out of the pool, at once. A node that holds ranks waits
:data:`SETTLE_S` before it first tries to move them on a *signal*: a scheduler's
warning often reaches every node of the job at once (Slurm's ``--signal``, ``scancel
--signal``: measured, every node's task gets it), and then the spare nodes, warned too,
must leave the pool first, or a rank node wins the race, moves its ranks onto a node
that is going away as well, and the job's fate depends on timing (seen on a real Slurm
cluster: one node migrated, the other stopped or went on). With the settle, such a
warning finds no spare parked elsewhere and stops the job (``migrate`` falls back to
``stop``), every time. A warning given to one node alone waits one second longer
(advance warnings come minutes ahead). ``migrate`` that cannot happen (no spare parked
on another node, nor, on a job of one node, enough on this one) falls back to ``stop``.
A migration that cannot happen *yet* (a recovery in progress, another node's generation
published meanwhile, the rendezvous backend unreachable) is tried again every
:data:`RETRY_S` seconds. The signal is never forwarded to the workers, and they start
with it ignored (:func:`tp_launch.procs.worker.ignore_in_workers`).

:class:`Advance` is the pure decision (what to do now, what a migration's outcome
means). The health check itself runs in :mod:`tp_launch.agent.health`, which keeps its
first failure for the agent's loop to pick up (the agent acts on both in
:meth:`tp_launch.agent.resilient_agent.ResilientAgent._advance`; the node's migration
itself is :meth:`tp_launch.agent.recovery.Recoverer.migrate_node`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

ON_PREEMPT = ("migrate", "stop", "ignore")
# Seconds between two tries of a node migration that could not happen yet.
RETRY_S = 1.0
# Seconds a node holding ranks waits on a preemption signal before it first tries to
# move them: the spare nodes warned by the same signal leave the pool meanwhile.
SETTLE_S = 1.0

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

    def notice(self, why: str, now: float, mode: Action | None = None,
               settle_s: float = 0.0) -> bool:
        """A warning (``mode``: what it asks for; None: ``--on-preempt``), acted on
        ``settle_s`` from ``now``. False when it changes nothing: ignored, or a warning is
        already being acted on."""
        mode = mode or (None if self.on_preempt == "ignore" else
                        "migrate" if self.on_preempt == "migrate" else "stop")
        if mode is None or self.why is not None:
            return False
        self.why, self.mode = why, mode
        self.next_try = now + (settle_s if mode == "migrate" else 0.0)
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
