"""Goodput model: expected time to N training steps under random failures, per strategy.

    python benchmarks/strategies/goodput.py [--results RESULTS.json] [--mc TRIALS]

**Method.** Failures of the job form a Poisson process of rate
``n_gpus * failures_per_gpu_hour`` (mean time between failures ``M``). A strategy turns
the N steps into *segments* of work that are either completed or lost whole:

- checkpoint restart: a segment is C steps plus one blocking checkpoint; a failure
  loses the segment's progress and costs a restart ``R`` (detect, replace the node,
  restart every process, reload the checkpoint, warm up);
- TorchFT: a segment is one step (every step is committed by the quorum); a failure
  loses the step in flight and stalls the survivors for the time to notice the dead
  replica group and form a new quorum; the restarted group catches up alone;
- tp-run (migration to a parked spare): a segment is one step; a failure loses the
  step in flight and costs detect + decide + group rebuild + moving one rank's state
  to the spare (``state_bytes / bandwidth``) + the first step after the rebuild.

For a segment of length ``d`` with restart cost ``R``, where failures can strike during
work and during the restart alike, the expected wall time is Daly's result
``M * exp(R / M) * (exp(d / M) - 1)`` (J. T. Daly, *A higher order estimate of the
optimum checkpoint interval for restart dumps*, FGCS 2006): exact for exponential
failures. Every strategy also pays its per-step overhead ``(1 + o) * step_s`` on every
step. :func:`simulate` is a seeded Monte Carlo of the same process (a cross-check;
the unit tests hold the two together).

What it leaves out, on purpose: a spare pool running dry (tp-run falls back to a
restart; spares are replaced within minutes, far below any MTBF here), TorchFT's
reduced batch while a group is missing (time to N steps does not change, the samples
per step do), checkpoint writes overlapping compute (asynchronous checkpointing: set
the checkpoint cost to the blocking part).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Meta (Llama 3 training report): about 7.9 h mean time to a failure at 1,024 GPUs.
META_FAILURES_PER_GPU_HOUR = 1.0 / (7.9 * 1024)

STRATEGIES = ("ckpt_restart", "torchft", "tprun")


@dataclass(frozen=True)
class Params:
    """One training setup. Times in seconds, rates per GPU-hour."""

    n_gpus: int
    failures_per_gpu_hour: float
    steps: int
    step_s: float
    # checkpoint restart
    ckpt_every: int = 100
    ckpt_s: float = 60.0          # blocking part of one checkpoint save
    restart_s: float = 600.0      # failure -> every rank training again from the checkpoint
    ckpt_overhead: float = 0.0    # per-step overhead of the restart strategy (none)
    # TorchFT
    torchft_overhead: float = 0.0  # per-step: quorum RPCs, cross-replica all-reduce
    torchft_stall_s: float = 10.0  # survivors' stall per failure (heartbeat timeout, quorum)
    # tp-run migration
    tprun_overhead: float = 0.0
    detect_s: float = 0.05        # agent's waitpid + decision
    rebuild_s: float = 1.0        # new process group (NCCL communicators at scale: more)
    state_bytes: float = 0.0      # one rank's training state, moved to the spare
    bandwidth_Bps: float = 1.8e9  # donor -> spare
    first_step_extra_s: float = 0.0  # the rebuilt group's first step over a normal one

    @property
    def mtbf_s(self) -> float:
        rate = self.n_gpus * self.failures_per_gpu_hour
        return math.inf if rate <= 0 else 3600.0 / rate

    def migration_s(self) -> float:
        """tp-run's cost of one failure, the lost step in flight aside."""
        transfer = self.state_bytes / self.bandwidth_Bps if self.bandwidth_Bps else 0.0
        return self.detect_s + self.rebuild_s + transfer + self.first_step_extra_s


def segment_time(d: float, r: float, mtbf: float) -> float:
    """Expected wall time to finish ``d`` seconds of uninterrupted work with restart
    cost ``r`` per failure (Daly): failures strike during work and restart alike."""
    if math.isinf(mtbf):
        return d
    x = d / mtbf
    y = r / mtbf
    if x + y > 700:  # exp overflow: this never finishes in any useful time
        return math.inf
    return mtbf * math.exp(y) * math.expm1(x)


def _segments(p: Params, strategy: str) -> list[tuple[int, float, float]]:
    """(count, work seconds, restart seconds) of the strategy's segments."""
    if strategy == "ckpt_restart":
        step = p.step_s * (1 + p.ckpt_overhead)
        full, rest = divmod(p.steps, p.ckpt_every)
        segs = [(full, p.ckpt_every * step + p.ckpt_s, p.restart_s)]
        if rest:
            segs.append((1, rest * step, p.restart_s))  # the tail needs no final checkpoint
        return segs
    if strategy == "torchft":
        return [(p.steps, p.step_s * (1 + p.torchft_overhead), p.torchft_stall_s)]
    if strategy == "tprun":
        return [(p.steps, p.step_s * (1 + p.tprun_overhead), p.migration_s())]
    raise ValueError(strategy)


def expected_time(p: Params, strategy: str) -> float:
    """Expected seconds to ``p.steps`` committed steps (closed form)."""
    return sum(n * segment_time(d, r, p.mtbf_s) for n, d, r in _segments(p, strategy))


def failure_free_time(p: Params, strategy: str) -> float:
    return sum(n * d for n, d, _r in _segments(p, strategy))


def expected_failures(p: Params, strategy: str) -> float:
    t = expected_time(p, strategy)
    return 0.0 if math.isinf(p.mtbf_s) else t / p.mtbf_s


def simulate(p: Params, strategy: str, trials: int = 200, seed: int = 0) -> list[float]:
    """Monte Carlo of the same failure process: wall seconds to N steps, per trial."""
    rng = random.Random(seed)
    rate = 1.0 / p.mtbf_s if not math.isinf(p.mtbf_s) else 0.0
    out = []
    for _ in range(trials):
        t = 0.0
        next_fail = rng.expovariate(rate) if rate else math.inf
        for n, d, r in _segments(p, strategy):
            for _ in range(n):
                while True:
                    if t + d <= next_fail:
                        t += d
                        break
                    # Failed: lose the segment, pay the restart (which a failure can
                    # interrupt too: then it starts over).
                    t = next_fail
                    next_fail = t + (rng.expovariate(rate) if rate else math.inf)
                    while t + r > next_fail:
                        t = next_fail
                        next_fail = t + rng.expovariate(rate)
                    t += r
        out.append(t)
    return out


# -- the published comparison, and the same at cluster scale --------------------------

PUBLISHED_MIN = {"ckpt_restart": 818.0, "torchft": 930.0, "tprun": 405.0}


def scout_params(measured: dict[str, float] | None = None) -> tuple[Params, dict[str, str]]:
    """Llama-4 Scout (109B) on 64 H200s, 3,000 steps, with the published run's injected
    failures, and where each parameter comes from.

    Unknown in the published figures: the failure count, the step time, the checkpoint
    and restart costs. Assumed: checkpoint every 100 steps, 60 s blocking save, 10 min
    restart (replace the node, relaunch, load ~1.5 TB of checkpoint, NCCL init, warm
    up). Calibrated, in this order: the step time from tp-run's 405 min (the migration
    cost is seconds); the failure rate from checkpoint restart's 818 min; TorchFT's
    per-step overhead from its 930 min. So the 64-GPU row reproduces the published
    numbers by construction; what the model adds is the cost of each failure and the
    extrapolation to other scales and failure rates.
    """
    m = measured or {}
    # One rank's state: bf16 weights + fp32 master + Adam m and v = 14 B/param,
    # sharded over 64 GPUs (FSDP): ~24 GB, from a replica over 400 Gb/s InfiniBand.
    state = 109e9 * 14 / 64
    base = Params(n_gpus=64, failures_per_gpu_hour=0.0, steps=3000, step_s=8.0,
                  ckpt_every=100, ckpt_s=60.0, restart_s=600.0, torchft_stall_s=10.0,
                  detect_s=m.get("detect_s", 0.05) + m.get("decide_s", 0.0),
                  rebuild_s=30.0, state_bytes=state, bandwidth_Bps=40e9,
                  first_step_extra_s=m.get("first_step_s", 0.0),
                  # Not the step overhead measured here: on 2 shared cores it is load
                  # noise (a parked spare blocks on a socket; the step code is torchrun's).
                  tprun_overhead=0.0)
    target = {k: v * 60 for k, v in PUBLISHED_MIN.items()}
    p = base
    # Fixed point: step time and failure rate each depend on the other a little.
    for _ in range(50):
        lam = _solve(lambda x: expected_time(replace(p, failures_per_gpu_hour=x),
                                             "ckpt_restart") - target["ckpt_restart"],
                     0.0, 1.0)
        p = replace(p, failures_per_gpu_hour=lam)
        step = _solve(lambda s: expected_time(replace(p, step_s=s), "tprun") - target["tprun"],
                      0.1, 60.0)
        p = replace(p, step_s=step)
    o = _solve(lambda o: expected_time(replace(p, torchft_overhead=o), "torchft")
               - target["torchft"], 0.0, 10.0)
    p = replace(p, torchft_overhead=o)
    sources = {
        "step_s": "calibrated: tp-run's 405 min",
        "failures_per_gpu_hour": "calibrated: checkpoint restart's 818 min (injected failures)",
        "torchft_overhead": "calibrated: TorchFT's 930 min",
        "ckpt_every / ckpt_s / restart_s": "assumed: 100 steps / 60 s / 600 s",
        "torchft_stall_s": "assumed: 10 s (heartbeat timeout + quorum)",
        "detect_s": "measured here (recovery.jsonl: detect + decide)" if m else "assumed",
        "rebuild_s": "assumed: 30 s (NCCL communicators for 64 GPUs; gloo here: "
                     f"{m.get('rebuild_s', float('nan')):.2f} s)",
        "state_bytes / bandwidth": f"{state / 1e9:.0f} GB (109B x 14 B / 64) at 40 GB/s",
        "tprun_overhead": "0: the step is plain DDP; measured here "
                          f"{100 * m.get('tprun_step_overhead', float('nan')):+.0f} % (2 shared "
                          "cores, noise)",
    }
    return p, sources


def _solve(f: Any, lo: float, hi: float, iters: int = 200) -> float:
    """Bisection for an increasing f with f(lo) <= 0 <= f(hi) (clamped otherwise)."""
    flo = f(lo)
    if flo >= 0:
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        v = f(mid)
        if v > 0 or math.isnan(v):
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def measured_from_results(path: Path) -> dict[str, float]:
    """Medians of tp-run's recovery records and step overhead from a bench.py run."""
    data = json.loads(path.read_text())
    recs = [r for s in data["samples"] if s["strategy"] == "tprun_resilient"
            for r in s.get("recoveries", [])]
    out: dict[str, float] = {}

    def med(key: str) -> float | None:
        vals = [r[key] for r in recs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    for key in ("decide_s", "rebuild_s", "transfer_s", "first_step_s", "total_s", "resumed_s"):
        v = med(key)
        if v is not None:
            out[key] = v
    summ = data.get("summary", {}).get("tprun_resilient", {})
    if summ.get("step_overhead") is not None:
        out["tprun_step_overhead"] = summ["step_overhead"]
    rates = [r["bytes"] / r["transfer_s"] for r in recs if r.get("transfer_s")]
    if rates:
        out["transfer_Bps"] = statistics.median(rates)
    return out


def predictions(measured: dict[str, float] | None = None, mc_trials: int = 0
                ) -> list[dict[str, Any]]:
    """Rows: the 64-GPU calibration, and 64 / 1,024 / 16,384 GPUs at Meta's rate."""
    scout, _ = scout_params(measured)
    rows = []
    cases = [("64 H200, published run's injected failures", scout)]
    for n in (64, 1024, 16384):
        cases.append((f"{n:,} GPUs, Meta's rate (MTBF {7.9 * 1024 / n:.2g} h)",
                      replace(scout, n_gpus=n, failures_per_gpu_hour=META_FAILURES_PER_GPU_HOUR)))
    for name, p in cases:
        row: dict[str, Any] = {"case": name, "n_gpus": p.n_gpus, "mtbf_min": p.mtbf_s / 60,
                               "failure_free_min": p.steps * p.step_s / 60}
        for s in STRATEGIES:
            row[s + "_min"] = expected_time(p, s) / 60
            row[s + "_failures"] = expected_failures(p, s)
            if mc_trials:
                sims = simulate(p, s, trials=mc_trials, seed=1)
                row[s + "_mc_min"] = statistics.fmean(sims) / 60
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | MTBF | failure-free | checkpoint restart | TorchFT | tp-run (spare) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for s in STRATEGIES:
            t = r[s + "_min"]
            cells.append("never finishes" if math.isinf(t) else
                         f"{t:,.0f} min ({r[s + '_failures']:.1f} failures)"
                         + (f" [MC {r[s + '_mc_min']:,.0f}]" if s + "_mc_min" in r else ""))
        lines.append(f"| {r['case']} | {r['mtbf_min']:,.0f} min | {r['failure_free_min']:,.0f} min "
                     f"| {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help="bench.py results.json: measured costs")
    parser.add_argument("--mc", type=int, default=0, help="also run a Monte Carlo of N trials")
    args = parser.parse_args()
    measured = measured_from_results(args.results) if args.results else None
    p, sources = scout_params(measured)
    print("64 x H200 Llama-4 Scout parameters:\n")
    print("| parameter | value | source |\n|---|---|---|")
    for key, src in sources.items():
        vals = ", ".join(f"{getattr(p, k.strip()):.4g}" for k in key.split("/")
                         if hasattr(p, k.strip()))
        if key == "state_bytes / bandwidth":
            vals = f"{p.state_bytes:.3g} B, {p.bandwidth_Bps:.3g} B/s"
        print(f"| {key} | {vals} | {src} |")
    print(f"\nmigration cost per failure: {p.migration_s():.1f} s; failure-free "
          f"{p.steps * p.step_s / 60:.0f} min; injected MTBF {p.mtbf_s / 60:.0f} min")
    if measured:
        print("measured here:", json.dumps({k: round(v, 4) for k, v in measured.items()}))
    print()
    print(markdown(predictions(measured, args.mc)))


if __name__ == "__main__":
    main()
