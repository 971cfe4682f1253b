"""What buddy copies of sharded state cost, and how fast a plain-FSDP rank comes back.

    python benchmarks/shard_copies.py [--shard-mb 100] [--reps 3] [--steps 30] [--every 10]

The same plain-FSDP job (``fsdp_job.py``: an MLP under FSDP2, AdamW, gloo, 2 ranks, each
rank's shard of the parameters and moments about ``--shard-mb``) runs, interleaved,

* under ``torchrun`` (the baseline);
* under ``tp-run --spares 1`` through resilient mode (``State(build=...)``), no copies;
* the same with ``--shard-copy-every 1`` (a copy of every committed step: a failure
  recomputes at most the step in flight);
* the same with ``--shard-copy-every K`` (``--every``).

The table gives each one's median and mean step time (rank 0, after the warm-up, every
repetition) and their ratios to torchrun's: the median is a step without a copy's cost
when copies are every K steps, the mean what K steps cost on average, the copy's
included; and rank 0's peak resident memory and what it adds to the run without
copies. Then one run with copies every step is killed (rank 1, SIGKILL after step 15's
optimizer step): kill → every rank resumed (the agent's
``recovery.jsonl``), next to the aim of 0.5 s plus the bytes moved at the link rate that
torchrun's run measured (one shard-sized gloo send between the two ranks).

The machine is shared and small: compare the columns of one run, not runs with each
other. On 2 CPU cores the copies' background send and receive take a core away from
two ranks that compute on two; on a GPU node the copy is a device-to-host transfer and
a network send beside compute.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
JOB = str(HERE / "fsdp_job.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TP_RUN = [sys.executable, "-m", "tp_launch", "--spares", "1"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                         os.environ.get("PYTHONPATH")]))}


def run(launcher: list[str], mode: str, args: argparse.Namespace, out: Path,
        extra: list[str]) -> dict:
    cmd = [*launcher, "--nproc-per-node", "2", *extra, JOB, "--mode", mode,
           "--steps", str(args.steps), "--shard-mb", str(args.shard_mb), "--out", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:8])}... exited {proc.returncode}:\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def killed_run(args: argparse.Namespace, tmp: Path) -> dict:
    logs = tmp / "logs"
    out = tmp / "killed"
    cmd = [*TP_RUN, "--log-dir", str(logs), "--nproc-per-node", "2", "--shard-copy-every",
           "1", JOB, "--mode", "resilient", "--steps", str(args.steps), "--shard-mb",
           str(args.shard_mb), "--out", str(out), "--kill-step", "15"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the killed run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    killed = float(Path(f"{out}.killed").read_text())
    (event,) = [json.loads(line) for p in glob.glob(str(logs / "*" / "recovery.jsonl"))
                for line in open(p) if line.strip()]
    return {"resumed": event["detected_at"] - killed + event["resumed_s"],
            "detect": event["detected_at"] - killed, "decide": event["decide_s"],
            "group": event["rebuild_s"], "agree": event["agree_s"],
            "transfer": event["transfer_s"], "verify": event["verify_s"],
            "bytes": event["bytes"], "step": event["step"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shard-mb", type=float, default=100.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    modes = {"torchrun": (TORCHRUN, "plain", []),
             "tp-run, no copies": (TP_RUN, "resilient", []),
             "tp-run, copy every step": (TP_RUN, "resilient", ["--shard-copy-every", "1"]),
             f"tp-run, copy every {args.every}": (TP_RUN, "resilient",
                                                  ["--shard-copy-every", str(args.every)])}
    print(f"plain FSDP, 2 ranks, {args.shard_mb:g} MB shard per rank (parameters + AdamW), "
          f"gloo, {args.steps} steps x {args.reps} runs each, interleaved "
          f"(load {os.getloadavg()[0]:.1f} at start)\n", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    try:
        times: dict[str, list[float]] = {m: [] for m in modes}
        rss: dict[str, list[float]] = {m: [] for m in modes}
        rates: list[float] = []
        for rep in range(args.reps):
            for i, (name, (launcher, mode, extra)) in enumerate(modes.items()):
                result = run(launcher, mode, args, tmp / f"{i}-{rep}", extra)
                times[name] += result["times"]
                rss[name].append(result["maxrss_mb"])
                if result["rate"]:
                    rates.append(result["rate"])
        base = statistics.median(times["torchrun"])
        none = statistics.median(rss["tp-run, no copies"])
        mean_base = statistics.fmean(times["torchrun"])
        print("| run | step time, median (vs torchrun) | mean (vs torchrun) "
              "| peak memory, rank 0 (vs no copies) |")
        print("|---|---|---|---|")
        for name in modes:
            step, mem = statistics.median(times[name]), statistics.median(rss[name])
            mean = statistics.fmean(times[name])
            print(f"| {name} | {step * 1000:.0f} ms ({step / base:.3f}x) | {mean * 1000:.0f} ms "
                  f"({mean / mean_base:.3f}x) | {mem:.0f} MB ({mem - none:+.0f} MB) |")
        rate = statistics.median(rates)
        k = killed_run(args, tmp)
        aim = 0.5 + k["bytes"] / rate
        print(f"\nkill -> resumed, copies every step: {k['resumed'] * 1000:.0f} ms (aim 0.5 s + "
              f"{k['bytes'] / 1e6:.0f} MB at the measured {rate / 1e9:.2f} GB/s = "
              f"{aim * 1000:.0f} ms: {'met' if k['resumed'] <= aim else 'missed'}); "
              f"back to step {k['step']} (killed after step 16's optimizer step)")
        parts = ("detect", "decide", "group", "agree", "transfer", "verify")
        rest = k["resumed"] - sum(k[x] for x in parts)
        print("  " + ", ".join(f"{x} {k[x] * 1000:.0f} ms" for x in parts) +
              f", rebuilding FSDP and the rest {rest * 1000:.0f} ms")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n(load {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
