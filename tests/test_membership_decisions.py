"""The membership's pure parts: the state document (rendezvous/state.py) and the join and
world-change decisions (rendezvous/decisions.py). No backend, no clock: milliseconds."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rendezvous.decisions import (
    CHANGE_COMPLETE,
    CHANGE_FAILURE,
    CHANGE_LOST,
    CHANGE_ROUND,
    CHANGE_WAITING,
    JOIN_READ_INTERVAL,
    CheckOpener,
    CountJoins,
    Fail,
    Formed,
    JoinLook,
    JoinProgress,
    JoinRules,
    LookAgain,
    Pause,
    PutJoinKey,
    ReadAlive,
    ReadJoiners,
    Wait,
    WriteState,
    decide_join,
    lost_participant,
    state_change,
)
from rendezvous.state import JoinRecord, Member, RoundState, StateError, World

pytestmark = pytest.mark.unit

A, B, C, ME = (Member(n, f"10.0.0.{i}", 2) for i, n in enumerate(["a", "b", "c", "me"]))
NOW = 100.0


def rules(**kw) -> JoinRules:
    d = dict(run_id="job", me=ME, min_nodes=2, max_nodes=3, accept_spare=False,
             last_round=-1, deadline=NOW + 600, join_timeout=600.0, last_call_timeout=30.0,
             safety_poll=5.0)
    d.update(kw)
    return JoinRules(**d)  # type: ignore[arg-type]


def look(state: RoundState | None, **kw) -> JoinLook:
    d = dict(now=NOW, wall=1.7e9, lease_epoch=1)
    d.update(kw)
    return JoinLook(state, **d)  # type: ignore[arg-type]


def closed(*participants: Member, rnd: int = 0, **kw) -> RoundState:
    return RoundState(round=rnd, phase="closed", opener="a", reason="first round",
                      generation=1, participants=participants, **kw)


def joining(rnd: int = 1, opener: str = "me", **kw) -> RoundState:
    return RoundState(round=rnd, phase="joining", opener=opener, reason="r", generation=1,
                      **kw)


def joined(rnd: int = 1, **kw) -> JoinProgress:
    """A member whose join key for ``rnd`` is on its current lease."""
    return JoinProgress(joined=(rnd, 1), join_time=1.7e9, **kw)


# ---------------------------------------------------------------- the state document

def test_state_round_trips_through_json():
    s = closed(A, B, spares=(C,), waiting=(ME,), failed="node a: boom", final=True,
               resilient={"ranks": {"0": "a"}, "store": "h:1"}, failures=2, v=7)
    assert RoundState.loads(s.dumps()) == s
    assert RoundState.from_json(json.loads(json.dumps(s.to_json()))) == s
    plain = joining()
    assert "failed" not in plain.to_json() and "resilient" not in plain.to_json()
    assert RoundState.loads(plain.dumps()) == plain


@pytest.mark.parametrize("change, why", [
    (lambda d: d.pop("round"), "missing ['round']"),
    (lambda d: d.update(extra=1), "unknown ['extra']"),
    (lambda d: d.update(round="1"), "round='1'"),
    (lambda d: d.update(generation=True), "generation=True"),
    (lambda d: d.update(phase="open"), "phase='open'"),
    (lambda d: d.update(participants=[{"id": "a"}]), "malformed member"),
    (lambda d: d.update(final="yes"), "final='yes'"),
])
def test_a_malformed_state_is_one_clear_error(change, why):
    d = closed(A).to_json()
    change(d)
    with pytest.raises(StateError, match="malformed") as e:
        RoundState.from_json(d)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_state_text_that_is_not_an_object_is_a_state_error():
    for text in ("{", "[]", "null"):
        with pytest.raises(StateError, match="malformed rendezvous state"):
            RoundState.loads(text)
    with pytest.raises(StateError, match="malformed join key"):
        JoinRecord.loads('{"id": "a", "addr": "h", "lws": 1}')


def test_transitions():
    first = RoundState.next_round(None, "me", "first round", False)
    assert (first.round, first.phase, first.opener, first.generation, first.failures) == \
        (0, "joining", "me", 0, 0)
    done = first.closed([A, B, C, ME], max_nodes=3)
    assert done.participants == (A, B, C) and done.spares == (ME,) and done.generation == 1
    failed = done.with_failure("node a: boom", final=True)
    assert (failed.failed, failed.final, failed.failures) == ("node a: boom", True, 1)
    again = RoundState.next_round(failed, "b", "node a: boom", failure=True)
    assert (again.round, again.failures, again.failed, again.generation) == (1, 2, None, 1)
    placed = done.placed(["me", "b"], {"store": "h:1"})
    assert placed.participants == (ME, B) and placed.spares == ()
    assert placed.generation == 2 and placed.resilient == {"store": "h:1"}
    assert closed(A).world_for("a") == World(0, 1, [A], [], "a", 0)


# ---------------------------------------------------------------- joining: no round to join

def test_no_state_opens_the_first_round():
    action, _ = decide_join(rules(), look(None), JoinProgress())
    assert isinstance(action, WriteState) and action.kind == "open"
    assert (action.state.round, action.state.opener, action.state.reason) == \
        (0, "me", "first round")


def test_a_complete_job_is_an_error():
    action, _ = decide_join(rules(), look(replace(closed(A), phase="complete")), JoinProgress())
    assert isinstance(action, Fail) and "already finished" in action.message


def test_a_closed_round_with_me_in_it_forms_or_is_restarted():
    state = closed(A, ME, rnd=3)
    action, _ = decide_join(rules(last_round=2), look(state), JoinProgress())
    assert isinstance(action, Formed) and action.world.node_rank == 1
    assert action.world.rank_offset == 2 and action.world.world_size == 4
    action, _ = decide_join(rules(last_round=3), look(state), JoinProgress())
    assert isinstance(action, WriteState) and action.kind == "open"
    assert action.state.round == 4 and action.state.reason == "restart requested by me"
    assert action.state.failures == 0
    failed = replace(state, failed="node a: boom")
    action, _ = decide_join(rules(last_round=3), look(failed), JoinProgress())
    assert isinstance(action, WriteState) and action.state.reason == "node a: boom"


def test_a_closed_round_with_a_dead_participant_is_reopened_as_a_failure():
    state = closed(A, B)
    action, _ = decide_join(rules(), look(state), JoinProgress())
    assert isinstance(action, ReadAlive)
    action, _ = decide_join(rules(), look(state, alive=frozenset({"a"})), JoinProgress())
    assert isinstance(action, WriteState) and action.kind == "open"
    assert action.state.reason == "node b left (its lease expired)"
    assert action.state.failures == 1 and action.state.round == 1


# ---------------------------------------------------------------- joining: a healthy world

def test_a_late_member_waits_below_max_and_is_a_spare_at_max():
    alive = frozenset({"a", "b", "c"})
    action, _ = decide_join(rules(), look(closed(A, B), alive=alive), JoinProgress())
    assert isinstance(action, WriteState) and action.kind == "wait"
    assert action.state.waiting == (ME,)
    action, _ = decide_join(rules(), look(closed(A, B, C), alive=alive), JoinProgress())
    assert isinstance(action, WriteState) and action.kind == "spare"
    assert action.state.spares == (ME,)
    # Resilient mode: a spare whatever the world's size.
    action, _ = decide_join(rules(accept_spare=True), look(closed(A, B), alive=alive),
                            JoinProgress())
    assert isinstance(action, WriteState) and action.kind == "spare"


def test_a_listed_member_waits_and_a_resilient_spare_forms():
    alive = frozenset({"a", "b"})
    waiting = closed(A, B, waiting=(ME,))
    action, _ = decide_join(rules(), look(waiting, alive=alive), JoinProgress())
    assert isinstance(action, Wait) and action.seconds == 5.0
    spare = closed(A, B, spares=(ME,))
    action, progress = decide_join(rules(), look(spare, alive=alive), JoinProgress())
    assert isinstance(action, Wait) and progress.spare
    action, _ = decide_join(rules(accept_spare=True), look(spare, alive=alive), JoinProgress())
    assert isinstance(action, Formed) and action.world.is_spare


def test_the_join_deadline_fails_a_waiting_member_but_not_a_spare():
    alive = frozenset({"a", "b"})
    late = look(closed(A, B, waiting=(ME,)), alive=alive, now=NOW + 600)
    action, _ = decide_join(rules(), late, JoinProgress())
    assert isinstance(action, Fail) and "timed out after 600s (join_timeout)" in action.message
    late = look(closed(A, B, spares=(ME,)), alive=alive, now=NOW + 600)
    action, _ = decide_join(rules(), late, JoinProgress())
    assert isinstance(action, Wait)
    action, _ = decide_join(rules(), look(closed(A, B, waiting=(ME,)), alive=alive,
                                          now=NOW + 598), JoinProgress())
    assert isinstance(action, Wait) and action.seconds == 2.0  # no later than the deadline


# ---------------------------------------------------------------- joining: a joining round

def test_a_joining_member_puts_its_key_once_per_round_and_lease():
    state = joining(opener="a")
    action, progress = decide_join(rules(), look(state), JoinProgress())
    assert action == PutJoinKey(1, JoinRecord(ME, 1.7e9))
    assert progress.joined == (1, 1)
    action, progress = decide_join(rules(), look(state, wall=2e9), progress)
    assert isinstance(action, CheckOpener)
    # A new lease (the old one took the key with it): the key again, same join time.
    action, progress = decide_join(rules(), look(state, lease_epoch=2, wall=2e9), progress)
    assert action == PutJoinKey(1, JoinRecord(ME, 1.7e9))


def test_a_dead_opener_is_taken_over_and_a_live_one_is_checked_at_most_every_safety_poll():
    state = joining(opener="a")
    action, progress = decide_join(rules(), look(state), joined())
    assert action == CheckOpener("a") and progress.next_opener_check == NOW + 5.0
    action, _ = decide_join(rules(), look(state, opener_alive=False), progress)
    assert isinstance(action, WriteState) and action.kind == "take over"
    assert action.state.opener == "me"
    action, _ = decide_join(rules(), look(state, opener_alive=True), progress)
    assert isinstance(action, Wait)
    action, _ = decide_join(rules(), look(state, now=NOW + 1), progress)
    assert isinstance(action, Wait)  # not checked again yet
    action, _ = decide_join(rules(), look(state, now=NOW + 5), progress)
    assert action == CheckOpener("a")


def test_the_opener_counts_joins_with_a_pause_between_reads():
    state = joining()
    action, progress = decide_join(rules(), look(state), joined())
    assert action == CountJoins(1) and progress.last_join_read == NOW
    action, _ = decide_join(rules(), look(state, now=NOW + 0.01), progress)
    assert isinstance(action, Pause)
    assert action.seconds == pytest.approx(JOIN_READ_INTERVAL - 0.01)


def test_the_opener_waits_for_min_then_for_the_last_call():
    state = joining()
    action, progress = decide_join(rules(), look(state, join_count=1), joined())
    assert isinstance(action, Wait) and progress.min_seen_at is None
    action, progress = decide_join(rules(), look(state, join_count=2), progress)
    assert isinstance(action, Wait) and progress.min_seen_at == NOW
    action, progress = decide_join(rules(), look(state, join_count=2, now=NOW + 29), progress)
    assert isinstance(action, Wait) and action.seconds == pytest.approx(1.0)
    action, progress = decide_join(rules(), look(state, join_count=2, now=NOW + 30), progress)
    assert action == ReadJoiners(1)
    action, _ = decide_join(rules(), look(state, join_count=2, now=NOW + 30,
                                          joiners=(ME, A)), progress)
    assert isinstance(action, WriteState) and action.kind == "close"
    assert action.state.participants == (ME, A) and action.state.generation == 2


def test_the_opener_closes_a_full_round_at_once_and_keeps_the_rest_as_spares():
    state = joining()
    action, progress = decide_join(rules(), look(state, join_count=4), joined())
    assert action == ReadJoiners(1)
    action, _ = decide_join(rules(), look(state, join_count=4, joiners=(ME, A, B, C)), progress)
    assert isinstance(action, WriteState) and action.kind == "close"
    assert action.state.participants == (ME, A, B) and action.state.spares == (C,)


def test_the_opener_looks_again_when_a_joiner_left_before_the_close():
    action, _ = decide_join(rules(), look(joining(), join_count=3, joiners=(ME,)), joined())
    assert isinstance(action, LookAgain)


def test_the_opener_times_out_with_the_count():
    action, _ = decide_join(rules(), look(joining(), join_count=1, now=NOW + 600), joined())
    assert isinstance(action, Fail)
    assert "1 of the 2 node(s) needed have joined round 1" in action.message


# ---------------------------------------------------------------- the running world

def test_world_changes():
    world = World(0, 1, [A, B], [], "a", failures=0)
    assert state_change(world, closed(A, B)) is None
    assert state_change(world, None).kind == CHANGE_LOST  # type: ignore[union-attr]
    cases = [
        (replace(joining(), failures=1, reason="node b left"), CHANGE_FAILURE, "node b left"),
        (replace(joining(), reason="restart requested by b"), CHANGE_ROUND, "restart"),
        (replace(closed(A, B), phase="complete"), CHANGE_COMPLETE, "finished"),
        (closed(A, B, failed="node b: boom"), CHANGE_FAILURE, "boom"),
        (closed(A, B, waiting=(C,)), CHANGE_WAITING, "node c is waiting"),
    ]
    for state, kind, detail in cases:
        change = state_change(world, state)
        assert change is not None and change.kind == kind and detail in change.detail
    assert lost_participant({"a", "b"}, {"a", "b", "c"}) is None
    change = lost_participant({"a", "b"}, {"a"})
    assert change is not None and change.kind == CHANGE_LOST and change.counts_as_failure
    assert change.detail == "node b left (its lease expired)"
