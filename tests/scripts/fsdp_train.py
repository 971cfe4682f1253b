"""An FSDP2 job (``fully_shard``, AdamW on the DTensor parameters) that saves a full
checkpoint (``get_state_dict(..., full_state_dict=True)``, written by rank 0) every
``--save-every`` steps: the model is sharded and the optimizer built inside ``train``,
the checkpoint loaded there by every rank when one exists (torch's object collectives,
which ``broadcast_from_rank0`` uses, need numpy).

``--kill-rank R --kill-step S``: rank R SIGKILLs itself once per job (a marker file in
$OUT) in step S's backward pass, after the agent has a spare parked. Every rank writes
``final_<rank>.json``: the steps trained, the process's first step (where it started
or resumed) and a checksum of the full parameters and optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from tp_launch import resilient

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--hold-at", type=int, default=-1,
               help="after committing step S (and its checkpoint) each rank, once a spare is "
                    "parked, writes held_<rank> and waits for $OUT/release")
args = p.parse_args()
OUT = Path(os.environ["OUT"])
CKPT = OUT / "ckpt.pt"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD = StateDictOptions(full_state_dict=True)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                      nn.Linear(32, 4))


def wait_parked() -> None:
    from tp_launch.resilient import parked_spares
    deadline = time.monotonic() + 60
    while "TP_RUN_CHANNEL" in os.environ and parked_spares() < 1 \
            and time.monotonic() < deadline:
        time.sleep(0.05)


def checksum(m: nn.Module, opt: torch.optim.Optimizer) -> str:
    sd, osd = get_state_dict(m, opt)
    h = hashlib.sha256()
    for tree in (sd, osd["state"]):
        for k in sorted(tree, key=str):
            v = tree[k]
            for t in (v.values() if isinstance(v, dict) else [v]):
                t = t.full_tensor() if isinstance(t, DTensor) else t
                h.update(bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()))
    return h.hexdigest()[:16]


def train(state: resilient.State) -> None:
    m = state.model
    if not isinstance(m, FSDPModule):
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    first = state.step
    rank = dist.get_rank()
    if CKPT.exists():
        tree = torch.load(CKPT)
        set_state_dict(m, opt, model_state_dict=tree["model"],
                       optim_state_dict=tree["optim"], options=LOAD)
        state.step = first = tree["step"]
    for step in state.steps(args.steps):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 16, generator=g)
        loss = m(x).square().mean()
        if step == args.kill_step and rank == args.kill_rank:
            wait_parked()
            marker = OUT / "killed"
            if not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.save_every == 0:
            sd, osd = get_state_dict(m, opt, options=FULL)
            if rank == 0:
                torch.save({"model": sd, "optim": osd, "step": step + 1}, f"{CKPT}.tmp")
                os.replace(f"{CKPT}.tmp", CKPT)
            dist.barrier()
        if step + 1 == args.hold_at and not (OUT / "release").exists():
            wait_parked()
            (OUT / f"held_{rank}").touch()
            while not (OUT / "release").exists():
                time.sleep(0.05)
    (OUT / f"final_{rank}.json").write_text(json.dumps(
        {"steps": state.step, "first": first, "checksum": checksum(m, opt)}))


resilient.run(train, resilient.State(model=model))
