"""The benchmark's training job: one data-parallel MLP, three ways to survive failures.

    train_job.py --steps N [--ckpt-every C] [--resilient] [--width W] [--depth D]

Every rank trains the same MLP with DDP over gloo on data that is a pure function of
(step, rank), so two runs that take the same optimizer steps end with bit-identical
parameters, however often they were interrupted. The gradient all-reduce is
:func:`tp_launch.resilient.ddp.ordered_allreduce_hook` (sums in rank order) so that a
DDP rebuilt after a restart or a recovery reduces exactly like the first one did.

- default (torchrun / tp-run compatible mode): ``init_process_group`` then train. With
  ``--ckpt-every C`` rank 0 saves model + optimizer + step with ``torch.save`` every C
  steps (write to a temporary file, then atomic rename) and every attempt resumes from
  the newest checkpoint: the classic checkpoint-restart recipe under ``--max-restarts``.
- ``--resilient``: the same training function under ``tp_launch.resilient.run``; no
  checkpoints, a dead rank is replaced by a parked spare.

Outputs, under ``$BENCH_DIR`` (the harness reads them while the job runs):
``progress_<pid>.txt`` one line "rank step wall_time" per committed step (the harness
kills a rank when its line reaches the scheduled step); ``parked_<pid>`` for a process
that reached ``resilient.run`` (a spare, until it gets a rank); ``final.json`` (rank 0)
with the committed step and the sha256 of the parameters.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

logger = logging.getLogger(__name__)

try:  # bit-exact reduction across DDP rebuilds; a plain all-reduce if tp_launch is absent
    from tp_launch.resilient.ddp import ordered_allreduce_hook
except ImportError:  # pragma: no cover - the benchmark runs inside the repository
    ordered_allreduce_hook = None

BATCH = 64


def build_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank and every run
    layers: list[nn.Module] = [nn.Linear(32, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic data: a function of (step, rank) only, never of the history."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH, 32, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.05 * torch.randn(BATCH, 1, generator=g)
    return x, y


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        t = t.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ckpt-every", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--resilient", action="store_true")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--init-timeout", type=float, default=60.0,
                   help="process-group timeout (s) of the non-resilient path")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds after each step (the smoke test's tiny model only)")
    args = p.parse_args()
    out = os.environ["BENCH_DIR"]
    ckpt = os.path.join(out, "ckpt.pt")

    model = build_model(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    progress = open(os.path.join(out, f"progress_{os.getpid()}.txt"), "a", buffering=1)

    def train(steps) -> None:  # type: ignore[no-untyped-def]
        ddp = DDP(model)  # inside: under resilient mode the group is new each time
        if ordered_allreduce_hook is not None:
            ddp.register_comm_hook(None, ordered_allreduce_hook)
        rank = dist.get_rank()
        for step in steps:
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            # Reported after the commit: the harness's kill lands after this step.
            progress.write(f"{rank} {step + 1} {time.time():.6f}\n")
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if args.ckpt_every and rank == 0 and (step + 1) % args.ckpt_every == 0:
                tmp = ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, tmp)
                os.replace(tmp, ckpt)  # a kill mid-save never leaves a torn checkpoint

    if args.resilient:
        from tp_launch import resilient

        state = resilient.State(model=model, optimizer=opt)
        open(os.path.join(out, f"parked_{os.getpid()}"), "w").close()
        resilient.run(lambda s: train(s.steps(args.steps)), state)
        final_step = state.step
    else:
        # A bounded timeout: torchrun 2.13 restarts reuse the store, and a restarted
        # group can then wait forever (default 30 min) in init; 60 s makes that attempt
        # fail so the launcher retries (the time is counted against the strategy).
        # (It bounds collectives too: far above any step time here.)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.init_timeout))
        start = 0
        if args.ckpt_every and os.path.exists(ckpt):
            saved = torch.load(ckpt, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["step"]
        train(range(start, args.steps))
        final_step = args.steps
    if dist.get_rank() == 0:
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"step": final_step, "checksum": checksum(model), "pid": os.getpid()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
