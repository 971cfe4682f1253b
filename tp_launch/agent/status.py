"""The agent's answer to ``tp-run status``: what this node's part of the job does now.

:func:`status_reply` reads, without changing anything, the attempt's state
(:class:`~tp_launch.agent.attempt.Attempt`): for each rank of this node its process
(pid, slot) and its progress board record (:mod:`tp_launch.progress`: committed step,
the last iteration's duration, how long ago it committed and beat, its generation and
stage); the parked spares (longest parked first); the attempt's state (training, a
recovery in progress, waiting for a spare, exiting); and the last recoveries, from the
tail of ``<run log dir>/recovery.jsonl`` (:mod:`tp_launch.agent.recovery_report`), the
newest one still in progress included. It is asked rarely (a person, a script polling
every few seconds), so reading the file's last kilobytes each time is cheap; a file
that cannot be read, or a line that is not a valid event, is left out, never an error.
Lists are capped (:data:`tp_launch.channel.STATUS_MAX_RANKS` and the others) so the
reply stays one channel line.

Multi-node: every agent publishes its own ranks and parked spares through the
rendezvous every few seconds (:func:`node_status`, on its lease: a lost node's entry
goes with it), and the answer adds the other nodes' (their rows carry ``node``; their
ages are as of that publication, plus its age).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Any

from tp_launch import channel, progress
from tp_launch.agent.attempt import Attempt
from tp_launch.agent.recovery_report import Recovery

RECOVERY_FILE = "recovery.jsonl"
# The tail of recovery.jsonl read for the last recoveries (an event is about 1 KiB).
_TAIL_BYTES = 64 * 1024


def _age(now: float, t: float) -> float | None:
    return None if t <= 0 else round(max(now - t, 0.0), 4)


def _stage(value: int) -> str:
    try:
        return progress.Stage(value).name.lower()
    except ValueError:
        return str(value)  # a torn or hostile record: a number, shown as such


def _rank_status(at: Attempt, rank: int, slot: int, now: float) -> channel.RankStatus:
    mark = at.board.mark(slot)
    proc = at.procs.get(slot)
    step_s = mark.step_s if mark.step_s == mark.step_s and 0 <= mark.step_s < 1e12 else 0.0
    return channel.RankStatus(
        rank=rank, pid=proc.worker.pid if proc is not None else -1, slot=slot,
        step=mark.step, step_s=round(step_s, 6), gen=mark.gen, stage=_stage(mark.stage),
        commit_age_s=_age(now, mark.commit_t) if 0 <= mark.commit_t < 1e12 else None,
        beat_age_s=_age(now, mark.beat_t) if 0 <= mark.beat_t < 1e12 else None,
        seq=max(0, mark.seq))


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list):
        return ()
    return tuple(v for v in values if type(v) is int)[: channel.STATUS_MAX_LISTED]


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) and value == value \
        and abs(value) < 1e15 else None


def recovery_status(event: Any) -> channel.RecoveryStatus | None:
    """One ``recovery.jsonl`` event as a status entry (None: not a valid event)."""
    if not isinstance(event, dict) or event.get("event") != "recovery":
        return None
    gen = event.get("generation")
    step = event.get("step")
    if type(gen) is not int:
        return None
    promoted = event.get("promoted")
    pids = [p.get("pid") for p in promoted if isinstance(p, dict)] \
        if isinstance(promoted, list) else []
    try:
        return channel.RecoveryStatus(
            gen=gen, reason=str(event.get("reason", ""))[:80],
            failed_ranks=_ints(event.get("failed_ranks")), promoted_pids=_ints(pids),
            step=step if type(step) is int else None,
            detected_at=_number(event.get("detected_at")),
            total_s=_number(event.get("total_s")))
    except channel.ChannelError:
        return None


def _in_progress(rec: Recovery) -> channel.RecoveryStatus:
    return channel.RecoveryStatus(
        gen=rec.gen, reason=rec.reason[:80],
        failed_ranks=_ints([f.rank for f in rec.failed]),
        promoted_pids=_ints([p.pid for p in rec.promoted]),
        step=None, detected_at=_number(rec.detected), total_s=None)


def read_recoveries(run_dir: str, limit: int = channel.STATUS_MAX_RECOVERIES
                    ) -> list[channel.RecoveryStatus]:
    """The last ``limit`` recoveries of ``<run_dir>/recovery.jsonl``, oldest first."""
    if run_dir == os.devnull:
        return []
    try:
        with open(os.path.join(run_dir, RECOVERY_FILE), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - _TAIL_BYTES, 0))
            lines = f.read(_TAIL_BYTES).splitlines()
            if size > _TAIL_BYTES:
                lines = lines[1:]  # cut in the middle
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            entry = recovery_status(json.loads(line))
        except (ValueError, RecursionError):
            continue
        if entry is not None:
            found.append(entry)
    return found[-limit:] if limit > 0 else []


def _state(at: Attempt) -> str:
    if at.exiting:
        return "exiting"
    if at.pending.no_spare or at.unplaced:
        return "waiting for a spare"
    if at.pending.no_backend:
        return "recovery deferred (backend unreachable)"
    if at.recovery is not None:
        return "recovering"
    return "training" if at.resilient else "starting"


# Node ids in a reply are cut to this length (the reply must stay one channel line).
_NODE_MAX = 64


def node_status(at: Attempt) -> channel.NodeStatus:
    """This node's ranks and parked spares, for the other nodes' ``tp-run status``."""
    now = time.monotonic()
    ranks = sorted(at.world.slot_of.items())[: channel.STATUS_MAX_RANKS]
    return channel.NodeStatus(
        t=time.time(), gen=at.world.gen,
        ranks=tuple(_rank_status(at, r, s, now) for r, s in ranks),
        parked=tuple(channel.SpareStatus(slot=s, pid=at.procs[s].worker.pid)
                     for s in at.world.parked if s in at.procs)[: channel.STATUS_MAX_SPARES])


def _elsewhere(at: Attempt, aged: bool = True
               ) -> tuple[list[channel.RankStatus], list[channel.SpareStatus]]:
    """The other nodes' ranks and parked spares, as they last published them (``aged``:
    their ages plus the publication's)."""
    ranks: list[channel.RankStatus] = []
    spares: list[channel.SpareStatus] = []
    for node, doc in sorted(at.gens.statuses().items()):
        late = max(0.0, time.time() - doc.t) if aged else 0.0
        name = node[:_NODE_MAX]
        for r in doc.ranks:
            ranks.append(replace(
                r, node=name,
                commit_age_s=None if r.commit_age_s is None else r.commit_age_s + late,
                beat_age_s=None if r.beat_age_s is None else r.beat_age_s + late))
        spares += [replace(s, node=name) for s in doc.parked]
    return ranks, spares


def remote_marks(at: Attempt, now: float) -> dict[int, progress.Mark]:
    """The other nodes' ranks as progress marks, for hang detection across nodes. Their
    ages count as of now, not plus the publication's age: a document is up to one
    publication interval (2 s) old, longer than a heartbeat may lag; a node whose agent
    died has no document (it lived on its lease)."""
    marks: dict[int, progress.Mark] = {}
    for r in _elsewhere(at, aged=False)[0]:
        try:
            stage = int(progress.Stage[r.stage.upper()])
        except KeyError:
            continue
        marks[r.rank] = progress.Mark(
            step=r.step, commit_t=0.0 if r.commit_age_s is None else now - r.commit_age_s,
            step_s=r.step_s, beat_t=0.0 if r.beat_age_s is None else now - r.beat_age_s,
            gen=r.gen, stage=stage, seq=r.seq)
    return marks


def status_reply(at: Attempt, run_id: str, run_dir: str) -> channel.StatusReply:
    """The answer to ``status``: the job's ranks (this node's from its board, the
    others' as published), parked spares and this node's last recoveries."""
    now = time.monotonic()
    mine = [_rank_status(at, r, s, now) for r, s in sorted(at.world.slot_of.items())]
    spares = [channel.SpareStatus(slot=s, pid=at.procs[s].worker.pid)
              for s in at.world.parked if s in at.procs]
    other_ranks, other_spares = _elsewhere(at)
    ranks = sorted(mine + [r for r in other_ranks if r.rank not in at.world.slot_of],
                   key=lambda r: r.rank)
    spares += other_spares
    recoveries = read_recoveries(run_dir)
    if at.recovery is not None:
        recoveries = [*recoveries, _in_progress(at.recovery)]
    recoveries = recoveries[-channel.STATUS_MAX_RECOVERIES:]
    return channel.StatusReply(
        run_id=run_id[:200], node=at.world.node[:200], agent_pid=os.getpid(),
        gen=at.world.gen, world_size=at.gen.world_size, state=_state(at),
        ranks=tuple(ranks[: channel.STATUS_MAX_RANKS]), ranks_total=len(ranks),
        parked=tuple(spares[: channel.STATUS_MAX_SPARES]),
        parked_total=len(spares), recoveries=tuple(recoveries),
        log_dir="" if run_dir == os.devnull else run_dir[:1000])
