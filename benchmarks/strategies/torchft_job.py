"""The benchmark's training job under TorchFT: one replica group per "rank".

    torchrun --nproc-per-node 1 --max-restarts R --master-port P torchft_job.py \
        --steps N --replica-id I

This is torchft's own ``train_ddp.py`` recipe on the benchmark's model and data
(:mod:`train_job`): each replica group is a separate torchrun job of one process
(``REPLICA_GROUP_ID`` = ``--replica-id``), all groups meet at a ``torchft_lighthouse``
(``TORCHFT_LIGHTHOUSE``), gradients are averaged across the groups that are in the
step's quorum by ``torchft.DistributedDataParallel`` over ``torchft.ProcessGroupGloo``,
and ``torchft.Optimizer`` only steps when the manager agrees the step can commit. A
killed group is restarted by its own torchrun (``--max-restarts``) and catches up by
fetching the live state from a healthy group (torchft's checkpoint transport) at the
next quorum; the others go on without it meanwhile (``min_replica_size=1``).

Data of replica I at step s is ``batch(s, I)``: the same as rank I of the other
strategies. Steps taken while a group is missing average fewer batches, so TorchFT's
final parameters are not expected to equal the failure-free run's; the harness
reports whether they do.

Outputs under ``$BENCH_DIR``: ``progress_<pid>.txt`` "replica step wall_time" per
committed step; ``attempts_<pid>.txt`` one line per iteration that did not commit;
``final.json`` from replica 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from datetime import timedelta

import torch
from torch import nn

from train_job import batch, build_model, checksum  # same directory: same model and data

logger = logging.getLogger(__name__)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds after each step (the smoke test's tiny model only)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="torchft collective / RPC timeout (s): bounds a survivor's wait on a dead peer")
    args = p.parse_args()
    out = os.environ["BENCH_DIR"]

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    model = build_model(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bench_{args.replica_id}", timeout=timeout,
                      quorum_timeout=timedelta(seconds=60))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        # First launch: wait until every group's manager is up (heartbeating), so the
        # first quorum has all of them, as the other strategies start with all ranks.
        open(os.path.join(out, f"ready_{args.replica_id}"), "w").close()
        while not all(os.path.exists(os.path.join(out, f"ready_{i}"))
                      for i in range(args.replicas)):
            time.sleep(0.02)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, opt)
    progress = open(os.path.join(out, f"progress_{os.getpid()}.txt"), "a", buffering=1)
    attempts = open(os.path.join(out, f"attempts_{os.getpid()}.txt"), "a", buffering=1)
    while manager.current_step() < args.steps:
        before = manager.current_step()
        optimizer.zero_grad()  # starts the quorum: a recovering group loads the state here
        x, y = batch(manager.current_step(), args.replica_id)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()  # steps only if every group in the quorum committed
        if manager.current_step() > before:
            progress.write(f"{args.replica_id} {manager.current_step()} {time.time():.6f}\n")
        else:
            attempts.write(f"{args.replica_id} {before} {time.time():.6f}\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if args.replica_id == 0:
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"step": manager.current_step(), "checksum": checksum(model),
                       "pid": os.getpid()}, f)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
