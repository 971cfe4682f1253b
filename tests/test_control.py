"""Pure decisions of resilient mode (tp_launch.agent.control), without processes."""

from __future__ import annotations

from tp_launch.agent.control import SpareRestarts


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
