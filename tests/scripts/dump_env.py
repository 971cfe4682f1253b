"""Writes this worker's argv and torchrun-related environment to $DUMP_DIR/<RANK>.json."""

import json
import os
import sys

PREFIXES = ("RANK", "LOCAL_", "WORLD", "GROUP", "ROLE", "MASTER", "TORCHELASTIC", "TORCH_NCCL",
            "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")

out = {
    "argv": sys.argv,
    "executable": sys.executable,
    "env": {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)},
}
path = os.path.join(os.environ["DUMP_DIR"], f"{os.environ['RANK']}.json")
with open(path, "w") as f:
    json.dump(out, f)
print(f"dumped rank {os.environ['RANK']}")
