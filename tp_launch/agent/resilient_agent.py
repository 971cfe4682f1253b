"""The node agent in resilient mode (``--spares K``): replace a dead rank, keep the rest.

One attempt, on top of the compatible agent (:mod:`tp_launch.agent.node_agent`):

1. Spawn the ranks, each with the agent channel in its environment
   (:mod:`tp_launch.channel`). A script that never connects (it does not use
   ``tp_launch.resilient``) is run exactly as torchrun runs it: no spare is started, a
   failure stops every worker and restarts them (``--max-restarts``).
2. The first ``hello`` proves the script resilient: start K spares. Each parks in
   ``run()`` with its model built. Every rank that says hello is told generation 0.
3. A rank dies (its pidfd is readable at once) -> :class:`~tp_launch.agent.control.World`
   gives it a parked spare; generation g+1 goes to every rank, the survivors' group
   collectives fail or their step-boundary hook fires, they rebuild, the newcomer
   receives the state; the agent starts a new spare. No spare parked: ``--spare-policy``.
   An error exit at the step of the previous error exit is a crash loop: stop.
4. Every rank of the current generation reports ``finished``: the agent tells them (and
   the spares) to exit; exit 0.

A planned migration (``tp-run migrate --rank R``, through the control socket) is the same
generation change with a boundary step and a handoff from R to the spare.

Each recovery is one JSON line in ``<run log dir>/recovery.jsonl`` and one line on the
console.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from rendezvous import RendezvousInfo
from tp_launch import channel
from tp_launch.agent.control import CrashLoop, World
from tp_launch.agent.failures import ProcessFailure, copy_root_cause, format_summary
from tp_launch.agent.node_agent import AttemptResult, NodeAgent, SignalWatch
from tp_launch.agent.worker_env import spare_env, worker_argv, worker_env
from tp_launch.config import ConfigError
from tp_launch.procs.logs import AttemptLogs, ConsoleTail, RankLogs
from tp_launch.procs.worker import WorkerProcess, stop_workers

logger = logging.getLogger(__name__)

# A spare that dies this many times in a row before it parks means the script cannot
# run as a spare (it reads RANK at import, say): carry on without spares.
_SPARE_FAILURES_MAX = 3
# Steps past the highest committed step at which a planned migration stops the ranks:
# ranks are within one step of each other, the announcement takes microseconds.
_MIGRATION_MARGIN = 2


def control_dir() -> str:
    """Where running agents keep their channel sockets (one per agent pid)."""
    return os.path.join(tempfile.gettempdir(), f"tp-run-{os.getuid()}")


@dataclass
class Proc:
    """One process of the attempt: a rank, a parked spare, or a retired rank."""

    slot: int
    worker: WorkerProcess
    logs: RankLogs
    conn: socket.socket | None = None
    hello: bool = False


@dataclass
class Recovery:
    """One generation change in progress, and its timings (for recovery.jsonl)."""

    gen: int
    reason: str
    detected: float
    decided: float = 0.0
    failed: list[dict[str, Any]] = field(default_factory=list)
    promoted: list[dict[str, Any]] = field(default_factory=list)
    resumed: dict[int, dict[str, Any]] = field(default_factory=dict)
    stepped: dict[int, float] = field(default_factory=dict)


class StopJob(Exception):
    """The job cannot go on: the result says why."""

    def __init__(self, result: AttemptResult, final: bool) -> None:
        super().__init__("job stopped")
        self.result = result
        self.final = final  # no restart, whatever --max-restarts says


class ResilientAgent(NodeAgent):
    """A :class:`NodeAgent` that replaces dead ranks with parked spares."""

    def run(self) -> int:
        if self.config.max_nodes > 1:
            raise ConfigError("--spares: resilient mode runs on a single node in this "
                              "version (use --nnodes 1)")
        os.makedirs(control_dir(), exist_ok=True)
        self._control_path = os.path.join(control_dir(), f"{os.getpid()}.sock")
        self._no_restart = False
        return super().run()

    def _may_restart(self) -> bool:
        return not self._no_restart

    # The compatible agent's run loop calls this once per attempt.
    def _run_attempt(self, info: RendezvousInfo, restart_count: int,
                     watch: SignalWatch) -> AttemptResult:
        cfg = self.config
        logs = self.layout.attempt(restart_count)
        self._info, self._logs, self._restart_count = info, logs, restart_count
        self._procs: dict[int, Proc] = {}
        self._next_slot = cfg.nproc_per_node
        self._world = World(info.world_size, info.rank_offset)
        self._resilient = False
        self._spare_failures = 0
        self._crash = CrashLoop()
        self._recovery: Recovery | None = None
        self._waiting: list[int] = []  # dead ranks waiting for a spare (policy wait)
        self._wait_deadline = 0.0
        self._finished: set[int] = set()
        self._exiting = False
        self._retired: set[int] = set()  # slots of ranks that migrated away
        self._waiting_since = 0.0
        self._first_failure: ProcessFailure | None = None
        board_dir = logs.attempt_dir if os.path.isdir(logs.attempt_dir) else tempfile.mkdtemp()
        self._board = channel.ProgressBoard(os.path.join(board_dir, ".progress"), create=True)
        self._server = self._listen()
        self._sel = selectors.DefaultSelector()
        self._sel.register(watch.fd, selectors.EVENT_READ, ("signal", None))
        self._sel.register(self._server, selectors.EVENT_READ, ("accept", None))
        self._tail = ConsoleTail(cfg, logs, {r: info.rank_offset + r for r in range(cfg.nproc_per_node)})
        try:
            for local in range(cfg.nproc_per_node):
                self._spawn_slot(local, logs.ranks[local])
                self._world.slot_of[info.rank_offset + local] = local
            for _ in range(cfg.spares):
                self._spawn_spare()
            self._write_status()
            return self._monitor_resilient(watch)
        except StopJob as e:
            self._no_restart = self._no_restart or e.final
            return e.result
        finally:
            stop_workers(self.workers, signal.SIGTERM, cfg.shutdown_timeout)
            self._tail.stop()
            self._close_channel()
            self._release_workers()

    # ------------------------------------------------------------------ processes

    def _spawn_slot(self, slot: int, rl: RankLogs, spare: bool = False) -> Proc:
        cfg, info = self.config, self._info
        make_env = spare_env if spare else worker_env
        env = make_env(cfg, info, slot, self._restart_count, rl.error_file)
        env.update({channel.ENV_SOCKET: self._control_path, channel.ENV_SLOT: str(slot),
                    channel.ENV_PROGRESS: self._board.path})
        argv = worker_argv(cfg, slot)
        try:
            worker = WorkerProcess(argv, env, rl.stdout, rl.stderr, slot)
        except OSError as e:
            raise ConfigError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        self.workers.append(worker)
        proc = Proc(slot, worker, rl)
        self._procs[slot] = proc
        self._sel.register(worker.pidfd, selectors.EVENT_READ, ("exit", proc))
        return proc

    def _spawn_spare(self) -> None:
        slot = self._next_slot
        self._next_slot += 1
        rl = self.layout.spare_logs(self._logs, slot)
        self._spawn_slot(slot, rl, spare=True)
        self._tail.add(rl, f"{self.config.role}-spare{slot}")

    def _slot_rank(self, slot: int) -> int | None:
        return self._world.rank_of(slot)

    # ------------------------------------------------------------------ channel

    def _listen(self) -> socket.socket:
        try:
            os.unlink(self._control_path)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self._control_path)
        server.listen(256)
        server.setblocking(False)
        return server

    def _write_status(self) -> None:
        """``<control dir>/<pid>.json``: for ``tp-run migrate`` and for people."""
        world = self._world
        status = {"run_id": self.rdzv.run_id, "pid": os.getpid(), "generation": world.gen,
                  "ranks": {r: self._procs[s].worker.pid for r, s in world.slot_of.items()},
                  "parked_spares": [self._procs[s].worker.pid for s in world.parked]}
        tmp = self._control_path + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, self._control_path + ".json")

    def _close_channel(self) -> None:
        for key in list(self._sel.get_map().values()):
            kind, obj = key.data
            if kind == "conn":
                obj[0].close()
        self._sel.close()
        self._server.close()
        self._board.close()
        for path in (self._control_path, self._control_path + ".json"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        self._sel.register(conn, selectors.EVENT_READ, ("conn", (conn, channel.LineReader())))

    def _read_conn(self, conn: socket.socket, reader: channel.LineReader) -> None:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._sel.unregister(conn)
            conn.close()
            return
        for msg in reader.feed(data):
            self._on_message(conn, msg)

    def _tell(self, slot: int, msg: dict[str, Any]) -> None:
        proc = self._procs.get(slot)
        if proc is None or proc.conn is None or proc.worker.returncode is not None:
            return
        try:
            channel.send(proc.conn, msg)
        except OSError:
            pass  # it is dying: its pidfd says so in a moment

    def _generation_msg(self, rank: int | None, **extra: Any) -> dict[str, Any]:
        return {"op": "generation", "gen": self._world.gen, "rank": rank,
                "world_size": self._world.world_size, "master_addr": self._info.master_addr,
                "master_port": self._info.master_port, **extra}

    def _on_message(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "hello":
            proc = self._procs.get(msg["slot"])
            if proc is None:
                return
            proc.conn, proc.hello = conn, True
            self._resilient = True
            rank = self._slot_rank(proc.slot)
            if rank is not None:
                self._tell(proc.slot, self._generation_msg(rank, reason="start"))
            elif proc.slot >= self.config.nproc_per_node:
                self._spare_failures = 0
                self._world.park(proc.slot)
                if self._waiting:
                    self._replace(list(self._waiting), [], self._waiting_since)
                self._write_status()
        elif op == "resumed" and self._recovery and msg["gen"] == self._recovery.gen:
            self._recovery.resumed[msg["rank"]] = msg
        elif op == "stepped" and self._recovery and msg["gen"] == self._recovery.gen:
            self._recovery.stepped.setdefault(msg["rank"], msg["t"])
            self._maybe_report()
        elif op == "finished" and msg["gen"] == self._world.gen:
            self._finished.add(msg["rank"])
            if self._recovery and msg["rank"] not in self._recovery.stepped:
                self._recovery.stepped[msg["rank"]] = time.time()
                self._maybe_report()
            if self._finished >= set(self._world.slot_of):
                self._exiting = True  # past the exit barrier: nothing left to recover
                for proc in self._procs.values():
                    self._tell(proc.slot, {"op": "exit"})
        elif op == "migrate":
            reply = self._migrate(int(msg["rank"]))
            try:
                channel.send(conn, {"op": "reply", "message": reply})
            except OSError:
                pass

    # ------------------------------------------------------------------ monitoring

    def _monitor_resilient(self, watch: SignalWatch) -> AttemptResult:
        cfg = self.config
        while True:
            timeout = max(cfg.monitor_interval, 0.01)
            exited: list[Proc] = []
            for key, _ in self._sel.select(timeout=timeout):
                kind, obj = key.data
                if kind == "signal":
                    watch.drain()
                elif kind == "accept":
                    self._accept()
                elif kind == "conn":
                    self._read_conn(*obj)
                elif kind == "exit" and obj.worker.returncode is not None:
                    self._sel.unregister(key.fd)
                    exited.append(obj)
            watch.raise_pending()
            if exited:
                self._on_exits(exited)
            if self._waiting and time.monotonic() > self._wait_deadline:
                raise StopJob(self._failure_result(), final=True)
            ranks_alive = [s for s in self._world.slot_of.values()
                           if self._procs[s].worker.returncode is None]
            if not ranks_alive and not self._waiting:
                return AttemptResult()  # every rank exited 0 after the exit barrier

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
            if proc.worker.returncode == 0 and (self._exiting or not proc.hello):
                continue  # the normal end: after the exit barrier, or a plain script's
            failures.append(proc)
            dead_ranks.append(rank)
        if not failures:
            return
        if not self._resilient or self._exiting:
            # Not resilient, or training is over (a rank died in the script's epilogue,
            # after every rank finished): torchrun's way.
            raise StopJob(self._fail([p.worker for p in failures], self._rank_map()), final=False)
        for proc in failures:
            f = self._as_failure(proc)
            if self._first_failure is None:
                self._first_failure = f
            step = self._board.read(proc.slot)
            if self._crash.is_loop(proc.worker.returncode or 0, step):
                logger.error("rank %s failed again at step %s with exit code %s: a crash "
                             "loop, not a machine failure; stopping the job",
                             f.rank, step, f.exitcode)
                stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
                raise StopJob(AttemptResult([f, *self._other_failures(f)], f), final=True)
        self._replace(dead_ranks, failures, now)

    def _lost_spare(self, proc: Proc) -> None:
        self._world.unpark(proc.slot)
        self._write_status()
        if self._exiting:
            return  # the job is ending: spares leave
        if not proc.hello:
            self._spare_failures += 1
            if self._spare_failures >= _SPARE_FAILURES_MAX or not self._resilient:
                logger.error("a spare exited with code %s before reaching "
                             "tp_launch.resilient.run() (see %s); going on without spares",
                             proc.worker.returncode, proc.logs.stderr or "its stderr")
                self._spare_failures = _SPARE_FAILURES_MAX
                return
        self._spawn_spare()

    def _rank_map(self) -> dict[int, int]:
        """slot -> rank for the summary (a spare shows as -1)."""
        return {p.slot: (self._slot_rank(p.slot) if self._slot_rank(p.slot) is not None else -1)
                for p in self._procs.values()}

    def _as_failure(self, proc: Proc) -> ProcessFailure:
        w = proc.worker
        rank = self._slot_rank(proc.slot)
        return ProcessFailure(rank=rank if rank is not None else -1, local_rank=proc.slot,
                              pid=w.pid, exitcode=w.returncode or 0, error_file=w.error_file,
                              observed=w.exit_time or time.time())

    def _other_failures(self, root: ProcessFailure) -> list[ProcessFailure]:
        return [self._as_failure(p) for p in self._procs.values()
                if p.worker.returncode and p.worker.pid != root.pid]

    def _failure_result(self) -> AttemptResult:
        stop_workers(self.workers, signal.SIGTERM, self.config.shutdown_timeout)
        root = self._first_failure
        assert root is not None
        return AttemptResult([root, *self._other_failures(root)], root)

    # ------------------------------------------------------------------ decisions

    def _replace(self, dead_ranks: list[int], failures: list[Proc], detected: float) -> None:
        world = self._world
        for proc in failures:
            logger.warning("rank %s (pid %s) failed with exit code %s; replacing it",
                           self._slot_rank(proc.slot), proc.worker.pid, proc.worker.returncode)
        dead = sorted(set(dead_ranks) | set(self._waiting))
        old_slots = {r: world.slot_of[r] for r in dead}
        promoted = world.replace(dead)
        if promoted is None:
            policy = self.config.spare_policy
            if policy == "wait":
                if not self._waiting:
                    self._waiting_since = detected
                    self._wait_deadline = time.monotonic() + self.config.spare_wait_timeout
                    logger.warning("no spare parked for rank(s) %s; waiting up to %.0f s",
                                   dead, self.config.spare_wait_timeout)
                    for rank, slot in world.slot_of.items():
                        if rank not in dead:
                            self._tell(slot, {"op": "recovering"})
                self._waiting = dead
                self._spawn_missing_spares()
                return
            logger.error("no spare parked for rank(s) %s (--spare-policy %s)", dead, policy)
            raise StopJob(self._failure_result(), final=policy == "fail")
        self._waiting = []
        rec = Recovery(world.gen, "failure", detected, decided=time.time())
        for rank in dead:
            old = self._procs[old_slots[rank]].worker
            rec.failed.append({"rank": rank, "slot": old_slots[rank], "pid": old.pid,
                               "exitcode": old.returncode,
                               "step": self._board.read(old_slots[rank])})
            new = self._procs[promoted[rank]].worker
            rec.promoted.append({"rank": rank, "slot": promoted[rank], "pid": new.pid})
        self._finish_report()
        self._recovery = rec
        self._finished.clear()
        for rank, slot in world.slot_of.items():
            self._tell(slot, self._generation_msg(rank, reason="failure"))
        self._spawn_missing_spares()
        self._write_status()

    def _spawn_missing_spares(self) -> None:
        if self._spare_failures >= _SPARE_FAILURES_MAX:
            return
        pending = [p for p in self._procs.values()
                   if p.slot >= self.config.nproc_per_node and self._slot_rank(p.slot) is None
                   and p.worker.returncode is None and p.slot not in self._retired]
        for _ in range(self.config.spares - len(pending)):
            self._spawn_spare()

    def _migrate(self, rank: int) -> str:
        world = self._world
        if rank not in world.slot_of:
            return f"error: no rank {rank} on this node (ranks {sorted(world.slot_of)})"
        if self._recovery is not None and len(self._recovery.resumed) < len(world.slot_of):
            return "error: a recovery is in progress; try again in a moment"
        steps = [self._board.read(s) for s in world.slot_of.values()]
        moved = world.migrate(rank)
        if moved is None:
            return "error: no spare is parked; try again when one is"
        old, new = moved
        boundary = max(steps) + _MIGRATION_MARGIN
        prefix = f"tp-run/g{world.gen}/handoff"
        self._retired.add(old)
        self._finish_report()
        self._recovery = Recovery(world.gen, "migration", time.time(), decided=time.time())
        self._recovery.failed.append({"rank": rank, "slot": old, "pid": self._procs[old].worker.pid})
        self._recovery.promoted.append({"rank": rank, "slot": new,
                                        "pid": self._procs[new].worker.pid})
        self._finished.clear()
        for r, slot in world.slot_of.items():
            handoff = {"role": "receiver", "prefix": prefix} if r == rank else None
            self._tell(slot, self._generation_msg(r, reason="migration", boundary=boundary,
                                                  handoff=handoff))
        self._tell(old, self._generation_msg(None, reason="migration", boundary=boundary,
                                             handoff={"role": "donor", "prefix": prefix}))
        self._spawn_missing_spares()
        self._write_status()
        logger.warning("migrating rank %s from pid %s to pid %s at step %s", rank,
                       self._procs[old].worker.pid, self._procs[new].worker.pid, boundary)
        return f"ok: rank {rank} moves to spare pid {self._procs[new].worker.pid} after step {boundary}"

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
        resumed_at = max((m["t"] for m in resumed), default=None)
        first_step = max(rec.stepped.values(), default=None)
        event = {
            "event": "recovery", "reason": rec.reason, "generation": rec.gen,
            "failed": rec.failed, "promoted": rec.promoted,
            "failed_ranks": [f["rank"] for f in rec.failed],
            "step": max((m["step"] for m in resumed), default=None),
            "detected_at": rec.detected,
            "decide_s": rec.decided - rec.detected,
            "handoff_s": max((m["handoff_s"] for m in resumed), default=0.0),
            "rebuild_s": max((m["group_s"] for m in resumed), default=None),
            "agree_s": max((m["agree_s"] for m in resumed), default=None),
            "transfer_s": max((m["transfer_s"] for m in resumed), default=None),
            "bytes": sum(m["bytes"] for m in resumed),
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
        if self.layout.run_dir != os.devnull and os.path.isdir(self.layout.run_dir):
            with open(os.path.join(self.layout.run_dir, "recovery.jsonl"), "a") as f:
                f.write(json.dumps(event) + "\n")


def _s(value: float | None) -> str:
    return "?" if value is None else f"{value * 1000:.0f} ms"
