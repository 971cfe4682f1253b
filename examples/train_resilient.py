"""The DDP job of train_ddp.py in resilient mode: a dead rank is replaced by a spare.

    tp-run --nproc-per-node 4 --spares 1 examples/train_resilient.py --steps 300 --kill-rank 2 --kill-step 120

``--kill-rank/--kill-step`` make that rank SIGKILL itself once, part-way (after a spare
has parked), to show a recovery: a spare takes the rank, the survivors keep running, the
state moves to the newcomer and the job ends with the same parameters as a run without
the kill (compare the printed checksum with ``torchrun --nproc-per-node 4
examples/train_resilient.py --steps 300``). It runs unchanged under torchrun.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tp_launch import resilient


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 16, generator=g)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(size, 1, generator=g)
    return x, y


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))  # the raw bytes (no numpy)
    return h.hexdigest()[:16]


def train(state: resilient.State, args: argparse.Namespace) -> None:
    model, opt = state.model, state.optimizer
    ddp = DDP(model)
    rank = dist.get_rank()
    for step in state.steps(args.steps):
        if rank == args.kill_rank and step == args.kill_step and os.environ.get("TP_RUN_SPARE") != "1":
            while "TP_RUN_CHANNEL" in os.environ and resilient.parked_spares() < 1:
                time.sleep(0.05)  # demo: make sure a spare is there to take over
            print(f"rank {rank}: SIGKILL myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    state = resilient.State(model=model, optimizer=opt)
    resilient.run(lambda s: train(s, args), state)
    if dist.get_rank() == 0:
        print(f"done: {args.steps} steps on {dist.get_world_size()} ranks, "
              f"params {checksum(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
