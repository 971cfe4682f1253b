"""An FSDP2 job (``fully_shard``, AdamW on the DTensor parameters), two ways.

``--build`` (resilient mode's sharded contract): ``State(build=...)`` builds the device
mesh (``--replicas R``: HSDP, R replica groups x world/R shards; 1: plain FSDP), the
sharded model and its optimizer for each generation; a failure is recovered peer to
peer from the ranks that hold the same shards.

Without it (a script written before that contract): the model is registered unsharded,
then sharded and its optimizer built inside ``train``; such a state is not recovered
peer to peer, so the job saves a full checkpoint (``get_state_dict(...,
full_state_dict=True)``, written by rank 0) every ``--save-every`` steps and loads it,
on every rank, when one exists (torch's object collectives, which
``broadcast_from_rank0`` uses, need numpy).

``--kill-rank R --kill-step S [--kill-where forward|backward|optimizer]``: rank R
SIGKILLs itself once per job (a marker file in $OUT) in step S, after the agent has a
spare parked: after the forward pass, inside the backward pass (a gradient hook on the
first layer's activation: the later layers' gradients are being reduce-scattered), or
right after the
optimizer step. ``--kill-ranks`` for several ranks at once. Every rank writes
``final_<rank>.json``: the steps trained, the process's first step (where it started or
resumed), its pid and a checksum of the full parameters and optimizer state.

``--stop-rank R --stop-step S``: rank R stops itself (SIGSTOP, once per job) after the
forward pass of step S: a hung rank, for the agent's hang detection.

``--per-rank-data``: each rank draws its batches from a data stream of its own (a
generator seeded by rank, registered by ``build`` as ``data``): a newcomer that is not
given the dead rank's position in it trains on other data and ends elsewhere.
``--late-per-rank-data``: the same stream, but every rank's starts alike (the seed by rank
is drawn at its first batch), so only ``State(per_rank=...)`` says it is each rank's
own; ``--declare-per-rank`` says so.

``--like-torchtitan``: the model as TorchTitan shards and saves it: the root module does
not reshard after forward (a rank killed between forward and backward leaves the
survivors' root parameters unsharded), and a state-dict hook runs a collective (as
TorchTitan's fused QKV linear redistributes its weight on save).
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from tp_launch import resilient

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--build", action="store_true")
p.add_argument("--replicas", type=int, default=1)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-ranks", type=str, default="", help="comma-separated ranks")
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--kill-where", choices=["forward", "backward", "optimizer"], default="forward")
p.add_argument("--corrupt-rank", type=int, default=-1,
               help="after step 3's optimizer step this rank adds 1e-3 to its piece of the "
                    "first weight (its replica peer's copy then differs)")
p.add_argument("--per-rank-data", action="store_true")
p.add_argument("--late-per-rank-data", action="store_true")
p.add_argument("--declare-per-rank", action="store_true")
p.add_argument("--like-torchtitan", action="store_true")
p.add_argument("--stop-rank", type=int, default=-1)
p.add_argument("--stop-step", type=int, default=-1)
p.add_argument("--hold-at", type=int, default=-1,
               help="after committing step S (and its checkpoint) each rank, once a spare is "
                    "parked, writes held_<rank> and waits for $OUT/release")
args = p.parse_args()
OUT = Path(os.environ["OUT"])
CKPT = OUT / "ckpt.pt"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD = StateDictOptions(full_state_dict=True)
KILL = {int(r) for r in args.kill_ranks.split(",") if r} | \
    ({args.kill_rank} if args.kill_rank >= 0 else set())


def new_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def shard(m: nn.Module, mesh=None) -> None:
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh, reshard_after_forward=not args.like_torchtitan)
    if args.like_torchtitan:
        m[0].register_state_dict_post_hook(
            lambda module, sd, prefix, meta: dist.all_reduce(torch.zeros(1)))


class RankData:
    """A rank's own data stream (a loader's position keyed by data-parallel rank)."""

    def __init__(self, rank: int, late: bool = False) -> None:
        self.rank = rank
        self.g = None if late else torch.Generator().manual_seed(1000 + rank)

    def batch(self) -> torch.Tensor:
        if self.g is None:
            self.g = torch.Generator().manual_seed(1000 + self.rank)
        return torch.randn(8, 16, generator=self.g)

    def state_dict(self) -> dict:
        return {"rng": None if self.g is None else self.g.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        if sd["rng"] is None:
            self.g = None
        else:
            self.g = self.g or torch.Generator()
            self.g.set_state(sd["rng"])


def build(gen: resilient.Generation) -> dict:
    shape = (args.replicas, gen.world_size // args.replicas)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) \
        if args.replicas > 1 else init_device_mesh("cpu", (gen.world_size,))
    m = new_model()
    shard(m, mesh)
    built = {"model": m, "optimizer": torch.optim.AdamW(m.parameters(), lr=0.01)}
    if args.per_rank_data or args.late_per_rank_data:
        built["data"] = RankData(gen.rank, late=args.late_per_rank_data)
    return built


def wait_parked() -> None:
    from tp_launch.resilient import parked_spares
    deadline = time.monotonic() + 60
    while "TP_RUN_CHANNEL" in os.environ and parked_spares() < max(1, len(KILL)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)


def die_once(rank: int) -> None:
    marker = OUT / f"killed_{rank}"
    if not marker.exists():
        marker.touch()
        (OUT / "killed").touch()
        os.kill(os.getpid(), signal.SIGKILL)


def die_in_backward(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
    output.register_hook(lambda grad: die_once(dist.get_rank()))


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
    if args.build:
        opt = state.optimizer
    else:
        if not isinstance(m, FSDPModule):
            shard(m)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    first = state.step
    rank = dist.get_rank()
    if not args.build and CKPT.exists():
        tree = torch.load(CKPT)
        set_state_dict(m, opt, model_state_dict=tree["model"],
                       optim_state_dict=tree["optim"], options=LOAD)
        state.step = first = tree["step"]
    for step in state.steps(args.steps):
        if args.per_rank_data or args.late_per_rank_data:
            x = state.data.batch()
        else:
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))
        dying = step == args.kill_step and rank in KILL and not (OUT / f"killed_{rank}").exists()
        if dying:
            wait_parked()
        hook = m[1].register_forward_hook(die_in_backward) \
            if dying and args.kill_where == "backward" else None
        loss = m(x).square().mean()
        if hook is not None:
            hook.remove()
        if dying and args.kill_where == "forward":
            die_once(rank)
        if step == args.stop_step and rank == args.stop_rank and \
                not (OUT / "stopped").exists():
            wait_parked()
            (OUT / "stopped").touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        loss.backward()
        opt.step()
        if step == 3 and rank == args.corrupt_rank:
            with torch.no_grad():
                m[0].weight.to_local().add_(1e-3)
        if dying and args.kill_where == "optimizer":
            die_once(rank)
        opt.zero_grad()
        if not args.build and (step + 1) % args.save_every == 0:
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
        {"steps": state.step, "first": first, "checksum": checksum(m, opt),
         "pid": os.getpid()}))


if args.build:
    resilient.run(train, resilient.State(build=build,
                                         per_rank={"data"} if args.declare_per_rank else ()))
else:
    resilient.run(train, resilient.State(model=new_model()))
