"""A small transformer language model sharded with FSDP2, in resilient mode.

    tp-run --nproc-per-node 4 --spares 1 examples/train_hsdp.py --steps 60 --kill-rank 1 --kill-step 30

``--replicas 2`` (the default) is HSDP: a 2-D device mesh of 2 replica groups x
world/2 shards; each block's parameters and AdamW state are sharded across a replica
group and replicated across groups. ``--replicas 1`` is plain FSDP: one copy of each
shard, so a killed rank comes back from the buddy copies of ``tp-run
--shard-copy-every 1`` (without it the job goes to ``--spare-policy``):

    tp-run --nproc-per-node 2 --spares 1 --shard-copy-every 1 examples/train_hsdp.py --replicas 1 --steps 60 --kill-rank 1 --kill-step 30

``--kill-rank/--kill-step`` make that rank SIGKILL itself once, after a spare has
parked: the spare takes the rank and receives its shards from the rank with the same
shard coordinate in the other replica group, the survivors rebuild their mesh, FSDP
and optimizer around their own shards (``State(build=...)``), and the job ends with the
same checksum as ``torchrun --nproc-per-node 4 examples/train_hsdp.py --steps 60``. It
runs unchanged under torchrun.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tp_launch import resilient

VOCAB, DIM, HEADS, LAYERS, SEQ = 256, 64, 4, 2, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, rank: int, size: int = 8) -> torch.Tensor:
    """Token sequences with a learnable pattern (each token the previous one + 1)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    return (start + torch.arange(SEQ + 1)) % VOCAB


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p  # a collective: every rank
        h.update(bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def build(gen: resilient.Generation, args: argparse.Namespace) -> dict:
    """The objects bound to the process group, for one generation."""
    if args.replicas > 1:
        mesh = init_device_mesh("cpu", (args.replicas, gen.world_size // args.replicas),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (gen.world_size,))
    torch.manual_seed(0)  # the same initial model everywhere (after a recovery the
    #                       committed generators replace this seed)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return {"model": model, "optimizer": opt}


def train(state: resilient.State, args: argparse.Namespace) -> None:
    model, opt = state.model, state.optimizer
    rank = dist.get_rank()
    for step in state.steps(args.steps):
        if rank == args.kill_rank and step == args.kill_step and os.environ.get("TP_RUN_SPARE") != "1":
            while "TP_RUN_CHANNEL" in os.environ and resilient.parked_spares() < 1:
                time.sleep(0.05)  # demo: make sure a spare is there to take over
            print(f"rank {rank}: SIGKILL myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        tokens = batch(step, rank)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args()

    state = resilient.State(build=lambda gen: build(gen, args))
    resilient.run(lambda s: train(s, args), state)
    digest = checksum(state.model)
    if dist.get_rank() == 0:
        print(f"done: {args.steps} steps on {dist.get_world_size()} ranks, "
              f"params {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
