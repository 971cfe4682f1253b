"""A resilient DDP job for the tests: deterministic data, chosen failures, a record of pids.

    resilient_train.py --steps N [--kill RANK:STEP:WHERE,...] [--crash-step S]
                       [--sabotage donor|newcomer] [--step-sleep SECONDS] [--hold-at S]

WHERE is ``forward`` (a forward pre-hook), ``allreduce`` (inside DDP's gradient
all-reduce: the communication hook), or ``after-step`` (right after optimizer.step()).
Each kill happens once per job (a marker file in $OUT), by SIGKILL to the process
itself. ``--crash-step S``: every rank raises at step S, every time (a script bug), once
``--parked`` spares are parked. ``--hold-at S``: after step S each rank (once) waits for
``$OUT/release``, so a test can act while the job is mid-run. ``--sabotage``: a
registered object that SIGKILLs its process while the state is moved (``donor``: when a
donor snapshots it; ``newcomer``: when a newcomer loads it; ``newcomer-stop``: the
newcomer SIGSTOPs itself there instead), once.
``--hang RANK:STEP:WHERE:HOW``: the rank (``all``: every rank) hangs there once per job,
HOW = ``stop`` (SIGSTOP
to itself: a stopped process) or ``deadlock`` (its main thread blocks for good, as in a
deadlocked data loader; WHERE ``loader`` fetches the batch); the time is written to
``$OUT/hang_t``. WHERE also takes ``optimizer`` (inside ``optimizer.step()``).
``--collective-timeout S``: the group's timeout (``run(timeout=)``).
``--slow RANK:SECONDS``: the rank's first process (not a spare that takes it later)
sleeps that long in every step (a throttled GPU). ``--eval-every N --eval-s S``: after
every N steps rank 0 alone evaluates for S seconds (no collective; ``--eval-marked``:
inside ``state.long_phase()``).
``--loader-workers N``: the batches come from a torch DataLoader with N worker processes
(forked by the rank after the group formed: they hold copies of its gloo sockets); HOW
``worker-deadlock`` with WHERE ``loader``: the rank's loader worker that fetches that
step's batch blocks for good instead.
``--rank-at-import``: read RANK at import, as many scripts do (a spare, which has no
RANK, fails there). ``--spare-dies-parked``: a spare SIGKILLs itself as soon as the agent
counts a parked spare (it parks, then dies, every time).

Outputs in $OUT: ``entry_<pid>`` lines "rank step world" at each (re)entry of train,
``final_<rank>.json`` {pid, step, checksum} at the end. With ``--no-resilient`` the
same training runs as a plain torchrun script (the reference run).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import inspect
import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--kill", default="")
p.add_argument("--crash-step", type=int, default=-1)
p.add_argument("--sabotage", default="", choices=["", "donor", "newcomer", "newcomer-stop"])
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--width", type=int, default=32)
p.add_argument("--no-resilient", action="store_true")
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
p.add_argument("--parked", type=int, default=1, help="spares that must be parked before a kill")
p.add_argument("--hold-at", type=int, default=-1,
               help="after this step, each rank writes $OUT/held_<rank> and waits for $OUT/release")
p.add_argument("--rank-at-import", action="store_true")
p.add_argument("--hang", default="")
p.add_argument("--collective-timeout", type=float, default=0.0)
p.add_argument("--slow", default="")
p.add_argument("--eval-every", type=int, default=0)
p.add_argument("--eval-s", type=float, default=0.0)
p.add_argument("--eval-marked", action="store_true")
p.add_argument("--spare-dies-parked", action="store_true")
p.add_argument("--loader-workers", type=int, default=0)
args = p.parse_args()
if args.rank_at_import:
    RANK_AT_IMPORT = int(os.environ["RANK"])
OUT = os.environ["OUT"]
KILLS = [tuple(k.split(":")) for k in args.kill.split(",") if k]
HANG = tuple(args.hang.split(":")) if args.hang else None
SLOW = (int(args.slow.split(":")[0]), float(args.slow.split(":")[1])) if args.slow else None


def once(name: str) -> bool:
    """True the first time in the whole job (across processes)."""
    try:
        fd = os.open(os.path.join(OUT, f"marker_{name}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wait_parked(count: int) -> None:
    """Block until the agent has ``count`` parked spares (so a kill finds one)."""
    from tp_launch.resilient import parked_spares

    # Waiting for the agent is not a hang (--hang-timeout): a phase marked long.
    state = STATE[0]
    with state.long_phase(120) if hasattr(state, "long_phase") else contextlib.nullcontext():
        while "TP_RUN_CHANNEL" in os.environ and parked_spares() < count:
            time.sleep(0.05)


def together(step: int, where: str) -> None:
    """Ranks killed at the same point die together: each waits (bounded) until all are
    there, so that "two ranks at once" does not depend on the machine's load."""
    peers = [r for r, s, w in KILLS if int(s) == step and w == where]
    open(os.path.join(OUT, f"ready_{dist.get_rank()}_{step}_{where}"), "w").close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(OUT, f"ready_{r}_{step}_{where}")) for r in peers):
        time.sleep(0.01)


def maybe_hang(where: str, step: int) -> None:
    if HANG is None:
        return
    r, s, w, how = HANG
    rank = dist.get_rank()
    marker = "hang" if r != "all" else f"hang_{rank}"
    if (r == "all" or int(r) == rank) and int(s) == step and w == where \
            and not os.path.exists(os.path.join(OUT, f"marker_{marker}")):
        wait_parked(args.parked)
        if once(marker):
            with open(os.path.join(OUT, "hang_t"), "w") as f:
                f.write(repr(time.time()))
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                threading.Event().wait()  # never set: blocked for good, the GIL released


def maybe_kill(where: str, step: int) -> None:
    maybe_hang(where, step)
    rank = dist.get_rank()
    for r, s, w in KILLS:
        if int(r) == rank and int(s) == step and w == where:
            wait_parked(args.parked)
            if once(f"{r}_{s}_{w}"):
                together(step, where)
                die()


TRAINING = threading.Event()  # set once train() runs here (a promoted spare included)
STATE: list = [None]  # the resilient state, once train() runs


def die_when_parked() -> None:
    from tp_launch.resilient import parked_spares

    while not TRAINING.is_set():
        if parked_spares() >= 1:
            die()
        time.sleep(0.05)


if args.spare_dies_parked and os.environ.get("TP_RUN_SPARE") == "1":
    threading.Thread(target=die_when_parked, daemon=True).start()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(16, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=g)
    return x.to(DEVICE), y.to(DEVICE)


class StepBatches(torch.utils.data.Dataset):
    """Item ``step``: (step, this rank's batch of that step), fetched by loader workers."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return args.steps

    def __getitem__(self, step: int):
        if HANG is not None and HANG[2] == "loader" and HANG[3] == "worker-deadlock" \
                and int(HANG[0]) == self.rank and int(HANG[1]) == step and once("hang"):
            from tp_launch.resilient import parked_spares

            while "TP_RUN_CHANNEL" in os.environ and parked_spares() < args.parked:
                time.sleep(0.05)  # (a loader worker prefetches: maybe before any spare)
            with open(os.path.join(OUT, "hang_t"), "w") as f:
                f.write(repr(time.time()))
            threading.Event().wait()  # this loader worker, blocked for good
        return step, batch(step, self.rank)


def loader_batches(first: int, rank: int):
    """The batches from ``first`` on, through ``--loader-workers`` worker processes."""
    loader = torch.utils.data.DataLoader(StepBatches(rank), batch_size=None,
                                         sampler=range(first, args.steps),
                                         num_workers=args.loader_workers)
    for step, xy in loader:
        yield step, xy


class Saboteur:
    """Registered state that kills its process while the state is being moved (the
    transfer's functions are on the stack: not a commit's or a rollback's call)."""

    def __init__(self) -> None:
        self.entered = 0

    def state_dict(self) -> dict:
        if args.sabotage == "donor" and self.entered > 1 and _in("send_state") \
                and once("sabotage_donor"):
            die()
        return {"blob": torch.zeros(64)}

    def load_state_dict(self, sd: dict) -> None:
        if args.sabotage == "newcomer" and _in("recv_state") and once("sabotage_newcomer"):
            die()
        if args.sabotage == "newcomer-stop" and _in("recv_state") and once("sabotage_stop"):
            os.kill(os.getpid(), signal.SIGSTOP)  # a newcomer that hangs mid-transfer


def _in(function: str) -> bool:
    return any(f.function == function for f in inspect.stack(0))


if args.device == "cuda":  # a spare's LOCAL_RANK is its own (spare) device
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
DEVICE = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else None
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, args.width), nn.Tanh(), nn.Linear(args.width, 1)).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
opt.register_step_post_hook(lambda *_: maybe_hang("optimizer", current[0]))
SLOW_HERE = SLOW is not None and os.environ.get("TP_RUN_SPARE") != "1"
saboteur = Saboteur()
current = [0]  # the step in flight, for the hooks
model.register_forward_pre_hook(lambda *_: maybe_kill("forward", current[0]))


def checksum(m: nn.Module) -> str:
    h = hashlib.sha256()
    for t in m.state_dict().values():
        t = t.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
    return h.hexdigest()


def train(state) -> str:
    TRAINING.set()
    STATE[0] = state
    saboteur.entered += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(OUT, f"entry_{os.getpid()}"), "a") as f:
        f.write(f"{rank} {state.step} {world}\n")
    ddp = DDP(model, device_ids=[DEVICE] if DEVICE is not None else None)

    def comm_hook(process_group, bucket):
        maybe_kill("allreduce", current[0])
        return allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, comm_hook)
    fetched = loader_batches(state.step, rank) if args.loader_workers else None
    for step in steps(state):
        current[0] = step
        if step == args.crash_step:
            wait_parked(args.parked)  # a bug, not a lack of spares, must stop the job
            raise ValueError(f"deliberate bug at step {step}")
        if fetched is None:
            maybe_hang("loader", step)
            x, y = batch(step, rank)
        else:
            if HANG is not None and HANG[3] == "worker-deadlock" and int(HANG[0]) == rank \
                    and int(HANG[1]) == step:
                wait_parked(args.parked)  # (marked long: the loader worker waits for it too)
            got, (x, y) = next(fetched)
            assert got == step, (got, step)
        if SLOW_HERE and rank == SLOW[0]:
            time.sleep(SLOW[1])
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        maybe_kill("after-step", step)
        if step == args.hold_at and once(f"hold_{rank}"):
            open(os.path.join(OUT, f"held_{rank}"), "w").close()
            while not os.path.exists(os.path.join(OUT, "release")):
                time.sleep(0.05)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.eval_every and (step + 1) % args.eval_every == 0 and rank == 0:
            evaluate(state)
    return checksum(model)


def evaluate(state) -> None:
    """Rank 0 alone, no collective: the others wait for it in the next step."""
    marked = args.eval_marked and hasattr(state, "long_phase")
    with state.long_phase(60) if marked else contextlib.nullcontext():
        time.sleep(args.eval_s)


def steps(state):  # the resilient loop, or a plain range for the reference run
    return state.steps(args.steps) if hasattr(state, "steps") else range(args.steps)


if args.no_resilient:
    dist.init_process_group("gloo")

    class _Plain:
        step = 0

    result = train(_Plain())
    final_step = args.steps
else:
    from tp_launch import resilient

    state = resilient.State(model=model, optimizer=opt, saboteur=saboteur)
    import datetime

    timeout = datetime.timedelta(seconds=args.collective_timeout) \
        if args.collective_timeout else None
    result = resilient.run(train, state, timeout=timeout)
    final_step = state.step
with open(os.path.join(OUT, f"final_{dist.get_rank()}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "step": final_step, "checksum": result}, f)
dist.destroy_process_group()
