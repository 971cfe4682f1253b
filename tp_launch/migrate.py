"""``tp-run migrate --rank R``: move a rank of a running job to a parked spare;
``tp-run migrate --node``: move every rank of the agent's node.

The agent of a resilient job listens on ``<control dir>/<agent pid>.sock``, in a control
directory private to the user who runs the job (:mod:`tp_launch.control_files`); its
status, with the run id, ranks and parked spares, is beside it as ``.json``. This
command finds the caller's own agents there (the only one running, or the one named by
``--run-id`` or ``--agent-pid``), asks it to migrate the rank, and prints its answer.
The agent stops every rank right after a step boundary a couple of steps ahead, the
rank hands its state to the spare and exits 0, and training goes on with no step
recomputed. ``--node`` does this for every rank of the node at once, to parked spares on
other nodes (a spare node first; with no other node, this node's own spares if it has
one for each rank): what a preemption notice does (``--on-preempt migrate``).

Only the job's owner can do this: another user's jobs are not listed, an
``--agent-pid`` of another user's process is refused with an error, and the agent itself
refuses connections from any other uid (``SO_PEERCRED``). ``tp-run status``
(:mod:`tp_launch.status`) finds and asks the agent the same way (:func:`pick_agent`,
:func:`ask`).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TypeVar

import click

from tp_launch import channel
from tp_launch.control_files import AgentStatus, find_agents


def check_owner(pid: int, command: str = "tp-run migrate") -> None:
    """``--agent-pid``: refuse a process of another user, whoever asks (root too)."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return  # no such process: "no running agent" says it
    if owner != os.getuid():
        raise click.ClickException(f"pid {pid} belongs to uid {owner}, not to you (uid "
                                   f"{os.getuid()}): {command} acts only on your own jobs")


def pick_agent(run_id: str | None, agent_pid: int | None,
               command: str = "tp-run migrate") -> AgentStatus:
    """The one running agent of the caller's that ``--run-id``/``--agent-pid`` name (or
    the only one); a ClickException (one line) when there is none or several."""
    if agent_pid is not None:
        check_owner(agent_pid, command)
    agents = [a for a in find_agents()
              if (run_id is None or a.run_id == run_id)
              and (agent_pid is None or a.pid == agent_pid)]
    if not agents:
        raise click.ClickException("no running tp-run agent with --spares found"
                                   + (" for that job" if run_id or agent_pid else "")
                                   + " among your own jobs")
    if len(agents) > 1:
        listing = ", ".join(f"pid {a.pid} (run id {a.run_id})" for a in agents)
        raise click.ClickException(f"several tp-run agents run ({listing}): name one "
                                   "with --run-id or --agent-pid")
    return agents[0]


_M = TypeVar("_M", bound=channel.Message)


def ask(agent: AgentStatus, request: channel.Message, answer: type[_M]) -> _M:
    """Send ``request`` to the agent; its answer, of type ``answer``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect(agent.socket)
        _, uid, _ = channel.peer_credentials(sock)
        if uid != os.getuid():
            raise click.ClickException(f"the socket {agent.socket} is served by uid {uid}, "
                                       "not by you")
        channel.send(sock, request)
        reader = channel.LineReader()
        while True:
            data = sock.recv(65536)
            if not data:
                raise click.ClickException("the agent closed the connection (an agent "
                                           "older than this command, or one ending)")
            for line in reader.lines(data):
                reply = channel.decode(line, (answer,))
                assert isinstance(reply, answer)
                return reply
    except channel.ChannelError as e:
        raise click.ClickException(f"bad reply from the agent: {e}") from None
    except OSError as e:
        raise click.ClickException(f"cannot reach the agent: {e}") from None
    finally:
        sock.close()


@click.command(name="tp-run migrate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Global rank to move.")
@click.option("--node", is_flag=True,
              help="Move every rank of the agent's node (to other nodes' parked spares).")
@click.option("--run-id", default=None, help="The job's --rdzv-id (when several jobs run).")
@click.option("--agent-pid", type=int, default=None, help="The tp-run agent's pid.")
def migrate(rank: int | None, node: bool, run_id: str | None, agent_pid: int | None) -> None:
    """Move RANK (or every rank of the node) of a running resilient job to parked spares
    at the next step boundary."""
    if (rank is None) == (not node):
        raise click.UsageError("give one of --rank R or --node")
    message = ask(pick_agent(run_id, agent_pid), channel.Migrate(rank), channel.Reply).message
    click.echo(f"tp-run migrate: {message}")
    sys.exit(0 if message.startswith("ok") else 1)


def run_command(command: click.Command, name: str, argv: list[str]) -> None:
    """Run a ``tp-run`` subcommand that talks to an agent: a usage error is one line and
    exit 2, any other error one line and exit 1, never a traceback."""
    try:
        command.main(args=argv, prog_name=name, standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"{name}: error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"{name}: error: {e.format_message()}", err=True)
        sys.exit(1)
    sys.exit(0)  # --help


def main(argv: list[str]) -> None:
    run_command(migrate, "tp-run migrate", argv)
