"""The membership protocol (rendezvous/membership.py) over an in-memory KV on a fake clock.

Members are :class:`~rendezvous.membership.Membership` objects sharing one
:class:`tests.memkv.MemStore`; each join is stepped one look at a time
(:meth:`~rendezvous.membership.Membership.begin_join`), every member in turn, and the
clock moves only when every member waits. No thread waits, no sleep: milliseconds.
The same scenarios run against real backends in tests/test_rendezvous.py.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from rendezvous.join import JoinLoop
from rendezvous.membership import (
    CHANGE_FAILURE,
    CHANGE_LOST,
    CHANGE_WAITING,
    Membership,
    Timeouts,
    World,
)
from rendezvous.state import RoundState
from tests.memkv import MemStore

pytestmark = pytest.mark.unit

TTL = 30.0


@pytest.fixture
def store() -> Iterator[MemStore]:
    yield MemStore()


@pytest.fixture
def members(store: MemStore) -> Iterator[list[Membership]]:
    made: list[Membership] = []
    yield made
    for m in made:
        m.close()


def add(members: list[Membership], store: MemStore, nnodes: tuple[int, int],
        n: int = 1, accept_spare: bool = False) -> list[Membership]:
    # A keep-alive interval of an hour: the keep-alive threads never run; the tests keep
    # leases alive by hand, on the fake clock.
    t = Timeouts(last_call_timeout=10.0, lease_ttl=TTL, keep_alive_interval=3600.0,
                 join_timeout=600.0)
    new = [Membership(store.client(), "/tp-test", "job", *nnodes, f"10.0.0.{len(members) + i}",
                      t, safety_poll=1.0, clock=store.clock) for i in range(n)]
    for m in new:
        m.accept_spare = accept_spare
    members.extend(new)
    return new


def step(loops: dict[Membership, JoinLoop], store: MemStore,
         until: int | None = None) -> dict[Membership, World | float]:
    """Each member looks in turn; when all wait, the clock moves to the first wake-up.
    Stops when ``until`` members (default: all) formed their world, or all only wait."""
    outcome: dict[Membership, World | float] = {}
    target = len(loops) if until is None else until
    for _ in range(1000):
        for m, loop in loops.items():
            if not isinstance(outcome.get(m), World):
                outcome[m] = loop.look()
        if sum(isinstance(o, World) for o in outcome.values()) >= target:
            return outcome
        waits = [o for o in outcome.values() if not isinstance(o, World)]
        if all(w > 0 for w in waits):
            if min(waits) >= 1.0 and until is not None:
                return outcome  # everyone left waits on the safety poll: a steady state
            store.clock.advance(min(waits))
    raise AssertionError(f"no steady state: {outcome}")


def state_of(m: Membership) -> RoundState:
    state, _ = m.read_state()
    assert state is not None
    return state


def test_two_members_form_a_world(store, members):
    a, b = add(members, store, (2, 2), 2)
    out = step({a: a.begin_join(1), b: b.begin_join(2)}, store)
    wa, wb = out[a], out[b]
    assert isinstance(wa, World) and isinstance(wb, World)
    assert [p.id for p in wa.participants] == [a.id, b.id]  # join order
    assert (wa.node_rank, wb.node_rank, wb.rank_offset, wb.world_size) == (0, 1, 1, 3)
    assert (wa.round, wa.generation) == (0, 1) and a.world == wa and b.world == wb
    assert a.check_world(wa) is None and b.check_world(wb) is None
    assert state_of(a).phase == "closed" and state_of(a).opener == a.id


def test_a_member_beyond_max_is_a_spare(store, members):
    a, b = add(members, store, (2, 2), 2)
    step({a: a.begin_join(1), b: b.begin_join(1)}, store)
    (c,) = add(members, store, (2, 2))
    out = step({c: c.begin_join(1)}, store, until=1)
    assert not isinstance(out[c], World)  # it waits, for ever, as torchrun's spare
    assert state_of(a).spare_ids == [c.id] and a.check_world(a.world) is None
    # Resilient mode: the spare node's join returns at once, outside the world.
    (d,) = add(members, store, (2, 2), accept_spare=True)
    out = step({d: d.begin_join(1)}, store)
    world = out[d]
    assert isinstance(world, World) and world.is_spare and world.node_rank == -1
    assert state_of(a).spare_ids == [c.id, d.id]


def test_a_late_member_below_max_waits_and_the_world_restarts_to_admit_it(store, members):
    a, b = add(members, store, (1, 3), 2)
    first = step({a: a.begin_join(1), b: b.begin_join(1)}, store)  # after the last call
    assert {len(w.participants) for w in first.values() if isinstance(w, World)} == {2}
    (c,) = add(members, store, (1, 3))
    step({c: c.begin_join(1)}, store, until=1)
    assert [m.id for m in state_of(a).waiting] == [c.id]
    change = a.check_world(a.world)
    assert change is not None and change.kind == CHANGE_WAITING and not change.counts_as_failure
    out = step({a: a.begin_join(1), b: b.begin_join(1), c: c.begin_join(1)}, store)
    worlds = [w for w in out.values() if isinstance(w, World)]
    assert {len(w.participants) for w in worlds} == {3} and {w.round for w in worlds} == {1}


def test_a_dead_opener_is_taken_over(store, members):
    a, b = add(members, store, (1, 2), 2)
    loop = a.begin_join(1)
    assert loop.look() == 0.0  # opened round 0
    assert loop.look() == 1.0  # joined; MIN are there: the last call (safety_poll)
    assert state_of(a).opener == a.id and a.kv.count_prefix("/tp-test/job/r0/join/") == 1
    store.expire(a.session.lease)  # a is SIGKILLed: its lease (and join key) go
    out = step({b: b.begin_join(1)}, store)
    world = out[b]
    assert isinstance(world, World) and [p.id for p in world.participants] == [b.id]
    assert state_of(b).opener == b.id and world.round == 0


def test_two_deciders_open_one_round_and_the_loser_follows(store, members):
    a, b = add(members, store, (2, 2), 2)
    la, lb = a.begin_join(1), b.begin_join(1)
    outcomes: list[World | float] = []
    # a has read "no state" and decided to open round 0; b does the same in between.
    store.cas_hook = lambda key: outcomes.append(lb.look())
    assert la.look() == 0.0  # a's compare-and-swap lost: it looks again
    assert outcomes == [0.0]
    state = state_of(a)
    assert (state.round, state.opener, state.phase) == (0, b.id, "joining")
    out = step({a: la, b: lb}, store)
    assert {w.round for w in out.values() if isinstance(w, World)} == {0}


def test_two_deciders_take_a_dead_opener_over_once(store, members):
    a, b, c = add(members, store, (2, 3), 3)
    la = a.begin_join(1)
    la.look()
    la.look()  # a opened round 0 and joined it
    store.expire(a.session.lease)  # a dies
    lb, lc = b.begin_join(1), c.begin_join(1)
    store.cas_hook = lambda key: lc.look()  # c takes over while b is about to
    assert lb.look() == 0.0
    assert state_of(b).opener == c.id
    out = step({b: lb, c: lc}, store)
    worlds = [w for w in out.values() if isinstance(w, World)]
    assert {tuple(p.id for p in w.participants) for w in worlds} == {(b.id, c.id)}
    assert {w.round for w in worlds} == {0}


def test_two_survivors_restart_their_round_once(store, members):
    a, b, c = add(members, store, (2, 3), 3)
    step({a: a.begin_join(1), b: b.begin_join(1), c: c.begin_join(1)}, store)
    assert state_of(a).generation == 1
    store.expire(c.session.lease)  # c dies
    la, lb = a.begin_join(1), b.begin_join(1)
    store.cas_hook = lambda key: lb.look()  # b decides in the middle of a's decision
    la.look()
    state = state_of(a)
    # (The restart is not counted here: each survivor counted the lost node already.)
    assert (state.round, state.phase, state.failures) == (1, "joining", 0)
    assert state.opener == b.id and state.reason == f"restart requested by {b.id}"
    out = step({a: la, b: lb}, store)
    worlds = [w for w in out.values() if isinstance(w, World)]
    assert {(w.round, w.generation, len(w.participants)) for w in worlds} == {(1, 2, 2)}


def test_a_lost_lease_is_a_world_change(store, members):
    a, b = add(members, store, (2, 2), 2)
    step({a: a.begin_join(1), b: b.begin_join(1)}, store)
    store.clock.advance(TTL / 2)
    a.kv.lease_keepalive(a.session.lease)  # only a's keep-alive reaches the backend
    store.clock.advance(TTL / 2 + 1)
    assert a.alive_members() == {a.id}
    change = a.check_world(a.world)
    assert change is not None and change.kind == CHANGE_LOST and b.id in change.detail
    assert change.counts_as_failure


def test_a_failure_report_restarts_everyone_and_a_stale_one_is_fenced(store, members):
    a, b = add(members, store, (2, 2), 2)
    old = step({a: a.begin_join(1), b: b.begin_join(1)}, store)
    assert a.report_failure("rank 0 exited with 3")
    change = b.check_world(b.world)
    assert change is not None and change.kind == CHANGE_FAILURE and "exited with 3" in change.detail
    new = step({a: a.begin_join(1), b: b.begin_join(1)}, store)
    assert {w.round for w in new.values() if isinstance(w, World)} == {1}
    state = state_of(a)
    assert state.failed is None and state.failures == 1 and state.generation == 2
    stale = a.world
    a.world = old[a]  # type: ignore[assignment]
    assert not a.report_failure("late")
    a.world = stale
    assert state_of(a).failed is None


def test_placement_is_published_once_per_generation(store, members):
    a, b = add(members, store, (2, 2), 2, accept_spare=True)
    step({a: a.begin_join(1), b: b.begin_join(1)}, store)
    ids = [a.id, b.id]
    assert not b.publish_placement(0, ids, {})  # old token
    assert b.publish_placement(1, ids[::-1], {"store": "h:1"})
    assert not a.publish_placement(1, ids, {})  # lost the race
    state = state_of(a)
    assert state.participant_ids == ids[::-1] and state.resilient == {"store": "h:1"}
    assert state.generation == 2
    a.set_parked(2)
    a.mark_finished(2)
    assert b.parked_counts() == {a.id: 2} and b.finished() == {a.id: 2}


def test_the_state_document_is_written_by_compare_and_swap_with_a_write_counter(store, members):
    (a,) = add(members, store, (1, 1))
    step({a: a.begin_join(1)}, store)
    state, version = a.read_state()
    assert state is not None and state.v == 2  # opened, closed
    assert a.states.write(version, state.completed())
    assert not a.states.write(version, state)  # the version moved on
    assert state_of(a).v == 3 and state_of(a).phase == "complete"
