"""Advance warnings (issue 13): a preemption notice, a failed health check or
``tp-run migrate --node`` moves every rank of a node to parked spares, each retiring
rank handing its state to its receiver directly (across nodes too).

The decisions are pure (:mod:`tp_launch.agent.advance`, :func:`control.evacuate`) and
tested fast; the real-process tests (gloo on CPU, etcd) check that the job ends with
torchrun's failure-free checksum, the other node's ranks keep their processes, and the
moved ranks have new ones.
"""

# ruff: noqa: F811  (the `reference` fixture, imported from test_resilient, is a parameter)
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT, TP_RUN, run_launcher
from tests.test_resilient import (
    SCRIPT,
    STEPS,
    _parked,
    _ranks,
    _status,
    _wait,
    all_held,
    background,
    entries,
    exits,
    finals,
    node_job,
    recoveries,
)
from tp_launch.agent.advance import Advance
from tp_launch.agent.health import HealthCheck, health_verdict
from tp_launch.agent.control import evacuate
from tp_launch.agent.node_agent import SignalWatch
from tp_launch.config import ConfigError, parse_preempt_signal

# ---------------------------------------------------------------- pure decisions


def test_preemption_notice_follows_on_preempt():
    assert not Advance("ignore").notice("SIGUSR1", 0.0)
    adv = Advance("migrate")
    assert adv.due(0.0) is None
    assert adv.notice("SIGUSR1", 1.0) and adv.due(1.0) == "migrate"
    assert not adv.notice("SIGUSR1 again", 1.5)  # one warning acted on at a time
    stop = Advance("stop")
    assert stop.notice("SIGUSR1", 0.0) and stop.due(0.0) == "stop"


def test_a_signal_on_a_node_with_ranks_is_acted_on_once_the_others_could_drain():
    """A signal may warn every node at once: a node holding ranks waits ``settle_s``
    before its first try (the warned spare nodes leave the pool meanwhile), a stop or a
    spare node's drain does not wait."""
    adv = Advance("migrate")
    assert adv.notice("SIGUSR1", 10.0, settle_s=1.0)
    assert adv.due(10.5) is None and adv.due(11.0) == "migrate"
    stop = Advance("stop")
    assert stop.notice("SIGUSR1", 10.0, settle_s=1.0) and stop.due(10.0) == "stop"


def test_health_check_failure_migrates_whatever_on_preempt_says():
    adv = Advance("ignore")
    assert adv.notice("health check failed", 0.0, mode="migrate")
    assert adv.due(0.0) == "migrate"


def test_migration_not_yet_is_retried_impossible_falls_back_to_stop():
    adv = Advance("migrate", retry_s=1.0)
    adv.notice("SIGUSR1", 0.0)
    assert adv.outcome("retry", 0.0) is None
    assert adv.due(0.5) is None and adv.due(1.0) == "migrate"
    assert adv.outcome("impossible", 1.0) == "stop"
    assert adv.due(5.0) is None  # acted on: once
    done = Advance("migrate")
    done.notice("SIGUSR1", 0.0)
    assert done.outcome("ok", 0.0) is None and done.due(9.0) is None
    assert not done.notice("SIGUSR1", 10.0)


def test_evacuate_prefers_a_spare_node_then_spreads():
    ranks = {0: "a", 1: "a", 2: "b", 3: "b"}
    # The spare node first (all together), else other nodes' parked spares.
    assert evacuate("b", ranks, {"s": 2, "a": 2}, ["s", "a"]) == {0: "a", 1: "a", 2: "s", 3: "s"}
    assert evacuate("b", ranks, {"s": 1, "a": 1}, ["s", "a"]) == {0: "a", 1: "a", 2: "s", 3: "a"}
    assert evacuate("b", ranks, {"s": 1, "b": 4}, ["s", "a"]) is None  # not its own spares
    assert evacuate("c", ranks, {"s": 2}, ["s"]) is None  # no rank on c


def test_evacuate_alone_uses_its_own_spares():
    ranks = {0: "n", 1: "n"}
    assert evacuate("n", ranks, {"n": 2}, []) == ranks
    assert evacuate("n", ranks, {"n": 1}, []) is None


def test_health_verdict_names_the_last_output_line():
    assert health_verdict("check", 0, "ok\n", 5) is None
    assert health_verdict("check", 3, "a\nGPU 2 fell off the bus\n\n", 5) == \
        "health check 'check' exited with 3: GPU 2 fell off the bus"
    assert "timed out after 5 s: (no output)" in health_verdict("check", None, "", 5)
    assert "killed by SIGKILL" in health_verdict("check", -9, "x", 5)


def test_preempt_signal_names():
    assert parse_preempt_signal("SIGUSR1") == signal.SIGUSR1
    assert parse_preempt_signal("usr2") == signal.SIGUSR2
    assert parse_preempt_signal("15") == signal.SIGTERM
    for bad in ("SIGFOO", "SIGKILL", "999", ""):
        with pytest.raises(ConfigError, match="--preempt-signal"):
            parse_preempt_signal(bad)


def test_a_notice_is_queued_never_raised():
    watch = SignalWatch([signal.SIGTERM, signal.SIGUSR1], [signal.SIGUSR1])
    try:
        with watch.interruptible():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)  # the handler runs: no SignalReceived
        assert watch.take_notices() == [signal.SIGUSR1]
        assert watch.take_notices() == [] and not watch.pending
    finally:
        watch.close()


def test_health_check_runs_until_it_fails_once(tmp_path):
    flag = tmp_path / "bad"
    check = HealthCheck(f"echo checking; test ! -e {flag}", 0.05)
    check.start()
    try:
        time.sleep(0.2)
        assert check.failure() is None
        flag.touch()
        deadline = time.monotonic() + 5
        while (line := check.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert line is not None and "exited with 1: checking" in line
        assert check.failure() is None  # once
    finally:
        check.stop()


def test_health_check_timeout_kills_the_command():
    check = HealthCheck("echo started; sleep 30", 0.2)
    check.start()
    try:
        deadline = time.monotonic() + 5
        while (line := check.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert line is not None and "timed out after 0.2 s: started" in line
    finally:
        check.stop()


# ---------------------------------------------------------------- real processes


@pytest.mark.slow
def test_bad_flags_are_one_line_exit_2(workdir, test_env):
    script = str(workdir / "scripts" / "resilient_train.py")
    cases = [(["--on-preempt", "later"], "--on-preempt"),
             (["--spares", "1", "--preempt-signal", "SIGFOO"], "--preempt-signal"),
             (["--on-preempt", "migrate"], "needs resilient mode"),
             (["--health-check", "true"], "needs resilient mode"),
             (["--shard-copy-every", "1"], "--shard-copy-every needs resilient mode"),
             (["--spares", "1", "--shard-copy-every", "-1"], "--shard-copy-every"),
             (["--spares", "1", "--health-check", "true", "--health-interval", "0"],
              "--health-interval"),
             (["--spares", "1", "--health-check", "true", "--health-interval", "1e-9"],
              "--health-interval"),
             (["--spares", "1", "--health-check", ""], "the command is empty"),
             (["--spares", "1", "--health-check", "nvidia-smii -q"], "command not found")]
    for args, words in cases:
        proc = run_launcher(TP_RUN, [*args, script], test_env, workdir)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], \
            (args, proc.stderr)
    cmd = run_launcher(TP_RUN, ["migrate", "--rank", "1", "--node"], test_env, workdir)
    assert cmd.returncode == 2 and "--rank R or --node" in cmd.stderr


# A node's ranks moved at one boundary: test_preemption_notice_moves_the_nodes_ranks;
# that a single node takes its own spares is placement_order's (test_agent_decisions.py).
@pytest.mark.matrix
def test_migrate_node_alone_uses_its_own_spares(workdir, test_env, reference):
    """One node, 4 ranks and 4 parked spares: `tp-run migrate --node` gives every rank a
    new process at one boundary, each handed its state by its predecessor."""
    with background(workdir, test_env, ["--nproc-per-node", "4", "--spares", "4", SCRIPT,
                                        "--steps", str(STEPS), "--hold-at", "2"]
                    ) as (proc, out, env):
        _wait(lambda: _parked(proc) >= 4 and all_held(out), "ranks train, 4 spares park")
        first = {e[0][0]: pid for pid, e in entries(out).items()}
        cmd = run_launcher(TP_RUN, ["migrate", "--node", "--agent-pid", str(proc.pid)],
                           env, workdir)
        assert cmd.returncode == 0 and "ok: rank(s) [0, 1, 2, 3]" in cmd.stdout, \
            cmd.stdout + cmd.stderr
        (out / "release").touch()
        stdout, stderr = proc.communicate(timeout=HANG_TIMEOUT)
    assert proc.returncode == 0, stderr[-3000:]
    final = finals(out)
    assert {r["checksum"] for r in final} == {reference}, stderr[-6000:]
    assert all(final[r]["pid"] != first[r] for r in range(4))
    reentries = {e[1] for ranks in entries(out).values() for e in ranks if e[1] > 0}
    assert len(reentries) == 1, entries(out)  # nothing recomputed
    assert "tp-run: migration: rank(s) [0, 1, 2, 3]" in stderr


def _moves_a_node(workdir: Path, test_env: dict[str, str], reference: str, etcd_server,
                  warn: str) -> None:
    """etcd, --nnodes 2 (2 ranks each) and a spare node: a warning (``warn``: SIGUSR1,
    or a failed health check) on one node moves its ranks to the spare node."""
    out = workdir / "out"
    with node_job(workdir, test_env, etcd_server) as (start, agents, _):
        def args(node: int) -> list[str]:
            if warn == "signal":
                return ["--on-preempt", "migrate"]
            return ["--health-check", f"test ! -e {out}/unhealthy{node}",
                    "--health-interval", "0.5"]
        for node in range(2):
            start(node, "--nnodes", "2", "--spares", "1", *args(node))
        _wait(lambda: all_held(out), "4 ranks train")
        start(2, "--nnodes", "2", "--spares", "1", *args(2))  # a spare node
        _wait(lambda: _parked(agents[2]) >= 2, "the spare node parks its processes")
        victim, other = sorted(agents[:2], key=lambda a: 2 in _ranks(a), reverse=True)
        moved, stayed = _ranks(victim), _ranks(other)
        first = {e[0][0]: pid for pid, e in entries(out).items()}
        if warn == "signal":
            # As Slurm's --signal does: to every process of the node (workers ignore it).
            status = _status(victim)
            assert status is not None
            for pid in [*status.ranks.values(), *status.parked_spares]:
                os.kill(pid, signal.SIGUSR1)
            victim.send_signal(signal.SIGUSR1)
        else:
            (out / f"unhealthy{agents.index(victim)}").touch()
        _wait(lambda: _ranks(agents[2]) == moved, "the spare node takes the ranks")
        (out / "release").touch()
        results = exits(agents)
    for rc, err in results:
        assert rc == 0, err[-3000:]
    final = finals(out)
    assert {r["checksum"] for r in final} == {reference}
    assert all(r["step"] == STEPS for r in final)
    assert all(final[r]["pid"] == first[r] for r in stayed)
    (event,) = recoveries(workdir / "logs2")  # the receiving node's account
    assert event["reason"] == "migration" and sorted(event["failed_ranks"]) == sorted(moved)
    promoted = {p["rank"]: p["pid"] for p in event["promoted"]}
    assert set(promoted) == moved
    assert all(final[r]["pid"] == promoted[r] != first[r] for r in moved)
    reentries = {e[1] for ranks in entries(out).values() for e in ranks if e[1] > 0}
    assert len(reentries) == 1, entries(out)  # one boundary, nothing recomputed
    victim_err = results[agents.index(victim)][1]
    if warn == "signal":
        assert "SIGUSR1 received: moving this node's ranks" in victim_err
    else:
        assert f"health check 'test ! -e {out}/unhealthy{agents.index(victim)}' exited " \
            "with 1" in victim_err


@pytest.mark.slow
def test_preemption_notice_moves_the_nodes_ranks(workdir, test_env, reference, etcd_server):
    _moves_a_node(workdir, test_env, reference, etcd_server, "signal")


@pytest.mark.slow
def test_failed_health_check_moves_the_nodes_ranks(workdir, test_env, reference,
                                                   etcd_server):
    _moves_a_node(workdir, test_env, reference, etcd_server, "health")


# The refusal is node_migration_refusal's (test_agent_decisions.py); a job stopped for
# want of a spare runs for real in test_resilient.py::test_no_spare_left.
@pytest.mark.matrix
def test_preemption_without_a_spare_stops_the_job(workdir, test_env, etcd_server):
    """No spare node and none parked elsewhere: the notice stops the job, one line."""
    out = workdir / "out"
    with node_job(workdir, test_env, etcd_server) as (start, agents, _):
        for node in range(2):
            start(node, "--nnodes", "2", "--spares", "1", "--on-preempt", "migrate",
                  "--spare-policy", "fail")
        _wait(lambda: all_held(out), "4 ranks train")
        victim = next(a for a in agents if 2 in _ranks(a))
        _wait(lambda: all(_parked(a) >= 1 for a in agents), "spares park")
        # Only one spare parked on the other node: it cannot take two ranks.
        victim.send_signal(signal.SIGUSR1)
        results = exits(agents)
    rc, err = results[agents.index(victim)]
    assert rc != 0
    lines = [line for line in err.splitlines() if line.startswith("tp-run: error:")]
    assert len(lines) == 1 and "preemption notice (SIGUSR1): no spare parked on another " \
        "node" in lines[0] and "stopping the job" in lines[0], err[-3000:]
    assert all(rc != 0 for rc, _ in results)
    assert not list(out.glob("final_*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_on_preempt_stop_stops_the_job_in_one_line(workdir, test_env, sig):
    """SIGTERM as the notice (Slurm's own warning): the workers, started ignoring it, are
    not waited for (it used to wait out the 30 s shutdown timeout, then SIGKILL them)."""
    with background(workdir, test_env, ["--nproc-per-node", "2", "--spares", "1",
                                        "--on-preempt", "stop", "--preempt-signal", sig.name,
                                        SCRIPT, "--steps", str(STEPS), "--hold-at", "2"]
                    ) as (proc, out, _):
        _wait(lambda: all((out / f"held_{r}").exists() for r in range(2)), "ranks train")
        first = {e[0][0]: pid for pid, e in entries(out).items()}
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=HANG_TIMEOUT)
    assert proc.returncode == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("tp-run: error:")]
    assert lines == [f"tp-run: error: preemption notice ({sig.name}); stopping the job (its "
                     "ranks stop now: the script's last checkpoint is where a restart "
                     "resumes)"], stderr[-3000:]
    assert "did not stop within" not in stderr, stderr[-3000:]
    assert len(first) == 2 and not list(out.glob("final_*.json"))
