"""Writes this worker's argv and torchrun-related environment to $DUMP_DIR/<RANK>.json.

Also prints one line to stdout and one to stderr, for the log and console checks.
"""

import json
import os
import sys

PREFIXES = ("RANK", "LOCAL_", "WORLD", "GROUP", "ROLE", "MASTER", "TORCHELASTIC", "TORCH_NCCL",
            "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TP_CONF_")

out = {
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "executable": sys.executable,
    "env": {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)},
}
path = os.path.join(os.environ["DUMP_DIR"], f"{os.environ['RANK']}.json")
with open(path, "w") as f:
    json.dump(out, f)
print(f"dumped rank {os.environ['RANK']}")
print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr)
