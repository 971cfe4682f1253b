"""The hang and straggler decisions (tp_launch.agent.hangs), driven with made-up marks."""

import pytest

from tp_launch.agent import hangs
from tp_launch.agent.hangs import HangPolicy, ProgressClock, Stragglers, assess
from tp_launch.progress import Mark, Stage

pytestmark = pytest.mark.unit

NOW = 1000.0
POLICY = HangPolicy(timeout=10.0)


def mark(seq=5, beat_age=0.01, stage=Stage.TRAINING, gen=0, step=3, long_until=0.0,
         step_s=0.1) -> Mark:
    return Mark(step=step, commit_t=NOW - 20, step_s=step_s, beat_t=NOW - beat_age, gen=gen,
                stage=stage, seq=seq, long_until=long_until)


def verdict(marks, idle=11.0, step_s=0.1, started=True):
    return assess(POLICY, NOW, marks, idle, step_s, started)


def test_no_verdict_before_the_limit_and_the_limit_adapts_to_the_step_time():
    marks = {0: mark(seq=5), 1: mark(seq=4)}
    assert verdict(marks, idle=9.9) is None
    assert verdict(marks, idle=10.1).ranks == [1]
    # Slow steps raise the limit: 20 x 2 s.
    assert verdict(marks, idle=39.0, step_s=2.0) is None
    assert verdict(marks, idle=41.0, step_s=2.0).limit_s == pytest.approx(40.0)
    # Before the first commit: the startup budget.
    assert verdict(marks, idle=119.0, started=False) is None
    assert verdict(marks, idle=121.0, started=False) is not None
    assert assess(HangPolicy(0.0), NOW, marks, 1e9, 0.1, True) is None  # off


def test_a_stopped_rank_is_the_culprit_even_when_its_peer_timed_out():
    # Rank 1 stopped (no heartbeat); rank 0's collective timed out: it waits, ahead.
    marks = {0: mark(stage=Stage.WAITING, seq=9), 1: mark(seq=5, beat_age=8.0),
             2: mark(seq=6)}
    v = verdict(marks)
    assert v.kind == "culprit" and v.ranks == [1]
    assert "no heartbeat for 8.0 s" in v.why[1]


def test_the_rank_behind_the_others_collectives_is_the_culprit():
    marks = {0: mark(seq=7), 1: mark(seq=7), 2: mark(seq=6), 3: mark(seq=7)}
    v = verdict(marks)
    assert v.kind == "culprit" and v.ranks == [2]
    assert "6 collectives" in v.why[2] and "[0, 1, 3]" in v.why[2]


def test_recovery_stages_order_the_ranks():
    # A newcomer that never reached the arrival barrier holds the others up there.
    marks = {0: mark(gen=1, stage=Stage.JOINING, seq=0), 1: mark(gen=1, stage=Stage.IDLE),
             2: mark(gen=1, stage=Stage.AGREEING, seq=2)}
    assert verdict(marks).ranks == [0, 1]
    # A rank still in the older generation is behind.
    marks = {0: mark(gen=0, seq=50), 1: mark(gen=1, stage=Stage.JOINING)}
    assert verdict(marks).ranks == [0]


def test_everywhere_needs_twice_the_limit_and_finished_ranks_never_hang():
    marks = {0: mark(seq=7), 1: mark(seq=7)}
    assert verdict(marks, idle=15.0) is None
    v = verdict(marks, idle=21.0)
    assert v.kind == "everywhere" and v.ranks == [0, 1]
    every_stale = {0: mark(seq=7, beat_age=9), 1: mark(seq=7, beat_age=9)}
    assert verdict(every_stale, idle=21.0).kind == "everywhere"
    done = {0: mark(stage=Stage.FINISHED), 1: mark(stage=Stage.FINISHED)}
    assert verdict(done, idle=1e6) is None


def test_a_marked_long_phase_exempts_the_job_until_it_ends():
    marks = {0: mark(seq=4, long_until=NOW + 5), 1: mark(seq=5)}
    assert verdict(marks, idle=1e4) is None
    marks = {0: mark(seq=4, long_until=NOW - 1), 1: mark(seq=5)}  # past its budget
    assert verdict(marks).ranks == [0]


def test_progress_clock_counts_commits_collectives_and_long_phase_ends():
    clock = ProgressClock()
    clock.reset(0.0)
    assert clock.observe(1.0, {0: mark(seq=1)}) == 1.0  # first sight is not progress
    assert clock.observe(2.0, {0: mark(seq=1)}) == 2.0
    assert clock.observe(3.0, {0: mark(seq=2)}) == 0.0  # a collective issued
    assert clock.observe(5.0, {0: mark(seq=2, step=4, step_s=0.5)}) == 0.0  # a commit
    assert clock.step_s == 0.5 and clock.committed
    assert clock.observe(6.0, {0: mark(seq=2, step=4, step_s=0.5, long_until=9)}) == 0.0
    assert clock.observe(8.0, {0: mark(seq=2, step=4, step_s=0.5)}) == 0.0
    assert clock.observe(9.5, {0: mark(seq=2, step=4, step_s=0.5)}) == 1.5
    clock.reset(10.0)
    assert clock.observe(10.5, {0: mark(seq=2, step=4, step_s=0.5)}) == 0.5


def _sample(st: Stragglers, t: float, step: int, seqs: dict[int, int]):
    return st.observe(t, {r: mark(seq=s, step=step) for r, s in seqs.items()})


def test_a_rank_behind_most_of_the_time_is_a_straggler_once_per_window():
    st = Stragglers(factor=2.0, window_s=10.0, min_steps=10, min_samples=20)
    found = []
    for i in range(300):  # 30 s at 10 Hz; rank 2 behind 80% of the samples
        seqs = {0: i, 1: i, 2: i - 1 if i % 5 else i, 3: i}
        s = _sample(st, i * 0.1, i // 2, seqs)
        if s is not None:
            found.append((i, s))
    assert [s.rank for _, s in found] == [2, 2, 2]  # once per 10 s window
    assert found[0][0] >= 90 and found[0][1].share == pytest.approx(0.8, abs=0.02)
    assert "about 5.0x" in found[0][1].evidence or "about 4." in found[0][1].evidence


def test_a_straggler_found_before_a_spare_parked_is_named_when_one_parks():
    """Before any spare parks nothing is named (a migration would be refused) and the
    samples are kept: the verdict comes at the first sample with a spare, not a whole
    window later (a short job would end first)."""
    st = Stragglers(factor=2.0, window_s=10.0, min_steps=10, min_samples=20)
    for i in range(150):  # 15 s, rank 2 behind 80% of the samples, no spare parked
        seqs = {0: i, 1: i, 2: i - 1 if i % 5 else i, 3: i}
        assert st.observe(i * 0.1, {r: mark(seq=q, step=i // 2) for r, q in seqs.items()},
                          can_act=False) is None
    s = st.observe(15.0, {0: mark(seq=150, step=75), 1: mark(seq=150, step=75),
                          2: mark(seq=149, step=75), 3: mark(seq=150, step=75)})
    assert s is not None and s.rank == 2


def test_healthy_ranks_taking_turns_and_short_slowdowns_are_not_stragglers():
    st = Stragglers(factor=2.0, window_s=10.0)
    for i in range(300):  # whoever is behind changes every sample
        assert _sample(st, i * 0.1, i, {0: i - (i % 2), 1: i - ((i + 1) % 2)}) is None
    st = Stragglers(factor=2.0, window_s=10.0)
    for i in range(300):  # 1.5x: behind a third of the time, under 1 - 1/2
        assert _sample(st, i * 0.1, i, {0: i, 1: i - (i % 3 == 0)}) is None
    st = Stragglers(factor=2.0, window_s=10.0)
    for i in range(300):  # always behind, but the steps do not advance: a hang's business
        assert _sample(st, i * 0.1, 3, {0: i, 1: i - 1}) is None
    off = Stragglers(factor=0.0)
    assert _sample(off, 0.0, 0, {0: 1, 1: 0}) is None


def test_a_recovery_or_a_single_rank_resets_the_window():
    st = Stragglers(factor=2.0, window_s=10.0)
    for i in range(95):
        _sample(st, i * 0.1, i, {0: i, 1: i - 1})
    st.observe(9.6, {0: mark(stage=Stage.JOINING, gen=1), 1: mark(gen=1)})
    assert _sample(st, 9.7, 96, {0: 97, 1: 96}) is None  # a fresh window
    assert hangs.FACTOR == 20.0


def test_all_waiting_means_every_rank_of_the_generation_waits():
    waiting = {0: mark(stage=Stage.WAITING, gen=2), 1: mark(stage=Stage.WAITING, gen=2)}
    assert hangs.all_waiting(waiting, 2)
    assert not hangs.all_waiting(waiting, 3)  # an older generation's wait: being handled
    assert not hangs.all_waiting({**waiting, 2: mark(gen=2)}, 2)  # one still trains
    assert not hangs.all_waiting({}, 2)


def test_ranks_waiting_on_a_peer_are_the_ones_whose_collective_failed_alone():
    waiting = {0: mark(stage=Stage.WAITING, gen=2), 1: mark(stage=Stage.WAITING, gen=2)}
    assert hangs.waiting_on_a_peer({**waiting, 2: mark(gen=2)}, 2) == [0, 1]
    assert hangs.waiting_on_a_peer(waiting, 2) == []  # everyone: a regroup, not a verdict
    assert hangs.waiting_on_a_peer({**waiting, 2: mark(stage=Stage.FINISHED, gen=2)}, 2) == []
    assert hangs.waiting_on_a_peer({**waiting, 2: mark(gen=3)}, 3) == []  # an older wait
