"""A small data-parallel training job: an MLP regression over gloo with DDP.

Run it under tp-run exactly as under torchrun:

    tp-run --nproc-per-node 4 examples/train_ddp.py --steps 200

Every rank draws its batch from a generator seeded by (step, rank), so the run is
deterministic; rank 0 prints the loss and a checksum of the final parameters.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


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


def train(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace) -> None:
    ddp = DDP(model)
    rank = dist.get_rank()
    for step in range(args.steps):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train(model, opt, args)
    if dist.get_rank() == 0:
        print(f"done: {args.steps} steps on {dist.get_world_size()} ranks "
              f"(restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}), "
              f"params {checksum(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
