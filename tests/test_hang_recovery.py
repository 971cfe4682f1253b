"""Failures that do not exit (issue 13), with real processes over gloo: a rank stopped
(SIGSTOP) in its forward pass, inside the all-reduce or inside the optimizer step, a rank
whose data loader deadlocks, a straggler. The agent names the culprit with its stack,
kills it, a spare takes its rank at the same step, and the job ends with the failure-free
torchrun run's checksum. An unmarked evaluation of 10x the step time and a marked long
phase are not hangs.

Each recovery test prints the time from the hang to the job resumed."""

import json
import time

import pytest

from tests.conftest import TORCHRUN, TP_RUN, run_launcher
from tests.test_resilient import (
    STEPS,
    check_completed,
    launch,
    recoveries,
)

HANG = ["--hang-timeout", "2"]


def hang_recovered(proc, out, log_dir, ref: str, rank: int, world: int = 4) -> dict:
    try:
        return _hang_recovered(proc, out, log_dir, ref, rank, world)
    except AssertionError as e:
        # The agent's own lines and the recovery log: what a CI log must show of a failure.
        said = "\n".join(line for line in proc.stderr.splitlines()
                         if "tp_launch/" in line or line.startswith("tp-run"))
        raise AssertionError(f"{e}\n--- agent:\n{said[-6000:]}\n--- recoveries:\n"
                             f"{recoveries(log_dir)}") from None


def _hang_recovered(proc, out, log_dir, ref: str, rank: int, world: int) -> dict:
    if world == 4:
        check_completed(proc, out, ref, {rank})
    else:
        assert proc.returncode == 0, proc.stderr[-4000:]
        finals = [json.loads((out / f"final_{r}.json").read_text()) for r in range(world)]
        assert {f["checksum"] for f in finals} == {ref}
    (event,) = recoveries(log_dir)
    assert event["reason"] == "hang" and event["failed_ranks"] == [rank], event
    assert event["complete"]
    stderr = proc.stderr
    assert f"rank {rank} (pid {event['failed'][0]['pid']}) holds the job up" in stderr
    assert "most recent call first" in stderr and "in train" in stderr  # its stack
    assert f"tp-run: hang: rank(s) [{rank}]" in stderr
    hung_at = float((out / "hang_t").read_text())
    resumed = event["detected_at"] + event["resumed_s"]
    print(f"\nhang -> resumed: {resumed - hung_at:.2f} s (--hang-timeout 2)")
    return event


# A stop in the forward pass or in optimizer.step() is the same verdict as one in the
# all-reduce (the rank is behind its peers on the board: test_hangs.py), and the kill
# that follows is any kill (tests/test_loops.py kills inside optimizer.step()): in the
# matrix.
@pytest.mark.parametrize("where", [pytest.param("forward", marks=pytest.mark.matrix), "allreduce",
                                   pytest.param("optimizer", marks=pytest.mark.matrix)])
def test_stopped_rank_is_killed_and_replaced(workdir, test_env, reference, where):
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir), *HANG],
                       ["--hang", f"2:9:{where}:stop"])
    event = hang_recovered(proc, out, log_dir, reference, 2)
    assert "no heartbeat" in event["failed"][0]["hang"]


@pytest.mark.slow
def test_stopped_rank_of_two(workdir, test_env):
    ref_proc, ref_out = launch(workdir, test_env, ["--nproc-per-node", "2"], ["--no-resilient"],
                               launcher=TORCHRUN, name="ref")
    assert ref_proc.returncode == 0, ref_proc.stderr[-3000:]
    ref = json.loads((ref_out / "final_0.json").read_text())["checksum"]
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "2", "--spares", "1",
                                           "--log-dir", str(log_dir), *HANG],
                       ["--hang", "0:7:forward:stop"])
    hang_recovered(proc, out, log_dir, ref, 0, world=2)


@pytest.mark.slow
def test_deadlocked_data_loader_is_the_culprit(workdir, test_env, reference):
    """Its heartbeat goes on (the main thread blocks with the GIL released): it is found
    because its peers wait in a collective it has not reached."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir), *HANG],
                       ["--hang", "1:11:loader:deadlock"])
    event = hang_recovered(proc, out, log_dir, reference, 1)
    assert "behind its peers" in event["failed"][0]["hang"]
    assert "maybe_hang" in proc.stderr  # where the stack says it blocks


# DataLoader workers (issue 25): forked by the rank after its group formed, they hold
# copies of its gloo sockets, so while one lives the rank's peers never see it gone.
@pytest.mark.slow
def test_rank_killed_alone_takes_its_loader_workers_with_it(workdir, test_env, reference):
    """Rank 1 (two loader workers, one of them busy for good on a later batch) is
    SIGKILLed alone, as the OOM killer does: its workers are killed with it, its peers'
    all-reduce fails, the spare takes rank 1 (an exit, not a hang verdict)."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir), *HANG],
                       ["--loader-workers", "2", "--kill", "1:9:after-step",
                        "--hang", "1:11:loader:worker-deadlock"])
    check_completed(proc, out, reference, {1})
    (event,) = recoveries(log_dir)
    assert event["reason"] != "hang" and event["failed_ranks"] == [1], event
    assert "holds the job up" not in proc.stderr


@pytest.mark.slow
def test_deadlocked_loader_worker_is_the_culprit(workdir, test_env, reference):
    """Rank 1's loader worker blocks for good: rank 1 waits for its batch, its peers in
    the all-reduce; rank 1 is the culprit, and its workers go with it."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir), *HANG],
                       ["--loader-workers", "2", "--hang", "1:11:loader:worker-deadlock"])
    event = hang_recovered(proc, out, log_dir, reference, 1)
    assert "behind its peers" in event["failed"][0]["hang"]


@pytest.mark.slow
@pytest.mark.parametrize("marked", [False, True])
def test_evaluation_phases_are_not_hangs(workdir, test_env, reference, marked):
    """Rank 0 evaluates alone (no collective) while its peers wait in the next step:
    10x the step time unmarked, or longer than the hang timeout inside
    ``state.long_phase()``."""
    log_dir = workdir / "logs"
    script = ["--step-sleep", "0.1", "--eval-every", "12",
              "--eval-s", "3" if marked else "1.0"] + (["--eval-marked"] if marked else [])
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir), "--hang-timeout", "1"],
                       script)
    check_completed(proc, out, reference, set())
    assert recoveries(log_dir) == [] and "hang" not in proc.stderr


@pytest.mark.slow
def test_straggler_migrates_to_a_spare(workdir, test_env, reference):
    """Rank 1's first process sleeps 0.25 s per step (a throttled GPU): after a 4 s window
    it moves to the spare by a planned migration, no step lost, the result exact."""
    log_dir = workdir / "logs"
    t0 = time.monotonic()
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir),
                                           "--straggler-window", "4"],
                       ["--slow", "1:0.25"])
    check_completed(proc, out, reference, {1})
    (event,) = recoveries(log_dir)
    assert event["reason"] == "migration" and event["failed_ranks"] == [1]
    assert "rank 1 was the last to reach the collectives" in event["evidence"]
    assert "straggler: rank 1" in proc.stderr
    print(f"\nstraggler job: {time.monotonic() - t0:.1f} s; {event['evidence']}")


def test_plain_script_hang_restarts_its_workers(workdir, test_env):
    """A script without the API: no worker writes anything for --hang-timeout: every
    worker is ended with its stack (PYTHONFAULTHANDLER + SIGABRT) and restarted,
    torchrun's way, long before torch's own watchdog would act."""
    dump = workdir / "dump"
    dump.mkdir()
    t0 = time.monotonic()
    proc = run_launcher(TP_RUN, ["--nproc-per-node", "2", "--max-restarts", "1",
                                 "--hang-timeout", "5",
                                 "--log-dir", str(workdir / "logs"), "--tee", "3",
                                 "scripts/plain_hang.py"],
                        {**test_env, "DUMP_DIR": str(dump)}, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in dump.iterdir()) == ["done_1_0", "done_1_1"]
    assert "hang: no worker wrote anything for" in proc.stderr
    assert "Fatal Python error: Aborted" in proc.stderr and "in <module>" in proc.stderr
    print(f"\nplain script hang -> restarted and finished: {time.monotonic() - t0:.1f} s")


@pytest.mark.slow
def test_newcomer_hung_in_the_transfer_is_replaced_too(workdir, test_env, reference):
    """A rank dies; the spare that takes its rank stops in the middle of receiving the
    state: the survivors' wait in the transfer ends in a decision (the stopped newcomer
    is the culprit), the second spare takes the rank, the result is exact."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "2",
                                           "--log-dir", str(log_dir), *HANG],
                       ["--kill", "3:8:forward", "--sabotage", "newcomer-stop",
                        "--parked", "2"])
    check_completed(proc, out, reference, {3})
    assert "holds the job up: no heartbeat" in proc.stderr
    assert recoveries(log_dir)[-1]["complete"]


@pytest.mark.slow
def test_culprit_alone_on_its_node_is_found_across_nodes(workdir, test_env, etcd_server):
    """etcd, two agents with one rank each: rank 1's data loader deadlocks (its heartbeat
    goes on). Its agent has no local peer to compare it with: it compares it with the
    other node's published rank, finds it behind, kills it; the spare of its node takes
    the rank; the result is torchrun's failure-free one."""
    from tests.test_resilient import exits, finals, node_job

    ref_proc, ref_out = launch(workdir, test_env, ["--nproc-per-node", "2"], ["--no-resilient"],
                               launcher=TORCHRUN, name="ref")
    assert ref_proc.returncode == 0, ref_proc.stderr[-3000:]
    ref = json.loads((ref_out / "final_0.json").read_text())["checksum"]
    with node_job(workdir, test_env, etcd_server) as (start, agents, out):
        for node in range(2):
            start(node, "--nnodes", "2", "--nproc-per-node", "1", "--spares", "1", *HANG,
                  script_args=("--hang", "1:11:loader:deadlock"))
        results = exits(agents)
    for rc, err in results:
        assert rc == 0, err[-3000:]
    assert {f["checksum"] for f in finals(out, world=2)} == {ref}
    culprit_node = [err for _, err in results if "holds the job up" in err]
    assert len(culprit_node) == 1 and "rank 1 (pid" in culprit_node[0]
    assert "behind its peers" in culprit_node[0]


@pytest.mark.slow
# The policy is a decision (tests/test_recovery_sequences.py: fail, restart, wait); a
# restart's real run: test_resilient.py::test_no_spare_left[restart].
@pytest.mark.parametrize("policy", [pytest.param("restart", marks=pytest.mark.matrix), "fail"])
def test_hang_everywhere_goes_to_the_spare_policy(workdir, test_env, reference, policy):
    """Every rank deadlocks at the same point (beating, none behind): no culprit. After
    twice the limit: one line, then --spare-policy: restart every worker (from the
    script's start: no checkpoint here) or stop with exit 1."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--max-restarts", "1", "--spare-policy", policy,
                                           "--log-dir", str(log_dir), *HANG],
                       ["--hang", "all:11:loader:deadlock"])
    assert "tp-run: error: hang on every rank: no progress for" in proc.stderr
    if policy == "fail":
        assert proc.returncode == 1 and "stopping (--spare-policy fail)" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = [json.loads((out / f"final_{r}.json").read_text()) for r in range(4)]
    assert {f["checksum"] for f in finals} == {reference}


@pytest.mark.slow
# deadlock: the same wait for the verdict on a peer, whose verdict ("behind its peers")
# test_deadlocked_data_loader_is_the_culprit reaches: in the matrix.
@pytest.mark.parametrize("how", ["stop", pytest.param("deadlock", marks=pytest.mark.matrix)])
def test_peers_whose_collective_timed_out_are_not_the_culprit(workdir, test_env, reference,
                                                              how):
    """A 2 s collective timeout, shorter than the 6 s hang timeout, and the peers' own
    give-up time (TP_RUN_RECOVERY_WAIT_S) shorter than both together: the hung rank's
    healthy peers time out first and are told to wait for the verdict (they used to give
    up first, exit 1 and be replaced as the failure, then their newcomers, until the job
    stopped as a crash loop); the board shows who stopped, and that rank (only) is
    replaced; the survivors keep their processes."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, {**test_env, "TP_RUN_RECOVERY_WAIT_S": "1"},
                       ["--nproc-per-node", "4", "--spares", "1", "--log-dir", str(log_dir),
                        "--hang-timeout", "6"],
                       ["--hang", f"2:9:forward:{how}", "--collective-timeout", "2"])
    event = hang_recovered(proc, out, log_dir, reference, 2)
    assert ("no heartbeat" if how == "stop" else "behind its peers") in \
        event["failed"][0]["hang"]


@pytest.mark.slow
def test_collectives_that_time_out_everywhere_regroup(workdir, test_env, reference):
    """Rank 0 evaluates for 4 s, unmarked, with a 2 s collective timeout: its peers'
    all-reduce times out, then its own fails; nobody died. The agent regroups them (the
    same ranks in a new generation) and the job ends exact, every process kept."""
    log_dir = workdir / "logs"
    proc, out = launch(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1",
                                           "--log-dir", str(log_dir)],
                       ["--eval-every", "12", "--eval-s", "4", "--collective-timeout", "2"])
    check_completed(proc, out, reference, set())
    assert "regrouping them in generation" in proc.stderr
    assert all(e["reason"] == "regroup" and e["failed_ranks"] == []
               for e in recoveries(log_dir))
