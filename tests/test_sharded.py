"""Sharded state (FSDP2 DTensors) under resilient mode: a failure is not recovered peer to
peer yet (tp_launch/resilient/sharding.py), so it must end in one line and
``--spare-policy``, never in a hang or a newcomer holding another rank's shard. With
``restart`` the job resumes from the script's own checkpoint and ends bit-identical to
the failure-free torchrun run.

Real processes, gloo, FSDP2 on 2 ranks: scripts/fsdp_train.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import HANG_TIMEOUT, SCRIPTS, TORCHRUN, TP_RUN, run_launcher, start_launcher
from tp_launch.resilient import sharding

SCRIPT = "scripts/fsdp_train.py"
WORLD = 2


def launch(workdir: Path, env: dict[str, str], launcher: list[str], launcher_args: list[str],
           script_args: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    out = workdir / "out"
    out.mkdir()
    run_env = {**env, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = run_launcher(launcher, [*launcher_args, SCRIPT, *script_args], run_env, workdir)
    return proc, out


def finals(out: Path) -> list[dict]:
    return [json.loads((out / f"final_{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    workdir = tmp_path_factory.mktemp("reference")
    shutil.copytree(SCRIPTS, workdir / "scripts")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    proc, out = launch(workdir, env, TORCHRUN, ["--nproc-per-node", str(WORLD)], [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = {f["checksum"] for f in finals(out)}
    assert len(sums) == 1, sums
    return sums.pop()


def said_sharded(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if line.startswith("tp-run: error:") and "sharded tensor" in line]


@pytest.mark.parametrize("rank", [0, 1])
def test_killed_sharded_rank_restarts_from_the_checkpoint(workdir, test_env, reference, rank):
    """A rank dies in step 6 (checkpoint at step 4) with a spare parked: one line says the
    sharded state is not recovered peer to peer, every worker restarts (the spare is not
    handed another rank's shard), the job resumes from step 4 and ends exact."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", str(WORLD), "--spares", "1",
                        "--spare-policy", "restart", "--max-restarts", "1"],
                       ["--kill-rank", str(rank), "--kill-step", "6"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "killed").exists()
    assert len(said_sharded(proc.stderr)) == 1, proc.stderr[-4000:]
    assert [(f["steps"], f["first"]) for f in finals(out)] == [(12, 4)] * WORLD
    assert {f["checksum"] for f in finals(out)} == {reference}


@pytest.mark.slow
def test_sharded_failure_with_policy_fail_stops_the_job(workdir, test_env):
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", str(WORLD), "--spares", "1",
                        "--spare-policy", "fail"],
                       ["--kill-rank", "1", "--kill-step", "6"])
    assert proc.returncode != 0
    assert len(said_sharded(proc.stderr)) == 1, proc.stderr[-4000:]
    assert not list(out.glob("final_*.json"))


@pytest.mark.slow
def test_planned_migration_of_a_sharded_rank_restarts_from_the_checkpoint(workdir, test_env,
                                                                        reference):
    """``tp-run migrate --rank 1``: the retiring rank cannot hand over its shard alone (the
    survivors' FSDP is bound to the old groups): one line, every worker restarts from the
    checkpoint at step 4, the result is exact."""
    out = workdir / "out"
    out.mkdir()
    env = {**test_env, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = start_launcher(TP_RUN, ["--nproc-per-node", str(WORLD), "--spares", "1",
                                   "--max-restarts", "1", SCRIPT, "--hold-at", "4"],
                          env, workdir)
    try:
        deadline = time.monotonic() + HANG_TIMEOUT
        while not all((out / f"held_{r}").exists() for r in range(WORLD)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks hold"
            time.sleep(0.1)
        cmd = run_launcher(TP_RUN, ["migrate", "--rank", "1", "--agent-pid", str(proc.pid)],
                           env, workdir)
        assert cmd.returncode == 0, cmd.stdout + cmd.stderr
        (out / "release").touch()
        _, stderr = proc.communicate(timeout=HANG_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    said = said_sharded(stderr)
    assert len(said) == 1 and "rank 1:" in said[0], stderr[-4000:]
    assert [(f["steps"], f["first"]) for f in finals(out)] == [(12, 4)] * WORLD
    assert {f["checksum"] for f in finals(out)} == {reference}


def test_plain_state_has_no_dtensors():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert sharding.dtensor_paths({"model": model, "optimizer": opt}) == []
    assert not sharding.is_dtensor(model.weight) and not sharding.is_dtensor(torch.ones(1))
    tree = {"a": [torch.ones(1), (1, "x")], "b": None}
    assert sharding.without_dtensors(tree) == tree
    assert sharding.local_piece(model.weight) is model.weight
