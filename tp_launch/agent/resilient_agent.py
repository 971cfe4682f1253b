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
generation change with a boundary step and a handoff from R to the spare; ``tp-run
migrate --node`` moves every rank of the node that way, to other nodes' spares. Advance
warnings (:mod:`tp_launch.agent.advance`: a preemption signal, ``--on-preempt``; a failed
``--health-check``) are acted on in the loop: the node's migration, or a stop. ``tp-run
status`` asks through the same socket and gets this node's ranks, spares and last
recoveries (:mod:`tp_launch.agent.status`).

This module is the agent's loop: it watches the processes' pidfds, the channel and the
job's state and hands what it sees to the attempt's decisions
(:class:`~tp_launch.agent.recovery.Recoverer`, on the attempt's state,
:class:`~tp_launch.agent.attempt.Attempt`). One node and many run the same code: only
the generations differ (:mod:`tp_launch.agent.generations`: one node's publish at once
and never wait for a backend). The processes and the spare pool are
:mod:`tp_launch.agent.processes`; the channel's server side (the control socket, with
its peer checks and message validation, the status file and the progress board, all in
a private control directory) is :mod:`tp_launch.agent.control_server`.

Each recovery is one JSON line in ``<run log dir>/recovery.jsonl``
(:mod:`tp_launch.agent.recovery_report`; a write that fails, a full disk, costs the
line, not the job) and one line on the console (multi-node: on
every node, with that node's ranks' timings). A spare's output goes to its own log files
(:mod:`tp_launch.procs.logs`) and reaches the console only once it takes a rank.

Multi-node, with the rendezvous backend unreachable (an etcd restart: see
:mod:`rendezvous.membership`, "Outages"): the workers keep running and nothing is
concluded. What a node can do alone it does (a dead parked spare is replaced). A rank
that dies needs the other nodes (every rank rebuilds the group in the new generation,
and they hear of it only through the backend), and a generation exists only once its
compare-and-swap succeeded: announcing g+1 to this node's ranks before that could let
two nodes announce two different g+1. So the decision is deferred (by
:meth:`~tp_launch.agent.recovery.Recoverer.recover`; a publish that could not reach the
backend is never taken for another node's win), this node's surviving ranks are told to
wait, and the generation goes out when the backend answers; if another node published first
meanwhile, its generation is applied, which gives this node's dead ranks this node's
spares. Ranks of other nodes give up waiting for the generation after
:data:`~tp_launch.worker_settings.RECOVERY_WAIT_S` and fail together at one step: while
the backend is (or lately was) unreachable, that is not a crash loop, and they get spares
like any dead rank. Past ``outage_timeout`` a deferred recovery ends the job with one
error line (exit 1); ranks that all finished training are let go (every rank took part
in the last step's collectives). A rank gone before the exit barrier is never a success:
the agent exits 0 only after the barrier (or when a plain script's ranks all exited 0).
"""

from __future__ import annotations

import logging
import selectors
import signal
import time

from rendezvous import RendezvousHandler, RendezvousInfo, api
from tp_launch import channel
from tp_launch.agent import hangs
from tp_launch.agent.advance import SETTLE_S, Advance
from tp_launch.agent.health import HealthCheck
from tp_launch.agent.attempt import Attempt, Proc
from tp_launch.agent.control import World
from tp_launch.agent.decisions import Exit, Phase, attempt_settled, backend_to_blame, judge_exits
from tp_launch.agent.control_server import Conn, ControlServer
from tp_launch.agent.generations import open_generations, shared_membership
from tp_launch.agent.node_agent import AttemptResult, NodeAgent, SignalReceived, SignalWatch
from tp_launch.agent.processes import Processes
from tp_launch.agent.recovery import Recoverer, StopJob
from tp_launch.agent.status import node_status, status_reply
from tp_launch.agent.watchdog import Watchdog
from tp_launch.config import ConfigError, LaunchConfig
from tp_launch.procs.logs import ConsoleTail, LogLayout
from tp_launch.procs.worker import stop_workers

logger = logging.getLogger(__name__)

# Multi-node: seconds between two reads of the job's state when no watch poked.
_VIEW_POLL_S = 2.0
# Multi-node: seconds between two publications of this node's status (tp-run status).
_STATUS_EVERY_S = 2.0


class ResilientAgent(NodeAgent):
    """A :class:`NodeAgent` that replaces dead ranks with parked spares."""

    def __init__(self, config: LaunchConfig, rdzv: RendezvousHandler,
                 layout: LogLayout | None = None) -> None:
        super().__init__(config, rdzv, layout)
        # Job-wide, across attempts:
        self._no_restart = False
        self.processes = Processes(config, self.layout, self.workers)
        self.attempt: Attempt  # the attempt in progress, or the last one
        self.watchdog = Watchdog(config, self.processes, self.abort_if_quiet)
        self.recoverer: Recoverer  # the attempt's decisions
        self.advance = Advance(config.on_preempt)  # advance warnings, once per job
        self.health = HealthCheck(config.health_check, config.health_interval) \
            if config.health_check else None

    def run(self, watch: SignalWatch) -> int:
        if self.config.max_nodes > 1 and shared_membership(self.rdzv) is None:
            raise ConfigError("--spares across nodes needs a membership rendezvous "
                              "(--rdzv-backend etcd or c10d), not "
                              f"{self.config.rdzv_backend!r}")
        self.rdzv.accept_spare_nodes()
        if self.health is not None:
            self.health.start()
        try:
            self.processes.start_template()  # it imports while the rendezvous forms
            # It serves this agent's stores as well: the agent never imports torch.
            self.rdzv.host_stores_with(self.processes.template)
            return super().run(watch)
        finally:
            self.processes.close()
            if self.health is not None:
                self.health.stop()

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
        at.clock.reset(time.monotonic())
        at.quiet.since = at.started = time.monotonic()
        at.stragglers = hangs.Stragglers(cfg.straggler_factor, cfg.straggler_window)
        self.recoverer = Recoverer(cfg, at, self.processes, self.layout, self.rdzv.run_id)
        try:
            self.processes.wait_for_template()
            for local, rank in enumerate(mine):
                self.processes.spawn(at, local, logs.ranks[local])
                at.world.slot_of[rank] = local
                at.holders.add(rank)  # its freshly built (or loaded) state
            self.processes.spawn_missing(at)
            self.recoverer.write_status()
            return self._monitor_resilient(watch)
        except StopJob as e:
            self._no_restart = self._no_restart or e.final
            return e.result
        except SignalReceived as e:  # forwarded to every process, as in compatible mode
            logger.warning("Received %s death signal, shutting down workers", e.sig.name)
            stop_workers(self.workers, e.sig, cfg.shutdown_timeout)
            raise
        finally:
            if at.phase is Phase.ENDED:
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

    def _on_message(self, conn: Conn, msg: channel.Message) -> channel.Message | None:
        """A checked message from one of this node's processes (or ``tp-run migrate``)."""
        at = self.attempt
        if isinstance(msg, channel.Hello):
            proc = at.procs.get(msg.slot)
            if proc is None:
                raise channel.ChannelError(f"hello from slot {msg.slot}, which this agent "
                                           "did not start")
            proc.conn, proc.hello = conn, True
            self.processes.opt_in(at)
            rank = at.slot_rank(proc.slot)
            if rank is not None:
                at.tell(proc.slot, at.generation_msg(rank))
            elif proc.slot not in at.retired:
                at.world.park(proc.slot)
                if at.unplaced:
                    self.recoverer.fill_unplaced()
                if at.pending.no_spare:
                    self.recoverer.recover({}, at.pending.no_spare_since)
                self.recoverer.write_status()
        elif isinstance(msg, channel.Resumed) and msg.gen == at.world.gen:
            at.holders.add(msg.rank)
            at.origin.pop(msg.rank, None)
            if at.recovery and msg.gen == at.recovery.gen:
                at.recovery.resumed[msg.rank] = msg
        elif isinstance(msg, channel.Stepped) and at.recovery and \
                msg.gen == at.recovery.gen:
            at.recovery.stepped.setdefault(msg.rank, msg.t)
            at.recovery.checks.setdefault(msg.rank, msg.check_s)
            self.recoverer.maybe_report()
        elif isinstance(msg, channel.Finished) and msg.gen == at.world.gen:
            at.finished.add(msg.rank)
            if at.recovery and msg.rank not in at.recovery.stepped:
                at.recovery.stepped[msg.rank] = time.time()
                self.recoverer.maybe_report()
            if at.finished >= set(at.world.slot_of) and not at.unplaced:
                at.gens.mark_finished(at.world.gen)
                at.last_view = 0.0  # the view that ends the job: read it now
        elif isinstance(msg, channel.Fatal):
            self.recoverer.fatal(msg)
        elif isinstance(msg, channel.Migrate):
            if msg.rank is None:
                return channel.Reply(self.recoverer.migrate_node()[1])
            return channel.Reply(self.recoverer.migrate(msg.rank))
        elif isinstance(msg, channel.Status):
            return status_reply(at, self.rdzv.run_id, self.layout.run_dir)
        return None

    # ------------------------------------------------------------------ monitoring

    def _monitor_resilient(self, watch: SignalWatch) -> AttemptResult:
        at = self.attempt
        cfg = self.config
        while True:
            timeout = max(cfg.monitor_interval, 0.01)
            exited: list[Proc] = []
            world_changed = False
            for key, events in at.sel.select(timeout=timeout):
                kind, obj = key.data
                if kind == "signal":
                    watch.drain()
                elif kind == ControlServer.KIND:
                    at.control.on_event(obj, events)
                elif kind == "world":
                    world_changed = True
                elif kind == "exit" and obj.worker.returncode is not None:
                    at.sel.unregister(key.fd)
                    exited.append(obj)
            watch.raise_pending()
            if exited:
                self._on_exits(exited)
            if world_changed or time.monotonic() - at.last_view > _VIEW_POLL_S:
                self.recoverer.on_world_change()
            if at.pending.no_spare and time.monotonic() > at.pending.deadline:
                self.recoverer.wait_ran_out()
            self.processes.spawn_missing(at)  # a spare whose backoff delay is over
            self._advance(watch)
            self.watchdog.tick(at, self.recoverer)
            if time.monotonic() - at.status_published > _STATUS_EVERY_S:
                at.status_published = time.monotonic()
                at.gens.set_status(node_status(at))
            # A rank that died since the select is seen by the next one: only exits 0 end
            # the attempt here (a death between the two used to pass for a success).
            if attempt_settled([at.procs[s].worker.returncode for s in at.world.slot_of.values()],
                               bool(at.pending), bool(at.unplaced), at.phase, at.resilient,
                               bool(at.world.slot_of)):
                if at.exiting:
                    at.enter(Phase.ENDED)
                if not at.resilient:
                    self.processes.say_unused()  # a plain script's ranks all exited 0
                return AttemptResult()

    def _on_exits(self, exited: list[Proc]) -> None:
        """Processes exited: act on what :func:`~tp_launch.agent.decisions.judge_exits`
        makes of them."""
        at = self.attempt
        now = time.time()
        exits = [Exit(p.slot, at.slot_rank(p.slot), p.worker.returncode or 0, p.hello,
                      p.slot in at.retired, at.board.read(p.slot)) for p in exited]
        blame = backend_to_blame(at.gens.outage_s(), time.monotonic() - at.outage_seen,
                                 self.processes.recovery_wait_s)
        verdict = judge_exits(exits, at.resilient, at.phase, blame, at.crash)
        procs = {p.slot: p for p in exited}
        for e in verdict.spares_lost:
            self._lost_spare(procs[e.slot])
        if verdict.plain:
            self.processes.say_unused()
        failed = [procs[e.slot] for e in verdict.failures]
        if verdict.outcome == "torchrun":
            # Not resilient, or training is over (a rank died in the script's epilogue,
            # after every rank finished): torchrun's way.
            raise StopJob(self._fail([p.worker for p in failed], at.rank_map()), final=False)
        if verdict.outcome == "none":
            return
        for proc in failed:
            if at.slot_rank(proc.slot) not in at.hung:
                logger.warning("rank %s (pid %s) failed with exit code %s; replacing it",
                               at.slot_rank(proc.slot), proc.worker.pid,
                               proc.worker.returncode)
            if at.first_failure is None:
                at.first_failure = at.as_failure(proc)
        if verdict.loop is not None:
            f = at.as_failure(procs[verdict.loop.slot])
            logger.error("rank %s failed again at step %s with exit code %s: a crash "
                         "loop, not a machine failure; stopping the job",
                         f.rank, verdict.loop.step, f.exitcode)
            at.gens.report_failure(f"rank {f.rank} crash loop at step {verdict.loop.step}",
                                   final=True)
            stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
            raise StopJob(AttemptResult([f, *at.other_failures(f)], f), final=True)
        self.recoverer.recover({e.rank: at.world.node for e in verdict.failures
                                if e.rank is not None}, now)

    def _lost_spare(self, proc: Proc) -> None:
        """A spare (parked or still starting) died."""
        self.attempt.world.unpark(proc.slot)
        self.recoverer.write_status()
        if not self.attempt.exiting:  # else the job is ending: spares leave
            self.processes.spare_died(self.attempt, proc)

    # ------------------------------------------------------------------ advance warnings

    def _advance(self, watch: SignalWatch) -> None:
        """A preemption notice or a failed health check: move this node's ranks (or
        stop the job), as :class:`~tp_launch.agent.advance.Advance` decides."""
        at, adv, now = self.attempt, self.advance, time.monotonic()
        holds_ranks = bool(at.world.slot_of or at.unplaced)
        for sig in watch.take_notices():
            if adv.notice(f"preemption notice ({sig.name})", now,
                          settle_s=SETTLE_S if holds_ranks else 0.0):
                logger.warning("%s received: %s", sig.name,
                               "moving this node's ranks" if adv.mode == "migrate"
                               else "stopping the job")
        failure = self.health.failure() if self.health is not None else None
        if failure is not None:
            logger.error("%s", failure)
            adv.notice(failure, now, mode="migrate")
        action = adv.due(now)
        if action is None or at.exiting:
            return
        if not holds_ranks:
            action = "migrate"  # no rank here: nothing to stop, its spares leave the pool
        if action == "migrate":
            outcome, reply = self.recoverer.migrate_node(evidence=adv.why or "")
            if adv.outcome(outcome, now) is None:
                if outcome == "retry":
                    logger.info("advance warning: not yet: %s", reply)
                return  # done, or tried again in a moment
            why = f"{adv.why}: {reply.removeprefix('error: ')}"
        else:
            why = adv.why or "advance warning"
        adv.stopped()
        detail = f"{why}; stopping the job (its ranks stop now: the script's last " \
            "checkpoint is where a restart resumes)"
        self.recoverer.stop_job(detail, detail, final=True)
