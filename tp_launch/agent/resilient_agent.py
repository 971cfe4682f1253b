"""The node agent in resilient mode (``--spares K``): replace a dead rank, keep the rest.

One attempt, on top of the compatible agent (:mod:`tp_launch.agent.node_agent`):

1. Spawn this node's ranks (a spare node, beyond the world: none), each with the agent
   channel in its environment (:mod:`tp_launch.channel`). The K spares (a spare node:
   ``--nproc-per-node``) start once a rank has said hello, which proves the script opts
   in (from then on, for the whole job, at once; a spare node starts them at once). A
   script that never connects (it does not use ``tp_launch.resilient``) is run exactly
   as torchrun runs it: no spare beside it, one line saying the spares are unused, a
   failure stops every worker and restarts them (``--max-restarts``).
2. Each spare parks in ``run()`` with its model built; each rank that says hello is told
   the current generation (:class:`~tp_launch.agent.control.Generation`). A spare that
   dies (before parking: it cannot run as a spare; or parked) is reported once with its
   error, and its replacements start with an exponential backoff while spares keep
   dying young (:class:`~tp_launch.agent.control.SpareRestarts`); meanwhile a dead rank
   takes another parked spare or ``--spare-policy``.
3. A rank dies (its pidfd is readable at once), or another node is lost (multi-node: its
   lease expired): :func:`~tp_launch.agent.control.place` finds parked spares for the
   ranks, the agent publishes generation g+1 (:mod:`tp_launch.agent.generations`: locally,
   or by compare-and-swap through the rendezvous) and every agent that sees it applies
   it (:meth:`~tp_launch.agent.control.World.apply`): its ranks are told g+1, their
   collectives fail or their step-boundary hook fires, they rebuild, the newcomers
   receive the state; the agent starts new spares. No spare parked anywhere:
   ``--spare-policy``. An error exit at the step of the previous error exit is a crash
   loop: stop.
4. Every rank of the current generation reports ``finished`` (multi-node: on every node
   of it): the agents tell their ranks and spares to exit; exit 0.

A planned migration (``tp-run migrate --rank R``, through the control socket) is the same
generation change with a boundary step and a handoff from R to the spare.

The channel's server side (the control socket, with its peer checks and message
validation, the status file and the progress board, all in a private control directory)
is :mod:`tp_launch.agent.control_server`; this module holds what the agent does with the
messages.

Each recovery is one JSON line in ``<run log dir>/recovery.jsonl`` (a write that fails,
a full disk, costs the line, not the job) and one line on the console (multi-node: on
every node, with that node's ranks' timings). A spare's output goes to its own log files
(:mod:`tp_launch.procs.logs`) and reaches the console only once it takes a rank.

Multi-node, with the rendezvous backend unreachable (an etcd restart: see
:mod:`rendezvous.membership`, "Outages"): the workers keep running and nothing is
concluded. What a node can do alone it does (a dead parked spare is replaced). A rank
that dies needs the other nodes (every rank rebuilds the group in the new generation,
and they hear of it only through the backend), and a generation exists only once its
compare-and-swap succeeded: announcing g+1 to this node's ranks before that could let
two nodes announce two different g+1. So the decision is deferred
(:meth:`ResilientAgent._defer`; a publish that could not reach the backend is never
taken for another node's win), this node's surviving ranks are told to wait, and the
generation goes out when the backend answers; if another node published first
meanwhile, its generation is applied, which gives this node's dead ranks this node's
spares. Ranks of other nodes give up waiting for the generation after ``_RANK_WAIT_S``
and fail together at one step: while the backend is (or lately was) unreachable, that
is not a crash loop, and they get spares like any dead rank. Past ``outage_timeout`` a
deferred recovery ends the job with one error line (exit 1); ranks that all finished
training are let go (every rank took part in the last step's collectives). A rank gone
before the exit barrier is never a success: the agent exits 0 only after the barrier
(or when a plain script's ranks all exited 0).
"""

from __future__ import annotations

import json
import logging
import selectors
import signal
import sys
import time
from typing import Any

from rendezvous import RendezvousError, RendezvousHandler, RendezvousInfo, api
from rendezvous.kv import KVError, KVUnavailable
from rendezvous.membership import CHANGE_FAILURE, CHANGE_LOST, WorldChange
from tp_launch import channel
from tp_launch.agent.attempt import Attempt, Proc
from tp_launch.agent.control import Generation, World, failures_served, place
from tp_launch.agent.control_server import Conn, ControlServer
from tp_launch.agent.generations import View, open_generations, shared_membership
from tp_launch.agent.node_agent import AttemptResult, NodeAgent, SignalReceived, SignalWatch
from tp_launch.agent.processes import Processes
from tp_launch.agent.recovery_report import Recovery, recovery_report
from tp_launch.config import ConfigError, LaunchConfig
from tp_launch.procs.logs import ConsoleTail, LogLayout
from tp_launch.procs.worker import stop_workers

logger = logging.getLogger(__name__)

# Steps past the highest committed step at which a planned migration stops the ranks:
# ranks are within one step of each other, the announcement takes microseconds.
_MIGRATION_MARGIN = 2
# Multi-node: seconds between two reads of the job's state when no watch poked.
_VIEW_POLL_S = 2.0
# How long a rank whose collective failed waits for its agent's next generation before
# it fails with an error (tp_launch.resilient.runtime.RECOVERY_WAIT_S). Ranks that gave
# up because the rendezvous backend was down meanwhile fail together, at one step: that
# is not a crash loop.
_RANK_WAIT_S = 60.0


class StopJob(Exception):
    """The job cannot go on: the result says why."""

    def __init__(self, result: AttemptResult, final: bool) -> None:
        super().__init__("job stopped")
        self.result = result
        self.final = final  # no restart, whatever --max-restarts says


class ResilientAgent(NodeAgent):
    """A :class:`NodeAgent` that replaces dead ranks with parked spares."""

    def __init__(self, config: LaunchConfig, rdzv: RendezvousHandler,
                 layout: LogLayout | None = None) -> None:
        super().__init__(config, rdzv, layout)
        # Job-wide, across attempts:
        self._no_restart = False
        self.processes = Processes(config, self.layout, self.workers)
        self.attempt: Attempt  # the attempt in progress, or the last one

    def run(self, watch: SignalWatch) -> int:
        if self.config.max_nodes > 1 and shared_membership(self.rdzv) is None:
            raise ConfigError("--spares across nodes needs a membership rendezvous "
                              "(--rdzv-backend etcd or c10d), not "
                              f"{self.config.rdzv_backend!r}")
        self.rdzv.accept_spare_nodes()
        return super().run(watch)

    def _may_restart(self) -> bool:
        return not self._no_restart

    def _exit_barrier(self) -> api.WorldChange | None:
        # Resilient ranks met at the generations' own exit barrier (whose nodes follow
        # the placement); a plain script's nodes meet at the rendezvous' as usual.
        # (Called after an attempt: the attempt is the one that just ended.)
        if self.attempt.exiting and self.attempt.resilient:
            return None
        return super()._exit_barrier()

    # The compatible agent's run loop calls this once per attempt.
    def _run_attempt(self, info: RendezvousInfo, restart_count: int,
                     watch: SignalWatch) -> AttemptResult:
        cfg = self.config
        logs = self.layout.attempt(restart_count)
        control = ControlServer(self._on_message)
        try:
            gens = open_generations(self.rdzv, info)
        except BaseException:
            control.close()
            raise
        sel = selectors.DefaultSelector()
        sel.register(watch.fd, selectors.EVENT_READ, ("signal", None))
        control.register(sel)
        if gens.fd is not None:
            sel.register(gens.fd, selectors.EVENT_READ, ("world", None))
        gen = gens.initial()
        mine = gen.ranks_of(gens.node)
        self.attempt = Attempt(
            info, logs, restart_count, control, control.board, gens, sel,
            # (A spare node's rank logs stay unused: its spares log as spares.)
            tail=ConsoleTail(cfg, logs, {r: mine[r] if r < len(mine) else r
                                         for r in logs.ranks}),
            gen=gen, world=World(gens.node, gen.gen),
            local_of={rank: local for local, rank in enumerate(mine)},
            # A spare node (beyond the world) starts as a node of parked spares only (it
            # has no rank to learn from whether the script opts in).
            pool=cfg.spares if mine else cfg.nproc_per_node,
            next_slot=cfg.nproc_per_node if mine else 0,
            spares_wanted=self.processes.opted_in or not mine)
        at = self.attempt
        try:
            for local, rank in enumerate(mine):
                self.processes.spawn(at, local, logs.ranks[local])
                at.world.slot_of[rank] = local
                at.holders.add(rank)  # its freshly built (or loaded) state
            self.processes.spawn_missing(at)
            self._write_status()
            return self._monitor_resilient(watch)
        except StopJob as e:
            self._no_restart = self._no_restart or e.final
            return e.result
        except SignalReceived as e:  # forwarded to every process, as in compatible mode
            logger.warning("Received %s death signal, shutting down workers", e.sig.name)
            stop_workers(self.workers, e.sig, cfg.shutdown_timeout)
            raise
        finally:
            if at.ended:
                self.processes.let_spares_leave(at)
            stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
            at.tail.stop()
            for proc in at.procs.values():
                if proc.output is not None:
                    proc.output.join(1.0)
            at.control.close()
            at.sel.close()
            at.gens.close()
            self._release_workers()

    # ------------------------------------------------------------------ channel

    def _write_status(self) -> None:
        """The status file (for ``tp-run migrate``, ``parked_spares()`` and people)."""
        at = self.attempt
        at.control.write_status(at.status(self.rdzv.run_id))
        at.gens.set_parked(len(at.world.parked))

    def _on_message(self, conn: Conn, msg: channel.Message) -> channel.Message | None:
        """A checked message from one of this node's processes (or ``tp-run migrate``)."""
        at = self.attempt
        if isinstance(msg, channel.Hello):
            proc = at.procs.get(msg.slot)
            if proc is None:
                raise channel.ChannelError(f"hello from slot {msg.slot}, which this agent "
                                           "did not start")
            proc.conn, proc.hello = conn, True
            at.resilient = True
            self.processes.opt_in(at)
            rank = at.slot_rank(proc.slot)
            if rank is not None:
                at.tell(proc.slot, at.generation_msg(rank))
            elif proc.slot not in at.retired:
                at.world.park(proc.slot)
                if at.unplaced:
                    self._fill_unplaced()
                if at.waiting:
                    self._recover({}, at.waiting_since)
                self._write_status()
        elif isinstance(msg, channel.Resumed) and msg.gen == at.world.gen:
            at.holders.add(msg.rank)
            at.origin.pop(msg.rank, None)
            if at.recovery and msg.gen == at.recovery.gen:
                at.recovery.resumed[msg.rank] = msg
        elif isinstance(msg, channel.Stepped) and at.recovery and \
                msg.gen == at.recovery.gen:
            at.recovery.stepped.setdefault(msg.rank, msg.t)
            self._maybe_report()
        elif isinstance(msg, channel.Finished) and msg.gen == at.world.gen:
            at.finished.add(msg.rank)
            if at.recovery and msg.rank not in at.recovery.stepped:
                at.recovery.stepped[msg.rank] = time.time()
                self._maybe_report()
            if at.finished >= set(at.world.slot_of) and not at.unplaced:
                at.gens.mark_finished(at.world.gen)
                at.last_view = 0.0  # the view that ends the job: read it now
        elif isinstance(msg, channel.Fatal):
            self._on_fatal(msg)
        elif isinstance(msg, channel.Migrate):
            return channel.Reply(self._migrate(msg.rank))
        return None

    def _on_fatal(self, msg: channel.Fatal) -> None:
        """A rank found that the job cannot go on exactly: stop it, with that reason."""
        if self.attempt.exiting:
            return
        detail = f"rank {msg.rank}: {msg.message}"
        if msg.kind == "state_lost":
            self._state_lost(detail)
        print(f"tp-run: error: {detail}", file=sys.stderr, flush=True)
        self.attempt.gens.report_failure(detail, final=True)
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
        raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, detail)), final=True)

    def _state_lost(self, detail: str) -> None:
        """No rank holds the committed state: ``--spare-policy restart`` restarts every
        worker (the script's own checkpoint applies); otherwise the job stops. Never a
        start from scratch that looks like a recovery."""
        restart = self.config.spare_policy == "restart"
        print(f"tp-run: error: the training state is lost ({detail}); "
              + ("restarting every worker (--spare-policy restart)" if restart
                 else f"stopping (--spare-policy {self.config.spare_policy})"),
              file=sys.stderr, flush=True)
        self.attempt.gens.report_failure(f"training state lost: {detail}", final=not restart)
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
        raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, detail)),
                      final=not restart)

    def _end_job(self) -> None:
        """Every rank finished: past the exit barrier, nothing is left to recover."""
        at = self.attempt
        at.exiting = True
        for proc in at.procs.values():
            at.tell(proc.slot, channel.Exit())

    # ------------------------------------------------------------------ monitoring

    def _monitor_resilient(self, watch: SignalWatch) -> AttemptResult:
        at = self.attempt
        cfg = self.config
        while True:
            timeout = max(cfg.monitor_interval, 0.01)
            exited: list[Proc] = []
            world_changed = False
            for key, _ in at.sel.select(timeout=timeout):
                kind, obj = key.data
                if kind == "signal":
                    watch.drain()
                elif kind == ControlServer.KIND:
                    at.control.on_event(obj)
                elif kind == "world":
                    world_changed = True
                elif kind == "exit" and obj.worker.returncode is not None:
                    at.sel.unregister(key.fd)
                    exited.append(obj)
            watch.raise_pending()
            if exited:
                self._on_exits(exited)
            if world_changed or time.monotonic() - at.last_view > _VIEW_POLL_S:
                self._on_world_change()
            if at.waiting and time.monotonic() > at.wait_deadline:
                raise StopJob(self._failure_result(), final=True)
            self.processes.spawn_missing(at)  # a spare whose backoff delay is over
            ranks_alive = [s for s in at.world.slot_of.values() if at.alive(s)]
            if not ranks_alive and not at.waiting and not at.unplaced and \
                    not at.deferred and \
                    (at.exiting or (at.world.slot_of and not at.resilient)):
                # Every rank exited 0: after the exit barrier, or a plain script's ranks.
                # (A resilient rank gone before the barrier is a failure being
                # recovered, never a success: its generation may still be on its way.)
                at.ended = at.exiting
                if not at.resilient:
                    self.processes.say_unused()  # a plain script's ranks all exited 0
                return AttemptResult()

    def _on_world_change(self) -> None:
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
        if view.broken:
            # The backend refuses this node (not an outage): its world is lost.
            stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
            raise StopJob(AttemptResult(change=WorldChange(
                CHANGE_LOST, f"the rendezvous backend failed: {view.broken}")), final=False)
        if view.failed and not at.exiting:
            stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
            raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, view.failed)),
                          final=view.final)
        g = view.generation
        if g.gen > at.world.gen:
            # (A deferred recovery is void: applying g gave this node's dead ranks
            # its parked spares; lost nodes are looked at again below.)
            detected = at.deferred_since if at.deferred else time.time()
            at.deferred = {}
            self._apply(g, detected)
        if view.complete or (g.nodes and view.all_finished()):
            if not at.exiting:
                at.gens.mark_complete()
                self._end_job()
            return
        lost = [n for n in g.nodes if n not in view.alive]
        survivors = sorted(n for n in g.nodes if n in view.alive)
        if lost and not at.exiting and survivors and survivors[0] == at.gens.node:
            # One decider, the lowest live node (a race is settled by the CAS anyway).
            moving = {r: n for r, n in g.ranks.items() if n in lost}
            if not at.waiting:
                logger.warning("node(s) %s lost (lease expired): moving rank(s) %s", lost,
                               sorted(moving))
            self._recover(moving, time.time(), view)
        elif (at.waiting or at.deferred) and not at.exiting:
            # A spare may have parked elsewhere; a deferred generation can go out now.
            self._recover({}, at.waiting_since if at.waiting else at.deferred_since,
                          view)

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
        if at.deferred:
            raise RendezvousError(f"rank(s) {sorted(at.deferred)} lost their process and "
                                  f"{gens.outage_error(e)}")
        if gens.finish_pending and not at.exiting:
            logger.warning("this node's ranks finished training, and %s: they exit without "
                           "waiting for the other nodes", gens.outage_error(e))
            self._end_job()

    def _defer(self, lost: dict[int, str], detected: float, e: KVError) -> None:
        """The generation for ``lost`` cannot be published now (backend unreachable):
        keep the decision's inputs and try again when the backend answers (every
        view). Nothing is announced meanwhile: a generation exists only once its
        compare-and-swap succeeded, so two nodes never announce different ones.
        This node's surviving ranks are told to wait for it without their own limit."""
        at = self.attempt
        at.outage_seen = time.monotonic()
        if not at.deferred:
            at.deferred_since = detected
            logger.warning("rank(s) %s lost their process while the rendezvous backend is "
                           "unreachable; the new generation waits for it (outage_timeout="
                           "%gs): %s", sorted(lost), at.gens.outage_timeout, e)
            for rank, slot in at.world.slot_of.items():
                if rank not in lost:
                    at.tell(slot, channel.Recovering())
        at.deferred = dict(lost)
        self._backend_unreachable(e)

    def _on_exits(self, exited: list[Proc]) -> None:
        at = self.attempt
        now = time.time()
        dead_ranks: list[int] = []
        failures: list[Proc] = []
        for proc in exited:
            rank = at.slot_rank(proc.slot)
            if rank is None:
                if proc.slot not in at.retired:
                    self._lost_spare(proc)
                continue  # a retired rank leaving, or a spare: not a failure of the job
            if not proc.hello:
                self.processes.say_unused()
            if proc.worker.returncode == 0 and (at.exiting or not proc.hello):
                continue  # the normal end: after the exit barrier, or a plain script's
            failures.append(proc)
            dead_ranks.append(rank)
        if not failures:
            return
        if not at.resilient or at.exiting:
            # Not resilient, or training is over (a rank died in the script's epilogue,
            # after every rank finished): torchrun's way.
            result = self._fail([p.worker for p in failures], at.rank_map())
            raise StopJob(result, final=False)
        # Ranks may have waited for a generation that only the unreachable backend could
        # bring, and given up: their errors say nothing about the script.
        blame_backend = at.gens.outage_s() > 0 or \
            time.monotonic() - at.outage_seen < _RANK_WAIT_S + 5
        for proc in failures:
            logger.warning("rank %s (pid %s) failed with exit code %s; replacing it",
                           at.slot_rank(proc.slot), proc.worker.pid, proc.worker.returncode)
            f = at.as_failure(proc)
            if at.first_failure is None:
                at.first_failure = f
            step = at.board.read(proc.slot)
            if not blame_backend and at.crash.is_loop(proc.worker.returncode or 0, step):
                logger.error("rank %s failed again at step %s with exit code %s: a crash "
                             "loop, not a machine failure; stopping the job",
                             f.rank, step, f.exitcode)
                at.gens.report_failure(f"rank {f.rank} crash loop at step {step}", final=True)
                stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
                raise StopJob(AttemptResult([f, *at.other_failures(f)], f), final=True)
        self._recover({r: at.world.node for r in dead_ranks}, now)

    def _lost_spare(self, proc: Proc) -> None:
        """A spare (parked or still starting) died."""
        self.attempt.world.unpark(proc.slot)
        self._write_status()
        if not self.attempt.exiting:  # else the job is ending: spares leave
            self.processes.spare_died(self.attempt, proc)

    def _failure_result(self, final: bool = True) -> AttemptResult:
        at = self.attempt
        root = at.first_failure
        at.gens.report_failure(f"rank {root.rank if root else '?'} failed and no spare is left",
                               final)
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
        if root is None:
            return AttemptResult(change=WorldChange(CHANGE_LOST, "no spare left"))
        return AttemptResult([root, *at.other_failures(root)], root)

    # ------------------------------------------------------------------ decisions

    def _recover(self, lost: dict[int, str], detected: float,
                 view: View | None = None) -> None:
        """Ranks lost their process (rank -> the node it was on; this node's own, or a
        lost node's): publish a generation that gives each a parked spare. ``view``:
        the job's state if the caller has just read it (multi-node)."""
        at = self.attempt
        world, g = at.world, at.gen
        lost = {**at.waiting, **at.deferred, **lost}
        if not lost:
            return
        local = [r for r, n in lost.items() if n == world.node]
        elsewhere = [r for r, n in g.ranks.items() if r not in lost and n != world.node]
        if not elsewhere and not at.holders - set(lost):
            self._state_lost(f"rank(s) {sorted(lost)} failed and no other rank held the "
                             "training state")
        try:
            ranks: dict[int, str] | None = g.ranks  # this node's spares take its dead ranks
            if len(local) < len(lost) or len(world.parked) < len(lost):
                ranks = self._place(lost, view)
            if ranks is not None:
                failed = [at.failed_record(r) if r in local else {"rank": r, "node": n}
                          for r, n in sorted(lost.items())]
                reason = "failure" if local else "node loss"
                new = Generation(g.gen + 1, ranks, at.gens.store, sorted(lost), reason)
                published = at.gens.publish(new)
        except KVUnavailable as e:
            self._defer(lost, detected, e)
            return
        except KVError as e:  # a refusal, not an outage (a c10d store whose host died)
            raise RendezvousError(f"rank(s) {sorted(lost)} lost their process and the "
                                  f"rendezvous backend failed: {e}") from None
        at.deferred = {}
        if ranks is None:
            self._no_spare(lost, detected)
            return
        if published:
            at.waiting = {}
            at.holders -= set(lost)
            self._apply(new, detected, failed)
        else:
            # Another node published first: read its generation now; applying it gives
            # this node's dead ranks this node's spares.
            at.last_view = 0.0

    def _place(self, lost: dict[int, str], view: View | None) -> dict[int, str] | None:
        """Homes for ``lost`` ranks, nodes tried in this order: this node for its own
        dead ranks, spare nodes (a lost node's ranks), then every other live node."""
        at = self.attempt
        view = view or at.gens.view()
        if view is None:
            return None
        parked = {**at.gens.parked(), at.world.node: len(at.world.parked)}
        order = [at.world.node] if at.world.node in lost.values() else []
        order += [n for n in view.spare_nodes + at.gen.nodes
                  if n in view.alive and n not in order and n not in lost.values()]
        return place(lost, at.gen.ranks, parked, order)

    def _no_spare(self, lost: dict[int, str], detected: float) -> None:
        """``--spare-policy``: nothing parked anywhere for the ``lost`` ranks."""
        at = self.attempt
        policy, dead = self.config.spare_policy, sorted(lost)
        if policy == "wait":
            if not at.waiting:
                at.waiting_since = detected
                at.wait_deadline = time.monotonic() + self.config.spare_wait_timeout
                logger.warning("no spare parked for rank(s) %s; waiting up to %.0f s",
                               dead, self.config.spare_wait_timeout)
                for rank, slot in at.world.slot_of.items():
                    if rank not in lost:
                        at.tell(slot, channel.Recovering())
            at.waiting = lost
            self.processes.spawn_missing(at)
            return
        logger.error("no spare parked for rank(s) %s (--spare-policy %s)", dead, policy)
        raise StopJob(self._failure_result(final=policy == "fail"), final=policy == "fail")

    def _apply(self, g: Generation, detected: float,
               failed: list[dict[str, Any]] | None = None) -> None:
        """Take generation ``g`` on this node and announce it to this node's ranks."""
        at = self.attempt
        world = at.world
        before = dict(world.slot_of)
        # This node's dead ranks: another node's generation gives them this node's
        # spares even where it was decided without this node's word (an outage).
        dead_here = {r: at.failed_record(r) for r, s in before.items() if not at.alive(s)}
        placed = world.apply(g, at.alive)
        at.gen = g
        at.unplaced = placed.unplaced
        if placed.promoted:
            at.pool = self.config.spares  # a spare node is an active node now
        handoffs: dict[int, channel.Handoff] = {}
        for rank, slot in placed.released.items():
            if not at.alive(slot):
                continue
            at.retired.add(slot)
            prefix = f"tp-run/g{g.gen}/handoff/{rank}"
            if g.boundary is not None and rank in placed.promoted:
                # A planned migration: the leaving rank hands its state over.
                handoffs[rank] = channel.Handoff("receiver", prefix)
                at.tell(slot, at.generation_msg(None, channel.Handoff("donor", prefix)))
            else:
                at.tell(slot, at.generation_msg(None))  # retire it
        superseded = at.recovery if at.recovery and not at.recovery.resumed else None
        if superseded is not None:
            at.recovery = None  # a failure during a recovery: one report for both
        self._finish_report()
        if not world.slot_of and not placed.unplaced:
            # A spare node the generation left alone: nothing to announce or report.
            self._write_status()
            return
        if failed is None:  # another node decided: its record has the details
            failed = failures_served(g.replaced, dead_here, placed)
        if superseded is not None:
            detected = min(detected, superseded.detected)
            known = {x["rank"] for x in superseded.failed}
            failed = superseded.failed + [f for f in failed if f["rank"] not in known]
        rec = Recovery(g.gen, g.reason, detected, decided=time.time(), failed=failed)
        rec.promoted = [{"rank": r, "slot": s, "pid": at.procs[s].worker.pid}
                        for r, s in sorted(placed.promoted.items())]
        if superseded is not None:  # the first newcomers that still hold their rank
            rec.promoted = sorted([p for p in superseded.promoted
                                   if world.slot_of.get(p["rank"]) == p["slot"]] + rec.promoted,
                                  key=lambda p: p["rank"])
        for rank, slot in placed.promoted.items():
            self.processes.show_as_rank(at, slot, rank)
        at.recovery = rec
        at.finished.clear()
        for rank in [*placed.promoted, *placed.unplaced]:
            # Where the rank's last holder ran: a newcomer reads the record it left
            # (kept until a newcomer resumes: one that dies first leaves no record).
            if rank in before:
                at.origin.setdefault(rank, before[rank])
        for rank, slot in world.slot_of.items():
            at.tell(slot, at.generation_msg(rank, handoff=handoffs.get(rank),
                                            from_slot=at.origin.get(rank)))
        self.processes.spawn_missing(at)
        self._write_status()

    def _fill_unplaced(self) -> None:
        """A spare parked: give it a rank of this generation that has no process yet."""
        at = self.attempt
        while at.unplaced:
            slot = at.world.fill(at.unplaced[0])
            if slot is None:
                return
            rank = at.unplaced.pop(0)
            self.processes.show_as_rank(at, slot, rank)
            if at.recovery is not None:
                at.recovery.promoted.append({"rank": rank, "slot": slot,
                                             "pid": at.procs[slot].worker.pid})
            at.tell(slot, at.generation_msg(rank, from_slot=at.origin.get(rank)))

    def _migrate(self, rank: int) -> str:
        at = self.attempt
        world, g = at.world, at.gen
        if rank not in world.slot_of:
            return f"error: no rank {rank} on this node (ranks {sorted(world.slot_of)})"
        if at.recovery is not None and len(at.recovery.resumed) < len(world.slot_of):
            return "error: a recovery is in progress; try again in a moment"
        if not world.parked:
            return "error: no spare is parked; try again when one is"
        steps = [at.board.read(s) for s in world.slot_of.values()]
        boundary = max(steps) + _MIGRATION_MARGIN
        old = at.procs[world.slot_of[rank]].worker.pid
        new = Generation(g.gen + 1, g.ranks, at.gens.store, [rank], "migration", boundary)
        try:
            if not at.gens.publish(new):
                return "error: the job's generation changed meanwhile; try again"
        except KVError as e:
            return f"error: the rendezvous backend cannot publish the migration: {e}"
        self._apply(new, time.time(), [{"rank": rank, "slot": world.slot_of[rank], "pid": old}])
        pid = at.procs[world.slot_of[rank]].worker.pid
        logger.warning("migrating rank %s from pid %s to pid %s at step %s", rank, old, pid,
                       boundary)
        return f"ok: rank {rank} moves to spare pid {pid} after step {boundary}"

    # ------------------------------------------------------------------ reporting

    def _maybe_report(self) -> None:
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
