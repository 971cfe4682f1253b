"""Sharded state (FSDP2 DTensors) under resilient mode (tp_launch/resilient/sharding.py).

With ``State(build=...)`` (the mesh, the sharded model and its optimizer built for each
generation) a dead rank's shards come back from the ranks that hold the same pieces:
under HSDP its replica peer. Every case ends with every rank's full parameters and
optimizer state bit-identical to the failure-free torchrun run. Where no rank holds a
dead rank's pieces (plain FSDP, or both replicas of a shard lost), or the script
sharded a registered model itself (no build), the failure ends in one line and
``--spare-policy``, never in a hang or a newcomer holding another rank's shard; with
``restart`` the job resumes from the script's own checkpoint, exact.

Real processes, gloo, FSDP2 on 2 ranks and HSDP on 4 (2 replicas x 2 shards):
scripts/fsdp_train.py.
"""

from __future__ import annotations

import json
import os
import re
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


HSDP = ["--build", "--replicas", "2"]


def launch(workdir: Path, env: dict[str, str], launcher: list[str], launcher_args: list[str],
           script_args: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    out = workdir / "out"
    out.mkdir()
    run_env = {**env, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = run_launcher(launcher, [*launcher_args, SCRIPT, *script_args], run_env, workdir)
    return proc, out


def finals(out: Path, world: int = WORLD) -> list[dict]:
    return [json.loads((out / f"final_{r}.json").read_text()) for r in range(world)]


def torchrun_result(tmp_path_factory: pytest.TempPathFactory, world: int,
                    script_args: list[str]) -> str:
    """The failure-free result under torchrun (every rank's checksum: one value)."""
    workdir = tmp_path_factory.mktemp("reference")
    shutil.copytree(SCRIPTS, workdir / "scripts")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    proc, out = launch(workdir, env, TORCHRUN, ["--nproc-per-node", str(world)], script_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = {f["checksum"] for f in finals(out, world)}
    assert len(sums) == 1, sums
    return sums.pop()


def exact(proc: subprocess.CompletedProcess, out: Path, reference: str, world: int,
          line: str) -> list[dict]:
    """The job ended exact on ``world`` ranks, after the one recovery ``line`` names."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run:")]
    assert len(said) == 1 and said[0].startswith(line), said
    results = finals(out, world)
    assert {f["checksum"] for f in results} == {reference}, results
    assert all(f["steps"] == 12 for f in results)
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return torchrun_result(tmp_path_factory, WORLD, [])


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return torchrun_result(tmp_path_factory, 4, HSDP)


# One kill point in CI, past the point of no return (the optimizer step); where a rank
# dies is the agreement's decision (tests/test_agreement.py), the replica path the same.
@pytest.mark.parametrize("where, rank, step", [
    pytest.param("forward", 1, 6, marks=pytest.mark.matrix),
    # A kill in FSDP's reduce-scatter: plain FSDP's case below.
    pytest.param("backward", 2, 6, marks=pytest.mark.matrix),
    ("optimizer", 3, 7),  # past the point of no return
])
def test_hsdp_rank_comes_back_from_its_replica(workdir, test_env, hsdp_reference, where,
                                               rank, step):
    """HSDP, 2 replicas x 2 shards: the dead rank's shard comes from the rank with the
    same shard coordinate in the other replica group; the survivors rebuild their mesh,
    FSDP and optimizer (State(build=...)) with their own pieces; the job goes on at the
    step every rank committed."""
    proc, out = launch(workdir, test_env, TP_RUN, ["--nproc-per-node", "4", "--spares", "1"],
                       [*HSDP, "--kill-rank", str(rank), "--kill-step", "6",
                        "--kill-where", where])
    results = exact(proc, out, hsdp_reference, 4, f"tp-run: failure: rank(s) [{rank}] ")
    assert f"at step {step};" in proc.stderr
    assert {f["first"] for f in results} == {step}


# Each receiver served by a donor of its own copy class: tests/test_agreement.py; two
# newcomers at once: tests/test_loops.py's 4-rank case.
@pytest.mark.matrix
def test_hsdp_two_ranks_of_different_replica_groups(workdir, test_env, hsdp_reference):
    """Ranks 1 and 2 die at once (different shards, different replica groups): each is
    served by its own replica peer, in parallel."""
    proc, out = launch(workdir, test_env, TP_RUN, ["--nproc-per-node", "4", "--spares", "2"],
                       [*HSDP, "--kill-ranks", "1,2", "--kill-step", "6"])
    exact(proc, out, hsdp_reference, 4, "tp-run: failure: rank(s) [")
    assert re.search(r"rank\(s\) \[(1, 2|2, 1)\] -> spare", proc.stderr), proc.stderr[-3000:]


@pytest.mark.parametrize("world, script_args, kill", [
    (2, ["--build"], "1"),  # plain FSDP: one copy of each shard
    # Both replicas of shard 1: the same rule (tests/test_agreement.py), in the matrix.
    pytest.param(4, HSDP, "1,3", marks=pytest.mark.matrix),
])
def test_a_shard_no_survivor_holds_goes_to_the_spare_policy(workdir, test_env, world,
                                                             script_args, kill):
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", str(world), "--spares", "2",
                        "--spare-policy", "fail"],
                       [*script_args, "--kill-ranks", kill, "--kill-step", "6"])
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run: error:")]
    assert len(said) == 1 and "held by no surviving rank" in said[0], proc.stderr[-4000:]
    assert not list(out.glob("final_*.json"))


@pytest.mark.slow
def test_planned_migration_of_an_hsdp_rank(workdir, test_env, hsdp_reference):
    """``tp-run migrate --rank 1``: the retiring rank hands its shard to its replacement;
    no step is recomputed."""
    proc, out = migrated(workdir, test_env, ["--nproc-per-node", "4", "--spares", "1"],
                         HSDP, 4)
    results = exact(proc, out, hsdp_reference, 4, "tp-run: migration: rank(s) [1] ")
    boundary = {f["first"] for f in results}
    assert len(boundary) == 1 and boundary.pop() > 4, results


def test_replicas_that_differ_stop_the_job(workdir, test_env):
    """``--verify-every 1``: rank 2's piece of a weight drifts from its replica peer's
    (rank 0): the next check names it and the job stops, never exit 0 with diverged
    replicas."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", "4", "--spares", "1", "--verify-every", "1"],
                       [*HSDP, "--corrupt-rank", "2"])
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run: error:")]
    assert len(said) == 1 and "shards differ: rank(s) [2]" in said[0], proc.stderr[-4000:]
    assert not list(out.glob("final_*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("world, options", [
    # HSDP's replica peer serving a newcomer: test_hsdp_rank_comes_back_from_its_replica.
    pytest.param("4", ["--replicas", "2"], marks=pytest.mark.matrix),
    ("2", ["--replicas", "1"]),  # plain FSDP: the buddy copy serves
])
def test_the_sharded_example_ends_as_under_torchrun(tmp_path, test_env, world, options):
    """examples/train_hsdp.py (a small transformer), its README commands: rank 1 killed
    at step 10, the printed checksum is torchrun's."""
    example = str(Path(__file__).resolve().parent.parent / "examples" / "train_hsdp.py")
    args = ["--nproc-per-node", world, example, "--steps", "20", *options]
    env = {**test_env, "OMP_NUM_THREADS": "1"}
    plain = run_launcher(TORCHRUN, args, env, tmp_path)
    killed = run_launcher(TP_RUN, ["--spares", "1", "--shard-copy-every", "1", *args,
                                   "--kill-rank", "1", "--kill-step", "10"], env, tmp_path)
    done = [re.findall(r"^done: .*params (\w+)$", p.stdout, re.M) for p in (plain, killed)]
    assert plain.returncode == 0 and killed.returncode == 0, killed.stderr[-3000:]
    assert done[0] and done[0] == done[1], (plain.stdout, killed.stdout)
    assert "tp-run: failure: rank(s) [1]" in killed.stderr


BUDDY = ["--build", "--per-rank-data"]  # plain FSDP, each rank's own data stream


@pytest.fixture(scope="module")
def buddy_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return torchrun_result(tmp_path_factory, WORLD, BUDDY)


@pytest.fixture(scope="module")
def buddy_reference_4(tmp_path_factory: pytest.TempPathFactory) -> str:
    return torchrun_result(tmp_path_factory, 4, BUDDY)


@pytest.mark.parametrize("where", [
    "forward",
    # Killed inside FSDP's reduce-scatter: the survivor's collective fails like any
    # other (tests/test_loops.py kills inside DDP's); the rollback rule is the same.
    pytest.param("backward", marks=pytest.mark.matrix),
    pytest.param("optimizer", marks=pytest.mark.slow),  # past the point of no return
])
def test_plain_fsdp_rank_comes_back_from_its_buddy_copy(workdir, test_env, buddy_reference,
                                                        where):
    """Plain FSDP, ``--shard-copy-every 1``: rank 1's shard, optimizer state and own data
    stream exist only in rank 0's copy of them; the newcomer gets them from there and
    the job ends as torchrun's failure-free run (a newcomer given rank 0's data stream,
    or none, would not)."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", str(WORLD), "--spares", "1",
                        "--shard-copy-every", "1"],
                       [*BUDDY, "--kill-rank", "1", "--kill-step", "6", "--kill-where", where])
    results = exact(proc, out, buddy_reference, WORLD, "tp-run: failure: rank(s) [1] ")
    # Back to the last step whose copies had arrived: the one rank 1 committed last (6),
    # or the one before if its copy was still on the way.
    first = {f["first"] for f in results}
    assert len(first) == 1 and first <= {5, 6}, results


TITAN_LIKE = ["--build", "--like-torchtitan", "--late-per-rank-data", "--declare-per-rank"]


@pytest.fixture(scope="module")
def titan_like_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return torchrun_result(tmp_path_factory, WORLD, TITAN_LIKE)


@pytest.mark.parametrize("where", [
    "forward",  # the survivor's root parameters are unsharded
    pytest.param("backward", marks=pytest.mark.matrix),  # the save hook is the path, not where
])
def test_model_saved_through_a_collective_with_an_unsharded_root(workdir, test_env,
                                                                 titan_like_reference, where):
    """The model as TorchTitan shards and saves it: its root keeps its parameters
    unsharded between forward and backward, and its state-dict hook runs a collective
    (TorchTitan's fused QKV linear redistributes on save: on the dead generation's group
    it hung the recovery). The runtime reads the modules' own tensors, resharded, never
    through ``state_dict()``; the data stream is declared each rank's own
    (``State(per_rank=...)``) though it starts alike everywhere; the result is exact."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", str(WORLD), "--spares", "1",
                        "--shard-copy-every", "1"],
                       [*TITAN_LIKE, "--kill-rank", "1", "--kill-step", "6",
                        "--kill-where", where])
    exact(proc, out, titan_like_reference, WORLD, "tp-run: failure: rank(s) [1] ")


def test_undeclared_per_rank_object_stops_the_job(workdir, test_env):
    """A data stream that starts alike on every rank and then differs, not declared with
    ``State(per_rank=...)``: after the recovery the replicas' comparison finds it
    differing and the job stops naming it and the declaration, never exits 0."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", str(WORLD), "--spares", "1",
                        "--shard-copy-every", "1", "--max-restarts", "0"],
                       ["--build", "--late-per-rank-data", "--kill-rank", "1",
                        "--kill-step", "6"])
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run: error:")]
    assert said and "State(per_rank=['data'])" in said[0], proc.stderr[-3000:]


def test_per_rank_naming_no_registered_object_is_one_line(workdir, test_env):
    """``State(per_rank={"data"})`` where no object "data" is registered: one line naming
    it, a non-zero exit, no traceback wall."""
    proc, _ = launch(workdir, test_env, TP_RUN, ["--nproc-per-node", str(WORLD), "--spares", "1"],
                     ["--build", "--declare-per-rank"])
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run: error:")]
    assert said and "State(per_rank=...) names ['data']" in said[0], proc.stderr[-3000:]


HSDP_OWN_DATA = [*HSDP, "--late-per-rank-data", "--declare-per-rank"]


@pytest.mark.slow
def test_hsdp_newcomer_gets_its_own_data_position_from_its_copy(workdir, test_env,
                                                                 tmp_path_factory):
    """HSDP with each rank's own data stream (declared: it starts alike everywhere) and
    ``--shard-copy-every 1``: the newcomer's shard comes from its replica peer, its data
    stream's position from the copy its holder keeps (the replica peer's is another
    stream). Exact, nothing reported inexact."""
    reference = torchrun_result(tmp_path_factory, 4, HSDP_OWN_DATA)
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", "4", "--spares", "1", "--shard-copy-every", "1"],
                       [*HSDP_OWN_DATA, "--kill-rank", "1", "--kill-step", "6"])
    exact(proc, out, reference, 4, "tp-run: failure: rank(s) [1] ")
    assert "inexact" not in proc.stderr and "goes on with a donor's" not in proc.stderr


def test_every_k_steps_goes_back_to_the_last_copy(workdir, test_env, buddy_reference_4):
    """``--shard-copy-every 4`` on 4 ranks, rank 2 killed after step 6's optimizer step:
    every rank goes back to the copies of step 4 and computes steps 4 to 6 again; the
    result is exact."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", "4", "--spares", "1", "--shard-copy-every", "4"],
                       [*BUDDY, "--kill-rank", "2", "--kill-step", "6",
                        "--kill-where", "optimizer"])
    results = exact(proc, out, buddy_reference_4, 4, "tp-run: failure: rank(s) [2] ")
    assert "at step 4;" in proc.stderr, proc.stderr[-3000:]
    assert {f["first"] for f in results} == {4}, results


@pytest.mark.slow
def test_a_hung_sharded_rank_comes_back_from_its_buddy_copy(workdir, test_env,
                                                            buddy_reference_4):
    """Rank 2 stops (SIGSTOP) after step 6's forward pass, its peers blocked in FSDP's
    collectives with it and rank 1 sending it copies: the hang detection names rank 2
    (not its ward), kills it, and the spare comes back from rank 3's copy; exact."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", "4", "--spares", "1", "--shard-copy-every", "1",
                        "--hang-timeout", "2"],
                       [*BUDDY, "--stop-rank", "2", "--stop-step", "6"])
    exact(proc, out, buddy_reference_4, 4, "tp-run: hang: rank(s) [2] ")


@pytest.mark.slow
def test_a_rank_lost_with_its_copy_holder_goes_to_the_spare_policy(workdir, test_env):
    """Ranks 1 and 2 die together; rank 2 held rank 1's copy: one line, the policy
    (fail), no result written."""
    proc, out = launch(workdir, test_env, TP_RUN,
                       ["--nproc-per-node", "4", "--spares", "2", "--shard-copy-every", "1",
                        "--spare-policy", "fail"],
                       [*BUDDY, "--kill-ranks", "1,2", "--kill-step", "6"])
    assert proc.returncode != 0
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run: error:")]
    assert len(said) == 1 and "no buddy copy" in said[0] and "rank(s) [1]" in said[0], \
        proc.stderr[-4000:]
    assert not list(out.glob("final_*.json"))


def test_planned_migration_of_a_plain_fsdp_rank(workdir, test_env, buddy_reference):
    """``tp-run migrate --rank 1`` of a built plain-FSDP state (no copies): the retiring
    rank hands its shard and its own data stream straight to its replacement; no step
    is recomputed, the result is exact."""
    proc, out = migrated(workdir, test_env, ["--nproc-per-node", str(WORLD), "--spares", "1"],
                         BUDDY, WORLD)
    results = exact(proc, out, buddy_reference, WORLD, "tp-run: migration: rank(s) [1] ")
    boundary = {f["first"] for f in results}
    assert len(boundary) == 1 and boundary.pop() > 4, results


def test_donor_plan_serves_each_receiver_from_its_copy_class():
    from tp_launch.resilient.transfer import StateLost, donor_plan

    # Replicated: round-robin over every donor.
    assert donor_plan([5, -1, 5, -1]) == {1: 0, 3: 2}
    # HSDP 2x2, classes = shard coordinates: rank 1 from 3, rank 2 from 0.
    assert donor_plan([5, -1, -1, 5], [(0,), (1,), (0,), (1,)]) == {1: 3, 2: 0}
    # Two receivers of one class, two donors of it: different donors.
    assert donor_plan([5, 5, -1, -1, 5, 5], [(0,), (0,), (0,), (0,), (1,), (1,)]) == \
        {2: 0, 3: 1}
    with pytest.raises(StateLost, match=r"rank\(s\) \[1\]"):
        donor_plan([5, -1, 5, 5], [(0,), (1,), (0,), (2,)])


def migrated(workdir: Path, test_env: dict[str, str], launcher_args: list[str],
             script_args: list[str], world: int) -> tuple[subprocess.CompletedProcess, Path]:
    """The job held after step 4 with a spare parked (``--hold-at``), ``tp-run migrate
    --rank 1`` asked for, then released and run to its end."""
    out = workdir / "out"
    out.mkdir()
    env = {**test_env, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = start_launcher(TP_RUN, [*launcher_args, SCRIPT, *script_args, "--hold-at", "4"],
                          env, workdir)
    try:
        deadline = time.monotonic() + HANG_TIMEOUT
        while not all((out / f"held_{r}").exists() for r in range(world)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks hold"
            time.sleep(0.1)
        cmd = run_launcher(TP_RUN, ["migrate", "--rank", "1", "--agent-pid", str(proc.pid)],
                           env, workdir)
        assert cmd.returncode == 0 and "ok: rank 1" in cmd.stdout, cmd.stdout + cmd.stderr
        (out / "release").touch()
        stdout, stderr = proc.communicate(timeout=HANG_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out


def said_sharded(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if line.startswith("tp-run: error:") and "sharded tensor" in line]


@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.matrix)])
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
    proc, out = migrated(workdir, test_env, ["--nproc-per-node", str(WORLD), "--spares", "1",
                                             "--max-restarts", "1"], [], WORLD)
    stderr = proc.stderr
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


@pytest.mark.slow
def test_a_lost_node_comes_back_from_copies_on_the_other_node(workdir, test_env, etcd_server,
                                                              buddy_reference_4):
    """etcd, two agents x 2 ranks of plain FSDP with each rank's own data stream,
    ``--shard-copy-every 1``: each rank's copy is held on the other node (rank r's by
    r + 2). SIGKILL one agent (a lost node): both its ranks' shards, optimizer state and
    data positions exist only on the surviving node, whose parked spares take them,
    served by their holders; the survivors keep their processes; exact. (With copies on
    the next rank, as on one node, rank 2's holder would be rank 3, lost with it.)"""
    from tests.test_resilient import _parked, _ranks, _status, _wait, exits, node_job, recoveries

    with node_job(workdir, test_env, etcd_server, script=SCRIPT, steps=12) as (start, agents,
                                                                               out):
        for node in range(2):
            start(node, "--nnodes", "2", "--spares", "2", "--shard-copy-every", "1",
                  script_args=(*BUDDY, "--hold-at", "8"))
        _wait(lambda: all((out / f"held_{r}").exists() for r in range(4)), "4 ranks train")
        victim, survivor = sorted(agents, key=lambda a: 2 in _ranks(a), reverse=True)
        _wait(lambda: _parked(survivor) >= 2, "the surviving node parks its spares")
        assert _ranks(victim) == {2, 3} and _ranks(survivor) == {0, 1}
        first = _status(survivor).ranks
        victim.kill()
        victim.communicate()
        (out / "release").touch()
        ((rc, err),) = exits([survivor])
    assert rc == 0, err[-4000:]
    assert "no buddy copy" not in err and "inexact" not in err, err[-4000:]
    results = finals(out, 4)
    assert {f["checksum"] for f in results} == {buddy_reference_4}, results
    assert all(f["steps"] == 12 for f in results)
    assert all(results[r]["pid"] == first[r] for r in (0, 1)), err[-4000:]
    (event,) = recoveries(workdir / "logs0") + recoveries(workdir / "logs1")
    assert event["reason"] == "node loss" and sorted(event["failed_ranks"]) == [2, 3]
    assert {p["rank"] for p in event["promoted"]} == {2, 3}
