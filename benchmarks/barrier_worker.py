"""Benchmark worker: gloo group, first barrier, timestamp; in attempt 0 rank 1 then dies.

Writes ``$BENCH_DIR/barrier_<restart>_<rank>`` (time.time() right after the first
barrier of the attempt) and, for the death, ``$BENCH_DIR/death`` (time.time() just
before rank 1 exits 1). Attempts after the first finish cleanly (exit 0).
"""

import datetime
import os
import sys
import time

import torch.distributed as dist

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["BENCH_DIR"]
die = os.environ.get("BENCH_RESTART", "1") == "1" and restart == 0


def write(name: str, value: float) -> None:
    tmp = os.path.join(out, f".{name}")
    with open(tmp, "w") as f:
        f.write(repr(value))
    os.replace(tmp, os.path.join(out, name))


# torchrun 2.13's restarts reuse the store and connectFullMesh can hang on a dead
# attempt's address for gloo's default 30 min: bound it so the launcher retries (counted).
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
dist.barrier()
rank = dist.get_rank()
write(f"barrier_{restart}_{rank}", time.time())

if not die:
    dist.destroy_process_group()
    sys.exit(0)
if rank == 1:
    # Let every rank record its barrier first, then die as a crashed worker would.
    while not all(os.path.exists(os.path.join(out, f"barrier_0_{r}"))
                  for r in range(dist.get_world_size())):
        time.sleep(0.01)
    write("death", time.time())
    os._exit(1)
while True:
    time.sleep(1)
