"""Resilient mode's cost per failure-free step, against plain DDP under torchrun.

    python benchmarks/step_overhead.py [--ranks 2,4] [--reps 5] [--steps 60] [--params-m 10.5]

The same DDP job (``step_job.py``: a 10.5 M-parameter MLP, SGD with momentum, gloo)
runs, interleaved, as

* ``torchrun``, a plain DDP script (the baseline);
* ``tp-run --spares 1``, the same loop through resilient mode: ``for step in
  state.steps(n)`` commits each iteration (restore point, progress board, generation
  check), a spare is parked beside the ranks, DDP's own all-reduce: **exact mode**;
* ``tp-run --spares 1`` with ``ordered_allreduce_hook``, the way earlier versions
  got exact results (all-gather and sum in rank order).

For each world size the table gives the median step time of each (rank 0, after a
warm-up, over all repetitions) and its ratio to the baseline's. Runs alternate, so the
machine's drift hits all alike; compare ratios, not absolute times. The last column is
what tp-run's loop itself takes per step in exact mode (the commit: from the end of one
iteration's body to the start of the next, median), timed inside the same runs: the
part of the overhead that the machine's noise cannot hide or inflate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = {"torchrun (plain DDP)": "plain", "tp-run exact": "resilient",
         "tp-run + ordered hook": "ordered"}


def run(mode: str, world: int, args: argparse.Namespace, out: Path) -> dict[str, list[float]]:
    launcher = [sys.executable, "-m", "torch.distributed.run"] if mode == "plain" else \
        [sys.executable, "-m", "tp_launch", "--spares", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [*launcher, "--nproc-per-node", str(world), str(HERE / "step_job.py"), "--mode", mode,
           "--steps", str(args.steps), "--params-m", str(args.params_m), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, list[float]] = json.loads(out.read_text())
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--params-m", type=float, default=10.5)
    args = p.parse_args()
    load = os.getloadavg()[0]
    print(f"step time, {args.params_m} M-parameter MLP, gloo, {args.steps} steps x "
          f"{args.reps} runs each, interleaved (load {load:.1f} at start)\n")
    print("| ranks | " + " | ".join(MODES) + " | tp-run's commit per step |")
    print("|---" * (len(MODES) + 2) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.ranks.split(",")):
            times: dict[str, list[float]] = {m: [] for m in MODES.values()}
            commit: list[float] = []
            for rep in range(args.reps):
                for mode in MODES.values():
                    result = run(mode, world, args, Path(tmp) / f"{mode}-{world}-{rep}")
                    times[mode] += result["times"]
                    if mode == "resilient":
                        commit += result["boundary"]
            base = statistics.median(times["plain"])
            cells = [f"{statistics.median(times[m]) * 1000:.1f} ms "
                     f"({statistics.median(times[m]) / base:.3f}x)" for m in MODES.values()]
            cells.append(f"{statistics.median(commit) * 1000:.2f} ms "
                         f"({statistics.median(commit) / base:.2%} of a step)")
            print(f"| {world} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n(load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
