"""The membership protocol (rendezvous/membership.py) against real backends.

Members are threads in this process, each with its own client: a real etcd server the
tests start (``etcd_server``), and a real TCPStore (c10d) hosted here. The same tests run
on both backends. A "crashed" member stops refreshing its lease without revoking it, as
a SIGKILLed agent does. Timeouts are generous and guard against hangs only.
"""

from __future__ import annotations

import threading
import uuid
from typing import Callable, Iterator

import pytest

from rendezvous.api import RendezvousError
from rendezvous.kv import CountingKV
from rendezvous.membership import (
    CHANGE_FAILURE,
    CHANGE_LOST,
    CHANGE_ROUND,
    CHANGE_WAITING,
    Membership,
    Timeouts,
    World,
)
from tests.etcd_server import free_port

HANG = 60.0
FAST = dict(join_timeout=30, last_call_timeout=0.5, keep_alive_interval=0.3, lease_ttl=2,
            close_timeout=2, exit_barrier_timeout=30)


@pytest.fixture(params=["etcd", "c10d"])
def kv_factory(request, etcd_server) -> Iterator[Callable]:
    """A function returning a fresh client of the backend (one per member)."""
    if request.param == "etcd":
        from rendezvous.etcd import EtcdKV

        yield lambda: EtcdKV("127.0.0.1", etcd_server.port, timeout=10, connect_timeout=10)
        return
    from rendezvous.c10d import C10dKV

    port = free_port()
    host = C10dKV("127.0.0.1", port, is_host=True, timeout=10, poll_interval=0.2)
    clients: list[C10dKV] = []

    def make() -> C10dKV:
        kv = C10dKV("127.0.0.1", port, is_host=False, timeout=10, poll_interval=0.2)
        clients.append(kv)
        return kv

    yield make
    for kv in clients:
        kv.close()
    host.close()


def member(kv_factory, run_id: str, nnodes: tuple[int, int], i: int, **t) -> Membership:
    return Membership(kv_factory(), "/tp-test", run_id, *nnodes, f"127.0.0.{i + 1}",
                      Timeouts(**{**FAST, **t}), safety_poll=0.3)


def join_all(members: list[Membership], lws: int = 1) -> list[World]:
    """Join every member concurrently; return their worlds (raise the first error)."""
    results: dict[int, object] = {}

    def go(i: int, m: Membership) -> None:
        try:
            results[i] = m.join(lws)
        except Exception as e:  # noqa: BLE001 - re-raised below
            results[i] = e

    threads = [threading.Thread(target=go, args=(i, m)) for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG)
        assert not t.is_alive(), "join hung"
    for i in range(len(members)):
        if isinstance(results[i], Exception):
            raise results[i]  # type: ignore[misc]
    return [results[i] for i in range(len(members))]  # type: ignore[misc]


def crash(m: Membership) -> None:
    """As a SIGKILLed agent: its lease is no longer refreshed, nothing is revoked."""
    m.session.stop()


def wait_change(m: Membership, timeout: float = HANG):
    deadline = threading.Event()
    for _ in range(int(timeout / 0.1)):
        change = m.world_change()
        if change is not None:
            return change
        deadline.wait(0.1)
    raise AssertionError("no world change seen")


def spare_ids(m: Membership) -> list[str]:
    """The state's redundancy list."""
    state, _ = m.read_state()
    return state.spare_ids if state is not None else []


def close_all(members: list[Membership]) -> None:
    for m in members:
        m.close()


def run_id() -> str:
    return f"job-{uuid.uuid4().hex[:8]}"


def test_world_forms_with_deterministic_ranks(kv_factory):
    """3 members, --nnodes 3: one world; every member sees the same participants in the
    same order, node ranks 0..2, node-major rank offsets, the same generation."""
    rid = run_id()
    ms = [member(kv_factory, rid, (3, 3), i) for i in range(3)]
    try:
        worlds = join_all(ms, lws=2)
        assert sorted(w.node_rank for w in worlds) == [0, 1, 2]
        assert len({tuple(p.id for p in w.participants) for w in worlds}) == 1
        assert {w.generation for w in worlds} == {1} and {w.round for w in worlds} == {0}
        assert sorted(w.rank_offset for w in worlds) == [0, 2, 4]
        assert {w.world_size for w in worlds} == {6}
    finally:
        close_all(ms)


def test_min_max_last_call_then_late_node_is_admitted(kv_factory):
    """--nnodes 2:3: two members close the round after last_call_timeout; a third that
    arrives later waits, the running members see it (a change that does not count as
    a failure), restart, and the next round has all three."""
    rid = run_id()
    ms = [member(kv_factory, rid, (2, 3), i) for i in range(3)]
    try:
        first = join_all(ms[:2])
        assert {len(w.participants) for w in first} == {2}
        for m in ms[:2]:
            m.start_monitor()
        late: dict[str, World] = {}
        t = threading.Thread(target=lambda: late.setdefault("w", ms[2].join(1)))
        t.start()
        changes = [wait_change(m) for m in ms[:2]]
        assert {c.kind for c in changes} == {CHANGE_WAITING}
        assert not any(c.counts_as_failure for c in changes)
        second = join_all(ms[:2])
        t.join(HANG)
        assert not t.is_alive()
        assert {len(w.participants) for w in [*second, late["w"]]} == {3}
        assert {w.round for w in [*second, late["w"]]} == {1}
    finally:
        close_all(ms)


@pytest.mark.slow
def test_beyond_max_is_redundancy_list_and_spare_takes_over(kv_factory):
    """--nnodes 1:2 with 3 members: 2 participants, 1 spare (the redundancy list).
    When the world's members leave, the spare forms the next world itself."""
    rid = run_id()
    ms = [member(kv_factory, rid, (1, 2), i, last_call_timeout=3) for i in range(3)]
    try:
        result: dict[str, object] = {}
        spare_thread = None
        worlds = join_all(ms[:2])
        assert {len(w.participants) for w in worlds} == {2}

        def spare_join() -> None:
            try:
                result["w"] = ms[2].join(1)
            except Exception as e:  # noqa: BLE001
                result["w"] = e

        spare_thread = threading.Thread(target=spare_join)
        spare_thread.start()
        for _ in range(300):
            if spare_ids(ms[0]):
                break
            threading.Event().wait(0.1)
        assert spare_ids(ms[0]) == [ms[2].id]
        ms[0].close()
        ms[1].close()
        spare_thread.join(HANG)
        assert not spare_thread.is_alive()
        w = result["w"]
        assert isinstance(w, World), w
        assert [p.id for p in w.participants] == [ms[2].id] and w.round == 1
    finally:
        close_all(ms)


@pytest.mark.slow
def test_lost_member_seen_through_lease_expiry(kv_factory):
    """A member that stops refreshing its lease (SIGKILLed agent) is seen as lost by the
    others within the TTL, counted as a failure; they re-form without it."""
    rid = run_id()
    ms = [member(kv_factory, rid, (1, 3), i) for i in range(3)]
    try:
        join_all(ms)
        for m in ms[:2]:
            m.start_monitor()
        crash(ms[2])
        changes = [wait_change(m) for m in ms[:2]]
        assert {c.kind for c in changes} == {CHANGE_LOST}
        assert all(c.counts_as_failure and ms[2].id in c.detail for c in changes)
        worlds = join_all(ms[:2])
        assert {len(w.participants) for w in worlds} == {2}
    finally:
        close_all(ms)


def test_report_failure_restarts_everyone_and_stale_writes_are_fenced(kv_factory):
    """report_failure: every member sees a counted failure; after the restart, a write
    from the stale round (report_failure, generation swap with the old token) is refused."""
    rid = run_id()
    ms = [member(kv_factory, rid, (2, 2), i) for i in range(2)]
    try:
        old = join_all(ms)
        for m in ms:
            m.start_monitor()
        assert ms[0].report_failure("rank 0 exited with 3")
        changes = [wait_change(m) for m in ms]
        assert all(c.counts_as_failure for c in changes)
        assert {c.kind for c in changes} <= {CHANGE_FAILURE}
        new = join_all(ms)
        assert {w.round for w in new} == {1} and {w.generation for w in new} == {2}
        stale = ms[0].world
        ms[0].world = old[0]  # an agent still living in round 0
        assert not ms[0].report_failure("late")
        ms[0].world = stale
        ids = [m.id for m in new[0].participants]
        assert not ms[1].publish_placement(1, ids, {})  # old token
        assert ms[1].publish_placement(2, ids[::-1], {})
        assert not ms[0].publish_placement(2, ids, {})  # lost the race
        state, _ = ms[0].read_state()
        assert state is not None and state.generation == 3 and state.failed is None
        assert state.participant_ids == ids[::-1]
    finally:
        close_all(ms)


def test_two_jobs_on_one_backend_never_see_each_other(kv_factory):
    """Two jobs with 2 members each, concurrently: each world holds only its own."""
    a, b = run_id(), run_id()
    ms = [member(kv_factory, rid, (2, 2), i) for rid in (a, b) for i in range(2)]
    try:
        worlds = join_all(ms)
        for rid, pair in ((a, worlds[:2]), (b, worlds[2:])):
            ids = {m.id for m in ms if m.run_id == rid}
            assert {p.id for w in pair for p in w.participants} == ids
    finally:
        close_all(ms)


@pytest.mark.slow
def test_leftovers_of_a_crashed_job_do_not_wedge_a_new_one(kv_factory):
    """A job whose members all crashed leaves its keys; a new job with the same run id
    forms its world once the old leases are gone (it opens a new round over them)."""
    rid = run_id()
    old = [member(kv_factory, rid, (2, 2), i) for i in range(2)]
    join_all(old)
    for m in old:
        crash(m)
    new = [member(kv_factory, rid, (2, 2), i) for i in range(2)]
    try:
        worlds = join_all(new)
        assert {p.id for p in worlds[0].participants} == {m.id for m in new}
        assert worlds[0].round >= 1
    finally:
        close_all(new)
        for m in old:
            m.kv.close()


@pytest.mark.slow
def test_join_timeout_is_a_clear_error(kv_factory):
    """--nnodes 2 and only one member ever arrives: RendezvousError after join_timeout."""
    m = member(kv_factory, run_id(), (2, 2), 0, join_timeout=2)
    try:
        with pytest.raises(RendezvousError, match=r"timed out after 2s \(join_timeout\)"):
            m.join(1)
    finally:
        m.close()


def test_exit_barrier_waits_for_all_then_closes_the_job(kv_factory):
    """Both members' exit barriers pass once both are done; the job is then complete,
    and a newcomer with the same run id is told so. A failure reported while one member
    waits in the barrier ends its wait with that (counted) failure."""
    rid = run_id()
    ms = [member(kv_factory, rid, (2, 2), i) for i in range(2)]
    late = member(kv_factory, rid, (2, 2), 2)
    try:
        join_all(ms)
        out: dict[int, object] = {}
        threads = [threading.Thread(target=lambda i=i: out.setdefault(i, ms[i].exit_barrier()))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG)
        assert out == {0: None, 1: None}
        with pytest.raises(RendezvousError, match="already finished"):
            late.join(1)

        rid2 = run_id()
        ms2 = [member(kv_factory, rid2, (2, 2), i) for i in range(2)]
        try:
            join_all(ms2)
            res: dict[str, object] = {}
            t = threading.Thread(target=lambda: res.setdefault("c", ms2[0].exit_barrier()))
            t.start()
            assert ms2[1].report_failure("rank 1 exited with 3")
            t.join(HANG)
            assert not t.is_alive()
            assert res["c"] is not None and res["c"].counts_as_failure
        finally:
            close_all(ms2)
    finally:
        close_all([*ms, late])


def test_requests_per_member_do_not_grow(kv_factory):
    """A small version of the benchmark: requests per member to form a world of 4 and
    of 12 stay within a constant bound (no member reads every other member's keys)."""
    per_member = {}
    for n in (4, 12):
        rid = run_id()
        ms = [Membership(CountingKV(kv_factory()), "/tp-test", rid, n, n, f"127.0.0.{i + 1}",
                         Timeouts(**FAST), safety_poll=5.0) for i in range(n)]
        try:
            join_all(ms)
            counts = sorted(m.kv.requests for m in ms)  # type: ignore[attr-defined]
            per_member[n] = sum(counts) / n
        finally:
            close_all(ms)
    assert per_member[12] < per_member[4] * 2 + 4, per_member


def test_change_kinds_are_stable():
    """The agent keys its restart counting on these names."""
    assert (CHANGE_FAILURE, CHANGE_LOST, CHANGE_WAITING, CHANGE_ROUND) == \
        ("failure", "lost", "waiting", "round")
