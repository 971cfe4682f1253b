"""Resilient mode's recovery decisions for one attempt: which generation comes next.

A :class:`Recoverer` acts on what the agent observes (:mod:`tp_launch.agent.resilient_agent`:
a rank's death, a message, a change of the job's state) through the attempt's state
(:class:`~tp_launch.agent.attempt.Attempt`) and the pure rules of
:mod:`tp_launch.agent.control`:

- :meth:`Recoverer.recover`: ranks lost their process: place them on parked spares
  (:func:`~tp_launch.agent.control.place`) and publish generation g+1; none parked:
  ``--spare-policy``; the backend unreachable: defer the generation until it answers
  (see :mod:`tp_launch.agent.resilient_agent`, on outages);
- :meth:`Recoverer.apply`: take a generation (this node's or another's) and announce it
  to this node's processes; :meth:`Recoverer.fill_unplaced` gives a spare that parks
  late a rank still without a process;
- :meth:`Recoverer.migrate`: a planned migration (``tp-run migrate``);
  :meth:`Recoverer.migrate_node`: every rank of this node to parked spares elsewhere
  (``tp-run migrate --node``, an advance warning: :mod:`tp_launch.agent.advance`), each
  retiring rank handing its state to its receiver directly, across nodes too (the
  receiving node's :meth:`Recoverer.apply` gives its promoted spare the receiver's role
  when the rank's previous node is alive);
- :meth:`Recoverer.on_world_change`: what the job's state says now (another node's
  generation, a lost node, a restart or stop asked for, the job's end);
- :meth:`Recoverer.regroup`: every rank waits for a generation and none died: the same
  placement again;
- :meth:`Recoverer.fatal`, :meth:`Recoverer.state_lost`, :meth:`Recoverer.failure_result`,
  :meth:`Recoverer.by_policy`, :meth:`Recoverer.stop_job`: the job cannot go on
  (:class:`StopJob`, one ``tp-run: error:`` line).

Over 400 lines on purpose: every path from "something changed" to "the next generation
is announced" (a death, a lost node, a migration, a regroup, another node's decision)
goes through :meth:`Recoverer.apply` and shares its bookkeeping; split, each piece would
reach into the others' state.

Each applied generation opens a recovery report (:mod:`tp_launch.agent.recovery_report`),
written once every rank of this node took its first step, or when the next one opens.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import NoReturn

from rendezvous import RendezvousError
from rendezvous.kv import KVError, KVUnavailable
from rendezvous.membership import CHANGE_FAILURE, CHANGE_LOST, WorldChange
from tp_launch import channel
from tp_launch.agent.advance import Outcome
from tp_launch.agent.attempt import Attempt
from tp_launch.agent.control import Generation, evacuate, failures_served, place
from tp_launch.agent.decisions import (
    NoSpare,
    Phase,
    Publish,
    StateLost,
    ViewFacts,
    judge_view,
    lost_addresses,
    migration_refusal,
    node_migration_refusal,
    placement_order,
    plan_recovery,
)
from tp_launch.agent.generations import View
from tp_launch.agent.node_agent import AttemptResult
from tp_launch.agent.processes import Processes
from tp_launch.agent.recovery_report import FailedRank, Promotion, Recovery, recovery_report
from tp_launch.config import LaunchConfig
from tp_launch.procs.logs import LogLayout
from tp_launch.procs.worker import stop_workers

logger = logging.getLogger(__name__)

# Steps past the highest committed step at which a planned migration stops the ranks:
# ranks are within one step of each other, the announcement takes microseconds.
_MIGRATION_MARGIN = 2


class StopJob(Exception):
    """The job cannot go on: the result says why."""

    def __init__(self, result: AttemptResult, final: bool) -> None:
        super().__init__("job stopped")
        self.result = result
        self.final = final  # no restart, whatever --max-restarts says


class Recoverer:
    """The decisions of one attempt (see the module's doc).

    Args:
        config: the launch configuration.
        attempt: the attempt's state, which the decisions read and change.
        processes: this node's processes (spares to start, output to show, workers to
            stop).
        layout: the run's logs (``recovery.jsonl``).
        run_id: the job's id, for the status file.
    """

    def __init__(self, config: LaunchConfig, attempt: Attempt, processes: Processes,
                 layout: LogLayout, run_id: str) -> None:
        self.config = config
        self.attempt = attempt
        self.processes = processes
        self.layout = layout
        self.run_id = run_id

    def recover(self, lost: dict[int, str], detected: float,
                view: View | None = None) -> None:
        """Ranks lost their process (rank -> the node it was on; this node's own, or a
        lost node's): publish the generation :func:`~tp_launch.agent.decisions.plan_recovery`
        decides, which gives each a parked spare; none parked: ``--spare-policy``; the
        backend unreachable: defer the generation until it answers. ``view``: the job's
        state if the caller has just read it (multi-node)."""
        at = self.attempt
        at.failed |= {at.world.slot_of[r] for r, n in lost.items()
                      if n == at.world.node and r in at.world.slot_of}
        lost = {**at.pending.ranks, **lost}
        if not lost:
            return
        try:
            plan = plan_recovery(lost, at.world.node, at.gen, at.holders, at.hung,
                                 len(at.world.parked), at.gens.store,
                                 lambda moving: self._place(moving, view))
            if isinstance(plan, Publish):
                failed = [at.failed_record(r) if r in plan.local else FailedRank(r, node=n)
                          for r, n in sorted(lost.items())]
                published = at.gens.publish(plan.generation)
        except KVUnavailable as e:
            self._defer(lost, detected, e)
            return
        except KVError as e:  # a refusal, not an outage (a c10d store whose host died)
            raise RendezvousError(f"rank(s) {sorted(lost)} lost their process and the "
                                  f"rendezvous backend failed: {e}") from None
        if isinstance(plan, StateLost):
            self.state_lost(plan.detail)
        at.pending.no_backend = {}
        if isinstance(plan, NoSpare):
            self._no_spare(lost, detected)
            return
        if published:
            at.pending.no_spare = {}
            at.holders -= set(lost)
            self.apply(plan.generation, detected, failed)
        else:
            # Another node published first: read its generation now; applying it gives
            # this node's dead ranks this node's spares.
            at.last_view = 0.0

    def _place(self, lost: dict[int, str], view: View | None) -> dict[int, str] | None:
        """Homes for ``lost`` ranks (:func:`~tp_launch.agent.control.place`), in the
        order :func:`~tp_launch.agent.decisions.placement_order` gives."""
        at = self.attempt
        view = view or at.gens.view()
        if view is None:
            return None
        parked = {**at.gens.parked(), at.world.node: len(at.world.parked)}
        order = placement_order(at.world.node, lost, view.spare_nodes, at.gen.nodes,
                                view.alive)
        return place(lost, at.gen.ranks, parked, order)

    def _no_spare(self, lost: dict[int, str], detected: float) -> None:
        """``--spare-policy``: nothing parked anywhere for the ``lost`` ranks."""
        at = self.attempt
        policy, dead = self.config.spare_policy, sorted(lost)
        if policy == "wait":
            if not at.pending.no_spare:
                at.pending.no_spare_since = detected
                at.pending.deadline = time.monotonic() + self.config.spare_wait_timeout
                logger.warning("no spare parked for rank(s) %s; waiting up to %.0f s",
                               dead, self.config.spare_wait_timeout)
                for rank, slot in at.world.slot_of.items():
                    if rank not in lost:
                        at.tell(slot, channel.Recovering())
            at.pending.no_spare = lost
            self.processes.spawn_missing(at)
            return
        logger.error("no spare parked for rank(s) %s (--spare-policy %s)", dead, policy)
        raise StopJob(self.failure_result(final=policy == "fail"), final=policy == "fail")

    def apply(self, g: Generation, detected: float,
              failed: list[FailedRank] | None = None,
              alive_nodes: set[str] | None = None) -> None:
        """Take generation ``g`` on this node and announce it to this node's ranks.
        ``alive_nodes``: the live nodes, if the caller just read them (None: all)."""
        at = self.attempt
        world = at.world
        previous = at.gen
        before = dict(world.slot_of)
        # This node's dead ranks: another node's generation gives them this node's
        # spares even where it was decided without this node's word (an outage).
        dead_here = {r: at.failed_record(r) for r, s in before.items() if s in at.failed}
        placed = world.apply(g, at.failed.__contains__)
        at.gen = g
        at.lost_addrs = lost_addresses(previous, g, world.node)
        at.unplaced = placed.unplaced
        if placed.promoted:
            at.pool = self.config.spares  # a spare node is an active node now
        handoffs: dict[int, channel.Handoff] = {}
        fenced: dict[int, int] = {}
        for rank, slot in placed.released.items():
            if not at.alive(slot):
                continue
            at.retired.add(slot)
            prefix = f"tp-run/g{g.gen}/handoff/{rank}"
            if g.boundary is not None and rank in placed.promoted:
                # A planned migration: the leaving rank hands its state over.
                handoffs[rank] = channel.Handoff("receiver", prefix)
                at.tell(slot, at.generation_msg(None, channel.Handoff("donor", prefix)))
            elif g.boundary is not None and rank in g.replaced and \
                    g.ranks.get(rank, world.node) != world.node:
                # A node migration: the receiver is on another node (which gives it the
                # receiver's role, below, on its side).
                at.tell(slot, at.generation_msg(None, channel.Handoff("donor", prefix)))
            else:
                at.tell(slot, at.generation_msg(None))  # retire it
                if g.boundary is None:
                    fenced[rank] = slot
        if fenced:
            self._fence(fenced)
        for rank in placed.promoted:
            source = previous.ranks.get(rank)
            if rank not in handoffs and g.boundary is not None and rank in g.replaced and \
                    source not in (None, world.node) and \
                    (alive_nodes is None or source in alive_nodes):
                # A node migration from a live node: its retiring rank is the donor.
                handoffs[rank] = channel.Handoff("receiver", f"tp-run/g{g.gen}/handoff/{rank}")
        if g.reason == "migration" and before and not world.slot_of and not placed.unplaced:
            at.draining = True  # this node's ranks left it: its spares take none
        superseded = at.recovery if at.recovery and not at.recovery.resumed else None
        if superseded is not None:
            at.recovery = None  # a failure during a recovery: one report for both
        self._finish_report()
        if not world.slot_of and not placed.unplaced:
            # A spare node the generation left alone: nothing to announce or report.
            self.write_status()
            return
        if failed is None:  # another node decided: its record has the details
            failed = failures_served(g.replaced, dead_here, placed)
        if superseded is not None:
            detected = min(detected, superseded.detected)
            known = {x.rank for x in superseded.failed}
            failed = superseded.failed + [f for f in failed if f.rank not in known]
        rec = Recovery(g.gen, g.reason, detected, decided=time.time(), failed=failed)
        rec.promoted = [Promotion(r, s, at.procs[s].worker.pid)
                        for r, s in sorted(placed.promoted.items())]
        if superseded is not None:  # the first newcomers that still hold their rank
            rec.promoted = sorted([p for p in superseded.promoted
                                   if world.slot_of.get(p.rank) == p.slot] + rec.promoted,
                                  key=lambda p: p.rank)
        for rank, slot in placed.promoted.items():
            self.processes.show_as_rank(at, slot, rank)
            at.hung.pop(rank, None)
        at.clock.reset(time.monotonic())
        at.stragglers.reset()
        at.recovery = rec
        at.finished.clear()
        for rank in [*placed.promoted, *placed.unplaced]:
            # Where the rank's last holder ran: a newcomer reads the record it left
            # (kept until a newcomer resumes: one that dies first leaves no record).
            if rank in before:
                at.origin.setdefault(rank, before[rank])
        # The status first: a rank told of the generation may read it at once (a
        # spare counted as parked there after its promotion was taken for a free one).
        self.write_status()
        for rank, slot in world.slot_of.items():
            at.tell(slot, at.generation_msg(rank, handoff=handoffs.get(rank),
                                            from_slot=at.origin.get(rank)))
        self.processes.spawn_missing(at)
        self.write_status()

    def fill_unplaced(self) -> None:
        """A spare parked: give it a rank of this generation that has no process yet."""
        at = self.attempt
        while at.unplaced:
            slot = at.world.fill(at.unplaced[0])
            if slot is None:
                return
            rank = at.unplaced.pop(0)
            self.processes.show_as_rank(at, slot, rank)
            if at.recovery is not None:
                at.recovery.promoted.append(Promotion(rank, slot,
                                                      at.procs[slot].worker.pid))
            at.tell(slot, at.generation_msg(rank, from_slot=at.origin.get(rank)))

    def migrate(self, rank: int, evidence: str = "") -> str:
        at = self.attempt
        world, g = at.world, at.gen
        refusal = migration_refusal(rank, world.slot_of, at.recovering(), len(world.parked))
        if refusal is not None:
            return refusal
        steps = [at.board.read(s) for s in world.slot_of.values()]
        boundary = max(steps) + _MIGRATION_MARGIN
        old = at.procs[world.slot_of[rank]].worker.pid
        new = Generation(g.gen + 1, g.ranks, at.gens.store, [rank], "migration", boundary)
        try:
            if not at.gens.publish(new):
                return "error: the job's generation changed meanwhile; try again"
        except KVError as e:
            return f"error: the rendezvous backend cannot publish the migration: {e}"
        self.apply(new, time.time(), [FailedRank(rank, slot=world.slot_of[rank], pid=old)])
        if at.recovery is not None:
            at.recovery.evidence = evidence
        pid = at.procs[world.slot_of[rank]].worker.pid
        logger.warning("migrating rank %s from pid %s to pid %s at step %s", rank, old, pid,
                       boundary)
        return f"ok: rank {rank} moves to spare pid {pid} after step {boundary}"

    def regroup(self) -> None:
        """Every rank waits for a generation and none died (their collectives failed or
        timed out everywhere): the same placement again, in a new generation."""
        at = self.attempt
        g = at.gen
        new = Generation(g.gen + 1, g.ranks, at.gens.store, [], "regroup")
        if at.gens.publish(new):
            logger.warning("every rank's collective failed and no process died: "
                           "regrouping them in generation %s", new.gen)
            self.apply(new, time.time(), [])

    def migrate_node(self, evidence: str = "") -> tuple[Outcome, str]:
        """Every rank of this node to parked spares elsewhere (a spare node first, then
        the other nodes; with no other node, this node's own spares if there are enough:
        :func:`~tp_launch.agent.control.evacuate`), in one generation with a boundary;
        each retiring rank hands its state to its receiver. The outcome (``ok``;
        ``retry``: not now; ``impossible``: no spare can take them) and the line for
        ``tp-run migrate``."""
        at = self.attempt
        world, g = at.world, at.gen
        mine = sorted(world.slot_of)
        refusal = node_migration_refusal(at.draining, len(mine), len(at.unplaced),
                                         at.resilient, at.phase, bool(at.pending),
                                         at.recovering())
        if refusal is not None:
            if not at.draining and not mine and not at.unplaced:
                # A spare node (or one its ranks left): nothing to move; its spares
                # leave the pool.
                at.draining = True
                self.write_status()
            return refusal
        try:
            view = at.gens.view()
            parked = {**at.gens.parked(), world.node: len(world.parked)}
        except KVUnavailable as e:
            return "retry", f"error: the rendezvous backend is unreachable: {e}"
        if view is None:
            return "retry", "error: the job's state cannot be read; try again"
        others = list(dict.fromkeys(n for n in view.spare_nodes + g.nodes
                                    if n in view.alive and n != world.node))
        ranks = evacuate(world.node, g.ranks, parked, others)
        if ranks is None:
            where = "on another node" if others else \
                f"on this node ({len(world.parked)} parked)"
            return "impossible", f"error: no spare parked {where} for rank(s) {mine}"
        records = [FailedRank(r, slot=s, pid=at.procs[s].worker.pid)
                   for r, s in sorted(world.slot_of.items())]
        boundary = max(at.board.read(s) for s in world.slot_of.values()) + _MIGRATION_MARGIN
        new = Generation(g.gen + 1, ranks, at.gens.store, mine, "migration", boundary)
        try:
            if not at.gens.publish(new):
                return "retry", "error: the job's generation changed meanwhile; try again"
        except KVError as e:  # unknown outcome: the next view tells (draining if it won)
            return "retry", f"error: the rendezvous backend cannot publish the migration: {e}"
        self.apply(new, time.time(), records)
        if at.recovery is not None:
            at.recovery.evidence = evidence
        homes = sorted({ranks[r] for r in mine})
        logger.warning("migrating rank(s) %s of this node to %s at step %s%s", mine,
                       ", ".join(homes), boundary, f" ({evidence})" if evidence else "")
        return "ok", f"ok: rank(s) {mine} move to {', '.join(homes)} after step {boundary}"

    def on_world_change(self) -> None:
        """Act on what the job's state says now (one node: its own view, which only
        ever ends the job)."""
        at = self.attempt
        at.last_view = time.monotonic()
        try:
            at.gens.flush()
            view = at.gens.view()
        except KVUnavailable as e:
            at.outage_seen = time.monotonic()
            self._backend_unreachable(e)
            return
        if view is None:
            return
        g = view.generation
        facts = ViewFacts(g, frozenset(view.alive), view.failed, view.final, view.complete,
                          view.all_finished(), view.broken)
        cut_off_s = time.monotonic() - max(at.outage_seen, at.gens.cut_off_at())
        decision = judge_view(facts, at.gens.node, at.world.gen, at.phase, at.pending,
                              cut_off_s)
        if decision.stop is not None:
            stop_workers(self.processes.workers, signal.SIGTERM, self.config.shutdown_timeout)
            if decision.stop == "broken":
                # The backend refuses this node (not an outage): its world is lost.
                raise StopJob(AttemptResult(change=WorldChange(
                    CHANGE_LOST, f"the rendezvous backend failed: {view.broken}")),
                    final=False)
            raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, view.failed or "")),
                          final=view.final)
        if decision.apply is not None:
            # (A deferred recovery is void: applying g gave this node's dead ranks
            # its parked spares; lost nodes are looked at again below.)
            detected = at.pending.no_backend_since if at.pending.no_backend else time.time()
            at.pending.no_backend = {}
            self.apply(decision.apply, detected, alive_nodes=view.alive)
        if decision.end:
            at.gens.mark_complete()
            self.end_job()
        elif decision.move:
            if not at.pending.no_spare:
                how = "agent gone" if set(decision.lost_nodes) <= view.dead else \
                    "lease expired"
                logger.warning("node(s) %s lost (%s): moving rank(s) %s",
                               decision.lost_nodes, how, sorted(decision.move))
            self.recover(decision.move, time.time(), view)
        elif decision.retry:
            # A spare may have parked elsewhere; a deferred generation can go out now.
            self.recover({}, at.pending.since, view)

    def _fence(self, fenced: dict[int, int]) -> None:
        """Ranks of this node (rank -> slot) went to other nodes with no handoff: the
        others took this node for lost (it was cut off from the backend for longer than
        its lease). Its processes for them are stale: told to retire, they would only
        notice at their next collective or iteration, and a long step or a local phase
        (an evaluation, a checkpoint) could go on as the rank meanwhile. SIGKILL them
        with their process group now (a retired rank's exit is no failure)."""
        at = self.attempt
        logger.warning("this node's rank(s) %s were given to other nodes while it was cut "
                       "off from the rendezvous (taken for lost): their processes here are "
                       "stopped", sorted(fenced))
        for slot in fenced.values():
            try:
                # Not reaped yet (alive): the pid is still this worker's, not reused.
                os.killpg(at.procs[slot].worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _backend_unreachable(self, e: KVError) -> None:
        """Multi-node, the backend cannot be reached: the workers keep running; what
        waits for the backend waits up to ``outage_timeout``. Past it, a deferred
        recovery ends the job (RendezvousError: one line); ranks that all finished
        training are let go without the other nodes' word (every rank took part in
        the last step's collectives, so every rank finished)."""
        at = self.attempt
        gens = at.gens
        if gens.outage_s() <= gens.outage_timeout:
            return
        if at.pending.no_backend:
            raise RendezvousError(f"rank(s) {sorted(at.pending.no_backend)} lost their process and "
                                  f"{gens.outage_error(e)}")
        if gens.finish_pending and not at.exiting:
            logger.warning("this node's ranks finished training, and %s: they exit without "
                           "waiting for the other nodes", gens.outage_error(e))
            self.end_job()

    def _defer(self, lost: dict[int, str], detected: float, e: KVError) -> None:
        """The generation for ``lost`` cannot be published now (backend unreachable):
        keep the decision's inputs and try again when the backend answers (every
        view). Nothing is announced meanwhile: a generation exists only once its
        compare-and-swap succeeded, so two nodes never announce different ones.
        This node's surviving ranks are told to wait for it without their own limit."""
        at = self.attempt
        at.outage_seen = time.monotonic()
        if not at.pending.no_backend:
            at.pending.no_backend_since = detected
            logger.warning("rank(s) %s lost their process while the rendezvous backend is "
                           "unreachable; the new generation waits for it (outage_timeout="
                           "%gs): %s", sorted(lost), at.gens.outage_timeout, e)
            for rank, slot in at.world.slot_of.items():
                if rank not in lost:
                    at.tell(slot, channel.Recovering())
        at.pending.no_backend = dict(lost)
        self._backend_unreachable(e)

    def wait_ran_out(self) -> NoReturn:
        """``--spare-policy wait``: no spare parked for the waiting ranks in time."""
        at = self.attempt
        print(f"tp-run: error: no spare parked for rank(s) {sorted(at.pending.no_spare)} "
              f"within --spare-wait-timeout {self.config.spare_wait_timeout:g} s; stopping",
              file=sys.stderr, flush=True)
        raise StopJob(self.failure_result(), final=True)

    def fatal(self, msg: channel.Fatal) -> None:
        """A rank found that the job cannot go on exactly: stop it, with that reason."""
        if self.attempt.exiting:
            return
        detail = f"rank {msg.rank}: {msg.message}"
        if msg.kind == "state_lost":
            self.state_lost(detail)
        self.stop_job(detail, detail, final=True)

    def state_lost(self, detail: str) -> NoReturn:
        """No rank holds the committed state: ``--spare-policy restart`` restarts every
        worker (the script's own checkpoint applies); otherwise the job stops. Never a
        start from scratch that looks like a recovery."""
        self.by_policy(f"the training state is lost ({detail})",
                       f"training state lost: {detail}")

    def by_policy(self, line: str, report: str) -> NoReturn:
        """The job cannot go on as it is: ``--spare-policy restart`` restarts every worker
        (counted against ``--max-restarts``), ``fail`` and ``wait`` stop it."""
        policy = self.config.spare_policy
        restart = policy == "restart"
        left = self.config.max_restarts - self.attempt.restart_count
        if restart and left <= 0:
            how = (f"stopping: no restart left (--spare-policy restart, --max-restarts "
                   f"{self.config.max_restarts})")
        else:
            how = ("restarting every worker (--spare-policy restart)" if restart
                   else f"stopping (--spare-policy {policy})")
        self.stop_job(f"{line}; {how}", report, final=not restart or left <= 0)

    def stop_job(self, line: str, report: str, final: bool) -> NoReturn:
        """Stop this attempt (``final``: the job) with one ``tp-run: error:`` line,
        telling the other nodes (``report``) and stopping every process here."""
        print(f"tp-run: error: {line}", file=sys.stderr, flush=True)
        self.attempt.gens.report_failure(report, final=final)
        stop_workers(self.processes.workers, signal.SIGTERM, self.config.shutdown_timeout)
        raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, report)), final=final)

    def failure_result(self, final: bool = True) -> AttemptResult:
        at = self.attempt
        root = at.first_failure
        at.gens.report_failure(f"rank {root.rank if root else '?'} failed and no spare is left",
                               final)
        stop_workers(self.processes.workers, signal.SIGTERM, self.config.shutdown_timeout)
        if root is None:
            return AttemptResult(change=WorldChange(CHANGE_LOST, "no spare left"))
        return AttemptResult([root, *at.other_failures(root)], root)

    def end_job(self) -> None:
        """Every rank finished: past the exit barrier, nothing is left to recover."""
        at = self.attempt
        at.enter(Phase.EXITING)
        for proc in at.procs.values():
            at.tell(proc.slot, channel.Exit())

    def write_status(self) -> None:
        """The status file (for ``tp-run migrate``, ``parked_spares()`` and people)."""
        at = self.attempt
        at.control.write_status(at.status(self.run_id))
        at.gens.set_parked(0 if at.draining else len(at.world.parked))

    def maybe_report(self) -> None:
        rec = self.attempt.recovery
        if rec is not None and rec.stepped_by_all(self.attempt.world.slot_of):
            self._finish_report()

    def _finish_report(self) -> None:
        """Write the recovery in progress (if any) to recovery.jsonl and the console."""
        at = self.attempt
        rec, at.recovery = at.recovery, None
        if rec is None:
            return
        event, line = recovery_report(rec, len(at.world.slot_of))
        print(line, file=sys.stderr, flush=True)
        self.layout.append("recovery.jsonl", json.dumps(event) + "\n")
