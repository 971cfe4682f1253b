"""A real 2-rank gloo job that fails after its first collective until the last attempt.

Each attempt: ``init_process_group("gloo")`` on the launcher's MASTER_ADDR/PORT, an
all_reduce (checked), then ``$DUMP_DIR/ok_<restart>_<rank>``. While
TORCHELASTIC_RESTART_COUNT < ``--fail-until``, rank 1 then exits 3 (once rank 0 has
written its ok file, so the collective finished everywhere) and rank 0 waits to be
stopped; on the last attempt both exit 0.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--fail-until", type=int, required=True)
args = p.parse_args()

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["DUMP_DIR"]

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(4) * (rank + 1)
dist.all_reduce(t)
assert t.tolist() == [world * (world + 1) / 2] * 4, t
open(os.path.join(out, f"ok_{restart}_{rank}"), "w").close()

if restart >= args.fail_until:
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)
if rank == 1:
    while not os.path.exists(os.path.join(out, f"ok_{restart}_0")):
        time.sleep(0.02)
    os._exit(3)
while True:
    time.sleep(1)
