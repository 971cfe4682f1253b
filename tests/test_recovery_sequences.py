"""The executor of the agent's recovery decisions (tp_launch.agent.recovery.Recoverer on
a real Attempt, World and LocalGenerations) driven through sequences of events, in
memory: processes are records with a pid and an exit status, the channel records what
each process is told, the progress board is a dict, time is what the test says. No
process, no socket.

The sequences are the interleavings end-to-end runs met only by chance: a rank that dies
while its recovery is under way, a promoted spare that dies before resuming, two
failures in one tick, a wait for a spare that parks late or never.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from rendezvous import RendezvousInfo
from tp_launch import channel
from tp_launch.agent.attempt import Attempt, Proc
from tp_launch.agent.control import Generation, World
from tp_launch.agent.decisions import Phase, replacement_wait
from tp_launch.agent.generations import LocalGenerations
from tp_launch.agent.processes import missing_spares
from tp_launch.agent.recovery import Recoverer, StopJob

pytestmark = pytest.mark.unit


class FakeWorker:
    def __init__(self, pid: int, local_rank: int) -> None:
        self.pid, self.local_rank = pid, local_rank
        self.returncode: int | None = None
        self.exit_time = None
        self.started = 0.0
        self.popen = SimpleNamespace(wait=lambda timeout=None: self.returncode)

    def signal_group(self, sig: int) -> None:
        self.returncode = -sig


class FakeControl:
    """The channel's server side: what each connection was told."""

    def __init__(self) -> None:
        self.told: list[tuple[int, channel.Message]] = []
        self.status: Any = None

    def send(self, conn: Any, msg: channel.Message) -> None:
        self.told.append((conn, msg))

    def write_status(self, status: Any) -> None:
        self.status = status


class FakeBoard(dict):
    def read(self, slot: int) -> int:
        return self.get(slot, 0)


class FakeProcesses:
    """Spares start as the pool asks (parked only when the test says they said hello)."""

    def __init__(self) -> None:
        self.workers: list[FakeWorker] = []
        self.shown: list[tuple[int, int]] = []

    def spawn_missing(self, at: Attempt) -> None:
        if at.exiting:
            return
        for _ in range(missing_spares(at)):  # the real count; only the start is faked
            slot = at.next_slot
            at.next_slot += 1
            add_proc(at, self, slot)

    def show_as_rank(self, at: Attempt, slot: int, rank: int) -> None:
        self.shown.append((slot, rank))


def add_proc(at: Attempt, processes: FakeProcesses, slot: int) -> Proc:
    worker = FakeWorker(1000 + slot, slot)
    processes.workers.append(worker)
    proc = Proc(slot, worker, logs=None, conn=slot)  # type: ignore[arg-type]
    at.procs[slot] = proc
    return proc


class Node:
    """One node's attempt, its executor and what its processes were told."""

    def __init__(self, ranks: int = 3, spares: int = 1, policy: str = "fail",
                 wait_s: float = 60.0) -> None:
        info = RendezvousInfo(round=0, node_rank=0, nnodes=1, rank_offset=0,
                              world_size=ranks, master_addr="127.0.0.1", master_port=1,
                              use_agent_store=False)
        gens = LocalGenerations(info)
        self.control = FakeControl()
        self.board = FakeBoard()
        self.logged: list[str] = []
        g = gens.initial()
        self.at = Attempt(info, logs=None, restart_count=0,  # type: ignore[arg-type]
                          control=self.control, board=self.board,  # type: ignore[arg-type]
                          gens=gens, sel=None, tail=None,  # type: ignore[arg-type]
                          gen=g, world=World(gens.node, g.gen), local_of={},
                          pool=spares, next_slot=ranks, spares_wanted=True)
        self.processes = FakeProcesses()
        config = SimpleNamespace(spares=spares, spare_policy=policy, max_restarts=3,
                                 spare_wait_timeout=wait_s, shutdown_timeout=0.1)
        layout = SimpleNamespace(append=lambda name, text: self.logged.append(text))
        self.rec = Recoverer(config, self.at, self.processes, layout, "run")  # type: ignore
        for rank in range(ranks):
            proc = add_proc(self.at, self.processes, rank)
            proc.hello = True
            self.at.world.slot_of[rank] = rank
            self.at.holders.add(rank)
        self.processes.spawn_missing(self.at)

    # ------------------------------------------------------------ events

    def park(self, slot: int | None = None) -> int:
        """A starting spare says hello and parks (the agent's hello path)."""
        at = self.at
        if slot is None:
            slot = next(p.slot for p in at.procs.values() if not p.hello
                        and p.worker.returncode is None)
        at.procs[slot].hello = True
        at.world.park(slot)
        if at.unplaced:
            self.rec.fill_unplaced()
        if at.pending.no_spare:
            self.rec.recover({}, at.pending.no_spare_since)
        return slot

    def kill(self, *ranks: int, t: float = 100.0) -> None:
        """Ranks die in one tick (their exits seen together)."""
        for rank in ranks:
            self.at.procs[self.at.world.slot_of[rank]].worker.returncode = -9
        self.rec.recover({r: self.at.world.node for r in ranks}, t)

    def resume(self, rank: int) -> None:
        """The rank's process reports the state in place (the agent's Resumed path)."""
        at = self.at
        msg = channel.Resumed(gen=at.world.gen, rank=rank, step=5, handoff_s=0.0, group_s=0.0,
                              agree_s=0.0, transfer_s=0.0, bytes=0, donor=0, t=0.0)
        at.holders.add(rank)
        at.origin.pop(rank, None)
        if at.recovery and msg.gen == at.recovery.gen:
            at.recovery.resumed[rank] = msg

    def told(self, slot: int) -> list[channel.Message]:
        return [m for conn, m in self.control.told if conn == slot]

    def generations_told(self, slot: int) -> list[tuple[int, int | None]]:
        return [(m.gen, m.rank) for m in self.told(slot)
                if isinstance(m, channel.NewGeneration)]


def test_a_dead_rank_takes_the_parked_spare_and_survivors_hear_of_it():
    n = Node(ranks=3, spares=1)
    spare = n.park()
    n.kill(1)
    assert n.at.gen.gen == 1 and n.at.gen.replaced == [1] and n.at.gen.reason == "failure"
    assert n.at.world.slot_of == {0: 0, 1: spare, 2: 2}
    for slot, rank in [(0, 0), (2, 2), (spare, 1)]:
        assert n.generations_told(slot) == [(1, rank)]
    new = [m for m in n.told(spare) if isinstance(m, channel.NewGeneration)][0]
    assert new.from_slot == 1  # the newcomer reads its predecessor's record
    assert n.at.holders == {0, 2}  # the newcomer holds nothing until it resumes
    # The replacement spare waits for the recovered ranks' first step (it would take
    # CPU from it), then starts.
    assert len(n.at.procs) == 4
    for rank in (0, 1, 2):
        n.resume(rank)
        n.at.recovery.stepped[rank] = 200.0
        n.processes.spawn_missing(n.at)
        assert len(n.at.procs) == 4
    n.rec.maybe_report()  # every rank stepped: the report is written
    n.processes.spawn_missing(n.at)  # the agent's next tick
    assert n.at.recovery is None and len(n.at.procs) == 5


def test_a_replacement_spare_starts_anyway_when_the_first_step_is_late():
    n = Node(ranks=2, spares=1)
    n.park()
    n.kill(1)
    n.processes.spawn_missing(n.at)
    assert len(n.at.procs) == 3  # waiting for the first step after the recovery...
    n.at.recovery.decided -= replacement_wait(0.0)  # ...which has not come in time
    n.processes.spawn_missing(n.at)
    assert len(n.at.procs) == 4


def test_two_failures_in_one_tick_are_one_generation():
    n = Node(ranks=3, spares=2)
    n.park(), n.park()
    n.kill(0, 2)
    assert n.at.gen.gen == 1 and n.at.gen.replaced == [0, 2]
    assert [f.rank for f in n.at.recovery.failed] == [0, 2]


def test_a_promoted_spare_that_dies_before_resuming_gets_the_next_one():
    """One recovery report for both generations, from the first detection."""
    n = Node(ranks=2, spares=2)
    first, second = n.park(), n.park()
    n.kill(1, t=100.0)
    assert n.at.world.slot_of[1] == first
    n.at.procs[first].worker.returncode = -9  # dies while receiving the state
    n.rec.recover({1: n.at.world.node}, 101.0)
    assert n.at.gen.gen == 2 and n.at.world.slot_of[1] == second
    assert n.at.recovery.detected == 100.0
    assert [f.rank for f in n.at.recovery.failed] == [1]  # one failure, not two
    assert [p.slot for p in n.at.recovery.promoted] == [second]
    assert n.logged == []  # the first report was folded into this one


def test_the_only_holder_dying_during_a_recovery_loses_the_state():
    """Rank 1 died; before its newcomer resumed, rank 0 (the only holder) dies too:
    nothing can give the newcomers the committed state. The job stops; never a fresh
    start that looks like a recovery."""
    n = Node(ranks=2, spares=2)
    n.park(), n.park()
    n.kill(1)
    with pytest.raises(StopJob) as stop:
        n.kill(0)
    assert stop.value.final
    assert "training state" in stop.value.result.change.detail


def test_once_the_newcomer_resumed_it_holds_the_state():
    n = Node(ranks=2, spares=2)
    n.park(), n.park()
    n.kill(1)
    n.resume(1)
    n.kill(0)  # rank 1's newcomer now serves rank 0's
    assert n.at.gen.gen == 2 and n.at.gen.replaced == [0]


def test_no_spare_with_policy_wait_waits_and_a_late_spare_serves_it():
    n = Node(ranks=2, spares=1, policy="wait")
    n.kill(1, t=50.0)  # the only spare is still starting
    assert n.at.gen.gen == 0 and n.at.pending.no_spare == {1: n.at.world.node}
    assert isinstance(n.told(0)[-1], channel.Recovering)  # the survivor waits, told why
    n.park()
    assert n.at.gen.gen == 1 and not n.at.pending
    assert n.at.recovery.detected == 50.0  # timed from the failure, not the parking


def test_no_spare_with_policy_fail_stops_the_job():
    n = Node(ranks=2, spares=1, policy="fail")
    with pytest.raises(StopJob) as stop:
        n.kill(1)
    assert stop.value.final


def test_no_spare_with_policy_restart_restarts_every_worker():
    n = Node(ranks=2, spares=1, policy="restart")
    with pytest.raises(StopJob) as stop:
        n.kill(1)
    assert not stop.value.final


def test_the_end_of_training_tells_every_process_to_exit_once():
    n = Node(ranks=2, spares=1)
    spare = n.park()
    n.rec.end_job()
    assert n.at.phase is Phase.EXITING
    assert all(isinstance(n.told(s)[-1], channel.Exit) for s in (0, 1, spare))
    n.at.enter(Phase.ENDED)
    with pytest.raises(Exception, match="ended -> running"):
        n.at.enter(Phase.RUNNING)


def test_a_planned_migration_hands_the_state_over_at_a_boundary():
    n = Node(ranks=2, spares=1)
    spare = n.park()
    n.board.update({0: 7, 1: 9})
    reply = n.rec.migrate(1)
    assert reply.startswith("ok: rank 1 moves to spare pid") and "after step 11" in reply
    donor = n.told(1)[-1]
    assert isinstance(donor, channel.NewGeneration) and donor.rank is None
    assert donor.handoff == channel.Handoff("donor", "tp-run/g1/handoff/1")
    receiver = n.told(spare)[-1]
    assert receiver.rank == 1 and receiver.handoff.role == "receiver"
    assert n.rec.migrate(0).startswith("error: a recovery is in progress")


def test_a_spare_node_that_is_asked_to_migrate_drains():
    n = Node(ranks=1, spares=1)
    n.at.world.slot_of.clear()  # its ranks left it
    assert n.rec.migrate_node()[0] == "ok" and n.at.draining
    assert n.rec.migrate_node() == ("ok", "ok: this node's ranks have moved already")


def test_two_ranks_lost_before_the_only_spare_parked_wait_for_two_spares():
    """--spare-policy wait, --spares 1, two ranks SIGKILLed while the spare starts: a
    spare starts for each waiting rank, and the job recovers once both parked (it used
    to wait for a second spare that never started, then stop after the timeout)."""
    n = Node(ranks=3, spares=1, policy="wait")
    n.kill(1, 2, t=50.0)
    assert n.at.gen.gen == 0 and set(n.at.pending.no_spare) == {1, 2}
    starting = [p for p in n.at.procs.values() if n.at.slot_rank(p.slot) is None]
    assert len(starting) == 3  # the pool's one, and one per waiting rank
    n.park()
    assert n.at.gen.gen == 0  # one parked: not enough for two
    n.park()
    assert n.at.gen.gen == 1 and sorted(n.at.gen.replaced) == [1, 2] and not n.at.pending


def exits_unseen(n: Node, *ranks: int) -> None:
    """Ranks' processes die after the agent's last look: their exits are not judged."""
    for rank in ranks:
        n.at.procs[n.at.world.slot_of[rank]].worker.returncode = -9


def test_a_rank_dead_but_unseen_when_a_generation_is_applied_keeps_its_slot():
    """--spare-policy fail, one spare, ranks 0 and 1 killed together; the agent sees
    rank 0's exit first. Rank 1's dead process keeps its rank in the generation that
    replaces rank 0, and its exit, seen next, meets the policy. (It used to be released
    and take the spare meant for rank 0, leaving rank 0 waiting for a spare whatever the
    policy, and its exit then passed for a parked spare's death: exit 0 for a job that
    had to stop.)"""
    n = Node(ranks=3, spares=1, policy="fail")
    spare = n.park()
    exits_unseen(n, 1)
    n.kill(0)
    assert n.at.gen.replaced == [0]
    assert n.at.world.slot_of == {0: spare, 1: 1, 2: 2} and not n.at.unplaced
    assert [f.rank for f in n.at.recovery.failed] == [0]
    with pytest.raises(StopJob) as stop:
        n.rec.recover({1: n.at.world.node}, 101.0)  # rank 1's exit, judged
    assert stop.value.final


def test_a_rank_dead_but_unseen_then_seen_is_recovered_as_its_own_failure():
    """The same race under --spare-policy wait: rank 1 waits for the replacement spare,
    and one recovery report covers both failures."""
    n = Node(ranks=3, spares=1, policy="wait")
    spare = n.park()
    exits_unseen(n, 1)
    n.kill(0, t=100.0)
    n.rec.recover({1: n.at.world.node}, 100.5)
    assert n.at.pending.no_spare == {1: n.at.world.node}
    second = n.park()
    assert n.at.gen.gen == 2 and n.at.gen.replaced == [1]
    assert n.at.world.slot_of == {0: spare, 1: second, 2: 2}
    assert [f.rank for f in n.at.recovery.failed] == [0, 1]
    assert n.at.recovery.detected == 100.0


def test_a_dead_rank_an_outage_kept_out_of_the_generation_takes_a_spare_here():
    """Multi-node: this node acted on rank 1's death, but the backend was away, and the
    generation another node published does not name it. Applying it gives the rank this
    node's parked spare at once."""
    n = Node(ranks=3, spares=1)
    spare = n.park()
    n.at.failed.add(1)  # acted on (deferred: the backend was unreachable)
    n.at.procs[1].worker.returncode = -9
    g = n.at.gen
    other = Generation(g.gen + 1, dict(g.ranks), g.store, [], "failure")
    n.rec.apply(other, 100.0)
    assert n.at.world.slot_of == {0: 0, 1: spare, 2: 2}
    assert [f.rank for f in n.at.recovery.failed] == [1]


def test_the_wait_for_a_spare_that_runs_out_says_so(capsys):
    n = Node(ranks=2, spares=1, policy="wait", wait_s=5.0)
    n.kill(1, t=50.0)
    with pytest.raises(StopJob) as stop:
        n.rec.wait_ran_out()
    assert stop.value.final
    assert "no spare parked for rank(s) [1] within --spare-wait-timeout 5 s" in \
        capsys.readouterr().err


@pytest.mark.parametrize("restarts, final, words", [
    (0, True, "no restart left (--spare-policy restart, --max-restarts 0)"),
    (2, False, "restarting every worker"),
])
def test_policy_restart_with_no_restart_left_says_it_stops(capsys, restarts, final, words):
    n = Node(ranks=2, spares=2, policy="restart")
    n.rec.config.max_restarts = restarts
    n.park(), n.park()
    n.kill(1)
    with pytest.raises(StopJob) as stop:
        n.kill(0)  # the only holder, before rank 1's newcomer resumed
    assert stop.value.final is final
    assert words in capsys.readouterr().err
