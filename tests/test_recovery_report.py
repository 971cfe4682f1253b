"""The recovery report (tp_launch.agent.recovery_report): recovery -> JSON event + console
line, without processes."""

from __future__ import annotations

import json

import pytest

from tp_launch import channel
from tp_launch.agent.recovery_report import FailedRank, Promotion, Recovery, recovery_report

pytestmark = pytest.mark.unit


def _resumed(rank: int, t: float, **timings: float) -> channel.Resumed:
    fields = {"handoff_s": 0.0, "group_s": 0.1, "agree_s": 0.01, "transfer_s": 0.2,
              "verify_s": 0.0, **timings}
    return channel.Resumed(gen=1, rank=rank, step=40, bytes=50_000_000, donor=0, t=t,
                           **fields)


def _recovery() -> Recovery:
    rec = Recovery(gen=1, reason="failure", detected=100.0, decided=100.05,
                   failed=[FailedRank(1, slot=1, pid=11, exitcode=-9, step=40)],
                   promoted=[Promotion(1, slot=2, pid=12)])
    rec.resumed = {0: _resumed(0, t=100.5), 1: _resumed(1, t=100.6, transfer_s=0.25)}
    rec.stepped = {0: 100.9, 1: 101.0}
    return rec


def test_a_complete_recovery():
    event, line = recovery_report(_recovery(), ranks_here=2)
    assert json.loads(json.dumps(event)) == event  # one JSON line
    assert event["event"] == "recovery" and event["generation"] == 1
    assert event["failed_ranks"] == [1] and event["step"] == 40
    assert event["failed"] == [{"rank": 1, "slot": 1, "pid": 11, "exitcode": -9, "step": 40}]
    assert event["promoted"] == [{"rank": 1, "slot": 2, "pid": 12}]
    assert event["decide_s"] == 100.05 - 100.0
    assert event["transfer_s"] == 0.25 and event["bytes"] == 100_000_000
    assert event["resumed_s"] == 100.6 - 100.0
    assert event["first_step_s"] == 101.0 - 100.6
    assert event["total_s"] == 101.0 - 100.0
    assert event["complete"] and event["inexact"] == []
    assert line == ("tp-run: failure: rank(s) [1] -> spare pid(s) [12] at step 40; resumed "
                    "in 600 ms (decide 50 ms, group 100 ms, state 100.0 MB in 250 ms = "
                    "400 MB/s), first step 400 ms")


def test_what_no_rank_reported_is_null_and_a_question_mark():
    rec = Recovery(gen=3, reason="node loss", detected=5.0, decided=5.5,
                   failed=[FailedRank(2, node="n1")])
    event, line = recovery_report(rec, ranks_here=1)
    assert event["failed"] == [{"rank": 2, "node": "n1"}]  # what this node knows of it
    assert event["step"] is None and event["resumed_s"] is None
    assert event["rebuild_s"] is None and event["total_s"] is None
    assert event["handoff_s"] == 0.0 and event["bytes"] == 0 and not event["complete"]
    assert "resumed in ? (decide 500 ms, group ?, state 0.0 MB in ? = 0 MB/s)" in line


def test_inexact_parts_are_listed_per_rank():
    rec = _recovery()
    rec.resumed[1] = _resumed(1, t=100.6, inexact="rng, optimizer")
    event, _ = recovery_report(rec, ranks_here=3)
    assert event["inexact"] == ["rank 1: optimizer", "rank 1: rng"]
    assert not event["complete"]  # a third rank of this node has not resumed


def test_a_report_waits_for_every_rank_first_step():
    rec = _recovery()
    assert rec.stepped_by_all([0, 1]) and not rec.stepped_by_all([0, 1, 2])
