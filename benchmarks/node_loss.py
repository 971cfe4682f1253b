"""Node loss over emulated hosts: a host killed or cut off -> training resumed, and false alarms.

    python benchmarks/node_loss.py [--hosts 2,3] [--reps N] [--hog-s S]

Needs root and iproute2's ``ip`` (the hosts are network namespaces: ``tests/hosts.py``).
For each world of H hosts (2 ranks each, ``--nnodes H``, ``--spares 1``), one more host
as spare node and etcd on a host of its own, the job (``tests/scripts/resilient_train.py``)
trains to step 8 and holds; then the world's last host (never the decider's) is

- **kill**ed: every process in it SIGKILLed (its sockets close, its lease stays), or
- **vanish**es: its link goes down (nothing closes; its processes run on, cut off),

and the job is released. Each case runs, interleaved, with tp-run's defaults (the
agents' links, :mod:`tp_launch.agent.links`, and resilient mode's 3 s lease), without
the links (``TP_RUN_AGENT_LINKS=0``: the lease alone), and with neither
(``TP_RUN_AGENT_LINKS=0 --rdzv-conf lease_ttl=30``: the lease-TTL path as it was before
issue 23). Columns: from the failure to training resumed (the first step committed after
it), split with the spare node's ``recovery.jsonl``: detect (failure -> the decider saw
the lease gone), decide, group (new group formed), transfer (agreement + state to the
newcomers), first step. Medians over ``--reps``.

False alarms: a job of 2 hosts trains for ``--hog-s`` seconds while a CPU hog spins on
every core in one host's namespace (its ranks slowed, its agent with them), with the
default 3 s lease; the count of node losses declared (should be 0).

On a shared machine compare the columns of one run, not separate runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from tests.etcd_server import EtcdServer  # noqa: E402
from tests.hosts import Cluster, Host, HostAgent as Agent, cannot_emulate  # noqa: E402

TP_RUN = [sys.executable, "-m", "tp_launch"]
SCRIPT = "scripts/resilient_train.py"
STEPS = 24
TIMEOUT = 240.0


def wait(cond, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


class Job:
    def __init__(self, cluster: Cluster, etcd: EtcdServer, world: int, conf: str,
                 script_args: list[str], steps: int = STEPS, links: bool = True) -> None:
        self.steps = steps
        self.dir = Path(tempfile.mkdtemp(prefix="tp-node-loss-"))
        shutil.copytree(REPO / "tests" / "scripts", self.dir / "scripts")
        self.out = self.dir / "out"
        self.out.mkdir()
        self.env = dict(os.environ, OUT=str(self.out), OMP_NUM_THREADS="1")
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.env["TP_RUN_AGENT_LINKS"] = "1" if links else "0"
        self.cluster, self.etcd, self.world = cluster, etcd, world
        self.conf, self.script_args = conf, script_args
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.agents: dict[int, Agent] = {}

    def start(self, i: int) -> Agent:
        host = self.cluster.hosts[i]
        argv = [*TP_RUN, "--nnodes", str(self.world), "--nproc-per-node", "2", "--spares", "1",
                "--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoint,
                "--rdzv-id", self.run_id, "--local-addr", host.addr,
                "--monitor-interval", "0.1", "--log-dir", str(self.dir / f"logs{i}"),
                *(["--rdzv-conf", self.conf] if self.conf else []),
                SCRIPT, "--steps", str(self.steps), *self.script_args]
        self.agents[i] = Agent(host, argv, self.env, self.dir)
        return self.agents[i]

    def held(self) -> bool:
        return all((self.out / f"held_{r}").exists() for r in range(2 * self.world))

    def recoveries(self, i: int) -> list[dict]:
        return [json.loads(line) for f in (self.dir / f"logs{i}").glob("*/recovery.jsonl")
                for line in f.read_text().splitlines() if line]

    def finish(self, lost: Host | None = None) -> set[str]:
        """Wait for every agent but the ``lost`` host's (cut off, it may wait long for
        etcd); the checksums the ranks ended with."""
        for a in self.agents.values():
            if a.host is lost:
                continue
            try:
                a.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                a.proc.kill()
                a.proc.wait()
        sums = set()
        for r in range(2 * self.world):
            path = self.out / f"final_{r}.json"
            sums.add(json.loads(path.read_text())["checksum"] if path.exists() else "missing")
        return sums

    def close(self) -> None:
        for a in self.agents.values():
            if a.proc.poll() is None:
                a.proc.kill()
                a.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


# name -> (--rdzv-conf, agent links)
VARIANTS = {"default (links, 3 s lease)": ("", True),
            "3 s lease, no links": ("", False),
            "30 s lease, no links": ("lease_ttl=30", False)}


def one_loss(cluster: Cluster, etcd: EtcdServer, world: int, how: str, conf: str,
             links: bool) -> dict[str, float]:
    """One job: the world's last host killed or cut off; the phases in seconds."""
    job = Job(cluster, etcd, world, conf, ["--hold-at", "8"], links=links)
    try:
        for i in range(1, world + 1):
            job.start(i)
        wait(job.held, "the world trains")
        spare_i = world + 1
        spare = job.start(spare_i)
        wait(lambda: (s := spare.status()) is not None and len(s.parked_spares) >= 2,
             "the spare node parks")
        victim = cluster.hosts[world]
        t_wall = time.time()
        if how == "kill":
            victim.kill()
        else:
            victim.cut()
        (job.out / "release").touch()
        wait(lambda: job.recoveries(spare_i), "the spare node takes the ranks")
        (event,) = job.recoveries(spare_i)[:1]
        detect = event["detected_at"] - t_wall
        sums = job.finish(lost=victim)
        if len(sums) != 1 or "missing" in sums:
            raise RuntimeError(f"{how}: the job did not end with one checksum: {sums}")
        return {"detect": detect, "decide": event["decide_s"],
                "group": event["handoff_s"] + event["rebuild_s"],
                "transfer": event["agree_s"] + event["transfer_s"] + event["verify_s"],
                "first step": event["first_step_s"], "total": detect + event["total_s"]}
    finally:
        job.close()
        cluster.hosts[world].restore()
        for h in cluster.hosts[1:]:
            h.kill()


def false_alarms(cluster: Cluster, etcd: EtcdServer, seconds: float) -> int:
    steps = max(10, int(seconds / 0.2))
    job = Job(cluster, etcd, 2, "", ["--step-sleep", "0.2"], steps)
    hogs: list[subprocess.Popen] = []
    try:
        a, b = job.start(1), job.start(2)
        wait(lambda: (job.out / "held_0").exists() or any(job.out.glob("entry_*")),
             "the job trains")
        hogs = [cluster.hosts[2].popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)]
        job.finish()
        return a.count("tp-run: node loss") + b.count("tp-run: node loss") + \
            a.count(" lost (") + b.count(" lost (")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        job.close()
        for h in cluster.hosts[1:]:
            h.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="2,3", help="world sizes in hosts")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--hog-s", type=float, default=20.0)
    args = p.parse_args()
    # SIGTERM (timeout, a CI's cancel) as an exit: the hosts and their processes go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = cannot_emulate()
    if why:
        sys.exit(f"node_loss.py: {why}")
    worlds = [int(x) for x in args.hosts.split(",")]
    load0 = os.getloadavg()
    rows: list[tuple[str, dict[str, dict[str, float]]]] = []
    alarms = 0
    with Cluster(max(worlds) + 2, "bench") as cluster, \
            EtcdServer(Path(tempfile.mkdtemp(prefix="tp-node-loss-etcd-")),
                       host=cluster.hosts[0]) as etcd:
        for world in worlds:
            for how in ("kill", "vanish"):
                runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
                for _ in range(args.reps):  # interleaved: the same load for each
                    for variant, (conf, links) in VARIANTS.items():
                        runs[variant].append(one_loss(cluster, etcd, world, how, conf,
                                                      links))
                med = {v: {k: statistics.median(x[k] for x in r) for k in r[0]}
                       for v, r in runs.items()}
                rows.append((f"{world} hosts, {how}", med))
                print(f"{world} hosts, {how}: " + ", ".join(
                    f"{v} {m['total']:.2f} s" for v, m in med.items()), file=sys.stderr)
        alarms = false_alarms(cluster, etcd, args.hog_s)
    load1 = os.getloadavg()
    print(f"load average {load0[0]:.1f} -> {load1[0]:.1f}; medians of {args.reps} run(s), "
          "seconds\n")
    phases = ["detect", "decide", "group", "transfer", "first step", "total"]
    print("| case | how the loss is seen | " + " | ".join(phases) + " | total / default |")
    print("|---|---|" + "---|" * (len(phases) + 1))
    for name, med in rows:
        default = med[next(iter(VARIANTS))]["total"]
        for variant, m in med.items():
            print(f"| {name} | {variant} | " + " | ".join(f"{m[k]:.2f}" for k in phases) +
                  f" | {m['total'] / default:.1f}x |")
    print(f"\nfalse alarms under a CPU hog on every core of one host, {args.hog_s:g} s of "
          f"training, default lease: {alarms}")


if __name__ == "__main__":
    main()
