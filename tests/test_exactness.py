"""Resilient mode never goes on from a state it cannot vouch for.

Real processes, gloo, SIGKILLs (scripts/loops.py). Each case is a way a job could end
with wrong or diverged replicas and exit 0, and what tp-run does instead: every rank
holding the state dies at once (the spare policy, never a start from step 0), replicas
that diverge (a loud stop naming the rank), a loop of earlier versions (one line), a
checkpoint loaded before run() (kept, no hidden flag), a planned migration during a
loop with a scheduler (exact, every step logged once), a rank lost after the last step
while the others are at different points of their end (no false divergence).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT, TORCHRUN, TP_RUN, Live, run_launcher, start_launcher

SCRIPT = "scripts/loops.py"


def launch(launcher: list[str], workdir: Path, env: dict[str, str], name: str,
           launcher_args: list[str], script_args: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    out = workdir / name
    out.mkdir()
    proc = run_launcher(launcher, [*launcher_args, SCRIPT, *script_args],
                        {**env, "OUT": str(out), "OMP_NUM_THREADS": "1"}, workdir,
                        timeout=HANG_TIMEOUT * 2)
    return proc, out


def digests(out: Path, world: int) -> list[str]:
    return [json.loads((out / f"final_{r}.json").read_text())["digest"] for r in range(world)]


def plain_env(env: dict[str, str]) -> dict[str, str]:
    """The torchrun reference's environment (no leftovers of an enclosing launcher)."""
    return {k: v for k, v in env.items() if not k.startswith(("PET_", "TORCHELASTIC"))}


@pytest.mark.slow
# The decision (state lost -> policy) is tests/test_agent_decisions.py's and
# test_recovery_sequences.py's; a restart's real run: test_resilient.py's no-spare case.
@pytest.mark.parametrize("policy", ["fail", pytest.param("restart", marks=pytest.mark.matrix)])
def test_every_holder_dying_at_once_is_not_a_fresh_start(workdir, test_env, policy):
    proc, out = launch(TP_RUN, workdir, test_env, "out",
                       ["--nproc-per-node", "2", "--spares", "2", "--spare-policy", policy,
                        "--max-restarts", "1"],
                       ["--steps", "8", "--fault", "0:4:forward,1:4:forward"])
    assert "the training state is lost" in proc.stderr, proc.stderr[-3000:]
    entries = [line.split() for f in out.glob("entry_*") for line in f.read_text().splitlines()]
    resumed = [int(step) for _rank, step in entries if int(step) > 0]
    assert not resumed  # nobody resumed "from" a state nobody held
    if policy == "fail":
        assert proc.returncode == 1
        assert not (out / "final_0.json").exists()
    else:
        # A counted restart: the script's own checkpoint (here none: step 0) applies.
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "restart" in proc.stderr


def test_diverged_replicas_stop_the_job_naming_the_rank(workdir, test_env):
    proc, out = launch(TP_RUN, workdir, test_env, "out",
                       ["--nproc-per-node", "2", "--spares", "1", "--verify-every", "2"],
                       ["--steps", "10", "--perturb", "1:4"])
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tp-run: error:")]
    assert lines and "rank(s) [1] do not match rank 0" in lines[0], proc.stderr[-3000:]
    assert not (out / "final_0.json").exists()


def test_a_newcomer_that_differs_from_its_donor_stops_the_job_before_its_next_step(
        workdir, test_env):
    # Rank 1 dies in step 4's forward; its spare's optimizer rounds what it receives
    # (--lossy-load). The digest of the recovered state runs beside the first step after
    # it; the comparison at that step's optimizer step names the newcomer, and the step
    # is never committed anywhere.
    proc, out = launch(TP_RUN, workdir, test_env, "out",
                       ["--nproc-per-node", "2", "--spares", "1"],
                       ["--steps", "10", "--lossy-load", "--fault", "1:4:forward"])
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tp-run: error:")]
    assert errors and "rank(s) [1] do not match rank 0 at step 4" in errors[0], \
        proc.stderr[-3000:]
    logged = [int(line.split()[0]) for line in (out / "loss_0.log").read_text().splitlines()]
    assert logged == [0, 1, 2, 3]
    assert not (out / "final_0.json").exists()
    # The same job without the fault: nothing is received, nothing differs.
    proc, out = launch(TP_RUN, workdir, test_env, "clean",
                       ["--nproc-per-node", "2", "--spares", "1"],
                       ["--steps", "10", "--lossy-load"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(set(digests(out, 2))) == 1


@pytest.mark.slow
def test_a_divergence_is_also_caught_after_a_recovery(workdir, test_env):
    # No --verify-every: the digest comparison that follows every recovery finds it
    # among the survivors (ranks 0 and 1; rank 2 dies).
    proc, _ = launch(TP_RUN, workdir, test_env, "out",
                     ["--nproc-per-node", "3", "--spares", "1"],
                     ["--steps", "10", "--perturb", "1:3", "--fault", "2:6:forward"])
    assert proc.returncode == 1
    assert "rank(s) [1] do not match rank 0" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_the_loop_of_earlier_versions_is_one_clear_error(workdir, test_env):
    proc, _ = launch(TP_RUN, workdir, test_env, "out", ["--nproc-per-node", "2", "--spares", "1"],
                     ["--steps", "6", "--old-style"])
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tp-run: error:")]
    assert len(errors) == 1 and "state.steps" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # Under plain torchrun the same script runs (no recovery is possible there anyway).
    proc, _ = launch(TORCHRUN, workdir, plain_env(test_env), "ref", ["--nproc-per-node", "2"],
                     ["--steps", "6", "--old-style", "--no-resilient"])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_checkpoint_loaded_before_run_is_kept(workdir, test_env):
    env = plain_env(test_env)
    ckpt = workdir / "ckpt.pt"
    proc, _ = launch(TORCHRUN, workdir, env, "first", ["--nproc-per-node", "2"],
                     ["--steps", "5", "--no-resilient", "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, ref = launch(TORCHRUN, workdir, env, "ref", ["--nproc-per-node", "2"],
                       ["--steps", "12", "--no-resilient", "--load", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, out = launch(TP_RUN, workdir, test_env, "out", ["--nproc-per-node", "2", "--spares", "1"],
                       ["--steps", "12", "--load", str(ckpt), "--fault", "1:8:forward"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert digests(out, 2) == digests(ref, 2)
    first_entries = {line.split()[1] for f in out.glob("entry_*")
                     for line in f.read_text().splitlines()}
    assert "5" in first_entries and "0" not in first_entries  # started at the checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("steps", [12, 5], ids=["boundary-inside", "loop-ends-first"])
def test_planned_migration_inside_a_loop_with_a_scheduler(workdir, test_env, steps):
    """Held in step 4, rank 1 is migrated: the boundary is two steps on. With 5 steps
    the loop ends before it: the migration still happens (after the end), nothing hangs."""
    env = plain_env(test_env)
    proc, ref = launch(TORCHRUN, workdir, env, "ref", ["--nproc-per-node", "2"],
                       ["--steps", str(steps), "--no-resilient"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = workdir / "out"
    out.mkdir()
    job = start_launcher(TP_RUN, ["--nproc-per-node", "2", "--spares", "1",
                                  SCRIPT, "--steps", str(steps), "--hold-at", "4"],
                         {**test_env, "OUT": str(out), "OMP_NUM_THREADS": "1"}, workdir)
    try:
        deadline = time.monotonic() + HANG_TIMEOUT
        while not all((out / f"held_{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and job.poll() is None, "the job never held"
            time.sleep(0.1)
        migrate = None
        while time.monotonic() < deadline:
            migrate = subprocess.run([*TP_RUN, "migrate", "--rank", "1", "--agent-pid",
                                      str(job.pid)],
                                     env=test_env, cwd=workdir, capture_output=True, text=True,
                                     timeout=60)
            if "no spare is parked" not in migrate.stdout + migrate.stderr:
                break
            time.sleep(0.2)
        assert migrate is not None and migrate.returncode == 0, migrate.stderr
        (out / "release").touch()
        stdout, stderr = job.communicate(timeout=HANG_TIMEOUT)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, stderr[-3000:]
    assert digests(out, 2) == digests(ref, 2)
    for rank in range(2):  # a migration loses no step and logs none twice
        assert sorted((out / f"loss_{rank}.log").read_text().splitlines()) == \
            sorted((ref / f"loss_{rank}.log").read_text().splitlines())
    entries = [line.split() for f in out.glob("entry_*") for line in f.read_text().splitlines()]
    # The spare entered at the boundary (two steps past the held step 4), or at the end.
    assert ["1", str(min(6, steps))] in entries or ["1", str(min(7, steps))] in entries


@pytest.mark.slow
def test_a_rank_lost_after_the_last_step_while_another_still_commits_it(workdir, test_env):
    """Rank 1 dies after its last step; rank 2 has returned from train(); rank 0 is still
    inside the last iteration and learns of the failure at its commit. Same training
    state on all three (one has 'ended', one not): the recovery goes on, exactly."""
    env = plain_env(test_env)
    proc, ref = launch(TORCHRUN, workdir, env, "ref", ["--nproc-per-node", "3"],
                       ["--steps", "8", "--no-resilient"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = workdir / "out"
    out.mkdir()
    job = Live(TP_RUN, ["--nproc-per-node", "3", "--spares", "1", SCRIPT, "--steps", "8",
                        "--fault", "1:7:end", "--hold-at", "7", "--hold-rank", "0"],
               {**test_env, "OUT": str(out), "OMP_NUM_THREADS": "1"}, workdir)
    try:
        job.wait_for(r"rank 1 \(pid \d+\) failed with exit code -9; replacing it")
        time.sleep(1.0)  # the new generation reaches rank 0's channel
        (out / "release").touch()
        rc, _, err = job.finish()
    finally:
        job.kill()
    assert rc == 0, err[-3000:]
    assert "do not match" not in err
    assert digests(out, 3) == digests(ref, 3)
