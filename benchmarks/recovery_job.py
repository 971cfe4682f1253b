"""The job of benchmarks/recovery.py: data-parallel SGD on a model of a chosen state size.

    recovery_job.py --state-mb M --steps N [--kill-step K] [--mode resilient|checkpoint]
                    [--ckpt-every C]

The model is a stack of square Linear layers sized so that parameters plus SGD momentum
come to about M MB. Every committed step appends "<step> <time>" to
``$BENCH_OUT/steps_<rank>_<pid>``. With ``--kill-step K``, rank 1 writes the time to
``$BENCH_OUT/killed`` and SIGKILLs itself right after step K (once per job; in resilient
mode only once a spare is parked). ``--mode resilient`` uses tp_launch.resilient;
``--mode checkpoint`` is the classic script: rank 0 saves model and optimizer with
torch.save every C steps, and a restarted job (TORCHELASTIC_RESTART_COUNT > 0) loads the
latest checkpoint and recomputes from there.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--state-mb", type=float, default=10)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--mode", default="resilient", choices=["resilient", "checkpoint"])
p.add_argument("--ckpt-every", type=int, default=10)
args = p.parse_args()
OUT = os.environ["BENCH_OUT"]
CKPT = os.path.join(OUT, "ckpt.pt")

# Parameters + momentum = 8 bytes per parameter; layers of width w hold w*w + w each.
params = args.state_mb * 1e6 / 8
width = 1024 if params > 4 * 1024 * 1024 else 256
layers = max(1, math.ceil(params / (width * width + width)))
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
for prm in model.parameters():  # momentum buffers exist from the start (a real job's do)
    opt.state[prm]["momentum_buffer"] = torch.zeros_like(prm)


def log_step(step: int) -> None:
    with open(os.path.join(OUT, f"steps_{dist.get_rank()}_{os.getpid()}"), "a") as f:
        f.write(f"{step} {time.time()}\n")


def maybe_kill(step: int) -> None:
    if dist.get_rank() != 1 or step != args.kill_step or os.path.exists(os.path.join(OUT, "killed")):
        return
    if args.mode == "resilient":
        from tp_launch.resilient import parked_spares

        while parked_spares() < 1:
            time.sleep(0.05)
    with open(os.path.join(OUT, "killed"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def train(steps) -> None:  # type: ignore[no-untyped-def]
    # Resilient mode has just agreed the state on every rank: DDP's own broadcast of the
    # parameters from rank 0 would move the whole model again.
    ddp = DDP(model, init_sync=args.mode != "resilient")
    rank = dist.get_rank()
    for step in steps:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(8, width, generator=g)
        loss = ddp(x).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        log_step(step + 1)
        if args.mode == "checkpoint" and rank == 0 and (step + 1) % args.ckpt_every == 0:
            torch.save({"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict()},
                       CKPT + ".tmp")
            os.replace(CKPT + ".tmp", CKPT)
        maybe_kill(step + 1)


if args.mode == "resilient":
    from tp_launch import resilient

    state = resilient.State(model=model, optimizer=opt)
    resilient.run(lambda s: train(s.steps(args.steps)), state)
else:
    # torchrun 2.13's restarts reuse its store and gloo's connectFullMesh may then hang on
    # a dead attempt's address: bound it (the default is 30 min) so the launcher retries.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    start = 0
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.exists(CKPT):
        t0 = time.time()
        ckpt = torch.load(CKPT)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["step"]
        with open(os.path.join(OUT, f"loaded_{dist.get_rank()}"), "w") as f:
            f.write(f"{start} {t0} {time.time()} {os.environ['TORCHELASTIC_RESTART_COUNT']}")
    train(range(start, args.steps))
dist.destroy_process_group()
