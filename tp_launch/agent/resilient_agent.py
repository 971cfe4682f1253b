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
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from rendezvous import RendezvousError, RendezvousInfo
from rendezvous.kv import KVError, KVUnavailable
from rendezvous.membership import CHANGE_FAILURE, CHANGE_LOST, WorldChange
from tp_launch import channel
from tp_launch.agent.control import (
    CrashLoop,
    Generation,
    SpareRestarts,
    World,
    failures_served,
    place,
)
from tp_launch.agent.control_server import Conn, ControlServer
from tp_launch.agent.generations import LocalGenerations, SharedGenerations, View
from tp_launch.agent.failures import ProcessFailure
from tp_launch.agent.node_agent import AttemptResult, NodeAgent, SignalReceived, SignalWatch
from tp_launch.agent.worker_env import spare_env, worker_argv, worker_env
from tp_launch.config import ConfigError
from tp_launch.control_files import AgentStatus
from tp_launch.procs.logs import ConsoleTail, RankLogs, SpareOutput
from tp_launch.procs.worker import WorkerProcess, stop_workers

logger = logging.getLogger(__name__)

# The job is over: how long spares told to exit get to do so before they are stopped.
_SPARE_EXIT_S = 5.0
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


@dataclass
class Proc:
    """One process of the attempt: a rank, a parked spare, or a retired rank."""

    slot: int
    worker: WorkerProcess
    logs: RankLogs
    conn: Conn | None = None
    hello: bool = False
    output: SpareOutput | None = None  # a spare's streams, through the agent


@dataclass
class Recovery:
    """One generation change in progress, and its timings (for recovery.jsonl)."""

    gen: int
    reason: str
    detected: float
    decided: float = 0.0
    failed: list[dict[str, Any]] = field(default_factory=list)
    promoted: list[dict[str, Any]] = field(default_factory=list)
    resumed: dict[int, channel.Resumed] = field(default_factory=dict)
    stepped: dict[int, float] = field(default_factory=dict)


class StopJob(Exception):
    """The job cannot go on: the result says why."""

    def __init__(self, result: AttemptResult, final: bool) -> None:
        super().__init__("job stopped")
        self.result = result
        self.final = final  # no restart, whatever --max-restarts says


class ResilientAgent(NodeAgent):
    """A :class:`NodeAgent` that replaces dead ranks with parked spares."""

    def run(self, watch: SignalWatch) -> int:
        membership = getattr(self.rdzv, "membership", None)
        if self.config.max_nodes > 1 and membership is None:
            raise ConfigError("--spares across nodes needs a membership rendezvous "
                              "(--rdzv-backend etcd or c10d), not "
                              f"{self.config.rdzv_backend!r}")
        if membership is not None:
            self.rdzv.accept_spare_nodes()  # type: ignore[attr-defined]
        self._no_restart = False
        # Job-wide: a rank of this node said hello (the script uses tp_launch.resilient);
        # until then no spare is started, since a script that does not opt in would only
        # run (and crash, or write files) beside the ranks.
        self._opted_in = False
        self._spare_restarts = SpareRestarts()
        self._said_unused = False
        return super().run(watch)

    def _may_restart(self) -> bool:
        return not self._no_restart

    def _exit_barrier(self) -> Any:
        # Resilient ranks met at the generations' own exit barrier (whose nodes follow
        # the placement); a plain script's nodes meet at the rendezvous' as usual.
        # (Called after an attempt: _exiting and _resilient are that attempt's.)
        return None if self._exiting and self._resilient else super()._exit_barrier()

    # The compatible agent's run loop calls this once per attempt.
    def _run_attempt(self, info: RendezvousInfo, restart_count: int,
                     watch: SignalWatch) -> AttemptResult:
        cfg = self.config
        logs = self.layout.attempt(restart_count)
        self._info, self._logs, self._restart_count = info, logs, restart_count
        self._procs: dict[int, Proc] = {}
        self._resilient = False
        self._crash = CrashLoop()
        self._recovery: Recovery | None = None
        self._waiting: dict[int, str] = {}  # rank -> lost node, waiting for a spare
        self._wait_deadline = 0.0
        # rank -> node: a recovery decided while the backend was unreachable, waiting
        # for it to be published (multi-node; see _defer).
        self._deferred: dict[int, str] = {}
        self._deferred_since = 0.0
        self._outage_seen = -1e9  # monotonic: the last time the backend was unreachable
        self._unplaced: list[int] = []  # ranks of this node whose spare has not parked yet
        self._finished: set[int] = set()
        self._exiting = False
        self._retired: set[int] = set()  # slots of ranks that migrated away
        self._waiting_since = 0.0
        self._first_failure: ProcessFailure | None = None
        self._last_view = 0.0
        self._holders: set[int] = set()  # this node's ranks whose process holds the state
        self._origin: dict[int, int] = {}  # rank -> slot of its last holder (newcomers)
        membership = getattr(self.rdzv, "membership", None)
        self._control = ControlServer(self._on_message)
        try:
            self._gens: LocalGenerations | SharedGenerations = \
                SharedGenerations(membership, info) if membership is not None else \
                LocalGenerations(info)
        except BaseException:
            self._control.close()
            raise
        self._board = self._control.board
        self._sel = selectors.DefaultSelector()
        self._sel.register(watch.fd, selectors.EVENT_READ, ("signal", None))
        self._control.register(self._sel)
        if self._gens.fd is not None:
            self._sel.register(self._gens.fd, selectors.EVENT_READ, ("world", None))
        self._gen = self._gens.initial()
        self._world = World(self._gens.node, self._gen.gen)
        mine = self._gen.ranks_of(self._gens.node)
        self._local_of = {rank: local for local, rank in enumerate(mine)}
        # A spare node (beyond the world) starts as a node of parked spares only (it has
        # no rank to learn from whether the script opts in).
        self._pool = cfg.spares if mine else cfg.nproc_per_node
        self._next_slot = cfg.nproc_per_node if mine else 0
        self._spares_wanted = self._opted_in or not mine
        self._ended = False
        # (A spare node's rank logs stay unused: its spares log as spares.)
        self._tail = ConsoleTail(cfg, logs, {r: mine[r] if r < len(mine) else r
                                             for r in logs.ranks})
        try:
            for local, rank in enumerate(mine):
                self._spawn_slot(local, logs.ranks[local])
                self._world.slot_of[rank] = local
                self._holders.add(rank)  # its freshly built (or loaded) state
            self._spawn_missing_spares()
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
            if self._ended:
                self._let_spares_leave()
            stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
            self._tail.stop()
            for proc in self._procs.values():
                if proc.output is not None:
                    proc.output.join(1.0)
            self._close_channel()
            self._gens.close()
            self._release_workers()

    # ------------------------------------------------------------------ processes

    def _spawn_slot(self, slot: int, rl: RankLogs, spare: bool = False) -> Proc:
        cfg, info = self.config, self._info
        # A rank's device is its local rank; a spare's, the lowest one no live process
        # uses (slots only grow: a slot number would point past the node's last device).
        device = self._free_device() if spare else slot
        make_env = spare_env if spare else worker_env
        env = make_env(cfg, info, device, self._restart_count, rl.error_file)
        env.update({channel.ENV_SOCKET: self._control.path, channel.ENV_SLOT: str(slot),
                    channel.ENV_PROGRESS: self._board.path})
        if cfg.verify_every:
            env[channel.ENV_VERIFY_EVERY] = str(cfg.verify_every)
        argv = worker_argv(cfg, device)
        try:
            worker = WorkerProcess(argv, env, rl.stdout, rl.stderr, device, piped=spare)
        except OSError as e:
            raise ConfigError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        self.workers.append(worker)
        proc = Proc(slot, worker, rl, output=SpareOutput(worker.popen, rl) if spare else None)
        self._procs[slot] = proc
        self._sel.register(worker.pidfd, selectors.EVENT_READ, ("exit", proc))
        return proc

    def _free_device(self) -> int:
        used = {p.worker.local_rank for p in self._procs.values() if p.worker.returncode is None}
        return next(d for d in range(len(used) + 1) if d not in used)

    def _spawn_spare(self) -> None:
        slot = self._next_slot
        self._next_slot += 1
        self._spawn_slot(slot, self.layout.spare_logs(self._logs, slot), spare=True)

    def _show_as_rank(self, slot: int, rank: int) -> None:
        """A spare took ``rank``: its output from now on appears as the rank's would."""
        output = self._procs[slot].output
        if output is not None:
            output.show(self.layout.console_streams(self._local_of.get(rank, 0), rank))

    def _let_spares_leave(self) -> None:
        """The job is over and the parked spares were told to exit: give them a moment to
        leave by themselves; what is left (spares still starting) is stopped quietly."""
        deadline = time.monotonic() + min(self.config.shutdown_timeout, _SPARE_EXIT_S)
        for proc in self._procs.values():
            if proc.hello:
                try:
                    proc.worker.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout,
                     level=logging.INFO)

    def _slot_rank(self, slot: int) -> int | None:
        return self._world.rank_of(slot)

    def _alive(self, slot: int) -> bool:
        return self._procs[slot].worker.returncode is None

    # ------------------------------------------------------------------ channel

    def _write_status(self) -> None:
        """The status file (for ``tp-run migrate``, ``parked_spares()`` and people)."""
        world = self._world
        self._control.write_status(AgentStatus(
            self.rdzv.run_id, os.getpid(), world.gen,
            {r: self._procs[s].worker.pid for r, s in world.slot_of.items()},
            [self._procs[s].worker.pid for s in world.parked]))
        if isinstance(self._gens, SharedGenerations):
            self._gens.set_parked(len(world.parked))

    def _close_channel(self) -> None:
        self._control.close()
        self._sel.close()

    def _tell(self, slot: int, msg: channel.Message) -> None:
        proc = self._procs.get(slot)
        if proc is not None and proc.worker.returncode is None:
            self._control.send(proc.conn, msg)

    def _generation_msg(self, rank: int | None, handoff: channel.Handoff | None = None,
                        from_slot: int | None = None) -> channel.NewGeneration:
        g = self._gen
        return channel.NewGeneration(gen=g.gen, rank=rank, world_size=g.world_size,
                                     master_addr=g.store[0], master_port=g.store[1],
                                     reason=g.reason, boundary=g.boundary, handoff=handoff,
                                     from_slot=from_slot)

    def _on_message(self, conn: Conn, msg: channel.Message) -> channel.Message | None:
        """A checked message from one of this node's processes (or ``tp-run migrate``)."""
        if isinstance(msg, channel.Hello):
            proc = self._procs.get(msg.slot)
            if proc is None:
                raise channel.ChannelError(f"hello from slot {msg.slot}, which this agent "
                                           "did not start")
            proc.conn, proc.hello = conn, True
            self._resilient = True
            if not self._spares_wanted:  # the script opts in: now the spares start
                self._opted_in = self._spares_wanted = True
                self._spawn_missing_spares()
            rank = self._slot_rank(proc.slot)
            if rank is not None:
                self._tell(proc.slot, self._generation_msg(rank))
            elif proc.slot not in self._retired:
                self._world.park(proc.slot)
                if self._unplaced:
                    self._fill_unplaced()
                if self._waiting:
                    self._recover({}, self._waiting_since)
                self._write_status()
        elif isinstance(msg, channel.Resumed) and msg.gen == self._world.gen:
            self._holders.add(msg.rank)
            self._origin.pop(msg.rank, None)
            if self._recovery and msg.gen == self._recovery.gen:
                self._recovery.resumed[msg.rank] = msg
        elif isinstance(msg, channel.Stepped) and self._recovery and \
                msg.gen == self._recovery.gen:
            self._recovery.stepped.setdefault(msg.rank, msg.t)
            self._maybe_report()
        elif isinstance(msg, channel.Finished) and msg.gen == self._world.gen:
            self._finished.add(msg.rank)
            if self._recovery and msg.rank not in self._recovery.stepped:
                self._recovery.stepped[msg.rank] = time.time()
                self._maybe_report()
            if self._finished >= set(self._world.slot_of) and not self._unplaced:
                if isinstance(self._gens, SharedGenerations):
                    self._gens.mark_finished(self._world.gen)  # the others' view ends it
                else:
                    self._end_job()
        elif isinstance(msg, channel.Fatal):
            self._on_fatal(msg)
        elif isinstance(msg, channel.Migrate):
            return channel.Reply(self._migrate(msg.rank))
        return None

    def _on_fatal(self, msg: channel.Fatal) -> None:
        """A rank found that the job cannot go on exactly: stop it, with that reason."""
        if self._exiting:
            return
        detail = f"rank {msg.rank}: {msg.message}"
        if msg.kind == "state_lost":
            self._state_lost(detail)
        print(f"tp-run: error: {detail}", file=sys.stderr, flush=True)
        self._report(detail, final=True)
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
        self._report(f"training state lost: {detail}", final=not restart)
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
        raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, detail)),
                      final=not restart)

    def _end_job(self) -> None:
        """Every rank finished: past the exit barrier, nothing is left to recover."""
        self._exiting = True
        for proc in self._procs.values():
            self._tell(proc.slot, channel.Exit())

    # ------------------------------------------------------------------ monitoring

    def _monitor_resilient(self, watch: SignalWatch) -> AttemptResult:
        cfg = self.config
        shared = isinstance(self._gens, SharedGenerations)
        while True:
            timeout = max(cfg.monitor_interval, 0.01)
            exited: list[Proc] = []
            world_changed = False
            for key, _ in self._sel.select(timeout=timeout):
                kind, obj = key.data
                if kind == "signal":
                    watch.drain()
                elif kind == ControlServer.KIND:
                    self._control.on_event(obj)
                elif kind == "world":
                    world_changed = True
                elif kind == "exit" and obj.worker.returncode is not None:
                    self._sel.unregister(key.fd)
                    exited.append(obj)
            watch.raise_pending()
            if exited:
                self._on_exits(exited)
            if shared and (world_changed or time.monotonic() - self._last_view > _VIEW_POLL_S):
                self._on_world_change()
            if self._waiting and time.monotonic() > self._wait_deadline:
                raise StopJob(self._failure_result(), final=True)
            self._spawn_missing_spares()  # a spare whose backoff delay is over
            ranks_alive = [s for s in self._world.slot_of.values() if self._alive(s)]
            if not ranks_alive and not self._waiting and not self._unplaced and \
                    not self._deferred and \
                    (self._exiting or (self._world.slot_of and not self._resilient)):
                # Every rank exited 0: after the exit barrier, or a plain script's ranks.
                # (A resilient rank gone before the barrier is a failure being
                # recovered, never a success: its generation may still be on its way.)
                self._ended = self._exiting
                if not self._resilient:
                    self._say_unused()  # a plain script's ranks all exited 0
                return AttemptResult()

    def _on_world_change(self) -> None:
        """Multi-node: act on what the job's state says now."""
        assert isinstance(self._gens, SharedGenerations)
        self._last_view = time.monotonic()
        try:
            self._gens.flush()
            view = self._gens.view()
        except KVUnavailable as e:
            self._outage_seen = time.monotonic()
            self._backend_unreachable(e)
            return
        if view is None:
            return
        if view.broken:
            # The backend refuses this node (not an outage): its world is lost.
            stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
            raise StopJob(AttemptResult(change=WorldChange(
                CHANGE_LOST, f"the rendezvous backend failed: {view.broken}")), final=False)
        if view.failed and not self._exiting:
            stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
            raise StopJob(AttemptResult(change=WorldChange(CHANGE_FAILURE, view.failed)),
                          final=view.final)
        g = view.generation
        if g.gen > self._world.gen:
            # (A deferred recovery is void: applying g gave this node's dead ranks
            # its parked spares; lost nodes are looked at again below.)
            detected = self._deferred_since if self._deferred else time.time()
            self._deferred = {}
            self._apply(g, detected)
        if view.complete or (g.nodes and view.all_finished()):
            if not self._exiting:
                self._gens.mark_complete()
                self._end_job()
            return
        lost = [n for n in g.nodes if n not in view.alive]
        survivors = sorted(n for n in g.nodes if n in view.alive)
        if lost and not self._exiting and survivors and survivors[0] == self._gens.node:
            # One decider, the lowest live node (a race is settled by the CAS anyway).
            moving = {r: n for r, n in g.ranks.items() if n in lost}
            if not self._waiting:
                logger.warning("node(s) %s lost (lease expired): moving rank(s) %s", lost,
                               sorted(moving))
            self._recover(moving, time.time(), view)
        elif (self._waiting or self._deferred) and not self._exiting:
            # A spare may have parked elsewhere; a deferred generation can go out now.
            self._recover({}, self._waiting_since if self._waiting else self._deferred_since,
                          view)

    def _backend_unreachable(self, e: KVError) -> None:
        """Multi-node, the backend cannot be reached: the workers keep running; what
        waits for the backend waits up to ``outage_timeout``. Past it, a deferred
        recovery ends the job (RendezvousError: one line); ranks that all finished
        training are let go without the other nodes' word (every rank took part in
        the last step's collectives, so every rank finished)."""
        gens = self._gens
        assert isinstance(gens, SharedGenerations)
        if gens.outage_s() <= gens.outage_timeout:
            return
        if self._deferred:
            raise RendezvousError(f"rank(s) {sorted(self._deferred)} lost their process and "
                                  f"{gens.outage_error(e)}")
        if gens.finish_pending and not self._exiting:
            logger.warning("this node's ranks finished training, and %s: they exit without "
                           "waiting for the other nodes", gens.outage_error(e))
            self._end_job()

    def _defer(self, lost: dict[int, str], detected: float, e: KVError) -> None:
        """The generation for ``lost`` cannot be published now (backend unreachable):
        keep the decision's inputs and try again when the backend answers (every
        view). Nothing is announced meanwhile: a generation exists only once its
        compare-and-swap succeeded, so two nodes never announce different ones.
        This node's surviving ranks are told to wait for it without their own limit."""
        assert isinstance(self._gens, SharedGenerations)  # a local publish cannot fail
        self._outage_seen = time.monotonic()
        if not self._deferred:
            self._deferred_since = detected
            logger.warning("rank(s) %s lost their process while the rendezvous backend is "
                           "unreachable; the new generation waits for it (outage_timeout="
                           "%gs): %s", sorted(lost), self._gens.outage_timeout, e)
            for rank, slot in self._world.slot_of.items():
                if rank not in lost:
                    self._tell(slot, channel.Recovering())
        self._deferred = dict(lost)
        self._backend_unreachable(e)

    def _on_exits(self, exited: list[Proc]) -> None:
        now = time.time()
        dead_ranks: list[int] = []
        failures: list[Proc] = []
        for proc in exited:
            rank = self._slot_rank(proc.slot)
            if rank is None:
                if proc.slot not in self._retired:
                    self._lost_spare(proc)
                continue  # a retired rank leaving, or a spare: not a failure of the job
            if not proc.hello:
                self._say_unused()
            if proc.worker.returncode == 0 and (self._exiting or not proc.hello):
                continue  # the normal end: after the exit barrier, or a plain script's
            failures.append(proc)
            dead_ranks.append(rank)
        if not failures:
            return
        if not self._resilient or self._exiting:
            # Not resilient, or training is over (a rank died in the script's epilogue,
            # after every rank finished): torchrun's way.
            result = self._fail([p.worker for p in failures], self._rank_map())
            raise StopJob(result, final=False)
        # Ranks may have waited for a generation that only the unreachable backend could
        # bring, and given up: their errors say nothing about the script.
        blame_backend = isinstance(self._gens, SharedGenerations) and (
            self._gens.outage_s() > 0 or time.monotonic() - self._outage_seen < _RANK_WAIT_S + 5)
        for proc in failures:
            logger.warning("rank %s (pid %s) failed with exit code %s; replacing it",
                           self._slot_rank(proc.slot), proc.worker.pid, proc.worker.returncode)
            f = self._as_failure(proc)
            if self._first_failure is None:
                self._first_failure = f
            step = self._board.read(proc.slot)
            if not blame_backend and self._crash.is_loop(proc.worker.returncode or 0, step):
                logger.error("rank %s failed again at step %s with exit code %s: a crash "
                             "loop, not a machine failure; stopping the job",
                             f.rank, step, f.exitcode)
                self._report(f"rank {f.rank} crash loop at step {step}", final=True)
                stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
                raise StopJob(AttemptResult([f, *self._other_failures(f)], f), final=True)
        self._recover({r: self._world.node for r in dead_ranks}, now)

    def _say_unused(self) -> None:
        """A rank ended without ever saying hello: the script does not opt in."""
        if not self._opted_in and not self._said_unused:
            self._said_unused = True
            logger.warning("--spares %s unused: a rank ended without reaching "
                           "tp_launch.resilient.run() (a script that does not call it runs "
                           "as under torchrun)", self.config.spares)

    def _lost_spare(self, proc: Proc) -> None:
        """A spare (parked or still starting) died: report it (the first of a streak of
        such deaths), and start its replacement when the backoff says so."""
        self._world.unpark(proc.slot)
        self._write_status()
        if self._exiting:
            return  # the job is ending: spares leave
        w = proc.worker
        lifetime = (w.exit_time or time.time()) - w.started
        delay = self._spare_restarts.died(lifetime, time.monotonic())
        how = _exit_description(w.returncode)
        if not self._spare_restarts.first_of_streak:
            logger.info("spare %s (pid %s) %s; the next spare starts in %.0f s", proc.slot,
                        w.pid, how, delay)
        elif proc.hello:
            logger.warning("parked spare %s (pid %s) %s; starting a new one (later, and "
                           "later, if spares keep dying)", proc.slot, w.pid, how)
        else:
            logger.error("spare %s (pid %s) %s before reaching tp_launch.resilient.run(): "
                         "%s; new spares start with a growing delay while this repeats",
                         proc.slot, w.pid, how, _spare_error(proc.output))
        self._spawn_missing_spares()

    def _rank_map(self) -> dict[int, int]:
        """slot -> rank for the summary (a spare shows as -1)."""
        return {p.slot: (self._slot_rank(p.slot) if self._slot_rank(p.slot) is not None else -1)
                for p in self._procs.values()}

    def _as_failure(self, proc: Proc) -> ProcessFailure:
        w = proc.worker
        rank = self._slot_rank(proc.slot)
        return ProcessFailure(rank=rank if rank is not None else -1, local_rank=w.local_rank,
                              pid=w.pid, exitcode=w.returncode or 0, error_file=w.error_file,
                              observed=w.exit_time or time.time())

    def _other_failures(self, root: ProcessFailure) -> list[ProcessFailure]:
        """The ranks' other failures, for the summary (spares are not the job's ranks:
        one that could not start was reported when it died)."""
        return [self._as_failure(p) for p in self._procs.values()
                if p.worker.returncode and p.worker.pid != root.pid
                and self._slot_rank(p.slot) is not None]

    def _report(self, detail: str, final: bool) -> None:
        """Multi-node: the job stops or restarts: tell the other nodes."""
        if isinstance(self._gens, SharedGenerations):
            self._gens.report_failure(detail, final)

    def _failure_result(self, final: bool = True) -> AttemptResult:
        root = self._first_failure
        self._report(f"rank {root.rank if root else '?'} failed and no spare is left", final)
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
        if root is None:
            return AttemptResult(change=WorldChange(CHANGE_LOST, "no spare left"))
        return AttemptResult([root, *self._other_failures(root)], root)

    # ------------------------------------------------------------------ decisions

    def _recover(self, lost: dict[int, str], detected: float,
                 view: View | None = None) -> None:
        """Ranks lost their process (rank -> the node it was on; this node's own, or a
        lost node's): publish a generation that gives each a parked spare. ``view``:
        the job's state if the caller has just read it (multi-node)."""
        world, g = self._world, self._gen
        lost = {**self._waiting, **self._deferred, **lost}
        if not lost:
            return
        local = [r for r, n in lost.items() if n == world.node]
        elsewhere = [r for r, n in g.ranks.items() if r not in lost and n != world.node]
        if not elsewhere and not self._holders - set(lost):
            self._state_lost(f"rank(s) {sorted(lost)} failed and no other rank held the "
                             "training state")
        try:
            ranks: dict[int, str] | None = g.ranks  # this node's spares take its dead ranks
            if len(local) < len(lost) or len(world.parked) < len(lost):
                ranks = self._place(lost, view)
            if ranks is not None:
                failed = [self._failed_record(r) if r in local else {"rank": r, "node": n}
                          for r, n in sorted(lost.items())]
                reason = "failure" if local else "node loss"
                new = Generation(g.gen + 1, ranks, self._gens.store, sorted(lost), reason)
                published = self._gens.publish(new)
        except KVUnavailable as e:
            self._defer(lost, detected, e)
            return
        except KVError as e:  # a refusal, not an outage (a c10d store whose host died)
            raise RendezvousError(f"rank(s) {sorted(lost)} lost their process and the "
                                  f"rendezvous backend failed: {e}") from None
        self._deferred = {}
        if ranks is None:
            self._no_spare(lost, detected)
            return
        if published:
            self._waiting = {}
            self._holders -= set(lost)
            self._apply(new, detected, failed)
        else:
            # Another node published first: read its generation now; applying it gives
            # this node's dead ranks this node's spares.
            self._last_view = 0.0

    def _place(self, lost: dict[int, str], view: View | None) -> dict[int, str] | None:
        """Homes for ``lost`` ranks, nodes tried in this order: this node for its own
        dead ranks, spare nodes (a lost node's ranks), then every other live node."""
        world = self._world
        parked = {world.node: len(world.parked)}
        order = [world.node] if world.node in lost.values() else []
        if isinstance(self._gens, SharedGenerations):
            view = view or self._gens.view()
            if view is None:
                return None
            parked = {**self._gens.parked(), **parked}
            order += [n for n in view.spare_nodes + self._gen.nodes
                      if n in view.alive and n not in order and n not in lost.values()]
        return place(lost, self._gen.ranks, parked, order)

    def _no_spare(self, lost: dict[int, str], detected: float) -> None:
        """``--spare-policy``: nothing parked anywhere for the ``lost`` ranks."""
        policy, dead = self.config.spare_policy, sorted(lost)
        if policy == "wait":
            if not self._waiting:
                self._waiting_since = detected
                self._wait_deadline = time.monotonic() + self.config.spare_wait_timeout
                logger.warning("no spare parked for rank(s) %s; waiting up to %.0f s",
                               dead, self.config.spare_wait_timeout)
                for rank, slot in self._world.slot_of.items():
                    if rank not in lost:
                        self._tell(slot, channel.Recovering())
            self._waiting = lost
            self._spawn_missing_spares()
            return
        logger.error("no spare parked for rank(s) %s (--spare-policy %s)", dead, policy)
        raise StopJob(self._failure_result(final=policy == "fail"), final=policy == "fail")

    def _failed_record(self, rank: int) -> dict[str, Any]:
        slot = self._world.slot_of[rank]
        old = self._procs[slot].worker
        return {"rank": rank, "slot": slot, "pid": old.pid, "exitcode": old.returncode,
                "step": self._board.read(slot)}

    def _apply(self, g: Generation, detected: float,
               failed: list[dict[str, Any]] | None = None) -> None:
        """Take generation ``g`` on this node and announce it to this node's ranks."""
        world = self._world
        before = dict(world.slot_of)
        # This node's dead ranks: another node's generation gives them this node's
        # spares even where it was decided without this node's word (an outage).
        dead_here = {r: self._failed_record(r) for r, s in before.items()
                     if not self._alive(s)}
        placed = world.apply(g, self._alive)
        self._gen = g
        self._unplaced = placed.unplaced
        if placed.promoted:
            self._pool = self.config.spares  # a spare node is an active node now
        handoffs: dict[int, channel.Handoff] = {}
        for rank, slot in placed.released.items():
            if not self._alive(slot):
                continue
            self._retired.add(slot)
            prefix = f"tp-run/g{g.gen}/handoff/{rank}"
            if g.boundary is not None and rank in placed.promoted:
                # A planned migration: the leaving rank hands its state over.
                handoffs[rank] = channel.Handoff("receiver", prefix)
                self._tell(slot, self._generation_msg(None, channel.Handoff("donor", prefix)))
            else:
                self._tell(slot, self._generation_msg(None))  # retire it
        superseded = self._recovery if self._recovery and not self._recovery.resumed else None
        if superseded is not None:
            self._recovery = None  # a failure during a recovery: one report for both
        self._finish_report()
        if not world.slot_of and not placed.unplaced:
            # A spare node the generation left alone: nothing to announce or report.
            self._write_status()
            return
        if failed is None:  # another node decided: its record has the details
            failed = failures_served(g.replaced, dead_here, placed)
        if superseded is not None:
            detected = min(detected, superseded.detected)
            failed = superseded.failed + [f for f in failed
                                          if f["rank"] not in {x["rank"] for x in superseded.failed}]
        rec = Recovery(g.gen, g.reason, detected, decided=time.time(), failed=failed)
        rec.promoted = [{"rank": r, "slot": s, "pid": self._procs[s].worker.pid}
                        for r, s in sorted(placed.promoted.items())]
        if superseded is not None:  # the first newcomers that still hold their rank
            rec.promoted = sorted([p for p in superseded.promoted
                                   if world.slot_of.get(p["rank"]) == p["slot"]] + rec.promoted,
                                  key=lambda p: p["rank"])
        for rank, slot in placed.promoted.items():
            self._show_as_rank(slot, rank)
        self._recovery = rec
        self._finished.clear()
        for rank in [*placed.promoted, *placed.unplaced]:
            # Where the rank's last holder ran: a newcomer reads the record it left
            # (kept until a newcomer resumes: one that dies first leaves no record).
            if rank in before:
                self._origin.setdefault(rank, before[rank])
        for rank, slot in world.slot_of.items():
            self._tell(slot, self._generation_msg(rank, handoff=handoffs.get(rank),
                                                  from_slot=self._origin.get(rank)))
        self._spawn_missing_spares()
        self._write_status()

    def _fill_unplaced(self) -> None:
        """A spare parked: give it a rank of this generation that has no process yet."""
        while self._unplaced:
            slot = self._world.fill(self._unplaced[0])
            if slot is None:
                return
            rank = self._unplaced.pop(0)
            self._show_as_rank(slot, rank)
            if self._recovery is not None:
                self._recovery.promoted.append({"rank": rank, "slot": slot,
                                                "pid": self._procs[slot].worker.pid})
            self._tell(slot, self._generation_msg(rank, from_slot=self._origin.get(rank)))

    def _spawn_missing_spares(self) -> None:
        """Start the spares this node lacks (the pool, plus one per rank of this node
        that still needs a process), unless none are wanted yet or the backoff after
        young deaths says wait."""
        if not self._spares_wanted or self._exiting or \
                not self._spare_restarts.ready(time.monotonic()):
            return
        pending = [p for p in self._procs.values()
                   if self._slot_rank(p.slot) is None and p.worker.returncode is None
                   and p.slot not in self._retired]
        for _ in range(self._pool + len(self._unplaced) - len(pending)):
            self._spawn_spare()

    def _migrate(self, rank: int) -> str:
        world, g = self._world, self._gen
        if rank not in world.slot_of:
            return f"error: no rank {rank} on this node (ranks {sorted(world.slot_of)})"
        if self._recovery is not None and len(self._recovery.resumed) < len(world.slot_of):
            return "error: a recovery is in progress; try again in a moment"
        if not world.parked:
            return "error: no spare is parked; try again when one is"
        steps = [self._board.read(s) for s in world.slot_of.values()]
        boundary = max(steps) + _MIGRATION_MARGIN
        old = self._procs[world.slot_of[rank]].worker.pid
        new = Generation(g.gen + 1, g.ranks, self._gens.store, [rank], "migration", boundary)
        try:
            if not self._gens.publish(new):
                return "error: the job's generation changed meanwhile; try again"
        except KVError as e:
            return f"error: the rendezvous backend cannot publish the migration: {e}"
        self._apply(new, time.time(), [{"rank": rank, "slot": world.slot_of[rank], "pid": old}])
        pid = self._procs[world.slot_of[rank]].worker.pid
        logger.warning("migrating rank %s from pid %s to pid %s at step %s", rank, old, pid,
                       boundary)
        return f"ok: rank {rank} moves to spare pid {pid} after step {boundary}"

    # ------------------------------------------------------------------ reporting

    def _maybe_report(self) -> None:
        rec = self._recovery
        if rec is not None and set(rec.stepped) >= set(self._world.slot_of):
            self._finish_report()

    def _finish_report(self) -> None:
        """Write the recovery in progress (if any) to recovery.jsonl and the console."""
        rec, self._recovery = self._recovery, None
        if rec is None:
            return
        resumed = rec.resumed.values()
        resumed_at = max((m.t for m in resumed), default=None)
        first_step = max(rec.stepped.values(), default=None)
        event = {
            "event": "recovery", "reason": rec.reason, "generation": rec.gen,
            "failed": rec.failed, "promoted": rec.promoted,
            "failed_ranks": [f["rank"] for f in rec.failed],
            "step": max((m.step for m in resumed), default=None),
            "detected_at": rec.detected,
            "decide_s": rec.decided - rec.detected,
            "handoff_s": max((m.handoff_s for m in resumed), default=0.0),
            "rebuild_s": max((m.group_s for m in resumed), default=None),
            "agree_s": max((m.agree_s for m in resumed), default=None),
            "transfer_s": max((m.transfer_s for m in resumed), default=None),
            "verify_s": max((m.verify_s for m in resumed), default=None),
            "inexact": sorted({f"rank {m.rank}: {what}" for m in resumed
                               for what in m.inexact.split(", ") if what}),
            "bytes": sum(m.bytes for m in resumed),
            "resumed_s": None if resumed_at is None else resumed_at - rec.detected,
            "first_step_s": None if first_step is None or resumed_at is None
            else first_step - resumed_at,
            "total_s": None if first_step is None else first_step - rec.detected,
            "complete": len(rec.resumed) == len(self._world.slot_of),
        }
        rate = (event["bytes"] / event["transfer_s"] / 1e6) if event["transfer_s"] else 0.0
        print(f"tp-run: {rec.reason}: rank(s) {event['failed_ranks']} -> spare pid(s) "
              f"{[p['pid'] for p in rec.promoted]} at step {event['step']}; resumed in "
              f"{_s(event['resumed_s'])} (decide {_s(event['decide_s'])}, group "
              f"{_s(event['rebuild_s'])}, state {event['bytes'] / 1e6:.1f} MB in "
              f"{_s(event['transfer_s'])} = {rate:.0f} MB/s), first step "
              f"{_s(event['first_step_s'])}", file=sys.stderr, flush=True)
        self.layout.append("recovery.jsonl", json.dumps(event) + "\n")


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


def _spare_error(output: SpareOutput | None) -> str:
    """What a spare that died wrote last to stderr (its error, for a crash)."""
    if output is None:
        return "no output"
    output.join(1.0)  # the exit is seen before the pipe is drained
    line = output.last_line()[:300] or "no output"
    return f"{line} (log: {output.stderr_path})" if output.stderr_path else line


def _s(value: float | None) -> str:
    return "?" if value is None else f"{value * 1000:.0f} ms"
