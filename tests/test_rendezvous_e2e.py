"""Multi-node tp-run over etcd and c10d: several agents as nodes on this machine.

Each agent is a real ``tp-run`` process with its own ``--local-addr`` (127.0.0.2,
127.0.0.3, ...), its workers a real gloo job (``scripts/rdzv_worker.py``) on the store
node rank 0's agent hosts. etcd is a real server the tests start (``etcd_server``);
c10d is hosted by whichever agent binds the endpoint first. Short TTLs and timeouts via
``--rdzv-conf`` keep the tests quick; timeouts only guard against hangs. Every test
passes the ``test_env`` leak check.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT, TP_RUN, start_launcher, wait_for_file
from tests.etcd_server import free_port

CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.5,lease_ttl=3,heartbeat_timeout=3"
SUMMARY = "scripts/rdzv_worker.py FAILED"


class Agents:
    """Start ``n`` tp-run agents of one job; ``finish()`` waits for all of them."""

    def __init__(self, workdir: Path, env: dict[str, str], backend: str, endpoint: str,
                 nnodes: str, run_id: str | None = None) -> None:
        self.workdir, self.backend, self.endpoint, self.nnodes = workdir, backend, endpoint, nnodes
        self.run_id = run_id or f"job-{uuid.uuid4().hex[:8]}"
        self.dump = workdir / "dump"
        self.dump.mkdir(exist_ok=True)
        self.env = {**env, "DUMP_DIR": str(self.dump), "OMP_NUM_THREADS": "1"}
        self.procs: list[subprocess.Popen] = []

    def start(self, node: int, *args: str, conf: str = CONF, nproc: int = 1,
              script: tuple[str, ...] = ()) -> subprocess.Popen:
        argv = ["--nnodes", self.nnodes, "--nproc-per-node", str(nproc),
                "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.run_id, "--local-addr", f"127.0.0.{node + 2}",
                "--rdzv-conf", conf, "--monitor-interval", "0.1", *args,
                "scripts/rdzv_worker.py", *script]
        proc = start_launcher(TP_RUN, argv, self.env, self.workdir)
        self.procs.append(proc)
        return proc

    def finish(self, timeout: float = HANG_TIMEOUT) -> list[tuple[int, str]]:
        """(exit status, stderr) of every agent, in start order."""
        deadline = time.monotonic() + timeout
        out = []
        try:
            for p in self.procs:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out.append((p.returncode, err))
        finally:
            self.kill()
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()

    def oks(self) -> dict[str, dict[str, str]]:
        return {p.stem: json.loads(p.read_text()) for p in self.dump.glob("ok_*.json")}


@pytest.fixture
def c10d_endpoint() -> str:
    return f"127.0.0.1:{free_port()}"


def endpoint_for(backend: str, etcd_server, c10d_endpoint: str) -> str:
    return etcd_server.endpoint if backend == "etcd" else c10d_endpoint


@pytest.mark.parametrize("backend", ["etcd", "c10d"])
def test_two_nodes_train_together(workdir, test_env, etcd_server, c10d_endpoint, backend):
    """2 agents x 2 workers form one gloo world of 4: node ranks 0/1, node-major global
    ranks, MASTER_ADDR/PORT = the store node rank 0's agent hosts, torchrun's variables."""
    job = Agents(workdir, test_env, backend, endpoint_for(backend, etcd_server, c10d_endpoint),
                 "2")
    for node in range(2):
        job.start(node, nproc=2)
    results = job.finish()
    assert [rc for rc, _ in results] == [0, 0], results
    oks = job.oks()
    assert sorted(oks) == [f"ok_0_{r}" for r in range(4)]
    for rank in range(4):
        env = oks[f"ok_0_{rank}"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
            ("4", "2", "2")
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCHELASTIC_RUN_ID"] == job.run_id
        assert env["MASTER_ADDR"] in ("127.0.0.2", "127.0.0.3")
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in oks.values()}) == 1


@pytest.mark.slow
def test_three_nodes_train_together(workdir, test_env, etcd_server):
    """3 agents over etcd: one world of 3, node ranks 0..2."""
    job = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "3")
    for node in range(3):
        job.start(node)
    results = job.finish()
    assert [rc for rc, _ in results] == [0, 0, 0], results
    oks = job.oks()
    assert sorted(e["GROUP_RANK"] for e in oks.values()) == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in oks.values()} == {"3"}


@pytest.mark.slow
def test_sigkilled_agent_is_noticed_and_the_world_restarts(workdir, test_env, etcd_server):
    """--nnodes 1:2: SIGKILL one agent while the job runs. Its workers die with it; the
    other agent sees its lease expire, stops its workers, re-rendezvouses alone
    (counted: --max-restarts 1) and finishes."""
    job = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "1:2")
    victim = job.start(0, "--max-restarts", "1", script=("--hold-until", "1"))
    job.start(1, "--max-restarts", "1", script=("--hold-until", "1"))
    for rank in range(2):
        wait_for_file(job.dump / f"ok_0_{rank}.json")
    victim.kill()
    results = job.finish()
    assert results[1][0] == 0, results[1][1]
    assert "left (its lease expired)" in results[1][1]
    env = job.oks()["ok_1_0"]
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("1", "1", "0")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd", "c10d"])
def test_worker_failure_on_one_node_restarts_every_node(workdir, test_env, etcd_server,
                                                        c10d_endpoint, backend):
    """Global rank 1 (on one node) exits 3 in attempt 0: both agents restart their
    workers (counted, --max-restarts 1) and the job then succeeds on both."""
    # LOGLEVEL=INFO: restarts are logged at INFO, as torchrun's.
    job = Agents(workdir, {**test_env, "LOGLEVEL": "INFO"}, backend,
                 endpoint_for(backend, etcd_server, c10d_endpoint), "2")
    for node in range(2):
        job.start(node, "--max-restarts", "1", script=("--fail-rank", "1", "--fail-until", "1"))
    results = job.finish()
    assert [rc for rc, _ in results] == [0, 0], results
    assert sorted(job.oks()) == ["ok_0_0", "ok_0_1", "ok_1_0", "ok_1_1"]
    assert all("Worker group FAILED. 1/1 attempts left" in err for _, err in results), results


@pytest.mark.slow
def test_restarts_exhausted_every_node_exits_1_with_summary(workdir, test_env, etcd_server):
    """No restarts left: the failing node and the other one both print the summary
    (the failing node's root cause is its worker) and exit 1."""
    job = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "2")
    for node in range(2):
        job.start(node, script=("--fail-rank", "1"))
    results = job.finish()
    assert [rc for rc, _ in results] == [1, 1], results
    for _, err in results:
        assert SUMMARY in err and "Traceback" not in err
    assert sum("exitcode  : 3 " in err for _, err in results) == 1


@pytest.mark.slow
def test_late_node_is_admitted_by_a_restart(workdir, test_env, etcd_server):
    """--nnodes 1:2: the first agent forms a world of 1 after last_call_timeout; its
    worker waits for a bigger world. A second agent arrives and waits; the first
    restarts to admit it (not counted: --max-restarts 0) and both finish in a world of 2."""
    # LOGLEVEL=INFO: the restart that admits a node is logged at INFO, as torchrun's.
    job = Agents(workdir, {**test_env, "LOGLEVEL": "INFO"}, "etcd", etcd_server.endpoint, "1:2")
    try:
        job.start(0, script=("--min-world", "2"))
        wait_for_file(job.dump / "waiting_0_0")  # a world of 1 formed and runs
        job.start(1, script=("--min-world", "2"))
        results = job.finish()
    finally:
        job.kill()
    assert [rc for rc, _ in results] == [0, 0], results
    oks = job.oks()
    assert sorted(oks) == ["ok_0_0", "ok_0_1"]
    assert {e["WORLD_SIZE"] for e in oks.values()} == {"2"}
    assert "waiting to join; restarting the worker group" in results[0][1]


@pytest.mark.slow
def test_leftovers_of_a_killed_job_do_not_wedge_the_next(workdir, test_env, etcd_server):
    """Both agents of a job SIGKILLed mid-run (keys left in etcd, leases running out);
    a new job with the same --rdzv-id forms its world and finishes."""
    rid = f"job-{uuid.uuid4().hex[:8]}"
    old = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "2", rid)
    for node in range(2):
        old.start(node, script=("--hold-until", "1"))
    for rank in range(2):
        wait_for_file(old.dump / f"ok_0_{rank}.json")
    old.kill()
    assert etcd_server.keys(f"/tp-run/{rid}/")  # the leftovers are there
    for p in old.dump.iterdir():
        p.unlink()
    new = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "2", rid)
    for node in range(2):
        new.start(node)
    results = new.finish()
    assert [rc for rc, _ in results] == [0, 0], results
    assert sorted(new.oks()) == ["ok_0_0", "ok_0_1"]


# ---------------------------------------------------------------- bad input


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tp-run: error: "), err
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd", "c10d"])
def test_unreachable_endpoint_is_one_line_error(workdir, test_env, backend):
    """Nothing listens at the endpoint: one error line within the timeout, exit 1.
    (c10d: is_host=false, or this agent would host the store there itself.)"""
    job = Agents(workdir, test_env, backend, f"127.0.0.1:{free_port()}", "2")
    job.start(0, conf="join_timeout=3,read_timeout=3" + (",is_host=false" * (backend == "c10d")))
    (rc, err), = job.finish(timeout=120)
    assert rc == 1
    line = one_error_line(err)
    assert "cannot reach" in line and "3s" in line


@pytest.mark.slow
def test_nodes_that_never_arrive_is_one_line_error(workdir, test_env, etcd_server):
    """--nnodes 2 and only one agent ever starts: join_timeout, one error line, exit 1."""
    job = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "2")
    job.start(0, conf="join_timeout=3,last_call_timeout=1,keep_alive_interval=0.5")
    (rc, err), = job.finish(timeout=120)
    assert rc == 1
    line = one_error_line(err)
    assert "timed out after 3s (join_timeout)" in line and "1 of the 2 node(s)" in line
    assert not list(job.dump.iterdir())


@pytest.mark.parametrize("conf,mentions", [
    ("keep_alive_interval=abc", "keep_alive_interval"),
    ("keep_alive_interval=5,lease_ttl=2", "lease TTL"),
    ("protocol=ftp", "protocol"),
    ("password=secret", "TP_RUN_ETCD_PASSWORD"),
    ("protocol=https,ca-cert=/etc/ca.pem", "did you mean 'ca_cert'"),
    ("join_timeout=nan", "not a finite number"),
])
def test_bad_rdzv_conf_is_one_line_error(workdir, test_env, etcd_server, conf, mentions):
    """A bad etcd setting: one ``tp-run: error:`` line naming it, exit 2, nothing started."""
    job = Agents(workdir, test_env, "etcd", etcd_server.endpoint, "2")
    job.start(0, conf=conf)
    (rc, err), = job.finish(timeout=120)
    assert rc == 2
    assert mentions in one_error_line(err)


# ---------------------------------------------------------------- stock torchrun


def test_setup_cfg_registers_the_torchrun_handler():
    """setup.cfg declares the etcd-v3 torchrun.handlers entry point, and it loads."""
    import configparser

    from tests.conftest import REPO

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [line.strip() for line in
             cfg["options.entry_points"]["torchrun.handlers"].strip().splitlines()]
    assert lines == [ENTRY_POINT]
    module, func = ENTRY_POINT.split("=", 1)[1].strip().split(":")
    import importlib

    creator = getattr(importlib.import_module(module), func)()
    assert callable(creator)


ENTRY_POINT = "etcd-v3 = rendezvous.torchrun_handler:get_handler"


@pytest.mark.slow
def test_stock_torchrun_with_etcd_v3(workdir, test_env, etcd_server, tmp_path):
    """Plain ``torchrun --rdzv-backend etcd-v3`` (torch's launcher, our handler through
    the torchrun.handlers entry point): 2 agents train together over etcd v3. The entry
    point is put on the path here, so the test does not depend on how tp-run was
    installed."""
    from tests.conftest import TORCHRUN

    dist = tmp_path / "site" / "tp_run_handler_test-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tp-run-handler-test\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(f"[torchrun.handlers]\n{ENTRY_POINT}\n")
    dump = workdir / "dump"
    dump.mkdir()
    env = {**test_env, "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{dist.parent}{os.pathsep}{test_env['PYTHONPATH']}"}
    rid = f"job-{uuid.uuid4().hex[:8]}"
    procs = [start_launcher(TORCHRUN, [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
        "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", rid,
        "--local-addr", f"127.0.0.{node + 2}", "--rdzv-conf", CONF,
        "scripts/rdzv_worker.py"], env, workdir) for node in range(2)]
    try:
        errs = [p.communicate(timeout=HANG_TIMEOUT)[1] for p in procs]
        results = [(p.returncode, err) for p, err in zip(procs, errs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [rc for rc, _ in results] == [0, 0], results
    oks = {p.stem: json.loads(p.read_text()) for p in dump.glob("ok_*.json")}
    assert sorted(oks) == ["ok_0_0", "ok_0_1"]
    assert {e["GROUP_WORLD_SIZE"] for e in oks.values()} == {"2"}
