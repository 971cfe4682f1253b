"""Jobs over emulated hosts (tests/hosts.py): whole hosts killed, cut off, slowed, returning.

Each test runs etcd on a host of its own and one tp-run agent per emulated host, with
DEFAULT timeouts (no --rdzv-conf lease_ttl: the resilient defaults are under test), 2
ranks per host, --nnodes 2 and a third agent started with the other two (the world forms
with the first two to join: the third is a spare node). Every job ends with torchrun's
failure-free checksum (the session's ``reference``) or fails loudly, and no process is
left in any host. Times are printed (``-s``), asserted only against hangs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import HANG_TIMEOUT, RESILIENT_SCRIPT, RESILIENT_STEPS, TP_RUN
from tests.hosts import Cluster, HostAgent as Agent

pytestmark = pytest.mark.slow

# A node's loss is acted on well within this; the tests assert it against hangs only
# (timings are printed, never asserted tightly).
RECOVERED_WITHIN = 60.0


def wait_until(cond, what: str, timeout: float = HANG_TIMEOUT, job: "Job | None" = None
               ) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what + ("" if job is None else job.dump()))
        time.sleep(0.05)


class Job:
    """etcd on ``cluster.hosts[0]``; ``start(i)`` starts the agent of host ``i``."""

    def __init__(self, cluster: Cluster, workdir: Path, env: dict[str, str], etcd) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.out = workdir / "out"
        self.out.mkdir()
        self.env = {**env, "OUT": str(self.out), "OMP_NUM_THREADS": "1"}
        self.etcd = etcd
        self.run_id = f"hosts-{uuid.uuid4().hex[:8]}"
        self.agents: dict[int, Agent] = {}

    def start(self, i: int, *args: str, script_args: tuple[str, ...] = ("--hold-at", "8")
              ) -> Agent:
        host = self.cluster.hosts[i]
        argv = [*TP_RUN, "--nnodes", "2", "--nproc-per-node", "2", "--spares", "1",
                "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoint,
                "--rdzv-id", self.run_id, "--local-addr", host.addr,
                "--monitor-interval", "0.1", "--log-dir", str(self.workdir / f"logs{i}"),
                *args, RESILIENT_SCRIPT, "--steps", str(RESILIENT_STEPS), *script_args]
        self.agents[i] = Agent(host, argv, self.env, self.workdir)
        return self.agents[i]

    def dump(self) -> str:
        """Every agent's stderr tail, for a failure's message."""
        return "".join(f"\n--- {a.host.name} (exit {a.proc.poll()}):\n{a.stderr[-3000:]}"
                       for a in self.agents.values())

    def index(self, agent: Agent) -> int:
        return next(i for i, a in self.agents.items() if a is agent)

    def held(self) -> bool:
        return all((self.out / f"held_{r}").exists() for r in range(4))

    def release(self) -> None:
        (self.out / "release").touch()

    def finals(self) -> list[dict]:
        return [json.loads((self.out / f"final_{r}.json").read_text()) for r in range(4)]

    def recoveries(self, i: int) -> list[dict]:
        return [json.loads(line) for f in (self.workdir / f"logs{i}").glob("*/recovery.jsonl")
                for line in f.read_text().splitlines() if line]


@pytest.fixture
def job(emulated_cluster, workdir, test_env) -> Iterator[Job]:
    """4 emulated hosts: host0 runs etcd, hosts 1-3 one agent each. Every agent and etcd
    are gone after the test (each test checks its hosts' namespaces are empty)."""
    from tests.etcd_server import EtcdServer

    cluster = emulated_cluster(4, "job")
    (workdir / "etcd-dir").mkdir()
    with EtcdServer(workdir / "etcd-dir", host=cluster.hosts[0]) as etcd:
        j = Job(cluster, workdir, test_env, etcd)
        try:
            yield j
        finally:
            for a in j.agents.values():
                if a.proc.poll() is None:
                    a.proc.kill()
                    a.proc.wait()
    for h in cluster.hosts[1:]:
        h.kill()  # a cut host's agent, whose workers may outlive it a moment


def start_world(job: Job, script_args: tuple[str, ...] = ("--hold-at", "8")
                ) -> tuple[Agent, Agent, Agent]:
    """Three agents at once on hosts 1-3: the first two to join train (held at step 8),
    the third is a spare node (--nnodes 2: the world formed without it), its processes
    parked. Returns (the agent holding rank 0, the other world node, the spare node)."""
    agents = [job.start(i, script_args=script_args) for i in (1, 2, 3)]
    wait_until(job.held, "4 ranks train", 90, job=job)
    wait_until(lambda: sum(bool(a.ranks()) for a in agents) == 2 and
               all(a.parked() >= (1 if a.ranks() else 2) for a in agents),
               "2 nodes hold the ranks and park a spare; the spare node parks 2", job=job)
    world = [a for a in agents if a.ranks()]
    (spare,) = [a for a in agents if not a.ranks()]
    first, second = sorted(world, key=lambda x: 0 in x.ranks(), reverse=True)
    return first, second, spare


def resumed_after(job: Job, t0: float, *agents: Agent) -> float:
    """Seconds from ``t0`` to the first agent's account of the node loss (it is printed
    once the ranks resumed training)."""
    def when() -> float | None:
        times = [t for a in agents if (t := a.first("tp-run: node loss", t0)) is not None]
        return min(times) if times else None

    wait_until(lambda: when() is not None, "the node loss is acted on", RECOVERED_WITHIN,
               job=job)
    t = when()
    assert t is not None
    return t - t0


def assert_completed(job: Job, reference: str, agents: list[Agent]) -> None:
    for a in agents:
        rc = a.wait(HANG_TIMEOUT)
        assert rc == 0, a.stderr[-4000:]
    final = job.finals()
    assert {r["checksum"] for r in final} == {reference}, final
    assert all(r["step"] == RESILIENT_STEPS for r in final)
    for a in agents:
        assert a.host.pids() == [], f"{a.host.name}: processes left {a.host.pids()}"


def test_host_killed_moves_its_ranks_to_the_spare_host(job, reference):
    """Every process of the host holding ranks 2 and 3 SIGKILLed at once: the spare host's
    processes take both ranks, the survivors keep theirs, torchrun's checksum."""
    survivor, victim, spare = start_world(job)
    moved, kept = victim.ranks(), dict(survivor.status().ranks)
    t0 = time.monotonic()
    victim.host.kill()
    job.release()
    print(f"kill -> resumed: {resumed_after(job, t0, survivor, spare):.2f} s")
    assert_completed(job, reference, [survivor, spare])
    assert {r: job.finals()[r]["pid"] for r in kept} == kept  # survivors keep their process
    (event,) = job.recoveries(job.index(spare))
    assert event["reason"] == "node loss" and sorted(event["failed_ranks"]) == sorted(moved)
    # Seen through its agent's link (its kernel closed the sockets), not its lease.
    assert "lost (agent gone)" in survivor.stderr, survivor.stderr[-3000:]


def test_host_cut_off_is_replaced_within_seconds(job, reference):
    """The link of the host holding ranks 2 and 3 goes down (no RST, no FIN: its
    processes run on, cut off): with the default settings its lease expires within
    seconds, the spare host takes its ranks, the survivors blocked in gloo against it are
    released (their connections to it shut), torchrun's checksum. The time from the cut
    to the resumed training is printed (goal: 5 s)."""
    survivor, victim, spare = start_world(job)
    moved, kept = victim.ranks(), dict(survivor.status().ranks)
    t0 = time.monotonic()
    victim.host.cut()
    job.release()  # the survivors' next collective waits for the vanished ranks
    print(f"vanish -> resumed: {resumed_after(job, t0, survivor, spare):.2f} s")
    assert_completed(job, reference, [survivor, spare])
    assert {r: job.finals()[r]["pid"] for r in kept} == kept  # survivors keep their process
    (event,) = job.recoveries(job.index(spare))
    assert event["reason"] == "node loss" and sorted(event["failed_ranks"]) == sorted(moved)
    # A vanished host closes nothing: its lease tells.
    assert "lost (lease expired)" in survivor.stderr, survivor.stderr[-3000:]


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def no_node_loss(*agents: Agent) -> None:
    for a in agents:
        assert "node loss" not in a.stderr and "lost (" not in a.stderr, \
            f"{a.host.name} took a live node for lost:\n{a.stderr[-4000:]}"


def test_slow_host_and_etcd_cut_off_are_no_node_loss(job, reference):
    """No false alarm. (1) A host merely slow: its ranks SIGSTOPped for 5 s (a GC pause,
    a long step; longer than the 3 s lease) while a CPU hog spins on every core of the
    machine in its namespace: its agent's keep-alive goes on, nobody is taken for lost.
    (2) Then etcd's own host is cut off for 10 s (every lease expires there; each agent
    comes back at its own time) while the ranks train: nobody is taken for lost either.
    Every rank keeps its process; torchrun's checksum."""
    # Steps slow enough that the ranks train through the etcd cut.
    a, b = job.start(1, script_args=("--hold-at", "8", "--step-sleep", "0.75")), \
        job.start(2, script_args=("--hold-at", "8", "--step-sleep", "0.75"))
    wait_until(job.held, "4 ranks train", 90, job=job)
    slow = next(x for x in (a, b) if 2 in x.ranks())
    status = slow.status()
    assert status is not None
    first = {**a.status().ranks, **b.status().ranks}
    stopped = list(status.ranks.values())
    hogs = [slow.host.popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 2)]
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        job.release()
        time.sleep(5)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for hog in hogs:
            hog.kill()
            hog.wait()
    no_node_loss(a, b)
    etcd_host = job.cluster.hosts[0]
    etcd_host.cut()
    try:
        time.sleep(10)
    finally:
        etcd_host.restore()
    assert_completed(job, reference, [a, b])
    no_node_loss(a, b)
    assert {r: f["pid"] for r, f in enumerate(job.finals())} == first
    assert not job.recoveries(1) and not job.recoveries(2)


def test_partitioned_host_returns_out_of_the_job(job, reference):
    """A host cut off for 10 s, then back, while the others are held at step 8 (so the
    return is mid-job whatever the timing): they moved its ranks to the spare host within
    seconds (the spare host holds them); back, it finds its generation stale (its lease
    expired), stops its workers while the job still runs, and publishes nothing: after
    the release the job ends with exactly the one node-loss generation, no rank of the
    returning host writes a result, its agent exits, torchrun's checksum."""
    survivor, victim, spare = start_world(job)
    moved = victim.ranks()
    old_pids = set(victim.status().ranks.values())
    t0 = time.monotonic()
    victim.host.cut()
    wait_until(lambda: spare.ranks() == moved, "the spare host takes the cut-off host's "
               "ranks", RECOVERED_WITHIN, job=job)
    print(f"partition -> the spare host holds the ranks: {time.monotonic() - t0:.2f} s")
    time.sleep(max(0.0, t0 + 10 - time.monotonic()))
    victim.host.restore()
    t_back = time.monotonic()
    wait_until(lambda: not any(map(pid_alive, old_pids)), "the returning host stops its "
               "workers", 40, job=job)
    print(f"the returning host stopped its workers {time.monotonic() - t_back:.1f} s after "
          "its return")
    assert survivor.proc.poll() is None and spare.proc.poll() is None  # mid-job
    assert victim.ranks() == set()
    job.release()
    assert_completed(job, reference, [survivor, spare])
    final = job.finals()
    assert not {final[r]["pid"] for r in moved} & old_pids, "a fenced rank wrote a result"
    rc = victim.wait(60)
    print(f"the returning host's agent: exit {rc}")
    assert rc == 0, victim.stderr[-3000:]
    assert victim.host.pids() == []
    # One generation after the start's: the returning host published none.
    for i in (job.index(survivor), job.index(spare)):
        (event,) = job.recoveries(i)
        assert event["reason"] == "node loss" and event["generation"] == 2
        assert sorted(event["failed_ranks"]) == sorted(moved)
