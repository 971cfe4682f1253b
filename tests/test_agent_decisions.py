"""The resilient agent's recovery decisions (tp_launch.agent.decisions), driven over
tables of events: no process, no socket, no clock.

Each case once needed a real launch (tests/test_resilient.py, test_failures.py,
test_etcd_outages.py, test_advance.py); the launches that stay there check that the
kernel, torch and etcd deliver the events these tables assume.
"""

from __future__ import annotations

import pytest

from tp_launch.agent.control import CrashLoop, Generation
from tp_launch.agent.decisions import (
    LOST_GRACE_S,
    BadTransition,
    Exit,
    NoSpare,
    Pending,
    Phase,
    Publish,
    StateLost,
    ViewFacts,
    attempt_settled,
    backend_to_blame,
    judge_exits,
    judge_view,
    lost_addresses,
    migration_refusal,
    next_phase,
    node_migration_refusal,
    placement_order,
    plan_recovery,
    replacement_wait,
    spares_to_start,
)
from tp_launch.worker_settings import RECOVERY_WAIT_S

pytestmark = pytest.mark.unit

STORE = ("127.0.0.1", 29500)
RUNNING, EXITING, ENDED = Phase.RUNNING, Phase.EXITING, Phase.ENDED


def gen(ranks: dict[int, str], n: int = 0) -> Generation:
    return Generation(n, ranks, STORE)


ONE_NODE = gen({0: "a", 1: "a", 2: "a", 3: "a"})
TWO_NODES = gen({0: "a", 1: "a", 2: "b", 3: "b"})
THREE_NODES = gen({0: "a", 1: "b", 2: "c"})


# ---------------------------------------------------------------- the lifecycle

@pytest.mark.parametrize("now,to,ok", [
    (RUNNING, EXITING, True), (EXITING, ENDED, True), (RUNNING, RUNNING, True),
    (EXITING, EXITING, True),
    (RUNNING, ENDED, False),  # an attempt ends only after the exit barrier
    (EXITING, RUNNING, False), (ENDED, RUNNING, False), (ENDED, EXITING, False),
])
def test_phase_transitions(now, to, ok):
    if ok:
        assert next_phase(now, to) is to
    else:
        with pytest.raises(BadTransition, match=f"{now.value} -> {to.value}"):
            next_phase(now, to)


def test_pending_merges_both_reasons():
    p = Pending()
    assert not p and p.ranks == {}
    p.no_spare, p.no_spare_since = {1: "a"}, 10.0
    p.no_backend, p.no_backend_since = {2: "a"}, 20.0
    assert p and p.ranks == {1: "a", 2: "a"}
    assert p.since == 10.0  # the first failure, not the outage's
    p.no_spare = {}
    assert p.since == 20.0


# ---------------------------------------------------------------- exits

def rank_exit(rank, rc, step=5, hello=True, slot=None):
    return Exit(slot if slot is not None else rank, rank, rc, hello=hello, step=step)


SPARE_DIED = Exit(7, None, -9)
RETIRED = Exit(6, None, 0, retired=True)


@pytest.mark.parametrize("name,exits,resilient,phase,blame,outcome,failed,loop", [
    ("signal death: recovered", [rank_exit(1, -9)], True, RUNNING, False,
     "recover", [1], None),
    ("error exit, first: recovered", [rank_exit(1, 1)], True, RUNNING, False,
     "recover", [1], None),
    # The crash-loop race: every rank hits the bug at one step; seen in one tick, the
    # second exit is the loop (the first is its root cause).
    ("two errors at one step, one tick", [rank_exit(0, 1), rank_exit(1, 1)], True, RUNNING,
     False, "crash_loop", [0, 1], 1),
    ("two signal deaths in one tick", [rank_exit(0, -9), rank_exit(1, -9)], True, RUNNING,
     False, "recover", [0, 1], None),
    ("signal death then error at the same step", [rank_exit(0, -9), rank_exit(1, 1)], True,
     RUNNING, False, "recover", [0, 1], None),
    ("errors while the backend is to blame", [rank_exit(0, 1), rank_exit(1, 1)], True,
     RUNNING, True, "recover", [0, 1], None),
    ("a plain script's rank exits 0", [rank_exit(0, 0, hello=False)], False, RUNNING, False,
     "none", [], None),
    ("a plain script's rank fails", [rank_exit(0, 1, hello=False)], False, RUNNING, False,
     "torchrun", [0], None),
    ("exit 0 after the barrier", [rank_exit(0, 0)], True, EXITING, False, "none", [], None),
    ("death in the epilogue, after the barrier", [rank_exit(0, -9)], True, EXITING, False,
     "torchrun", [0], None),
    # A resilient rank that exits 0 before the barrier left the job early: a failure.
    ("resilient rank exits 0 before the barrier", [rank_exit(0, 0)], True, RUNNING, False,
     "recover", [0], None),
    ("a spare died", [SPARE_DIED], True, RUNNING, False, "none", [], None),
    ("a retired rank left", [RETIRED], True, RUNNING, False, "none", [], None),
    ("a spare died beside a rank", [SPARE_DIED, rank_exit(2, -9)], True, RUNNING, False,
     "recover", [2], None),
])
def test_judge_exits(name, exits, resilient, phase, blame, outcome, failed, loop):
    v = judge_exits(exits, resilient, phase, blame, CrashLoop())
    assert v.outcome == outcome, name
    assert [e.rank for e in v.failures] == failed, name
    assert (v.loop.rank if v.loop else None) == loop, name
    assert [e.slot for e in v.spares_lost] == [e.slot for e in exits if e.rank is None
                                               and not e.retired]


@pytest.mark.parametrize("name,batches,outcomes", [
    # Two ticks: the first error is recovered (its spare takes the rank), the same
    # error at the same step from the survivor or the newcomer is the loop.
    ("same step, two ticks", [[rank_exit(0, 1, step=5)], [rank_exit(1, 1, step=5)]],
     ["recover", "crash_loop"]),
    ("newcomer fails earlier than the first", [[rank_exit(0, 1, step=5)],
                                               [rank_exit(0, 1, step=4, slot=4)]],
     ["recover", "crash_loop"]),
    ("training moved on in between", [[rank_exit(0, 1, step=5)], [rank_exit(1, 1, step=9)]],
     ["recover", "recover"]),
    ("a kill between two errors resets nothing", [[rank_exit(0, 1, step=5)],
                                                  [rank_exit(1, -9, step=6)],
                                                  [rank_exit(0, 1, step=5, slot=4)]],
     ["recover", "recover", "crash_loop"]),
    ("signal deaths never loop", [[rank_exit(0, -9)], [rank_exit(0, -9, slot=4)],
                                  [rank_exit(0, -9, slot=5)]],
     ["recover", "recover", "recover"]),
])
def test_crash_loop_over_ticks(name, batches, outcomes):
    crash = CrashLoop()
    got = [judge_exits(b, True, RUNNING, False, crash).outcome for b in batches]
    assert got == outcomes, name


def test_a_plain_rank_says_the_spares_are_unused():
    assert judge_exits([rank_exit(0, 0, hello=False)], False, RUNNING, False,
                       CrashLoop()).plain
    assert not judge_exits([rank_exit(0, -9)], True, RUNNING, False, CrashLoop()).plain


@pytest.mark.parametrize("outage_s,since_s,blame", [
    (0.0, 1e9, False),  # never an outage
    (3.0, 0.0, True),  # unreachable now
    (0.0, RECOVERY_WAIT_S + 4, True),  # ranks may still be giving up on it
    (0.0, RECOVERY_WAIT_S + 6, False),
])
def test_backend_to_blame(outage_s, since_s, blame):
    assert backend_to_blame(outage_s, since_s) is blame


# ---------------------------------------------------------------- a recovery

def no_homes(_lost):
    raise AssertionError("looked elsewhere although this node's spares were enough")


@pytest.mark.parametrize("name,g,lost,holders,hung,parked,homes,want", [
    ("own spare takes own rank", ONE_NODE, {2: "a"}, {0, 1, 2, 3}, set(), 1, no_homes,
     Publish(Generation(1, ONE_NODE.ranks, STORE, [2], "failure"), [2])),
    ("two failures in one tick, two spares", ONE_NODE, {1: "a", 2: "a"}, {0, 1, 2, 3}, set(),
     2, no_homes, Publish(Generation(1, ONE_NODE.ranks, STORE, [1, 2], "failure"), [1, 2])),
    ("killed as hung", ONE_NODE, {2: "a"}, {0, 1, 2, 3}, {2}, 1, no_homes,
     Publish(Generation(1, ONE_NODE.ranks, STORE, [2], "hang"), [2])),
    ("one hung, one dead", ONE_NODE, {1: "a", 2: "a"}, {0, 1, 2, 3}, {2}, 2, no_homes,
     Publish(Generation(1, ONE_NODE.ranks, STORE, [1, 2], "failure"), [1, 2])),
    ("no spare here, none elsewhere", ONE_NODE, {2: "a"}, {0, 1, 2, 3}, set(), 0,
     lambda lost: None, NoSpare({2: "a"})),
    ("fewer spares than dead ranks", ONE_NODE, {1: "a", 2: "a"}, {0, 1, 2, 3}, set(), 1,
     lambda lost: None, NoSpare({1: "a", 2: "a"})),
    ("a lost node's ranks go elsewhere", TWO_NODES, {2: "b", 3: "b"}, {0, 1, 2, 3}, set(), 2,
     lambda lost: {0: "a", 1: "a", 2: "a", 3: "a"},
     Publish(Generation(1, {0: "a", 1: "a", 2: "a", 3: "a"}, STORE, [2, 3], "node loss"), [])),
    # Every holder died: only a newcomer (no state) would be left. Never a fresh start.
    ("every holder died", ONE_NODE, {0: "a", 1: "a", 2: "a", 3: "a"}, {0, 1, 2, 3}, set(), 4,
     no_homes, StateLost("rank(s) [0, 1, 2, 3] failed and no other rank held the training "
                         "state")),
    # A rank dies during a recovery: the survivor is a newcomer that has not resumed
    # (not yet a holder), the only holder is the one that died.
    ("the holder dies during a recovery", gen({0: "a", 1: "a"}, 1), {1: "a"}, {1}, set(), 1,
     no_homes, StateLost("rank(s) [1] failed and no other rank held the training state")),
    # Ranks on another node always count: their agent knows whether they hold it.
    ("the other node's ranks count as holders", TWO_NODES, {0: "a", 1: "a"}, set(), set(), 2,
     no_homes, Publish(Generation(1, TWO_NODES.ranks, STORE, [0, 1], "failure"), [0, 1])),
])
def test_plan_recovery(name, g, lost, holders, hung, parked, homes, want):
    assert plan_recovery(lost, "a", g, holders, hung, parked, STORE, homes) == want, name


def test_a_spare_that_died_while_promoted_is_a_new_failure_of_the_rank():
    """Generation 1 gave rank 2 spare slot 5, which died before resuming: rank 2 is
    lost again; the survivors still hold the state, the next spare takes it."""
    g1 = Generation(1, ONE_NODE.ranks, STORE, [2], "failure")
    plan = plan_recovery({2: "a"}, "a", g1, {0, 1, 3}, set(), 1, STORE, no_homes)
    assert plan == Publish(Generation(2, ONE_NODE.ranks, STORE, [2], "failure"), [2])


def test_placement_looks_only_when_needed():
    asked = []

    def homes(lost):
        asked.append(dict(lost))
        return {0: "a", 1: "c", 2: "c"}

    plan_recovery({1: "b"}, "a", THREE_NODES, {0, 1, 2}, set(), 5, STORE, homes)
    assert asked == [{1: "b"}]  # another node's rank: never this node's spares blindly


@pytest.mark.parametrize("name,node,lost,spares,nodes,alive,order", [
    ("own dead rank: here first", "a", {1: "a"}, ["s"], ["a", "b"], {"a", "b", "s"},
     ["a", "s", "b"]),
    ("a lost node: spare nodes first, never the lost one", "a", {2: "b"}, ["s"],
     ["a", "b"], {"a", "s"}, ["s", "a"]),
    ("a dead spare node is skipped", "a", {2: "b"}, ["s", "t"], ["a", "b"], {"a", "t"},
     ["t", "a"]),
])
def test_placement_order(name, node, lost, spares, nodes, alive, order):
    assert placement_order(node, lost, spares, nodes, alive) == order, name


# ---------------------------------------------------------------- the job's view

def view(g=TWO_NODES, alive=("a", "b"), **kw):
    return ViewFacts(g, frozenset(alive), **kw)


G2 = Generation(2, TWO_NODES.ranks, STORE, [1], "failure")
WAITING = Pending(no_spare={1: "a"})
DEFERRED = Pending(no_backend={1: "a"})


@pytest.mark.parametrize("name,v,node,applied,phase,pending,want", [
    ("nothing new", view(), "a", 0, RUNNING, Pending(), {}),
    ("the backend refuses this node", view(broken="gone"), "a", 0, RUNNING, Pending(),
     {"stop": "broken"}),
    ("refused even while exiting", view(broken="gone"), "a", 0, EXITING, Pending(),
     {"stop": "broken"}),
    ("a node asks for a stop", view(failed="rank 3 crash loop", final=True), "a", 0,
     RUNNING, Pending(), {"stop": "failed"}),
    ("a stop after the end is ignored", view(failed="x"), "a", 0, EXITING, Pending(), {}),
    ("another node's generation", view(G2), "a", 0, RUNNING, Pending(), {"apply": G2}),
    ("an old generation is not applied again", view(G2), "a", 2, RUNNING, Pending(), {}),
    ("every rank finished", view(all_finished=True), "a", 0, RUNNING, Pending(),
     {"end": True}),
    ("complete while exiting: nothing more", view(complete=True), "a", 0, EXITING,
     Pending(), {}),
    ("a lost node, this node decides", view(alive=("a",)), "a", 0, RUNNING, Pending(),
     {"move": {2: "b", 3: "b"}, "lost_nodes": ["b"]}),
    ("a lost node, the lowest live node decides", view(THREE_NODES, ("b", "c")), "c", 0,
     RUNNING, Pending(), {}),
    ("a lost node while exiting: nothing", view(alive=("a",)), "a", 0, EXITING, Pending(),
     {}),
    ("waiting for a spare: retry", view(), "a", 0, RUNNING, WAITING, {"retry": True}),
    ("deferred: retry once the backend answers", view(), "a", 0, RUNNING, DEFERRED,
     {"retry": True}),
    # An outage during a generation: another node published first; applying its
    # generation serves this node's deferred ranks (no retry), a wait for a spare stays.
    ("deferred, another node's generation", view(G2), "a", 0, RUNNING, DEFERRED,
     {"apply": G2}),
    ("waiting, another node's generation", view(G2), "a", 0, RUNNING, WAITING,
     {"apply": G2, "retry": True}),
])
def test_judge_view(name, v, node, applied, phase, pending, want):
    d = judge_view(v, node, applied, phase, pending)
    got = {k: getattr(d, k) for k in ("stop", "apply", "end", "move", "lost_nodes", "retry")
           if getattr(d, k)}
    assert got == want, name


@pytest.mark.parametrize("name,cut_off_s,want", [
    ("never cut off: decides", float("inf"), {"move": {2: "b", 3: "b"}, "lost_nodes": ["b"]}),
    ("cut off a moment ago: the other may be on its way back", 1.0, {}),
    ("just inside the grace", LOST_GRACE_S - 0.1, {}),
    ("the grace is over: decides", LOST_GRACE_S,
     {"move": {2: "b", 3: "b"}, "lost_nodes": ["b"]}),
])
def test_judge_view_after_being_cut_off(name, cut_off_s, want):
    """A node that was itself cut off from the backend (etcd's host cut off: every
    lease expired there) takes nobody for lost until the others had time to come back."""
    d = judge_view(view(alive=("a",)), "a", 0, RUNNING, Pending(), cut_off_s)
    got = {k: getattr(d, k) for k in ("move", "lost_nodes") if getattr(d, k)}
    assert got == want, name


# Node ids as rendezvous.membership.new_member_id makes them: <addr>-<pid>-<hex8>.
NA, NB, NC = "198.18.0.2-11-aaaaaaaa", "198.18.0.3-12-bbbbbbbb", "node-c.example-13-cccccccc"
NB2 = "198.18.0.3-99-dddddddd"  # another agent on NB's address


@pytest.mark.parametrize("name,before,after,node,boundary,want", [
    ("a lost node's address", {0: NA, 1: NB}, {0: NA, 1: NC}, NA, None, ("198.18.0.3",)),
    ("a name is passed on as it is", {0: NA, 1: NC}, {0: NA, 1: NB}, NA, None,
     ("node-c.example",)),
    ("nothing lost", {0: NA, 1: NB}, {0: NA, 1: NB}, NA, None, ()),
    ("a planned migration's leaving node is never cut", {0: NA, 1: NB}, {0: NA, 1: NC},
     NA, 5, ()),
    ("an address a live node still has is never cut", {0: NA, 1: NB}, {0: NA, 1: NB2},
     NA, None, ()),
    ("nor this node's own", {0: NA, 1: "198.18.0.2-77-eeeeeeee"}, {0: NA, 1: NC}, NA,
     None, ()),
    ("an id that names no address", {0: NA, 1: "local"}, {0: NA, 1: NC}, NA, None, ()),
])
def test_lost_addresses(name, before, after, node, boundary, want):
    g0 = Generation(1, before, STORE)
    g1 = Generation(2, after, STORE, [1], "node loss", boundary)
    assert lost_addresses(g0, g1, node) == want, name


# ---------------------------------------------------------------- planned migrations

@pytest.mark.parametrize("rank,here,recovering,parked,says", [
    (1, [0, 1], False, 1, None),
    (5, [0, 1], False, 1, "no rank 5 on this node (ranks [0, 1])"),
    (1, [0, 1], True, 1, "a recovery is in progress"),
    (1, [0, 1], False, 0, "no spare is parked"),
])
def test_migration_refusal(rank, here, recovering, parked, says):
    got = migration_refusal(rank, here, recovering, parked)
    assert (got is None) if says is None else (says in got)


@pytest.mark.parametrize("kw,want", [
    ({}, None),
    ({"draining": True}, ("ok", "moved already")),
    ({"ranks_here": 0}, ("ok", "holds no rank")),
    ({"ranks_here": 0, "unplaced": 1}, ("retry", "recovery is in progress")),
    ({"resilient": False}, ("impossible", "does not use tp_launch.resilient")),
    ({"phase": EXITING}, ("impossible", "the job is ending")),
    ({"pending": True}, ("retry", "recovery is in progress")),
    ({"recovering": True}, ("retry", "recovery is in progress")),
])
def test_node_migration_refusal(kw, want):
    args = {"draining": False, "ranks_here": 2, "unplaced": 0, "resilient": True,
            "phase": RUNNING, "pending": False, "recovering": False, **kw}
    got = node_migration_refusal(**args)
    assert got is None if want is None else (got[0] == want[0] and want[1] in got[1])


# ---------------------------------------------------------------- the attempt's end

@pytest.mark.parametrize("name,rcs,pending,unplaced,phase,resilient,has,settled", [
    ("every rank exited 0 after the barrier", [0, 0], False, False, EXITING, True, True, True),
    ("a plain script's ranks exited 0", [0, 0], False, False, RUNNING, False, True, True),
    # A resilient rank that exited 0 before the barrier: its generation may be coming.
    ("resilient, before the barrier", [0, 0], False, False, RUNNING, True, True, False),
    ("one still running", [0, None], False, False, EXITING, True, True, False),
    ("one died since the select", [0, -9], False, False, EXITING, True, True, False),
    ("a recovery pending", [0, 0], True, False, EXITING, True, True, False),
    ("a rank with no spare yet", [0], False, True, EXITING, True, True, False),
    ("a spare node with no rank, plain", [], False, False, RUNNING, False, False, False),
])
def test_attempt_settled(name, rcs, pending, unplaced, phase, resilient, has, settled):
    assert attempt_settled(rcs, pending, unplaced, phase, resilient, has) is settled, name


@pytest.mark.parametrize("pool,unplaced,waiting,starting,recovering,want", [
    (1, 0, 0, 0, False, 1),  # the pool's spare
    (1, 0, 0, 1, False, 0),  # parked or starting already
    (1, 0, 0, 0, True, 0),  # a promoted spare's replacement waits for the first step...
    (1, 1, 0, 0, True, 1),  # ...a rank without a process does not
    (1, 0, 2, 0, True, 2),  # nor ranks waiting for a spare (--spare-policy wait)
    (1, 0, 2, 0, False, 3),  # one each, beside the pool
    (2, 0, 0, 1, False, 1),
])
def test_spares_to_start(pool, unplaced, waiting, starting, recovering, want):
    assert spares_to_start(pool, unplaced, waiting, starting, recovering) == want


@pytest.mark.parametrize("step_s,want", [(0.0, 2.0), (0.01, 2.0), (1.5, 4.5), (8.0, 10.0)])
def test_replacement_wait(step_s, want):
    assert replacement_wait(step_s) == pytest.approx(want)
