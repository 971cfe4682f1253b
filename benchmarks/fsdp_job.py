"""The FSDP job of ``shard_copies.py``: an MLP under FSDP2 (plain, one copy of each
shard), AdamW, gloo, N steps.

    fsdp_job.py --mode plain|resilient --steps N --shard-mb S --out FILE [--kill-step K]

``plain``: a torchrun script. ``resilient``: the same loop through resilient mode with
``State(build=...)`` (the mesh, the sharded model and its optimizer built per
generation). The model is sized so that each rank's shard of the parameters and of
AdamW's two moments is about S MB. Rank 0 writes to FILE, as JSON: each step's wall
time after the warm-up, its peak resident memory, and (plain mode) the gloo
point-to-point rate between rank 0 and rank 1 for a shard-sized message. Every rank
appends ``step time`` lines to ``FILE.steps``. With ``--kill-step K`` rank 1 writes the
time to ``FILE.killed`` and SIGKILLs itself right after step K's optimizer step (once).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=["plain", "resilient"], required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--shard-mb", type=float, default=100.0)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--out", required=True)
args = p.parse_args()
OUT = Path(args.out)
WIDTH = 1024
BYTES_PER_PARAM = 12  # fp32 parameter + AdamW's two moments


def build(world: int) -> dict:
    per_rank = args.shard_mb * 1e6 / BYTES_PER_PARAM
    layers = max(1, round(per_rank * world / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4)}


def link_rate() -> float:
    """Bytes per second from rank 0 to rank 1 for one shard-sized gloo send."""
    t = torch.ones(int(args.shard_mb * 1e6 / 4))
    dist.barrier()
    t0 = time.perf_counter()
    if dist.get_rank() == 0:
        dist.send(t, 1)
    elif dist.get_rank() == 1:
        dist.recv(t, 0)
    dist.barrier()
    return t.numel() * 4 / (time.perf_counter() - t0)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps) -> list[float]:  # type: ignore[no-untyped-def]
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    times, last = [], time.perf_counter()
    with open(f"{OUT}.steps", "a") as log:
        for step in steps:
            x = torch.randn(8, WIDTH, generator=g)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if rank == 1 and step == args.kill_step and not Path(f"{OUT}.killed").exists():
                from tp_launch.resilient import parked_spares

                deadline = time.monotonic() + 120
                while parked_spares() < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)  # the spare takes the rank: kill once it is parked
                Path(f"{OUT}.killed").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            now = time.perf_counter()
            if step >= args.warmup:
                times.append(now - last)
            last = now
            log.write(f"{step + 1} {time.time()}\n")
            log.flush()
    return times


def report(times: list[float], rate: float | None) -> None:
    if dist.get_rank() == 0:
        OUT.write_text(json.dumps({
            "times": times, "rate": rate,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if args.mode == "plain":
    dist.init_process_group("gloo")
    rate = link_rate()
    built = build(dist.get_world_size())
    report(train(built["model"], built["optimizer"], range(args.steps)), rate)
    dist.destroy_process_group()
else:
    from tp_launch import resilient

    def run(state: resilient.State) -> None:
        report(train(state.model, state.optimizer, state.steps(args.steps)), None)

    resilient.run(run, resilient.State(build=lambda gen: build(gen.world_size)))
