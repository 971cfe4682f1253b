"""The data-parallel job of ``step_overhead.py``: one MLP, DDP over gloo, N steps.

    step_job.py --mode plain|resilient|ordered --steps N --params-m M --out FILE

``plain``: a torchrun script (``for step in range(N)``, DDP as is). ``resilient``: the
same loop through resilient mode (``resilient.State``, ``for step in state.steps(N)``,
``resilient.run``), exact across recoveries with DDP's own all-reduce. ``ordered``: the
resilient loop with the ``ordered_allreduce_hook`` that earlier versions needed for
exact results. Rank 0 writes to FILE as JSON every step's wall time (``times``, from the
first step on: the caller picks its window), the time the loop itself took between one
body's end and the next one's start (``boundary``: tp-run's commit in resilient mode,
``range``'s next in plain mode), and under tp-run the index of the first step that
started after the spare had parked (``parked``; null if it had not by the end; the
spare starts when the ranks reach ``run()``, beside the first steps).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["plain", "resilient", "ordered"], required=True)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--params-m", type=float, default=10.5)
p.add_argument("--out", required=True)
args = p.parse_args()

WIDTH = 1024
layers = max(1, round(args.params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def train(steps: Iterable[int]) -> tuple[list[float], list[float], int | None]:
    ddp = DDP(model)
    if args.mode == "ordered":
        from tp_launch.resilient import ordered_allreduce_hook

        ddp.register_comm_hook(None, ordered_allreduce_hook)
    rank = dist.get_rank()
    # Under tp-run, rank 0 watches for the spare's park (a status file read per step,
    # until it has parked) to tell the steps beside the spare's start from the rest.
    watch = args.mode != "plain" and rank == 0
    if watch:
        from tp_launch.resilient import parked_spares
    times: list[float] = []
    boundary: list[float] = []
    parked: int | None = None
    t0 = t1 = time.perf_counter()
    for step in steps:
        # From the end of the previous body to here: the loop's own cost (the commit).
        boundary.append(time.perf_counter() - t1)
        if watch and parked is None and parked_spares() >= 1:
            parked = len(times)  # this step: the first without the spare's start beside
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(32, WIDTH, generator=g)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    # A step's time includes the commit of the step before, which runs when the loop
    # resumes: boundary[i] belongs to times[i].
    return times, boundary, parked


if args.mode == "plain":
    dist.init_process_group("gloo")
    times, boundary, parked = train(range(args.steps))
else:
    from tp_launch import resilient

    state = resilient.State(model=model, optimizer=opt)
    box: list[tuple[list[float], list[float], int | None]] = []
    resilient.run(lambda s: box.append(train(s.steps(args.steps))), state)
    times, boundary, parked = box[0]
if dist.get_rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"mode": args.mode, "world": dist.get_world_size(), "times": times,
                   "boundary": boundary, "parked": parked}, f)
dist.destroy_process_group()
