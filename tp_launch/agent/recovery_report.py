"""The report of one recovery: one JSON line in ``recovery.jsonl``, one line on the console.

A :class:`Recovery` is opened when a generation change is applied on this node and
collects what this node's ranks say about it (``resumed``, ``stepped``);
:func:`recovery_report` turns it into the event and the line, without side effects.

The event (``"event": "recovery"``) has: ``reason`` and ``generation`` (the generation's),
``failed`` (records of the ranks that lost their process: ``rank``, and where this node
knows them ``node``, ``slot``, ``pid``, ``exitcode``, ``step``), ``promoted`` (``rank``,
``slot``, ``pid`` of the spares that took them), ``failed_ranks``, ``step`` (the step the
ranks resumed at), ``detected_at`` (time.time() of the first failure), then durations in
seconds: ``decide_s`` (detection to the generation), the slowest rank's ``handoff_s``,
``rebuild_s`` (the group), ``agree_s``, ``transfer_s``, ``verify_s`` (the replicas'
check's part before resuming: the digest of what the first iteration changes), and
``resumed_s`` (detection to the last rank resumed), ``first_step_s`` (resumed to the last
rank's first step), ``check_s`` (the most any rank's first step spent on the replicas'
check: waiting for its digest, and the comparison at its commit), ``total_s``; ``inexact`` (what a rank could not restore exactly), ``bytes`` (state
sent) and ``complete`` (every rank of this node resumed). A duration no rank reported is
null. The console line says the same in milliseconds (``?``: not reported).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tp_launch import channel


@dataclass(frozen=True)
class FailedRank:
    """A rank that lost its process (or left it: a migration), as this node knows it: on
    the node that ran it ``slot``, ``pid``, and for a death ``exitcode``, its last
    committed ``step`` and, if it was killed as hung, why (``hang``); elsewhere only the
    ``node`` it was on, if known."""

    rank: int
    node: str | None = None
    slot: int | None = None
    pid: int | None = None
    exitcode: int | None = None
    step: int | None = None
    hang: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``failed`` entry of the event: what this node does not know is left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Promotion:
    """A spare that took ``rank``: its ``slot`` on this node and its ``pid``."""

    rank: int
    slot: int
    pid: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Recovery:
    """One generation change in progress on this node, and its timings."""

    gen: int
    reason: str
    detected: float
    decided: float = 0.0
    failed: list[FailedRank] = field(default_factory=list)
    promoted: list[Promotion] = field(default_factory=list)
    resumed: dict[int, channel.Resumed] = field(default_factory=dict)
    stepped: dict[int, float] = field(default_factory=dict)  # rank -> its first step's time
    checks: dict[int, float] = field(default_factory=dict)  # rank -> that step's check_s
    evidence: str = ""  # why a migration was decided by the agent (a straggler)

    def stepped_by_all(self, ranks: Iterable[int]) -> bool:
        """Every one of ``ranks`` took its first step in the generation."""
        return set(self.stepped) >= set(ranks)


def recovery_report(rec: Recovery, ranks_here: int) -> tuple[dict[str, Any], str]:
    """The event and the console line for ``rec``; ``ranks_here``: how many ranks this
    node holds (the recovery is complete when they all resumed)."""
    resumed = list(rec.resumed.values())
    resumed_at = max((m.t for m in resumed), default=None)
    first_step = max(rec.stepped.values(), default=None)
    step = max((m.step for m in resumed), default=None)
    decide_s = rec.decided - rec.detected
    rebuild_s = max((m.group_s for m in resumed), default=None)
    transfer_s = max((m.transfer_s for m in resumed), default=None)
    sent = sum(m.bytes for m in resumed)
    resumed_s = None if resumed_at is None else resumed_at - rec.detected
    first_step_s = None if first_step is None or resumed_at is None \
        else first_step - resumed_at
    failed_ranks = [f.rank for f in rec.failed]
    event = {
        "event": "recovery", "reason": rec.reason, "generation": rec.gen,
        "failed": [f.to_json() for f in rec.failed],
        "promoted": [p.to_json() for p in rec.promoted],
        "failed_ranks": failed_ranks,
        "step": step,
        "detected_at": rec.detected,
        "decide_s": decide_s,
        "handoff_s": max((m.handoff_s for m in resumed), default=0.0),
        "rebuild_s": rebuild_s,
        "agree_s": max((m.agree_s for m in resumed), default=None),
        "transfer_s": transfer_s,
        "verify_s": max((m.verify_s for m in resumed), default=None),
        "check_s": max(rec.checks.values(), default=None),
        "inexact": sorted({f"rank {m.rank}: {what}" for m in resumed
                           for what in m.inexact.split(", ") if what}),
        "bytes": sent,
        "resumed_s": resumed_s,
        "first_step_s": first_step_s,
        "total_s": None if first_step is None else first_step - rec.detected,
        "complete": len(rec.resumed) == ranks_here,
    }
    if rec.evidence:
        event["evidence"] = rec.evidence
    rate = sent / transfer_s / 1e6 if transfer_s else 0.0
    line = (f"tp-run: {rec.reason}: rank(s) {failed_ranks} -> spare pid(s) "
            f"{[p.pid for p in rec.promoted]} at step {step}; resumed in "
            f"{_ms(resumed_s)} (decide {_ms(decide_s)}, group {_ms(rebuild_s)}, state "
            f"{sent / 1e6:.1f} MB in {_ms(transfer_s)} = {rate:.0f} MB/s), first step "
            f"{_ms(first_step_s)}")
    return event, line


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value * 1000:.0f} ms"
