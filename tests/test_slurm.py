"""Slurm defaults (tp_launch/slurm.py) and the srun example under a faked Slurm.

The parsing tests use fixed environments; the example test runs
``examples/slurm/train.sbatch`` with a fake ``srun`` on PATH that starts one task per
"node" (127.0.0.2 and 127.0.0.3 on this machine) with the variables real srun sets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import HANG_TIMEOUT, REPO
from tests.etcd_server import free_port
from tp_launch.config import ConfigError
from tp_launch.slurm import expand_hostlist, slurm_defaults


@pytest.mark.parametrize("text,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2],b3,c[09-11]", ["a1", "a2", "b3", "c09", "c10", "c11"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("10.0.0.[1-3]", ["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu]1[", "gpu[a-b]", "gpu[5-3]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ConfigError, match="Slurm host list"):
        expand_hostlist(bad)


STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_NNODES": "4",
        "SLURM_NODEID": "2", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[01-04,07]",
        "SLURM_STEP_NODELIST": "gpu[02-05]"}


def test_defaults_from_a_step():
    assert slurm_defaults(STEP) == {"rdzv_id": "4242.3", "nnodes": "4", "node_rank": 2,
                                    "master_addr": "gpu02"}


def test_local_addr_is_the_node_name():
    """--local-addr: the node's name in the node list (the names --master-addr takes),
    not the machine's FQDN, which may resolve to another address elsewhere."""
    assert slurm_defaults({**STEP, "SLURMD_NODENAME": "gpu04"})["local_addr"] == "gpu04"
    assert "local_addr" not in slurm_defaults(STEP)


def test_job_nodelist_when_no_step_nodelist():
    env = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert slurm_defaults(env)["master_addr"] == "gpu01"


@pytest.mark.parametrize("env", [
    {},                                                   # not under Slurm
    {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"},  # the batch script, not srun
    {**STEP, "TP_RUN_NO_SLURM": "1"},                     # turned off
])
def test_no_defaults_outside_a_step(env):
    assert slurm_defaults(env) == {}


def test_more_tasks_than_nodes_is_an_error():
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):
        slurm_defaults({**STEP, "SLURM_NTASKS": "16"})


def _config(args: list[str], env: dict[str, str]):
    """config_from_options as the CLI runs it (click context, explicit vs default)."""
    from tp_launch.cli import config_from_options, tp_run

    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        ctx = tp_run.make_context("tp-run", [*args, str(REPO / "examples/train_ddp.py")])
        with ctx:
            return config_from_options(ctx.params)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_cli_takes_slurm_defaults_and_flags_win():
    base = {"PATH": os.environ.get("PATH", "")}
    cfg = _config([], {**base, **STEP})
    assert (cfg.run_id, cfg.min_nodes, cfg.max_nodes, cfg.node_rank) == ("4242.3", 4, 4, 2)
    assert cfg.rdzv_backend == "static" and cfg.rdzv_endpoint == "gpu02:29500"
    cfg = _config(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.1.1",
                   "--rdzv-id", "mine"], {**base, **STEP})
    assert (cfg.run_id, cfg.max_nodes, cfg.node_rank, cfg.master_addr) == \
        ("mine", 2, 1, "10.1.1.1")
    cfg = _config([], {**base, **STEP, "PET_NNODES": "3"})  # PET_* is explicit too
    assert cfg.max_nodes == 3


FAKE_SRUN = r'''#!{python}
"""A fake srun: one task per node of SLURM_JOB_NODELIST, with srun's variables."""
import os, subprocess, sys
sys.path.insert(0, {repo!r})
from tp_launch.slurm import expand_hostlist
argv = sys.argv[1:]
while argv and argv[0].startswith("-"):
    argv.pop(0)
hosts = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])
procs = []
for i, host in enumerate(hosts):
    env = dict(os.environ, SLURM_STEP_ID="0", SLURM_PROCID=str(i), SLURM_NODEID=str(i),
               SLURM_LOCALID="0", SLURM_NTASKS=str(len(hosts)),
               SLURM_STEP_NUM_NODES=str(len(hosts)), SLURM_STEP_NUM_TASKS=str(len(hosts)),
               SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"], SLURMD_NODENAME=host)
    procs.append(subprocess.Popen(argv, env=env))
sys.exit(max(p.wait() for p in procs))
'''


@pytest.mark.slow
def test_sbatch_example_under_fake_srun(workdir, test_env, tmp_path):
    """examples/slurm/train.sbatch with a faked 2-node allocation: the two agents take
    nnodes, node ranks, run id and master address from SLURM_* and train together."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable, repo=str(REPO)))
    srun.chmod(0o755)
    dump = workdir / "dump"
    dump.mkdir()
    env = {**test_env, "PATH": f"{bindir}{os.pathsep}{test_env['PATH']}",
           "SLURM_JOB_ID": "777", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.[2-3]",
           "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable,
           "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(REPO / "examples/slurm/train.sbatch"),
                        "scripts/rdzv_worker.py"], env=env, cwd=workdir, capture_output=True,
                       text=True, timeout=HANG_TIMEOUT, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    oks = {p.name: json.loads(p.read_text()) for p in dump.glob("ok_*.json")}
    assert sorted(oks) == ["ok_0_0.json", "ok_0_1.json"]
    for rank in range(2):
        e = oks[f"ok_0_{rank}.json"]
        assert (e["GROUP_RANK"], e["WORLD_SIZE"], e["MASTER_ADDR"]) == (str(rank), "2",
                                                                        "127.0.0.2")
        assert e["TORCHELASTIC_RUN_ID"] == "777.0"
        assert e["MASTER_PORT"] == env["MASTER_PORT"]
