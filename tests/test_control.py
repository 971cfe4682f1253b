"""Pure decisions of resilient mode (tp_launch.agent.control), without processes."""

from __future__ import annotations

import pytest

from tp_launch.agent.control import CrashLoop, Placed, SpareRestarts, failures_served
from tp_launch.agent.recovery_report import FailedRank

pytestmark = pytest.mark.unit


def test_spares_dying_young_are_restarted_ever_later():
    r = SpareRestarts(base_s=1.0, cap_s=8.0, stable_s=60.0)
    delays = [r.died(lifetime=3.0, now=100.0) for _ in range(7)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert [r.streak, r.first_of_streak] == [7, False]
    assert not r.ready(100.0 + 7.9) and r.ready(108.0)


def test_a_spare_that_lived_resets_the_backoff():
    r = SpareRestarts(base_s=1.0, cap_s=120.0, stable_s=60.0)
    for _ in range(4):
        r.died(lifetime=2.0, now=0.0)
    assert r.died(lifetime=600.0, now=1000.0) == 0.0  # killed after a long, parked life
    assert r.first_of_streak and r.ready(1000.0)
    assert r.died(lifetime=1.0, now=1001.0) == 1.0  # and a young death right after it


def test_no_death_no_wait():
    assert SpareRestarts().ready(0.0)


def test_another_nodes_generation_reports_this_nodes_dead_ranks_it_serves():
    """An outage: node 0 replaced its ranks 0 and 1 and took node 1's parked spare for
    one of them, not knowing that node 1's rank 2 had died too. On node 1 the generation
    still stands for rank 2's failure: rank 2 waits for the next spare to park."""
    dead_here = {2: FailedRank(2, slot=0, pid=22, exitcode=-9, step=5)}
    served = failures_served([1, 0], dead_here, Placed(released={2: 0}, unplaced=[2]))
    assert served == [FailedRank(0), FailedRank(1), dead_here[2]]
    # A dead rank given a spare at once counts the same; one the generation replaced
    # is counted once, with this node's record of it.
    served = failures_served([2], dead_here, Placed(promoted={2: 3}, released={2: 0}))
    assert served == [dead_here[2]]
    # A live rank the generation leaves alone is no failure.
    assert failures_served([0], {}, Placed(promoted={}, released={})) == [FailedRank(0)]


def test_an_error_exit_again_at_the_same_step_is_a_crash_loop():
    crash = CrashLoop()
    assert not crash.is_loop(1, step=10)  # the first error: recovered
    assert not crash.is_loop(-9, step=10)  # a signal death: a machine failure, always
    assert crash.is_loop(1, step=10)  # the script fails where it failed before
    assert crash.is_loop(1, step=7)  # or earlier


def test_an_error_at_a_later_step_is_no_crash_loop():
    crash = CrashLoop()
    assert not crash.is_loop(1, step=10)
    assert not crash.is_loop(1, step=11)  # training moved on: a new failure
