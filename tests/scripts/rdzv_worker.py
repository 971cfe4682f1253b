"""A multi-node test worker: a real gloo group over the launcher's store, then a choice.

Every attempt: ``init_process_group("gloo")``, an all_reduce (checked), then
``$DUMP_DIR/ok_<restart>_<rank>.json`` with the torchrun variables it got.

    rdzv_worker.py [--min-world N] [--hold-until K] [--fail-rank R --fail-until K]

``--min-world N``: with fewer than N workers, write ``waiting_<restart>_<rank>`` and wait
(to be restarted) instead.
``--hold-until K``: while TORCHELASTIC_RESTART_COUNT < K, keep running after the
collective (until stopped). ``--fail-rank R --fail-until K``: rank R exits 3 after the
collective while TORCHELASTIC_RESTART_COUNT < K; its peers wait to be stopped.
"""

import argparse
import json
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--min-world", type=int, default=0)
p.add_argument("--hold-until", type=int, default=0)
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--fail-until", type=int, default=1 << 30)
args = p.parse_args()

env = {k: v for k, v in os.environ.items()
       if k.startswith(("RANK", "LOCAL_", "WORLD", "GROUP", "ROLE", "MASTER", "TORCHELASTIC",
                        "TP_RUN_"))}
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["DUMP_DIR"]
if int(os.environ["WORLD_SIZE"]) < args.min_world:
    open(os.path.join(out, f"waiting_{restart}_{os.environ['RANK']}"), "w").close()
    while True:
        time.sleep(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(2) * (rank + 1)
dist.all_reduce(t)
assert t.tolist() == [world * (world + 1) / 2] * 2, t
tmp = os.path.join(out, f".ok_{restart}_{rank}.tmp")
with open(tmp, "w") as f:
    json.dump(env, f)
os.replace(tmp, os.path.join(out, f"ok_{restart}_{rank}.json"))

if rank == args.fail_rank and restart < args.fail_until:
    os._exit(3)
if restart < args.hold_until or (args.fail_rank >= 0 and restart < args.fail_until):
    while True:
        time.sleep(1)
dist.barrier()
dist.destroy_process_group()
sys.exit(0)
