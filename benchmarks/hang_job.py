"""The job of ``hang_detection.py``: a small DDP job whose rank 1 stops at step 20.

    hang_job.py --out DIR [--steps 40] [--stop-at 20]

Resilient mode (``state.steps``), 4 ranks expected. Rank 1's first process (not the
spare that takes its rank) writes ``DIR/stop_t`` (time.time()) and SIGSTOPs itself at
the start of step ``--stop-at``, once the agent has a spare parked.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tp_launch import resilient

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--stop-at", type=int, default=20)
args = p.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
FIRST = os.environ.get("TP_RUN_SPARE") != "1"


def train(state: resilient.State) -> None:
    ddp = DDP(model)
    rank = dist.get_rank()
    for step in state.steps(args.steps):
        if step == args.stop_at and rank == 1 and FIRST:
            with state.long_phase(300):  # waiting for the spare is not the hang
                while resilient.parked_spares() < 1:
                    time.sleep(0.05)
            with open(os.path.join(args.out, "stop_t"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        g = torch.Generator().manual_seed(step * 100 + rank)
        loss = ddp(torch.randn(32, 64, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.01)


resilient.run(train, resilient.State(model=model, optimizer=opt))
dist.destroy_process_group()
