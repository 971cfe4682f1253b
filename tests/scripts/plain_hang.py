"""A plain torchrun script (no tp_launch API) that hangs on its first attempt.

Each rank joins a gloo group and all-reduces a few times, printing each step. On the
first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 1 stops printing and blocks in a
``threading.Event().wait()`` after step 2; rank 0 waits in its next all-reduce. Later
attempts finish, writing ``$DUMP_DIR/done_<restart>_<rank>``.
"""

import os
import threading

import torch
import torch.distributed as dist

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(5):
    if restart == 0 and rank == 1 and step == 3:
        threading.Event().wait()  # hung for good: no output, no collective
    t = torch.ones(2)
    dist.all_reduce(t)
    print(f"rank {rank} step {step}", flush=True)
open(os.path.join(os.environ["DUMP_DIR"], f"done_{restart}_{rank}"), "w").close()
dist.destroy_process_group()
