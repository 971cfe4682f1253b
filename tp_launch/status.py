"""``tp-run status``: what a running resilient job does, from its agent on this machine.

The command finds the caller's own running agent as ``tp-run migrate`` does
(:func:`tp_launch.migrate.pick_agent`: the only one, or the one ``--run-id`` or
``--agent-pid`` names), sends it :class:`~tp_launch.channel.Status` over its control
socket and prints the :class:`~tp_launch.channel.StatusReply`
(:mod:`tp_launch.agent.status` builds it): the job's generation and state, each rank of
this node (pid, slot, committed step, the last iteration's duration, how long ago it
committed, its generation and stage, from the progress board), the parked spares, and
the last recoveries (``recovery.jsonl``). A compact table by default (:func:`format_table`),
one JSON document with ``--json`` (:func:`to_document`).

Multi-node jobs: run it on any node. The agent there answers for the whole job: its own
ranks from its board, the other nodes' as they published them through the rendezvous
(every few seconds; a ``NODE`` column says where each rank runs).

Bad input (no running agent, an unknown run id, several agents and none named, an agent
that does not answer) is one line on stderr and exit status 1 (usage: 2), never a
traceback.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

import click

from tp_launch import channel
from tp_launch.migrate import ask, pick_agent, run_command

COMMAND = "tp-run status"


def to_document(reply: channel.StatusReply) -> dict[str, Any]:
    """The ``--json`` document: the reply's fields (lists as lists), without ``op``."""
    doc: dict[str, Any] = json.loads(json.dumps(asdict(reply)))
    return doc


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{_ms(seconds)} ago"


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
            for row in [header, *rows]]


def format_table(reply: channel.StatusReply) -> str:
    """The human view of ``reply``: a heading, one line per rank, spares, recoveries."""
    lines = [f"job {reply.run_id}  node {reply.node}  agent pid {reply.agent_pid}  "
             f"generation {reply.gen}  world size {reply.world_size}  {reply.state}"]
    nodes = any(r.node for r in reply.ranks)  # multi-node: say where each rank runs
    rows = [[str(r.rank), *([r.node or reply.node] if nodes else []), str(r.pid),
             str(r.slot), "-" if r.step < 0 else str(r.step),
             _ms(r.step_s) if r.step_s > 0 else "-", _ago(r.commit_age_s), str(r.gen),
             r.stage] for r in reply.ranks]
    if rows:
        lines += _table(["RANK", *(["NODE"] if nodes else []), "PID", "SLOT", "STEP",
                         "STEP TIME", "COMMITTED", "GEN", "STAGE"], rows)
    else:
        lines.append("no rank on this node")
    if reply.ranks_total > len(reply.ranks):
        lines.append(f"... and {reply.ranks_total - len(reply.ranks)} more rank(s)")
    pids = ", ".join(f"{s.pid}{f' on {s.node}' if s.node else ''}" for s in reply.parked)
    more = reply.parked_total - len(reply.parked)
    lines.append(f"parked spares: {reply.parked_total}"
                 + (f" (pid {pids}{f', ... {more} more' if more > 0 else ''})"
                    if reply.parked else ""))
    if reply.recoveries:
        lines.append("recent recoveries:")
        for rec in reply.recoveries:
            done = f"total {_ms(rec.total_s)}" if rec.total_s is not None else "in progress"
            step = "" if rec.step is None else f" at step {rec.step}"
            lines.append(f"  {_clock(rec.detected_at)}  generation {rec.gen}  {rec.reason}: "
                         f"rank(s) {list(rec.failed_ranks)} -> spare pid(s) "
                         f"{list(rec.promoted_pids)}{step}, {done}")
    else:
        lines.append("recent recoveries: none")
    if reply.log_dir:
        lines.append(f"logs: {reply.log_dir}")
    return "\n".join(lines)


@click.command(name=COMMAND, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run-id", "--rdzv-id", "run_id", default=None,
              help="The job's --rdzv-id (when several jobs run).")
@click.option("--agent-pid", type=int, default=None, help="The tp-run agent's pid.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of a table.")
def status(run_id: str | None, agent_pid: int | None, as_json: bool) -> None:
    """Show a running resilient job: its generation, its ranks (node, pid, step, step
    time), parked spares and this node's recent recoveries."""
    reply = ask(pick_agent(run_id, agent_pid, COMMAND), channel.Status(),
                channel.StatusReply)
    if as_json:
        click.echo(json.dumps(to_document(reply), indent=2))
    else:
        click.echo(format_table(reply))


def main(argv: list[str]) -> None:
    run_command(status, COMMAND, argv)
