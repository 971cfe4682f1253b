"""The agent's watch over failures that do not exit: it acts on :mod:`tp_launch.agent.hangs`.

At every tick of the resilient agent's loop, :meth:`Watchdog.tick` reads this node's
progress board (:mod:`tp_launch.progress`) and asks the pure decisions what they make
of it; then it acts:

- **a hang with a culprit**: note why (``Attempt.hung``) and end it with its Python stack
  on its stderr (SIGABRT, :func:`~tp_launch.procs.worker.abort_with_stacks`: its exit
  marks the dump complete, and it runs no further); the agent's death path then
  replaces it at the same step (``"reason": "hang"``);
- **a hang everywhere** (single node): every rank's stack, then ``--spare-policy``
  (:meth:`~tp_launch.agent.recovery.Recoverer.by_policy`); across nodes it is reported
  only (the rank that holds these up may be on another node);
- **across nodes**, when no rank here is behind another: the other nodes' ranks as they
  published them (:func:`tp_launch.agent.status.remote_marks`) decide, and only this
  node's culprits are killed;
- **every rank waiting, none dead** (their collectives failed everywhere): regroup them
  (:meth:`~tp_launch.agent.recovery.Recoverer.regroup`, single node);
- **a straggler**: a planned migration to a spare, with the evidence;
- **a plain script** (no API) with an explicit ``--hang-timeout``, once past the startup
  budget without a hello: the compatible agent's output watch (``abort_if_quiet``).

Nothing is watched while the job waits for a reason of its own (a spare, the backend,
the exit barrier).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from tp_launch import channel
from tp_launch.agent import hangs
from tp_launch.agent.attempt import Attempt
from tp_launch.agent.processes import Processes
from tp_launch.agent.recovery import Recoverer
from tp_launch.agent.status import remote_marks
from tp_launch.config import LaunchConfig
from tp_launch.procs.worker import abort_with_stacks
from tp_launch.progress import Mark

logger = logging.getLogger(__name__)

# How long every rank may wait for a generation, none dead, before they are regrouped
# (a death is seen within a tick: it gets the moment to be the reason).
_REGROUP_AFTER_S = 1.0
# Across nodes: the shortest time between two reads of the other nodes' status (they
# publish every 2 s).
_REMOTE_EVERY_S = 2.0


class Watchdog:
    """One agent's hang and straggler watch (its state is the attempt's)."""

    def __init__(self, config: LaunchConfig, processes: Processes,
                 abort_if_quiet: Callable[[hangs.OutputClock, float], None]) -> None:
        self.config = config
        self.processes = processes
        self.abort_if_quiet = abort_if_quiet
        self.policy = hangs.HangPolicy(config.hang_timeout_for(resilient=True))

    def tick(self, at: Attempt, recoverer: Recoverer) -> None:
        now = time.monotonic()
        if not at.resilient:
            if self.config.hang_timeout and now - at.started > self.policy.startup:
                self.abort_if_quiet(at.quiet, self.config.hang_timeout)
            return
        if at.exiting or at.pending or at.unplaced:
            at.clock.reset(now)
            at.stragglers.reset()
            return
        marks = {r: at.board.mark(s) for r, s in at.world.slot_of.items()
                 if at.alive(s) and r not in at.hung}
        if not marks:
            return
        idle = at.clock.observe(now, marks)
        single = self.config.max_nodes == 1
        # Regroup only a whole world: a rank killed as hung, or dead and not yet seen,
        # is about to bring the generation that ends the wait.
        whole = len(marks) == len(at.world.slot_of)
        if single and whole and hangs.all_waiting(marks, at.world.gen):
            if now - at.clock.since > _REGROUP_AFTER_S:
                recoverer.regroup()
            return
        for rank in hangs.waiting_on_a_peer(marks, at.world.gen) if self.policy.enabled else []:
            if (at.world.gen, rank) not in at.told_to_wait:
                at.told_to_wait.add((at.world.gen, rank))
                at.tell(at.world.slot_of[rank], channel.Recovering())
        verdict = hangs.assess(self.policy, now, marks, idle, at.clock.step_s,
                               at.clock.committed)
        if not single and (verdict is None or verdict.kind == "everywhere") \
                and idle >= self.policy.limit(at.clock.step_s, at.clock.committed):
            verdict = self._across_nodes(at, marks, idle, verdict)
        if verdict is not None:
            at.clock.reset(now)  # one verdict per limit
            self._on_hang(at, recoverer, verdict)
            return
        straggler = at.stragglers.observe(now, marks, can_act=bool(at.world.parked))
        if straggler is not None:
            logger.warning("straggler: %s; migrating it to a spare", straggler.evidence)
            reply = recoverer.migrate(straggler.rank, evidence=straggler.evidence)
            if not reply.startswith("ok"):
                logger.warning("straggler: rank %s stays: %s", straggler.rank, reply)

    def _across_nodes(self, at: Attempt, marks: dict[int, Mark], idle: float,
                      local: hangs.Verdict | None) -> hangs.Verdict | None:
        """No rank of this node is behind another: compare them with the other nodes'
        ranks as published. A culprit here is this node's to kill; one elsewhere, its
        own agent's."""
        now = time.monotonic()
        if now - at.remote_read < _REMOTE_EVERY_S:
            return None
        at.remote_read = now
        wide = hangs.assess(self.policy, now, {**remote_marks(at, now), **marks}, idle,
                            at.clock.step_s, at.clock.committed)
        if wide is None or wide.kind == "everywhere":
            return local
        here = [r for r in wide.ranks if r in marks]
        if not here:
            logger.info("hang: rank(s) %s on other nodes hold the job up; their agents act",
                        wide.ranks)
            return None
        return hangs.Verdict("culprit", here, {r: wide.why[r] for r in here}, wide.idle_s,
                             wide.limit_s)

    def _on_hang(self, at: Attempt, recoverer: Recoverer, verdict: hangs.Verdict) -> None:
        if verdict.kind == "culprit":
            culprits = [at.procs[at.world.slot_of[r]].worker for r in verdict.ranks]
            for rank, worker in zip(verdict.ranks, culprits):
                at.hung[rank] = verdict.why[rank]
                logger.error("hang: no progress for %.1f s (limit %.1f s): rank %s (pid %s) "
                             "holds the job up: %s; ending it (its stack follows on its "
                             "stderr), a spare takes its rank", verdict.idle_s,
                             verdict.limit_s, rank, worker.pid, verdict.why[rank])
            abort_with_stacks(culprits)
            return
        where = "; ".join(f"rank {r}: {verdict.why[r]}" for r in verdict.ranks)
        if self.config.max_nodes > 1:
            logger.warning("no progress for %.0f s and no rank of this node behind another "
                           "(%s)", verdict.idle_s, where)
            return
        for rank in verdict.ranks:
            stack = self.processes.stack_of(at, at.world.slot_of[rank])
            logger.error("hang: rank %s's stack:\n%s", rank, stack or "(not available)")
        detail = (f"hang on every rank: no progress for {verdict.idle_s:.0f} s and no rank "
                  f"behind another ({where})")
        recoverer.by_policy(detail, detail)
