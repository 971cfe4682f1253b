"""Resilient mode's cost per failure-free step, against plain DDP under torchrun.

    python benchmarks/step_overhead.py [--ranks 2,4] [--reps 5] [--steps 60] [--params-m 10.5]
                                       [--modes exact[,ordered]]

The same DDP job (``step_job.py``: a 10.5 M-parameter MLP, SGD with momentum, gloo)
runs, alternately, run by run, as

* ``torchrun``, a plain DDP script (the baseline);
* ``tp-run --spares 1``, the same loop through resilient mode: ``for step in
  state.steps(n)`` commits each iteration (restore point, progress board, generation
  check), a spare is started beside the ranks and parks, DDP's own all-reduce: **exact
  mode** (``--modes exact``, the default);
* with ``--modes exact,ordered``, also ``tp-run --spares 1`` with
  ``ordered_allreduce_hook``, the way earlier versions got exact results.

A pair is one torchrun run and the tp-run run(s) right after it. For each world size
and each of two windows of rank 0's step times, the table gives the median step time of
each launcher (over all its runs) and the ratio tp-run / torchrun of each pair's
medians: its median over the pairs and its spread (min-max), against the aim of 1.02x:

* **from step 3**: every step from the fourth on, the window in which tp-run's spare
  starts (a few CPU-seconds, once per job, beside the ranks) included;
* **steady**: tp-run's steps after its spare has parked (rank 0 watches the agent's
  status; the header says when it parked, median), torchrun's after ``--warmup`` steps.

The last column is what tp-run's loop itself takes per step in exact mode (the commit:
from the end of one iteration's body to the start of the next, median over the steady
steps), timed inside the same runs: the part of the overhead that the machine's noise
cannot hide or inflate. Runs alternate, so the machine's drift hits both alike; compare
ratios within one run, not absolute times or separate runs. The defaults (2 and 4
ranks, 5 pairs of 60 steps) take about 10 minutes on a 2-core machine.
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
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# --modes name -> (step_job.py mode, the table's name)
TP_MODES = {"exact": ("resilient", "tp-run exact"), "ordered": ("ordered", "tp-run + ordered hook")}
FIRST = 3  # the "from step 3" window's first step (0-based)
AIM = 1.02


def run(mode: str, world: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    launcher = [sys.executable, "-m", "torch.distributed.run"] if mode == "plain" else \
        [sys.executable, "-m", "tp_launch", "--spares", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [*launcher, "--nproc-per-node", str(world), str(HERE / "step_job.py"), "--mode", mode,
           "--steps", str(args.steps), "--params-m", str(args.params_m), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def steady_from(result: dict[str, Any], warmup: int) -> Optional[int]:
    """The first step of a run's steady window: after the warm-up and, under tp-run, the
    step in which rank 0 saw the spare parked; None if it never saw it."""
    if result["mode"] == "plain":
        return warmup
    parked = result.get("parked")
    return None if parked is None else max(warmup, parked + 1)


def spread(ratios: list[float]) -> str:
    if not ratios:
        return "? (no pair)"
    med = statistics.median(ratios)
    return (f"{med:.3f}x ({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs): "
            f"{'met' if med <= AIM else 'missed'}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--reps", type=int, default=5, help="pairs per world size")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="torchrun's steps left out of "
                   "the steady window")
    p.add_argument("--params-m", type=float, default=10.5)
    p.add_argument("--modes", default="exact",
                   help="tp-run modes, comma-separated: exact, ordered (ordered: the "
                   "ordered all-reduce hook, slow)")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in TP_MODES for m in modes):
        p.error(f"--modes: a comma-separated list of {', '.join(TP_MODES)}")
    load = os.getloadavg()[0]
    print(f"step time, {args.params_m} M-parameter MLP, gloo, {args.steps} steps, "
          f"{args.reps} pairs of runs (torchrun, then tp-run --spares 1) per world size, "
          f"alternating (load {load:.1f} at start); ratios: each pair's medians, then "
          f"median (min-max) over the pairs; aim: within {AIM}x\n")
    cols = ["ranks", "window", "torchrun (plain DDP)"]
    for m in modes:
        cols += [TP_MODES[m][1], f"{TP_MODES[m][1]} / torchrun per pair"]
    cols.append("tp-run's commit per step (steady)")
    print("| " + " | ".join(cols) + " |")
    print("|---" * len(cols) + "|")
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.ranks.split(",")):
            pairs: list[dict[str, dict[str, Any]]] = []
            for rep in range(args.reps):
                pair = {}
                for mode in ["plain", *(TP_MODES[m][0] for m in modes)]:
                    pair[mode] = run(mode, world, args, Path(tmp) / f"{mode}-{world}-{rep}")
                pairs.append(pair)
            windows: dict[str, dict[str, list[list[float]]]] = {"from step 3": {}, "steady": {}}
            commit: list[float] = []
            for pair in pairs:
                for mode, result in pair.items():
                    windows["from step 3"].setdefault(mode, []).append(result["times"][FIRST:])
                    start = steady_from(result, args.warmup)
                    steady = [] if start is None else result["times"][start:]
                    windows["steady"].setdefault(mode, []).append(steady)
                    if mode == "resilient" and start is not None:
                        commit += result["boundary"][start:]
            parked = [pair[TP_MODES[m][0]].get("parked") for pair in pairs for m in modes]
            seen = [x for x in parked if x is not None]
            notes.append(f"{world} ranks: rank 0 first saw tp-run's spare parked as step "
                         + (f"{statistics.median(seen):.0f} began (0-based, median; "
                            f"{min(seen)}-{max(seen)})" if seen else "? began (never)")
                         + (f", not by the end in {len(parked) - len(seen)} of {len(parked)} "
                            f"runs (left out of the steady window)" if len(seen) < len(parked)
                            else "") + f" of {args.steps}")
            for name, runs in windows.items():
                base = runs["plain"]
                cells = [str(world), name, _median_ms(base)]
                for m in modes:
                    mine = runs[TP_MODES[m][0]]
                    ratios = [statistics.median(a) / statistics.median(b)
                              for a, b in zip(mine, base) if a and b]
                    cells += [_median_ms(mine), spread(ratios)]
                if name == "steady" and "exact" in modes and commit:
                    c = statistics.median(commit)
                    plain = [t for ts in base for t in ts]
                    cells.append(f"{c * 1000:.2f} ms ({c / statistics.median(plain):.2%} of "
                                 f"a step)")
                else:
                    cells.append("")
                print("| " + " | ".join(cells) + " |", flush=True)
    print("\n" + "\n".join(notes))
    print(f"(load {os.getloadavg()[0]:.1f} at the end)")


def _median_ms(runs: list[list[float]]) -> str:
    """Median step of all the runs' windows together."""
    steps = [t for ts in runs for t in ts]
    return f"{statistics.median(steps) * 1000:.1f} ms" if steps else "?"


if __name__ == "__main__":
    main()
