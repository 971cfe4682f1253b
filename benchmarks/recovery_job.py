"""The job of benchmarks/recovery.py: data-parallel training on a model of a chosen state size.

    recovery_job.py --state-mb M --steps N [--kill-step K] [--optimizer adamw|sgd]
                    [--mode resilient|checkpoint] [--ckpt-every C]
    recovery_job.py --mode p2p --state-mb M [--optimizer adamw|sgd] [--reps R]

The model is a stack of square Linear layers (width 1024, or 256 below 4 Mi parameters)
sized so that parameters plus optimizer state come to about M MB (:func:`layout`):
AdamW (the default) keeps ``exp_avg`` and ``exp_avg_sq`` beside each parameter, 12 bytes
per parameter; SGD with momentum its ``momentum_buffer``, 8 bytes. The optimizer state
exists from the start (created as the optimizer's first step would, zeros), so the state
that a recovery moves has its full size from step 1. Every committed step appends
"<step> <time>" to ``$BENCH_OUT/steps_<rank>_<pid>``. With ``--kill-step K``, rank 1 writes
the time to ``$BENCH_OUT/killed`` and SIGKILLs itself right after step K (once per job;
in resilient mode only once a spare is parked: the first generation's ranks wait for it
before their first step, so that the steps before the kill are the steady state).
``--mode resilient`` uses tp_launch.resilient; ``--mode checkpoint`` is the classic
script: rank 0 saves model and optimizer with torch.save every C steps, and a restarted
job (TORCHELASTIC_RESTART_COUNT > 0) loads the latest checkpoint and recomputes from
there.

``--mode p2p`` (two processes, any launcher) measures gloo's point-to-point rate for the
same state: rank 1 sends as many bytes as the model's parameters and optimizer state
hold to rank 0 the way one donor would, as 4 MiB tensors back to back (all ``isend``,
then all ``wait``), into receive buffers allocated beforehand (all ``irecv``); timed on
rank 0 from a barrier to the last receive done: first the new pair's first transfer
(receive buffers touched beforehand, as a spare's parameters are; a recovery's transfer
is always its pair's first), then ``--reps`` more on the warmed pair. Rank 0 writes
"<bytes> <first seconds> <seconds> ..." to ``$BENCH_OUT/p2p``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BYTES_PER_PARAM = {"adamw": 12, "sgd": 8}  # float32 parameter + its optimizer state
CHUNK = 4 * 1024 * 1024  # bytes of one p2p send: a 1024x1024 float32 weight's

p = argparse.ArgumentParser()
p.add_argument("--state-mb", type=float, default=10)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--kill-step", type=int, default=-1)
p.add_argument("--optimizer", default="adamw", choices=sorted(BYTES_PER_PARAM))
p.add_argument("--mode", default="resilient", choices=["resilient", "checkpoint", "p2p"])
p.add_argument("--ckpt-every", type=int, default=10)
p.add_argument("--reps", type=int, default=3, help="p2p mode: timed transfers")
args = p.parse_args()
OUT = os.environ["BENCH_OUT"]
CKPT = os.path.join(OUT, "ckpt.pt")


def layout(state_mb: float, optimizer: str) -> tuple[int, int]:
    """(width, layers): Linear(width, width) layers (w*w + w parameters each) whose
    parameters and optimizer state come nearest to ``state_mb`` MB."""
    params = state_mb * 1e6 / BYTES_PER_PARAM[optimizer]
    width = 1024 if params > 4 * 1024 * 1024 else 256
    return width, max(1, round(params / (width * width + width)))


width, layers = layout(args.state_mb, args.optimizer)
# The state a donor sends: the float32 parameters and their optimizer state (AdamW's
# step counters, 4 bytes per parameter tensor, left out: a few hundred bytes).
STATE_BYTES = layers * (width * width + width) * BYTES_PER_PARAM[args.optimizer]


def p2p() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [min(CHUNK, STATE_BYTES - i) // 4 for i in range(0, STATE_BYTES, CHUNK)]
    tensors = [torch.ones(n) if rank == 1 else torch.empty(n) for n in sizes]

    def transfer(ts: list[torch.Tensor]) -> None:
        ops = dist.isend if rank == 1 else dist.irecv
        for work in [ops(t, 1 - rank) for t in ts]:
            assert work is not None
            work.wait()

    for t in tensors:  # touched, as a spare's parameters are
        t.zero_() if rank == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    transfer(tensors)  # the first transfer of a new pair, as a recovery's is
    took = [time.perf_counter() - t0]
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        transfer(tensors)
        took.append(time.perf_counter() - t0)
    if rank == 0:
        with open(os.path.join(OUT, "p2p"), "w") as f:
            f.write(" ".join(map(str, [STATE_BYTES, *took])))
    dist.barrier()
    dist.destroy_process_group()


if args.mode == "p2p":
    p2p()
    raise SystemExit(0)

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
opt: torch.optim.Optimizer
if args.optimizer == "adamw":
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for prm in model.parameters():  # AdamW's state as its first step creates it (torch 2.13)
        opt.state[prm].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(prm),
                              exp_avg_sq=torch.zeros_like(prm))
else:
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
        wait_for_spare()
    with open(os.path.join(OUT, "killed"), "w") as f:
        f.write(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def wait_for_spare() -> None:
    """Until the spare (started when the ranks reach run()) has parked: the steps before
    the kill then time the steady state, not the spare's start beside them."""
    from tp_launch.resilient import parked_spares

    deadline = time.monotonic() + 300
    while parked_spares() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)


def train(steps: Iterable[int], fresh: bool = False) -> None:
    # Resilient mode has just agreed the state on every rank: DDP's own broadcast of the
    # parameters from rank 0 would move the whole model again.
    ddp = DDP(model, init_sync=args.mode != "resilient")
    rank = dist.get_rank()
    if fresh and args.kill_step >= 0:
        wait_for_spare()
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
    resilient.run(lambda s: train(s.steps(args.steps), fresh=s.step == 0), state)
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
