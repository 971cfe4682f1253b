"""Hang detection: how fast a stopped rank is found, and what the progress marks cost.

    python benchmarks/hang_detection.py [--timeouts 2,5] [--reps 3] [--steps 60] [--params-m 10.5]

Two parts, each interleaved so that the machine's drift hits both sides alike:

* **Detection latency.** ``hang_job.py`` (a small DDP job, 4 ranks, ``--spares 1``)
  stops rank 1 with SIGSTOP at step 20; the agent (``--hang-timeout T``) must find it,
  log its stack, kill it and give its rank to the spare. From the agent's
  ``recovery.jsonl``: *stop -> killed* (the agent saw the culprit's death) against the
  configured T, and *stop -> resumed* (every rank back at work on the same step).
* **Cost of the marks.** ``step_job.py`` (the job of ``step_overhead.py``: an MLP of
  ``--params-m`` M parameters, 2 ranks, DDP over gloo) under ``tp-run --spares 1`` with
  hang and straggler detection on (the default: every worker runs its heartbeat thread
  and writes its commit marks) and off (``--hang-timeout 0 --straggler-factor 0``: no
  heartbeat), ``--reps`` runs each: the median step time of each and their ratio (the
  issue's target: at most 0.5 %). Also, in this process, what one commit mark and one
  heartbeat cost (ns per write to the mapped board).

Compare the columns of one run, not separate runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def detection(timeout: float, tmp: Path) -> tuple[float, float]:
    """(stop -> killed, stop -> resumed) in seconds for one run."""
    out = tmp / f"hang-{timeout}-{time.monotonic_ns()}"
    out.mkdir()
    cmd = [sys.executable, "-m", "tp_launch", "--nproc-per-node", "4", "--spares", "1",
           "--hang-timeout", str(timeout), "--log-dir", str(out / "logs"),
           str(HERE / "hang_job.py"), "--out", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"hang_job failed:\n{proc.stderr[-3000:]}")
    stopped = float((out / "stop_t").read_text())
    (path,) = glob.glob(str(out / "logs" / "*" / "recovery.jsonl"))
    (event,) = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert event["reason"] == "hang", event
    return event["detected_at"] - stopped, event["detected_at"] + event["resumed_s"] - stopped


def step_times(detect: bool, args: argparse.Namespace, out: Path) -> list[float]:
    off = [] if detect else ["--hang-timeout", "0", "--straggler-factor", "0"]
    cmd = [sys.executable, "-m", "tp_launch", "--spares", "1", *off, "--nproc-per-node", "2",
           str(HERE / "step_job.py"), "--mode", "resilient", "--steps", str(args.steps),
           "--params-m", str(args.params_m), "--out", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"step_job failed:\n{proc.stderr[-3000:]}")
    times: list[float] = json.loads(out.read_text())["times"]
    return times


def mark_cost_ns(tmp: Path) -> tuple[float, float]:
    """ns per commit mark and per heartbeat write, on a board in ``tmp``."""
    from tp_launch.progress import ProgressBoard

    board = ProgressBoard(str(tmp / "board"), create=True)
    try:
        n = 200_000
        t0 = time.perf_counter_ns()
        for i in range(n):
            board.commit(3, i, 1.0, 0.1)
        t1 = time.perf_counter_ns()
        for i in range(n):
            board.beat(3, 1.0, i)
        t2 = time.perf_counter_ns()
        return (t1 - t0) / n, (t2 - t1) / n
    finally:
        board.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeouts", default="2,5")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--params-m", type=float, default=10.5)
    args = p.parse_args()
    print(f"(load {os.getloadavg()[0]:.1f} at start)\n")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        timeouts = [float(t) for t in args.timeouts.split(",")]
        found: dict[float, list[tuple[float, float]]] = {t: [] for t in timeouts}
        for _ in range(args.reps):
            for t in timeouts:
                found[t].append(detection(t, tmp))
        print("detection: 4 ranks, rank 1 SIGSTOPped at step 20, medians of "
              f"{args.reps} runs\n")
        print("| --hang-timeout | stop -> killed | / timeout | stop -> resumed |")
        print("|---|---|---|---|")
        for t in timeouts:
            killed = statistics.median(k for k, _ in found[t])
            resumed = statistics.median(r for _, r in found[t])
            print(f"| {t:g} s | {killed:.2f} s | {killed / t:.2f}x | {resumed:.2f} s |")
        on: list[float] = []
        off: list[float] = []
        for rep in range(args.reps):
            on += step_times(True, args, tmp / f"on-{rep}")
            off += step_times(False, args, tmp / f"off-{rep}")
        base = statistics.median(off)
        print(f"\nstep time, {args.params_m} M-parameter MLP, 2 ranks, gloo, {args.steps} "
              f"steps x {args.reps} runs each, interleaved\n")
        print("| detection off (no heartbeat) | detection on (marks + heartbeat) | ratio |")
        print("|---|---|---|")
        print(f"| {base * 1000:.1f} ms | {statistics.median(on) * 1000:.1f} ms | "
              f"{statistics.median(on) / base:.4f}x |")
        commit_ns, beat_ns = mark_cost_ns(tmp)
        beats = 1 / 0.05  # progress.BEAT_S
        print(f"\none commit mark: {commit_ns:.0f} ns ({commit_ns / (base * 1e9):.5%} of a "
              f"step); heartbeat: {beat_ns:.0f} ns x {beats:.0f}/s "
              f"({beat_ns * beats / 1e9:.5%} of a second, plus a thread wake-up each)")
    print(f"\n(load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
