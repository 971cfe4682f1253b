"""examples/slurm/train.sbatch on a real Slurm cluster of emulated hosts (issue 23).

Four emulated hosts (tests/hosts.py): three are Slurm nodes (tests/slurm_cluster.py:
munged, one slurmd per host), the fourth runs etcd and slurmctld and is the login node
every Slurm command runs on. Each test submits the example as the README tells a Slurm
user, a resilient job of 2 nodes x 2 ranks with the
third node as a spare node:

    RDZV_BACKEND=etcd RDZV_ENDPOINT=<etcd>:2379 SPARE_NODES=1 SPARES=1 \\
        sbatch --nodes=3 examples/slurm/train.sbatch scripts/resilient_train.py ...

and ends with the checksum of the same training under torchrun without a failure
(``reference``), the job COMPLETED with exit code 0, and no process of the job left.
Skipped with one line where Slurm or emulated hosts are not available.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from tests.conftest import HANG_TIMEOUT, REPO, RESILIENT_SCRIPT, RESILIENT_STEPS, \
    wait_no_marked

pytestmark = pytest.mark.slow

# Short leases so that a lost agent is noticed in seconds (as tests/test_resilient.py).
RDZV_CONF = ("join_timeout=60,last_call_timeout=1,keep_alive_interval=0.5,lease_ttl=3,"
             "heartbeat_timeout=3")


@pytest.fixture
def slurm(emulated_cluster, tmp_path: Path, test_env) -> Iterator[tuple[Any, Any]]:
    """(SlurmCluster on hosts 0-2, EtcdServer and slurmctld on host 3). Torn down before
    test_env's leak check: a test that fails mid-job leaves its job to the cancel here,
    and only the failure it had is reported (a passing test checks for leftovers itself,
    in finish())."""
    from tests.etcd_server import EtcdServer
    from tests.slurm_cluster import SlurmCluster, cannot_run_slurm

    why = cannot_run_slurm()
    if why:
        pytest.skip(why)
    cluster = emulated_cluster(4, "slurm")
    (tmp_path / "etcd").mkdir()
    with EtcdServer(tmp_path / "etcd", host=cluster.hosts[3]) as etcd, \
            SlurmCluster(cluster, tmp_path, cluster.hosts[:3], cluster.hosts[3]) as slurm_cluster:
        yield slurm_cluster, etcd


def submit(slurm_cluster: Any, etcd: Any, workdir: Path, env: dict[str, str],
           *script_args: str, **settings: str) -> tuple[str, Path, Path]:
    """sbatch the example (3 nodes, one a spare node); returns (job id, $OUT, output)."""
    out = workdir / "out"
    out.mkdir(exist_ok=True)
    job_env = {**env, "RDZV_BACKEND": "etcd", "RDZV_ENDPOINT": etcd.endpoint,
               "SPARE_NODES": "1", "SPARES": "1", "NPROC_PER_NODE": "2",
               "PYTHON": env.get("PYTHON", sys.executable),
               "OUT": str(out), "OMP_NUM_THREADS": "1",
               "PET_RDZV_CONF": RDZV_CONF, "PET_MONITOR_INTERVAL": "0.1", **settings}
    output = workdir / "slurm-%j.out"
    r = slurm_cluster.cmd(["sbatch", "--parsable", "--nodes=3", f"--output={output}",
                           str(REPO / "examples/slurm/train.sbatch"), RESILIENT_SCRIPT,
                           "--steps", str(RESILIENT_STEPS), *script_args],
                          env=job_env, cwd=workdir)
    job_id = r.stdout.strip().split(";")[0]
    return job_id, out, Path(str(output).replace("%j", job_id))


def finish(slurm_cluster: Any, job_id: str, output: Path, marker: str) -> tuple[dict, str]:
    """Wait for the job; return (its record, its output); no process of it may remain."""
    rec = slurm_cluster.wait_job(job_id, HANG_TIMEOUT)
    text = output.read_text(errors="replace") if output.exists() else ""
    left = wait_no_marked(marker)
    assert not left, f"processes of job {job_id} left after it ended: {[p.pid for p in left]}"
    return rec, text


def console(text: str) -> str:
    """tp-run's own lines and errors (the job's output minus library noise)."""
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(("tp-run", "srun", "E", "W", "Traceback")))


def check_result(out: Path, reference: str) -> list[dict]:
    final = [json.loads((out / f"final_{r}.json").read_text()) for r in range(4)]
    assert {f["checksum"] for f in final} == {reference}
    assert all(f["step"] == RESILIENT_STEPS for f in final)
    return final


def entries(out: Path) -> dict[int, list[tuple[int, int]]]:
    """pid -> [(rank, step at entry), ...] for every (re)entry of train()."""
    found: dict[int, list[tuple[int, int]]] = {}
    for f in out.glob("entry_*"):
        lines = [line.split() for line in f.read_text().splitlines() if line]
        found[int(f.name.split("_")[1])] = [(int(w[0]), int(w[1])) for w in lines]
    return found


def held_ranks(slurm_cluster: Any, job_id: str, out: Path, output: Path, deadline: float
               ) -> tuple[dict[int, int], dict[str, set[int]]]:
    """Once the 4 ranks hold (the job pending or running until then, by ``deadline``):
    rank -> the pid that first trained it, and host name -> the ranks it holds."""
    while not all((out / f"held_{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline and slurm_cluster.job(job_id)["JobState"] in (
            "PENDING", "RUNNING"), console(output.read_text(errors="replace"))
        time.sleep(0.2)
    first = {ranks[0][0]: pid for pid, ranks in entries(out).items()}
    on_host = {h.name: set(h.pids()) for h in slurm_cluster.nodes}
    return first, {name: {r for r, pid in first.items() if pid in pids}
                   for name, pids in on_host.items()}


def workers(host: Any) -> set[int]:
    """The host's processes running the training script (ranks and parked spares)."""
    found = set()
    for pid in host.pids():
        try:
            if RESILIENT_SCRIPT in " ".join(psutil.Process(pid).cmdline()):
                found.add(pid)
        except psutil.Error:
            pass
    return found


def test_sbatch_job_survives_a_rank_kill(slurm, workdir, test_env, reference):
    """Rank 1 SIGKILLs itself in DDP's all-reduce: its node's spare takes the rank, the
    Slurm step and job go on (the agents never exit), and the job ends COMPLETED with
    torchrun's failure-free checksum."""
    slurm_cluster, etcd = slurm
    job_id, out, output = submit(slurm_cluster, etcd, workdir, test_env,
                                 "--kill", "1:5:allreduce")
    rec, text = finish(slurm_cluster, job_id, output, test_env["TP_TEST_MARKER"])
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), console(text)
    assert "tp-run: failure: rank(s) [1] -> spare pid" in text, console(text)
    check_result(out, reference)


def test_node_warning_moves_its_ranks_to_the_spare_node(slurm, workdir, test_env,
                                                          reference):
    """A warning for one node, given through Slurm as a step of the job on that node
    (``srun --jobid J --overlap -w NODE tp-run migrate --node``): that node's two ranks
    move to the spare node's parked processes at one step boundary, with no step
    recomputed anywhere; the job ends COMPLETED with torchrun's checksum."""
    slurm_cluster, etcd = slurm
    hosts = slurm_cluster.nodes
    job_id, out, output = submit(slurm_cluster, etcd, workdir, test_env, "--hold-at", "8")
    deadline = time.monotonic() + HANG_TIMEOUT
    first, ranks_on = held_ranks(slurm_cluster, job_id, out, output, deadline)
    assert sorted(len(r) for r in ranks_on.values()) == [0, 2, 2], ranks_on
    spare_node = next(n for n, r in ranks_on.items() if not r)
    warned = next(n for n, r in ranks_on.items() if r and 0 not in r)
    spare_host = next(h for h in hosts if h.name == spare_node)
    python = test_env.get("PYTHON", sys.executable)

    def on_warned(*argv: str) -> Any:  # a step of the job on the warned node
        return slurm_cluster.cmd(["srun", f"--jobid={job_id}", "--overlap",
                                  f"--nodelist={warned}", "-N1", "-n1", python, "-m",
                                  "tp_launch", *argv], env=test_env, cwd=workdir,
                                 timeout=60, check=False)

    # The warned node's agent must know of two processes parked elsewhere (the spare
    # node's, published through the rendezvous every 2 s) before it can move two ranks.
    while True:
        st = on_warned("status", "--json")
        doc = json.loads(st.stdout) if st.returncode == 0 else {}
        if len([p for p in doc.get("parked", []) if p["node"] != doc["node"]]) >= 2:
            break
        assert time.monotonic() < deadline, f"no spare parked elsewhere: {st}"
        time.sleep(0.5)
    migrate = on_warned("migrate", "--node")
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr
    time.sleep(1.0)  # the other node hears of the boundary (etcd watch: milliseconds)
    (out / "release").touch()
    seen = set()  # every training process the spare node runs until the job ends
    while slurm_cluster.job(job_id)["JobState"] in ("RUNNING", "COMPLETING"):
        seen |= workers(spare_host)
        assert time.monotonic() < deadline, "the job did not end"
        time.sleep(0.1)
    rec, text = finish(slurm_cluster, job_id, output, test_env["TP_TEST_MARKER"])
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), console(text)
    final = check_result(out, reference)
    for rank in ranks_on[warned]:
        assert final[rank]["pid"] != first[rank]
        assert final[rank]["pid"] in seen, (rank, seen, console(text))
    reentries = {e[1] for ranks in entries(out).values() for e in ranks if e[1] > 0}
    assert len(reentries) == 1, entries(out)  # one boundary, nothing recomputed


def test_a_job_wide_warning_stops_the_job(slurm, workdir, test_env):
    """Slurm's own warning, ``scancel --signal=USR1`` (as ``--signal=USR1@N`` sends it),
    reaches every node's task at once, with ``ON_PREEMPT=migrate``: the spare node's
    processes leave the pool and each training node, finding no spare elsewhere, stops
    the job with one line, every time (the spare node is going away too: moving ranks
    onto it would only race its drain). The job ends FAILED with exit 1 at once, its
    workers stopped without waiting out the shutdown timeout, none left."""
    slurm_cluster, etcd = slurm
    job_id, out, output = submit(slurm_cluster, etcd, workdir, test_env, "--hold-at", "8",
                                 ON_PREEMPT="migrate")
    deadline = time.monotonic() + HANG_TIMEOUT
    _, ranks_on = held_ranks(slurm_cluster, job_id, out, output, deadline)
    spare_host = next(h for h in slurm_cluster.nodes if not ranks_on[h.name])
    while len(workers(spare_host)) < 3:  # its agent and both parked processes
        assert time.monotonic() < deadline, f"{spare_host.name} parks nothing"
        time.sleep(0.2)
    slurm_cluster.cmd(["scancel", "--signal=USR1", job_id])
    time.sleep(1.0)
    (out / "release").touch()  # a job that went on would now finish: it must not
    rec, text = finish(slurm_cluster, job_id, output, test_env["TP_TEST_MARKER"])
    assert (rec["JobState"], rec["ExitCode"]) == ("FAILED", "1:0"), console(text)
    lines = [x for x in text.splitlines() if x.startswith("tp-run: ")]
    assert sorted(lines) == sorted(
        f"tp-run: error: preemption notice (SIGUSR1): no spare parked on another node for "
        f"rank(s) {sorted(r)}; stopping the job (its ranks stop now: the script's last "
        "checkpoint is where a restart resumes)" for r in ranks_on.values() if r), lines
    assert "did not stop within" not in text, console(text)
    assert not list(out.glob("final_*.json")), "a rank finished training after the warning"


def test_a_whole_host_killed_mid_job(slurm, workdir, test_env, reference):
    """Every process of a training host dies at once (its slurmd, slurmstepd, agent and
    workers: SIGKILL, as a power loss that the kernel reports to the peers). The other
    node's agent sees the lost one's agent connection close (tp_launch.agent.links) and
    moves its two ranks to the spare node; Slurm marks the host DOWN and, the job being --no-kill, leaves the job and
    its step running; the job ends with torchrun's checksum. (Not the batch host: the
    batch script, and srun, run there; losing it ends any Slurm job.)"""
    slurm_cluster, etcd = slurm
    hosts = slurm_cluster.nodes
    job_id, out, output = submit(slurm_cluster, etcd, workdir, test_env, "--hold-at", "8")
    deadline = time.monotonic() + HANG_TIMEOUT
    first, ranks_on = held_ranks(slurm_cluster, job_id, out, output, deadline)
    spare_host = next(h for h in hosts if not ranks_on[h.name])
    victim = next(h for h in hosts[1:] if ranks_on[h.name])
    while len(workers(spare_host)) < 3:
        assert time.monotonic() < deadline, f"{spare_host.name} parks nothing"
        time.sleep(0.2)
    victim.kill()
    (out / "release").touch()
    deadline = time.monotonic() + 90
    seen = set()
    while slurm_cluster.job(job_id)["JobState"] in ("RUNNING", "COMPLETING"):
        seen |= workers(spare_host)
        assert time.monotonic() < deadline, (
            f"the job did not end: {slurm_cluster.node_states()} "
            f"{slurm_cluster.job(job_id)}\n{console(output.read_text(errors='replace'))}")
        time.sleep(0.1)
    rec, text = finish(slurm_cluster, job_id, output, test_env["TP_TEST_MARKER"])
    assert f"tp-run: node loss: rank(s) {sorted(ranks_on[victim.name])}" in text, console(text)
    final = check_result(out, reference)
    assert all(final[r]["pid"] in seen for r in ranks_on[victim.name]), console(text)
    assert slurm_cluster.node_states()[victim.name].startswith("down"), \
        slurm_cluster.node_states()
    assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), (rec, console(text))
