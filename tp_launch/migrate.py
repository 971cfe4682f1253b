"""``tp-run migrate --rank R``: move a rank of a running job to a parked spare.

The agent of a resilient job listens on ``<tmp>/tp-run-<uid>/<agent pid>.sock`` (its
status, with the run id, ranks and parked spares, is beside it as ``.json``). This
command finds the agent (the only one running, or the one named by ``--run-id`` or
``--agent-pid``), asks it to migrate the rank, and prints its answer. The agent stops
every rank right after a step boundary a couple of steps ahead, the rank hands its
state to the spare and exits 0, and training goes on with no step recomputed.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sys

import click

from tp_launch import channel
from tp_launch.agent.resilient_agent import control_dir


def _agents() -> list[dict]:
    found = []
    for path in glob.glob(os.path.join(control_dir(), "*.sock.json")):
        try:
            with open(path) as f:
                status = json.load(f)
            os.kill(status["pid"], 0)
        except (OSError, ValueError, KeyError):
            continue
        status["socket"] = path[: -len(".json")]  # <pid>.sock.json -> <pid>.sock
        found.append(status)
    return found


@click.command(name="tp-run migrate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rank", type=click.IntRange(min=0), required=True, help="Global rank to move.")
@click.option("--run-id", default=None, help="The job's --rdzv-id (when several jobs run).")
@click.option("--agent-pid", type=int, default=None, help="The tp-run agent's pid.")
def migrate(rank: int, run_id: str | None, agent_pid: int | None) -> None:
    """Move RANK of a running resilient job to a parked spare at the next step boundary."""
    agents = [a for a in _agents()
              if (run_id is None or a["run_id"] == run_id)
              and (agent_pid is None or a["pid"] == agent_pid)]
    if not agents:
        raise click.ClickException("no running tp-run agent with --spares found"
                                   + (" for that job" if run_id or agent_pid else ""))
    if len(agents) > 1:
        listing = ", ".join(f"pid {a['pid']} (run id {a['run_id']})" for a in agents)
        raise click.ClickException(f"several tp-run agents run ({listing}): name one "
                                   "with --run-id or --agent-pid")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect(agents[0]["socket"])
        channel.send(sock, {"op": "migrate", "rank": rank})
        reader = channel.LineReader()
        replies: list[dict] = []
        while not replies:
            data = sock.recv(65536)
            if not data:
                raise click.ClickException("the agent closed the connection")
            replies = reader.feed(data)
    except OSError as e:
        raise click.ClickException(f"cannot reach the agent: {e}") from None
    finally:
        sock.close()
    message = replies[0]["message"]
    click.echo(f"tp-run migrate: {message}")
    sys.exit(0 if message.startswith("ok") else 1)


def main(argv: list[str]) -> None:
    try:
        migrate.main(args=argv, prog_name="tp-run migrate", standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"tp-run migrate: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"tp-run migrate: error: {e.format_message()}", err=True)
        sys.exit(1)
    sys.exit(0)  # --help
