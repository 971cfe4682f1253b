"""A configurable test worker: one rank fails in a chosen way, its peers wait.

Every worker writes ``$DUMP_DIR/start_<restart>_<rank>`` when it starts (so tests can
count attempts and see TORCHELASTIC_RESTART_COUNT). A peer that receives SIGTERM or
SIGINT writes ``$DUMP_DIR/sig_<restart>_<rank>`` (the signal's name) and then dies by
that signal, as an unprepared worker would.

    worker.py [--fail-rank R] [--fail-mode raise|exit3|sigkill|none]
              [--fail-until K] [--peer sleep|ignore-term|exit0] [--helper]

``--fail-until K``: fail only while TORCHELASTIC_RESTART_COUNT < K (default: always).
The failing rank waits until every rank of its attempt has started.
``--helper``: each worker first starts a helper process of its own (a sleeping child, as
a data loader would), whose pid is in ``$DUMP_DIR/helper_<restart>_<rank>``.
"""

import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--fail-mode", default="exit3", choices=["raise", "exit3", "sigkill", "none"])
p.add_argument("--fail-until", type=int, default=1 << 30)
p.add_argument("--peer", default="sleep", choices=["sleep", "ignore-term", "exit0"])
p.add_argument("--helper", action="store_true")
args = p.parse_args()

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["DUMP_DIR"]


def write(name: str, text: str = "") -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))


def on_signal(signum, _frame):
    write(f"sig_{restart}_{rank}", signal.Signals(signum).name)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if args.peer == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
if args.helper:
    import subprocess

    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    write(f"helper_{restart}_{rank}", str(helper.pid))
write(f"start_{restart}_{rank}", str(os.getpid()))
print(f"rank {rank} started (restart {restart})", flush=True)

failing = rank == args.fail_rank and args.fail_mode != "none" and restart < args.fail_until
if not failing:
    if args.fail_rank < 0 or args.peer == "exit0" or restart >= args.fail_until:
        sys.exit(0)
    while True:
        time.sleep(1)

while not all(os.path.exists(os.path.join(out, f"start_{restart}_{r}")) for r in range(world)):
    time.sleep(0.05)
if args.fail_mode == "exit3":
    print(f"rank {rank} exits 3", file=sys.stderr, flush=True)
    sys.exit(3)
if args.fail_mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402


@record
def main() -> None:
    raise RuntimeError(f"deliberate failure on rank {rank}")


main()
