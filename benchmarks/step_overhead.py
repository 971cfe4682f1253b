"""Resilient mode's cost per failure-free step, measured inside one running job.

    python benchmarks/step_overhead.py [--state-mb 10] [--blocks 30] [--block-steps 20]

Launches 2 gloo ranks with ``tp-run --spares 1`` (a spare parked beside them, the agent
channel and progress board live) running this file as the training script. Inside
``resilient.run`` the same DDP model alternates blocks of steps with two SGD optimizers
of identical settings: the one registered in ``resilient.State`` (its step post-hook
commits: progress board write, generation check) and an unregistered twin (a plain
step, what the script does under torchrun). Blocks alternate, so machine noise hits both
alike; the ratio of the median step times is the overhead. The commit alone is also
timed in a tight loop (an upper bound on what resilient mode adds to a step). ``benchmarks/recovery.py``'s
last line compares whole runs under tp-run and torchrun instead (noisier: separate runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tp_launch import resilient

    width = 256
    layers = max(1, round(args.state_mb * 1e6 / 8 / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    registered = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    plain = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    state = resilient.State(model=model, optimizer=registered)

    def train(state: resilient.State) -> None:
        ddp = DDP(model)
        times: dict[str, list[float]] = {"registered": [], "plain": []}
        rank = dist.get_rank()
        for block in range(args.blocks * 2 + 1):
            name = "registered" if block % 2 else "plain"
            opt = registered if name == "registered" else plain
            for i in range(args.block_steps):
                x = torch.randn(8, width, generator=torch.Generator().manual_seed(i + rank))
                t0 = time.perf_counter()
                loss = ddp(x).square().mean()
                opt.zero_grad(set_to_none=False)
                loss.backward()
                opt.step()
                if block > 0:  # the first block warms up
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            # The commit alone (what the registered optimizer adds to a step), timed
            # directly: an upper bound that does not drown in the step's noise.
            n = 20000
            t0 = time.perf_counter()
            for _ in range(n):
                state.commit()
            times["commit"] = [(time.perf_counter() - t0) / n]
            with open(args.out, "w") as f:
                json.dump(times, f)

    resilient.run(train, state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-mb", type=float, default=10)
    ap.add_argument("--blocks", type=int, default=30, help="blocks of each kind")
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        job(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        cmd = [sys.executable, "-m", "tp_launch", "--nproc-per-node", "2", "--spares", "1",
               os.path.abspath(__file__), "--job", "--out", out, "--state-mb",
               str(args.state_mb), "--blocks", str(args.blocks), "--block-steps",
               str(args.block_steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, timeout=1800)
        with open(out) as f:
            times = json.load(f)
    reg, pl = statistics.median(times["registered"]), statistics.median(times["plain"])
    print(f"{args.state_mb:g} MB state, 2 ranks, {args.blocks} x {args.block_steps} steps each, "
          f"interleaved: registered (resilient commit) {reg * 1000:.3f} ms, plain "
          f"{pl * 1000:.3f} ms per step; overhead {100 * (reg / pl - 1):+.2f}%")
    commit = times["commit"][0]
    print(f"the commit itself: {commit * 1e6:.2f} us per step = {100 * commit / pl:.4f}% of a "
          "plain step")


if __name__ == "__main__":
    main()
