"""Training loops as people write them, with failures injected at chosen points.

    loops.py --style STYLE --steps N [--fault RANK:STEP:WHERE,...] [--no-resilient]

Each style is a real loop shape written from the README's "Resilient mode" section
(see STYLES). WHERE is the point at which RANK SIGKILLs itself (once per job, after
the agent has the spares it needs parked) during iteration STEP:

    forward     in the model's forward pass
    backward    in the backward pass (a gradient hook on the first layer: later layers'
                buckets are already being all-reduced)
    allreduce   inside DDP's gradient all-reduce (styles with a communication hook)
    optimizer   inside optimizer.step() (a step pre-hook)
    after-step  between optimizer.step() and the scheduler step
    collective  just before a collective that follows the optimizer step (styles with
                one: survivors are left inside it, past their optimizer step)
    end         after the last iteration, before train() returns

Outputs in $OUT: ``final_<rank>.json`` {pid, step, digest: the whole State's digest},
``loss_<rank>.log`` (one line per committed step, written through state.on_commit, so
that a step appears exactly once), ``entry_<pid>`` (rank and step at each train()
entry). With ``--no-resilient`` the same loop runs as a plain torchrun script: the
reference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tp_launch import resilient

STYLES = {
    # zero_grad at the top, scheduler per step, dropout, gradient clipping
    "basic": dict(zero="top", sched="step", dropout=True, clip=True),
    # zero_grad after the step, BatchNorm, an EMA copy, a loss all-reduce after the step
    "after": dict(zero="after", sched="step", bn=True, ema=True, reduce_loss=True),
    # gradient accumulation with no_sync(), zero_grad(set_to_none=False), a comm hook
    "accum": dict(zero="keep", sched="step", accum=2, hook=True, clip=True),
    # epochs over a DistributedSampler, scheduler per epoch, an evaluation all-reduce
    "epochs": dict(zero="top", sched="epoch", dropout=True, data="sampler", evaluate=True),
    # a registered StatefulDataLoader, CPU autocast (bf16), GradScaler skipping steps
    "stateful": dict(zero="top", sched="step", data="stateful", amp=True),
    # torch.compile'd model
    "compile": dict(zero="top", sched="step", compile=True, bn=True),
}

p = argparse.ArgumentParser()
p.add_argument("--style", choices=sorted(STYLES), default="basic")
p.add_argument("--steps", type=int, default=12, help="steps (epochs style: epochs x batches)")
p.add_argument("--fault", default="")
p.add_argument("--no-resilient", action="store_true")
p.add_argument("--save", default="", help="torch.save(state.state_dict()) here at the end")
p.add_argument("--load", default="", help="state.load_state_dict() from here before run()")
p.add_argument("--perturb", default="", help="RANK:STEP: that rank nudges a parameter "
               "after committing STEP (a replica that diverges)")
p.add_argument("--lossy-load", action="store_true",
               help="the optimizer's load_state_dict rounds its momentum through bfloat16 "
               "(a newcomer's received state then differs from its donor's)")
p.add_argument("--old-style", action="store_true",
               help="the loop of earlier versions: range(state.step, n), no state.steps()")
p.add_argument("--hold-at", type=int, default=-1,
               help="after this step, each rank writes $OUT/held_<rank> and waits for $OUT/release")
p.add_argument("--hold-rank", type=int, default=-1, help="with --hold-at: only this rank holds")
args = p.parse_args()
S = STYLES[args.style]
OUT = os.environ["OUT"]
FAULTS = [(int(r), int(s), w) for r, s, w in (f.split(":") for f in args.fault.split(",") if f)]
BATCHES_PER_EPOCH = 4


def once(name: str) -> bool:
    try:
        fd = os.open(os.path.join(OUT, f"marker_{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def fault(where: str, step: int) -> None:
    if args.no_resilient or not dist.is_initialized():
        return
    rank = dist.get_rank()
    for r, s, w in FAULTS:
        if r == rank and s == step and w == where and \
                not os.path.exists(os.path.join(OUT, f"marker_{r}_{s}_{w}")):
            from tp_launch.resilient import parked_spares

            # As many spares as ranks die in this iteration (they may die at once; one
            # that died in an earlier run of it needs none now).
            together = sum(1 for r2, s2, w2 in FAULTS if s2 == step and
                           not os.path.exists(os.path.join(OUT, f"marker_{r2}_{s2}_{w2}")))
            while "TP_RUN_CHANNEL" in os.environ and parked_spares() < together:
                time.sleep(0.05)
            if once(f"{r}_{s}_{w}"):
                os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- the model and data

torch.manual_seed(0)
layers: list[nn.Module] = [nn.Linear(8, 32)]
if S.get("bn"):
    layers.append(nn.BatchNorm1d(32))
layers.append(nn.Tanh())
if S.get("dropout"):
    layers.append(nn.Dropout(0.2))
layers += [nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
model = nn.Sequential(*layers)


class LossySGD(torch.optim.SGD):
    """A bug a real optimizer can have: its state cast on the way in."""

    def load_state_dict(self, state_dict):  # type: ignore[no-untyped-def]
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for st in self.state.values():
                buf = st.get("momentum_buffer")
                if buf is not None:
                    buf.copy_(buf.to(torch.bfloat16).float())


opt = torch.optim.AdamW(model.parameters(), lr=0.01) if S.get("amp") else \
    (LossySGD if args.lossy_load else torch.optim.SGD)(model.parameters(), lr=0.02,
                                                        momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
objects: dict = {"model": model, "optimizer": opt, "scheduler": sched}
if S.get("ema"):
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    objects["ema"] = ema
scaler = None
if S.get("amp"):
    # A huge first scale: the first steps overflow and are skipped, growth brings more.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126, growth_interval=2)
    objects["scaler"] = scaler

g = torch.Generator().manual_seed(1234)
X = torch.randn(256, 8, generator=g)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=g)
dataset = torch.utils.data.TensorDataset(X, Y)
loader = None
if S.get("data") == "stateful":
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(dataset, batch_size=8, shuffle=True,
                                generator=torch.Generator().manual_seed(7))
    objects["loader"] = loader


def synthetic(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000_003 * step + 101 * rank + micro)
    x = torch.randn(16, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=gen)


state = resilient.State(**objects)


def train(state: resilient.State) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(OUT, f"entry_{os.getpid()}"), "a") as f:
        f.write(f"{rank} {state.step}\n")
    net = torch.compile(model, backend="aot_eager") if S.get("compile") else model
    ddp = DDP(net)
    if S.get("hook"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(process_group, bucket):  # type: ignore[no-untyped-def]
            fault("allreduce", state.step)
            return allreduce_hook(process_group, bucket)

        ddp.register_comm_hook(None, hook)
    model[0].weight.register_hook(lambda grad: fault("backward", state.step))
    model.register_forward_pre_hook(lambda *_: fault("forward", state.step))
    opt.register_step_pre_hook(lambda *_: fault("optimizer", state.step))
    log = open(os.path.join(OUT, f"loss_{rank}.log"), "a")

    def one_step(step: int, batch: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        model.train()
        if S["zero"] == "top":
            opt.zero_grad()
        elif S["zero"] == "keep":
            opt.zero_grad(set_to_none=False)
        micro_batches = S.get("accum", 1)
        losses = []
        for m in range(micro_batches):
            x, y = batch if batch is not None else synthetic(step, rank, m)
            sync = m == micro_batches - 1
            with (contextlib.nullcontext() if sync else ddp.no_sync()), \
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(S.get("amp"))):
                loss = nn.functional.mse_loss(ddp(x).float(), y) / micro_batches
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses.append(loss.detach())
        if S.get("clip"):
            if scaler is not None:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        fault("after-step", step)
        if S["sched"] == "step":
            sched.step()
        if S.get("ema"):
            objects["ema"].update_parameters(model)
        if S["zero"] == "after":
            opt.zero_grad()
        total = torch.stack(losses).sum()
        if S.get("reduce_loss"):
            fault("collective", step)
            dist.all_reduce(total)
            total /= world
        value = float(total)
        state.on_commit(lambda: (log.write(f"{step} {value!r}\n"), log.flush()))

    if S.get("data") == "sampler":
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=5)
        data = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
        for epoch in state.epochs(args.steps // BATCHES_PER_EPOCH):
            sampler.set_epoch(epoch)
            for batch in state.batches(data):
                if state.batch >= BATCHES_PER_EPOCH:
                    break  # a shortened epoch (and a break out of batches())
                one_step(state.step, batch)
            sched.step()
            if S.get("evaluate"):
                model.eval()
                with torch.no_grad():
                    metric = nn.functional.mse_loss(model(X[:32]), Y[:32]).reshape(1)
                dist.all_reduce(metric)
                model.train()
    elif S.get("data") == "stateful":
        it = iter(loader)
        for step in state.steps(args.steps):
            batch = next(it, None)
            if batch is None:
                it = iter(loader)
                batch = next(it)
            one_step(step, batch)
            hold(step, rank)
    elif args.old_style:
        for step in range(state.step, args.steps):
            one_step(step, None)
    else:
        for step in state.steps(args.steps):
            one_step(step, None)
            hold(step, rank)
            if args.perturb and [rank, step] == [int(x) for x in args.perturb.split(":")]:
                state.on_commit(lambda: model[0].weight.data.add_(1e-3))
    fault("end", args.steps - 1)
    log.close()
    return state.step


def hold(step: int, rank: int) -> None:
    if step == args.hold_at and args.hold_rank in (-1, rank) and once(f"hold_{rank}"):
        open(os.path.join(OUT, f"held_{rank}"), "w").close()
        while not os.path.exists(os.path.join(OUT, "release")):
            time.sleep(0.05)


if args.load:
    state.load_state_dict(torch.load(args.load, weights_only=True))
resilient.run(train, state)
if args.save and dist.get_rank() == 0:
    torch.save(state.state_dict(), args.save)
with open(os.path.join(OUT, f"final_{dist.get_rank()}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "step": state.step, "digest": state.digest()}, f)
dist.destroy_process_group()
