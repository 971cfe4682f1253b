"""``tp-run status``: the typed status request and reply, the agent's answer, the command.

Unit tests for the messages (round trip, the largest reply stays under the line limit),
the recovery entries read from ``recovery.jsonl`` and the table; then a real resilient
job (2 ranks, 1 spare, gloo on the CPU) asked while it trains, before and after a rank
is SIGKILLed, and the command's one-line errors.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT, TP_RUN, run_launcher, start_launcher
from tp_launch import channel
from tp_launch.agent.status import read_recoveries, recovery_status
from tp_launch.control_files import find_agents
from tp_launch.status import format_table, to_document

SCRIPT = "scripts/resilient_train.py"


def _reply(ranks: int = 2, spares: int = 1, recoveries: int = 1) -> channel.StatusReply:
    return channel.StatusReply(
        run_id="job-1", node="host-a", agent_pid=4242, gen=3, world_size=ranks,
        state="training",
        ranks=tuple(channel.RankStatus(rank=r, pid=1000 + r, slot=r, step=57, step_s=0.0123,
                                       gen=3, stage="training", commit_age_s=0.05,
                                       beat_age_s=0.01) for r in range(ranks)),
        ranks_total=ranks,
        parked=tuple(channel.SpareStatus(slot=100 + s, pid=2000 + s) for s in range(spares)),
        parked_total=spares,
        recoveries=tuple(channel.RecoveryStatus(gen=g, reason="failure", failed_ranks=(1,),
                                                promoted_pids=(2000,), step=12,
                                                detected_at=1.7e9, total_s=0.45)
                         for g in range(recoveries)),
        log_dir="/tmp/logs/job-1_abc")


# ---------------------------------------------------------------- messages


def test_status_messages_round_trip():
    assert channel.decode(channel.encode(channel.Status()), channel.TO_AGENT) == channel.Status()
    reply = _reply()
    assert channel.decode(channel.encode(reply), channel.TO_WORKER) == reply


def test_largest_status_reply_fits_a_line():
    big = channel.RankStatus(rank=2**31, pid=2**22, slot=4095, step=2**40, step_s=123.456789,
                             gen=2**20, stage="finished", commit_age_s=1234.5678,
                             beat_age_s=1234.5678)
    rec = channel.RecoveryStatus(gen=2**20, reason="r" * 80,
                                 failed_ranks=(2**31,) * channel.STATUS_MAX_LISTED,
                                 promoted_pids=(2**22,) * channel.STATUS_MAX_LISTED,
                                 step=2**40, detected_at=1.7e9, total_s=1234.5678)
    reply = channel.StatusReply(
        run_id="i" * 200, node="n" * 200, agent_pid=2**22, gen=2**20, world_size=2**20,
        state="recovery deferred (backend unreachable)",
        ranks=(big,) * channel.STATUS_MAX_RANKS, ranks_total=2**20,
        parked=(channel.SpareStatus(slot=4095, pid=2**22),) * channel.STATUS_MAX_SPARES,
        parked_total=2**20, recoveries=(rec,) * channel.STATUS_MAX_RECOVERIES,
        log_dir="/" * 1000)
    assert len(channel.encode(reply)) < channel.MAX_LINE * 3 // 4


@pytest.mark.parametrize("bad, error", [
    ({"ranks": {}}, "ranks must be a list"),
    ({"ranks": [{"rank": -1, "pid": 1, "slot": 0, "step": 0, "step_s": 0, "gen": 0,
                 "stage": "idle"}]}, "ranks[0]: rank must be at least 0"),
    ({"parked": [{"slot": 1, "pid": "x"}]}, "parked[0]: pid must be an integer"),
    ({"recoveries": [{"gen": 1, "reason": "x", "failed_ranks": [True],
                      "promoted_pids": []}]}, "failed_ranks[0] must be an integer"),
])
def test_bad_status_reply_is_one_line_error(bad, error):
    doc = {**json.loads(channel.encode(_reply())), **bad}
    with pytest.raises(channel.ChannelError) as e:
        channel.decode(json.dumps(doc), channel.TO_WORKER)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_nodes_published_status_round_trips_and_forgeries_are_refused():
    """What a node publishes for the others (``P/status/<node>``) is read back as the
    same record; a document that is not one is a ChannelError (left out, one line)."""
    reply = _reply(ranks=3, spares=2)
    doc = channel.NodeStatus(t=1.7e9, gen=3, ranks=reply.ranks, parked=reply.parked)
    assert channel.NodeStatus.from_json(json.loads(json.dumps(asdict(doc)))) == doc
    good = json.loads(json.dumps(asdict(doc)))
    for bad, error in [([1, 2], "must be an object"),
                       ({**good, "t": "now"}, "t must be a number"),
                       ({**good, "ranks": [{"rank": 0}]}, "ranks[0]: pid is missing"),
                       ({k: v for k, v in good.items() if k != "gen"}, "gen is missing")]:
        with pytest.raises(channel.ChannelError, match=re.escape(error)):
            channel.NodeStatus.from_json(bad)


def test_list_fields_are_checked_when_built():
    with pytest.raises(channel.ChannelError, match="failed_ranks must be a list"):
        channel.RecoveryStatus(gen=1, reason="x", failed_ranks=[1],  # type: ignore[arg-type]
                               promoted_pids=())


# ---------------------------------------------------------------- recoveries


def test_recovery_entries_from_the_report(tmp_path):
    event = {"event": "recovery", "reason": "failure", "generation": 2,
             "failed": [{"rank": 1}], "promoted": [{"rank": 1, "slot": 3, "pid": 77}],
             "failed_ranks": [1], "step": 9, "detected_at": 1.7e9, "total_s": 0.5}
    assert recovery_status(event) == channel.RecoveryStatus(
        gen=2, reason="failure", failed_ranks=(1,), promoted_pids=(77,), step=9,
        detected_at=1.7e9, total_s=0.5)
    assert recovery_status({"event": "other"}) is None
    assert recovery_status({**event, "generation": "2"}) is None
    lines = [json.dumps({**event, "generation": g}) for g in range(8)]
    (tmp_path / "recovery.jsonl").write_text("\n".join(lines[:4] + ["{not json", "[]"]
                                                       + lines[4:]) + "\n")
    got = read_recoveries(str(tmp_path))
    assert [r.gen for r in got] == [3, 4, 5, 6, 7]  # the last five, oldest first
    assert read_recoveries(str(tmp_path / "missing")) == []
    assert read_recoveries(os.devnull) == []


# ---------------------------------------------------------------- formatting


def test_table():
    text = format_table(_reply())
    lines = text.splitlines()
    assert lines[0] == ("job job-1  node host-a  agent pid 4242  generation 3  world size 2  "
                        "training")
    assert lines[1].split() == ["RANK", "PID", "SLOT", "STEP", "STEP", "TIME", "COMMITTED",
                                "GEN", "STAGE"]
    assert lines[2].split() == ["0", "1000", "0", "57", "12", "ms", "50", "ms", "ago", "3",
                                "training"]
    assert "parked spares: 1 (pid 2000)" in text
    assert "generation 0  failure: rank(s) [1] -> spare pid(s) [2000] at step 12, total 450 ms" \
        in text
    assert text.endswith("logs: /tmp/logs/job-1_abc")


def test_table_without_ranks_spares_or_recoveries():
    reply = _reply(ranks=0, spares=0, recoveries=0)
    text = format_table(reply)
    assert "no rank on this node" in text and "parked spares: 0\n" in text
    assert "recent recoveries: none" in text


def test_json_document():
    doc = to_document(_reply())
    assert "op" not in doc and doc["gen"] == 3
    assert doc["ranks"][1] == {"rank": 1, "pid": 1001, "slot": 1, "step": 57, "step_s": 0.0123,
                               "gen": 3, "stage": "training", "commit_age_s": 0.05,
                               "beat_age_s": 0.01, "node": "", "seq": 0}
    assert doc["parked"] == [{"slot": 100, "pid": 2000, "node": ""}]
    assert doc["recoveries"][0]["failed_ranks"] == [1]
    json.dumps(doc)


# ---------------------------------------------------------------- the command


def test_status_errors(workdir, test_env):
    cmd = run_launcher(TP_RUN, ["status", "--agent-pid", str(os.getpid())], test_env, workdir)
    assert cmd.returncode == 1 and cmd.stdout == "", cmd.stderr
    assert cmd.stderr.startswith("tp-run status: error: no running tp-run agent")
    assert len(cmd.stderr.splitlines()) == 1
    cmd = run_launcher(TP_RUN, ["status", "--run-id", "no-such-job", "--json"], test_env,
                       workdir)
    assert cmd.returncode == 1 and "for that job" in cmd.stderr
    assert len(cmd.stderr.splitlines()) == 1
    cmd = run_launcher(TP_RUN, ["status", "--bogus"], test_env, workdir)
    assert cmd.returncode == 2 and len(cmd.stderr.splitlines()) == 1


def _status(env: dict[str, str], workdir: Path, agent: int) -> dict:
    cmd = run_launcher(TP_RUN, ["status", "--json", "--agent-pid", str(agent)], env, workdir)
    assert cmd.returncode == 0, cmd.stderr
    return json.loads(cmd.stdout)


def _wait_status(env, workdir, agent, cond, what):
    deadline = time.monotonic() + HANG_TIMEOUT
    while True:
        if any(a.pid == agent for a in find_agents()):
            doc = _status(env, workdir, agent)
            if cond(doc):
                return doc
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def test_status_of_a_running_job(workdir, test_env):
    """The only real job of the inner loop here: ranks, advancing steps, the parked spare;
    after a rank is SIGKILLed, the recovery and the spare's pid as the rank's."""
    out = workdir / "out"
    out.mkdir()
    env = {**test_env, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = start_launcher(TP_RUN, ["--nproc-per-node", "2", "--spares", "1",
                                   "--log-dir", str(workdir / "logs"), SCRIPT,
                                   "--steps", "100000", "--step-sleep", "0.05"], env, workdir)
    try:
        doc = _wait_status(env, workdir, proc.pid,
                           lambda d: d["parked_total"] == 1
                           # step 1 is the generation's first commit, whose step_s is 0
                           and all(r["step"] >= 2 for r in d["ranks"]),
                           "the ranks train, a spare parks")
        assert doc["agent_pid"] == proc.pid and doc["world_size"] == 2
        # Its store is served from the process template: the agent never imported torch.
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        assert [r["rank"] for r in doc["ranks"]] == [0, 1]
        assert all(r["stage"] == "training" and r["step_s"] > 0 for r in doc["ranks"]), doc
        assert doc["recoveries"] == [] and doc["log_dir"].startswith(str(workdir / "logs"))
        spare = doc["parked"][0]["pid"]
        step = doc["ranks"][1]["step"]
        later = _wait_status(env, workdir, proc.pid,
                             lambda d: d["ranks"][1]["step"] > step, "steps advance")
        victim = later["ranks"][1]["pid"]

        table = run_launcher(TP_RUN, ["status", "--agent-pid", str(proc.pid)], env, workdir)
        assert table.returncode == 0, table.stderr
        assert f"agent pid {proc.pid}" in table.stdout and f"parked spares: 1 (pid {spare})" \
            in table.stdout
        assert str(victim) in table.stdout

        os.kill(victim, signal.SIGKILL)
        after = _wait_status(env, workdir, proc.pid,
                             lambda d: d["recoveries"]
                             and d["recoveries"][-1]["total_s"] is not None,
                             "the recovery is reported")
        rec = after["recoveries"][-1]
        assert rec["failed_ranks"] == [1] and rec["promoted_pids"] == [spare]
        assert after["gen"] == rec["gen"] >= 1
        assert after["ranks"][1]["pid"] == spare
        table = run_launcher(TP_RUN, ["status", "--agent-pid", str(proc.pid)], env, workdir)
        assert f"rank(s) [1] -> spare pid(s) [{spare}]" in table.stdout, table.stdout
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=HANG_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
def test_status_of_a_two_node_job(workdir, test_env, etcd_server):
    """etcd, --nnodes 2, 2 ranks per node: asked on either node, the agent answers for
    the whole job, the other node's ranks and spare as that node published them."""
    from tests.test_resilient import all_held, exits, node_job

    with node_job(workdir, test_env, etcd_server) as (start, agents, out):
        for node in range(2):
            start(node, "--nnodes", "2", "--spares", "1")
        deadline = time.monotonic() + HANG_TIMEOUT
        while not all_held(out):
            assert time.monotonic() < deadline, "4 ranks train"
            time.sleep(0.1)
        for agent in agents:
            doc = _wait_status(test_env, workdir, agent.pid,
                               lambda d: d["ranks_total"] == 4 and d["parked_total"] == 2,
                               "every rank and spare of the job in one answer")
            assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
            assert all(r["step"] >= 8 for r in doc["ranks"])
            here = {r["rank"] for r in doc["ranks"] if r["node"] == ""}
            there = {r["node"] for r in doc["ranks"] if r["node"]}
            assert len(here) == 2 and len(there) == 1 and doc["node"] not in there
            table = subprocess.run([*TP_RUN, "status", "--agent-pid", str(agent.pid)],
                                   env=test_env, cwd=workdir, capture_output=True,
                                   text=True, timeout=60)
            assert table.returncode == 0 and "NODE" in table.stdout, table.stderr
        (out / "release").touch()
        for rc, err in exits(agents):
            assert rc == 0, err[-3000:]
