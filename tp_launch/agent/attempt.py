"""One attempt of the resilient agent: its processes and what it has learned so far.

The compatible agent's run loop calls the resilient agent once per attempt (the first
start and every restart); everything that attempt keeps is one :class:`Attempt`, made
afresh for it, so nothing of a failed attempt leaks into the next. Its helpers answer
questions about the attempt's processes (which rank a slot holds, whether it is alive,
a dead one's failure record); the decisions are the agent's
(:mod:`tp_launch.agent.resilient_agent`) and :mod:`tp_launch.agent.control`'s.
"""

from __future__ import annotations

import os
import selectors
from dataclasses import dataclass, field

from rendezvous import RendezvousInfo
from tp_launch import channel, progress
from tp_launch.agent.control import CrashLoop, Generation, World
from tp_launch.agent.decisions import Phase, Pending, next_phase
from tp_launch.agent.control_server import Conn, ControlServer
from tp_launch.agent.failures import ProcessFailure
from tp_launch.agent.generations import Generations
from tp_launch.agent.hangs import OutputClock, ProgressClock, Stragglers
from tp_launch.agent.recovery_report import FailedRank, Recovery
from tp_launch.control_files import AgentStatus
from tp_launch.procs.logs import AttemptLogs, ConsoleTail, RankLogs, SpareOutput
from tp_launch.procs.worker import WorkerProcess


@dataclass
class Proc:
    """One process of the attempt: a rank, a parked spare, or a retired rank."""

    slot: int
    worker: WorkerProcess
    logs: RankLogs
    conn: Conn | None = None
    hello: bool = False
    output: SpareOutput | None = None  # a spare's streams, through the agent


@dataclass(eq=False)
class Attempt:
    """Everything one attempt keeps.

    The channel (``control``, with its progress board ``board``), the generations
    (``gens``) and the selector (``sel``) are the attempt's own and closed with it;
    ``gen`` is the generation this node applied last and ``world`` its side of it.
    """

    info: RendezvousInfo
    logs: AttemptLogs
    restart_count: int
    control: ControlServer
    board: progress.ProgressBoard
    gens: Generations
    sel: selectors.BaseSelector
    tail: ConsoleTail
    gen: Generation
    world: World
    local_of: dict[int, int]  # rank -> local rank, for a newcomer's console prefix
    pool: int  # how many spares this node keeps parked
    next_slot: int  # slots only grow: a slot number names one process for the attempt
    spares_wanted: bool  # the script opts in (or this is a spare node): spares start
    procs: dict[int, Proc] = field(default_factory=dict)  # slot -> process
    phase: Phase = Phase.RUNNING  # changed only through enter()
    crash: CrashLoop = field(default_factory=CrashLoop)
    recovery: Recovery | None = None  # the generation change being reported
    # Ranks lost with no generation yet: no spare parked (--spare-policy wait), or the
    # backend unreachable (multi-node; see ResilientAgent, on outages).
    pending: Pending = field(default_factory=Pending)
    outage_seen: float = -1e9  # monotonic: the last time the backend was unreachable
    unplaced: list[int] = field(default_factory=list)  # this node's ranks with no spare yet
    finished: set[int] = field(default_factory=set)  # ranks that finished training
    retired: set[int] = field(default_factory=set)  # slots of ranks that migrated away
    failed: set[int] = field(default_factory=set)  # slots whose death was acted on
    first_failure: ProcessFailure | None = None
    last_view: float = 0.0  # monotonic: the last read of the job's state
    holders: set[int] = field(default_factory=set)  # ranks whose process holds the state
    clock: ProgressClock = field(default_factory=ProgressClock)  # the job's progress here
    stragglers: Stragglers = field(default_factory=Stragglers)
    quiet: OutputClock = field(default_factory=OutputClock)  # a plain script's output
    started: float = 0.0  # monotonic
    status_published: float = 0.0  # monotonic: the last node status sent to other nodes
    remote_read: float = 0.0  # monotonic: the last read of the other nodes' status
    hung: dict[int, str] = field(default_factory=dict)  # rank -> why it was killed as hung
    # (generation, rank): told to wait for a hang verdict on a peer past its own limit.
    told_to_wait: set[tuple[int, int]] = field(default_factory=set)
    origin: dict[int, int] = field(default_factory=dict)  # rank -> slot of its last holder
    # This node's ranks moved away on an advance warning: its spares take no rank.
    draining: bool = False
    # The lost nodes' addresses of the generation applied last (decisions.lost_addresses).
    lost_addrs: tuple[str, ...] = ()

    @property
    def resilient(self) -> bool:
        """A process said hello: the script uses tp_launch.resilient."""
        return any(p.hello for p in self.procs.values())

    @property
    def exiting(self) -> bool:
        """Training is over: every rank finished, the processes are told to exit."""
        return self.phase is not Phase.RUNNING

    def enter(self, phase: Phase) -> None:
        """Move the attempt's lifecycle on (:class:`~tp_launch.agent.decisions.Phase`)."""
        self.phase = next_phase(self.phase, phase)

    def recovering(self) -> bool:
        """A generation change is under way on this node: not every rank resumed."""
        return self.recovery is not None and \
            len(self.recovery.resumed) < len(self.world.slot_of)

    def slot_rank(self, slot: int) -> int | None:
        return self.world.rank_of(slot)

    def alive(self, slot: int) -> bool:
        return self.procs[slot].worker.returncode is None

    def free_device(self) -> int:
        """The lowest device no live process uses (for a spare: slots only grow, so a
        slot number would point past the node's last device)."""
        used = {p.worker.local_rank for p in self.procs.values() if p.worker.returncode is None}
        return next(d for d in range(len(used) + 1) if d not in used)

    def as_failure(self, proc: Proc) -> ProcessFailure:
        rank = self.slot_rank(proc.slot)
        return ProcessFailure.of_exit(proc.worker, rank if rank is not None else -1)

    def other_failures(self, root: ProcessFailure) -> list[ProcessFailure]:
        """The ranks' other failures, for the summary (spares are not the job's ranks:
        one that could not start was reported when it died)."""
        return [self.as_failure(p) for p in self.procs.values()
                if p.worker.returncode and p.worker.pid != root.pid
                and self.slot_rank(p.slot) is not None]

    def rank_map(self) -> dict[int, int]:
        """slot -> rank for the summary (a spare shows as -1)."""
        ranks = {p.slot: self.slot_rank(p.slot) for p in self.procs.values()}
        return {slot: -1 if rank is None else rank for slot, rank in ranks.items()}

    def failed_record(self, rank: int) -> FailedRank:
        """This node's record of ``rank``'s dead process, for the recovery report."""
        slot = self.world.slot_of[rank]
        old = self.procs[slot].worker
        return FailedRank(rank, slot=slot, pid=old.pid, exitcode=old.returncode,
                          step=self.board.read(slot), hang=self.hung.get(rank))

    def status(self, run_id: str) -> AgentStatus:
        """The status file's contents (for ``tp-run migrate``, ``parked_spares()``)."""
        return AgentStatus(run_id, os.getpid(), self.world.gen,
                           {r: self.procs[s].worker.pid for r, s in self.world.slot_of.items()},
                           [self.procs[s].worker.pid for s in self.world.parked])

    def tell(self, slot: int, msg: channel.Message) -> None:
        """Send ``msg`` to the process in ``slot`` if it is alive."""
        proc = self.procs.get(slot)
        if proc is not None and proc.worker.returncode is None:
            self.control.send(proc.conn, msg)

    def generation_msg(self, rank: int | None, handoff: channel.Handoff | None = None,
                       from_slot: int | None = None) -> channel.NewGeneration:
        """The announcement of :attr:`gen` to a process that holds ``rank`` in it (None:
        none, it retires)."""
        g = self.gen
        return channel.NewGeneration(gen=g.gen, rank=rank, world_size=g.world_size,
                                     master_addr=g.store[0], master_port=g.store[1],
                                     reason=g.reason, boundary=g.boundary, handoff=handoff,
                                     from_slot=from_slot, lost_addrs=self.lost_addrs)
