"""Recovery cost: tp-run's spare promotion, its phases, and gloo's own rate beside it.

    python benchmarks/recovery.py [--sizes 10,126,1000] [--ranks 2,4] [--reps 2]
                                  [--optimizer adamw|sgd] [--skip-restart] [--no-one-donor]
                                  [--restart-launcher tp-run|torchrun]

For each world size (``--ranks``) and state size (``--sizes``, MB of parameters plus
optimizer state: with AdamW, the default, 12 bytes per parameter, so 126 MB is a
10.5 M-parameter model of 1024x1024 Linear layers), the same data-parallel job
(``recovery_job.py``) runs ``--reps`` times under tp-run with ``--spares 1``: rank 1 is
SIGKILLed right after step K (once a spare is parked), the spare takes its place and
the state moves to it over gloo. From the agent's ``recovery.jsonl`` and the steps'
timestamps, the table gives the medians of:

- **kill -> resumed** (every rank back in the script with the state), next to its aim,
  0.1 s plus the bytes moved at gloo's point-to-point rate measured in the same run;
- its phases: detect (kill -> the agent saw the death), decide, rebuild (the new group),
  agree, transfer, verify, then, under their own names, any other duration the record
  carries (``*_s`` fields beyond these, e.g. ``handoff_s``; ``check_s``, the replicas'
  check in the first step, where the agent reports it; a field a record lacks or has
  null shows as "?", and a line under the table names it);
- **first step**: from resumed to the first step completed after it on the slowest rank,
  against the run's normal step (rank 0's median step interval before the kill, after
  ``--warmup`` steps; the ranks start stepping once the spare has parked, so these are
  the steady state); aim: at most 1.2x;
- bytes moved (``bytes``: what the receivers received), the transfer's rate
  (bytes / ``transfer_s``), **gloo's point-to-point rate** for the same number of bytes,
  and the transfer's rate as a share of it (aim: at least 80 %);
- kill -> the first step past K completed again.

Beyond 2 ranks several survivors hold the state and each sends the newcomer a share of
its large tensors; each such run is paired with one where only one donor sends
(``TP_RUN_DONORS=1``, ``--no-one-donor`` to skip), its own row ("donors" column).

Gloo's rate comes from ``recovery_job.py --mode p2p`` under ``torchrun --standalone``
(two processes): rank 1 sends the state's bytes to rank 0 as one donor would, 4 MiB
tensors back to back (all isend, then all wait) into receive buffers allocated
beforehand, timed from a barrier to the last receive, median of 3. It is measured for
each size before the recovery runs and again after them; the header gives both, the
table uses the median of all six.

Unless ``--skip-restart``, at the first world size only (to keep the default run short)
and interleaved repetition by repetition, the same job also runs as a classic
checkpointing script (**restart from checkpoint**, torchrun's way): every worker
restarts (``--max-restarts``) and the script reloads its last checkpoint (torch.save
every C steps): the same kill; the time until a step past K is completed again, split
into restart (kill -> the restarted script starts loading), checkpoint load, and
recomputation of the steps since the checkpoint. Its launcher is tp-run in compatible
mode by default: torchrun 2.13's own restarts mostly fail on this machine (its reused
store: "connectFullMesh ... Connection refused", 5 of 5 attempts in one measured run), so
``--restart-launcher torchrun`` measures them only with luck.

The defaults (3 sizes x 2 world sizes x 2 reps, the restart baseline at 2 ranks) should
take 10-20 minutes on a 2-core machine (an estimate from 10 MB and 126 MB runs; the 1 GB
runs are most of it) and about 10 GB of memory at 1 GB x 4 ranks (every rank and the
spare hold the state, DDP its gradient buckets beside). On a shared machine compare the
columns of one run (the transfer against the gloo rate measured beside it), not
separate runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "recovery_job.py")
REPO = os.path.dirname(HERE)

# recovery.jsonl's durations shown as phases, in this order, with the table's names.
PHASES = {"decide_s": "decide", "rebuild_s": "rebuild", "agree_s": "agree",
          "transfer_s": "transfer", "verify_s": "verify"}
# Durations of the record that are not phases of kill -> resumed (shown otherwise).
NOT_PHASES = {"resumed_s", "first_step_s", "total_s"}
EXPECTED = ["detected_at", *PHASES, "resumed_s", "first_step_s", "bytes"]
FIRST_STEP_AIM = 1.2
RATE_AIM = 0.8


def _env(out: str) -> dict[str, str]:
    env = dict(os.environ, BENCH_OUT=out, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], out: str, timeout: float = 1800,
         extra_env: Optional[dict[str, str]] = None) -> None:
    proc = subprocess.run(cmd, env={**_env(out), **(extra_env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def _steps(out: str) -> dict[int, list[tuple[int, float]]]:
    """rank -> its (step, time) completions, every process of the rank together."""
    found: dict[int, list[tuple[int, float]]] = {}
    for path in glob.glob(os.path.join(out, "steps_*")):
        rank = int(os.path.basename(path).split("_")[1])
        with open(path) as f:
            found.setdefault(rank, []).extend(
                (int(a), float(b)) for a, b in (line.split() for line in f if line.strip()))
    return {r: sorted(v, key=lambda st: st[1]) for r, v in found.items()}


def _back_at(out: str, killed: float, kill_step: int) -> float:
    """First completion of a step past the kill step, after the kill."""
    return min(t for steps in _steps(out).values() for s, t in steps
               if s > kill_step and t > killed) - killed


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def p2p_rate(size: float, optimizer: str, reps: int = 3) -> tuple[int, list[float]]:
    """(bytes, rates in bytes/s): gloo's point-to-point rate for the state of ``size``,
    the new pair's first transfer first, then the warmed pair's."""
    out = tempfile.mkdtemp(prefix="tp-bench-")
    try:
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2", JOB, "--mode", "p2p", "--state-mb", str(size),
              "--optimizer", optimizer, "--reps", str(reps)], out, timeout=600)
        nbytes, *took = open(os.path.join(out, "p2p")).read().split()
        return int(nbytes), [int(nbytes) / float(t) for t in took]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def resilient_recovery(size: float, nproc: int, args: argparse.Namespace,
                       donors: int = 0) -> dict[str, Any]:
    """One killed run under tp-run --spares 1: its recovery record's durations (None
    where the record lacks them), the first step and the normal step. ``donors``: the
    most survivors sending to the newcomer (``TP_RUN_DONORS``; 0: every one)."""
    out = tempfile.mkdtemp(prefix="tp-bench-")
    try:
        logs = os.path.join(out, "logs")
        _run([sys.executable, "-m", "tp_launch", "--nproc-per-node", str(nproc), "--spares", "1",
              "--log-dir", logs, JOB, "--state-mb", str(size), "--steps", str(args.steps),
              "--kill-step", str(args.kill_step), "--optimizer", args.optimizer], out,
             timeout=args.run_timeout, extra_env={"TP_RUN_DONORS": str(donors)})
        killed = float(open(os.path.join(out, "killed")).read())
        events = [e for p in glob.glob(os.path.join(logs, "*", "recovery.jsonl"))
                  for e in (json.loads(line) for line in open(p) if line.strip())
                  if e.get("event", "recovery") == "recovery"]
        if len(events) != 1:
            raise RuntimeError(f"{len(events)} recovery records in {logs}, expected 1")
        event = events[0]
        steps = _steps(out)
        rank0 = [t for s, t in steps[0] if s >= args.warmup and s <= args.kill_step]
        detected = _num(event.get("detected_at"))
        resumed_s = _num(event.get("resumed_s"))
        r: dict[str, Any] = {
            "missing": [k for k in EXPECTED if _num(event.get(k)) is None],
            "back": _back_at(out, killed, args.kill_step),
            "normal": statistics.median(b - a for a, b in zip(rank0, rank0[1:])),
            "detect": None if detected is None else detected - killed,
            "resumed": None, "first_step": None,
            "bytes": _num(event.get("bytes")),
            # Every duration of the record, the phases and any other one.
            "phases": {k: _num(v) for k, v in event.items()
                       if k.endswith("_s") and k not in NOT_PHASES},
        }
        if detected is not None and resumed_s is not None:
            at = detected + resumed_s
            r["resumed"] = at - killed
            firsts = [min((t for _, t in v if t > at), default=None) for v in steps.values()]
            if None not in firsts:
                r["first_step"] = max(t for t in firsts if t is not None) - at
        return r
    finally:
        shutil.rmtree(out, ignore_errors=True)


LAUNCHERS = {"tp-run": [sys.executable, "-m", "tp_launch"],
             "torchrun": [sys.executable, "-m", "torch.distributed.run"]}


def checkpoint_restart(size: float, nproc: int, args: argparse.Namespace) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix="tp-bench-")
    try:
        _run([*LAUNCHERS[args.restart_launcher], "--nproc-per-node", str(nproc),
              "--max-restarts", "5", JOB, "--mode", "checkpoint", "--state-mb", str(size),
              "--optimizer", args.optimizer, "--steps", str(args.steps),
              "--kill-step", str(args.kill_step), "--ckpt-every", str(args.ckpt_every)], out)
        killed = float(open(os.path.join(out, "killed")).read())
        start, t0, t1, attempts = map(float, open(os.path.join(out, "loaded_0")).read().split())
        back = _back_at(out, killed, args.kill_step)
        return {"total": back, "restart": t0 - killed, "load": t1 - t0,
                "recompute": back - (t1 - killed), "recomputed_steps": args.kill_step - start,
                "attempts": attempts}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _med(values: list[Any]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ms(v: Optional[float]) -> str:
    if v is None:
        return "?"
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def _rate(bps: Optional[float]) -> str:
    return "?" if bps is None else f"{bps / 1e9:.2f} GB/s"


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,126,1000", help="state sizes in MB")
    ap.add_argument("--ranks", default="2,4", help="world sizes")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--kill-step", type=int, default=10)
    ap.add_argument("--steps", type=int, default=None, help="default: kill step + 3")
    ap.add_argument("--warmup", type=int, default=3,
                    help="steps left out of the normal step time")
    ap.add_argument("--ckpt-every", type=int, default=6)
    ap.add_argument("--skip-restart", action="store_true",
                    help="no restart-from-checkpoint baseline (by default it runs at the "
                    "first world size)")
    ap.add_argument("--run-timeout", type=float, default=600,
                    help="seconds before a tp-run run counts as failed (hung)")
    ap.add_argument("--no-one-donor", action="store_true",
                    help="beyond 2 ranks, do not also run with one donor (TP_RUN_DONORS=1)")
    ap.add_argument("--restart-launcher", default="tp-run", choices=sorted(LAUNCHERS),
                    help="launcher of the restart-from-checkpoint baseline (torchrun 2.13's "
                    "restarts mostly fail here: its reused store)")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = args.kill_step + 3
    sizes = [float(s) for s in args.sizes.split(",")]
    worlds = [int(w) for w in args.ranks.split(",")]
    load0 = os.getloadavg()[0]

    before = {size: p2p_rate(size, args.optimizer) for size in sizes}
    runs: dict[tuple[int, float, int], list[dict[str, Any]]] = {}
    restarts: dict[tuple[int, float], list[dict[str, float]]] = {}
    failed: dict[tuple[int, float, int], int] = {}
    for world in worlds:
        for size in sizes:
            for _ in range(args.reps):
                # Beyond 2 ranks several survivors hold the state: each sends a share,
                # and, interleaved, only one does (TP_RUN_DONORS=1).
                for donors in ((0, 1) if world > 2 and not args.no_one_donor else (0,)):
                    try:
                        got = resilient_recovery(size, world, args, donors)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        # A run that fails or hangs is reported, not averaged in.
                        print(f"{size:g} MB, {world} ranks, donors {donors or 'all'}: run "
                              f"failed: {str(e).splitlines()[0][:300]}", flush=True)
                        failed[(world, size, donors)] = failed.get((world, size, donors), 0) + 1
                        continue
                    runs.setdefault((world, size, donors), []).append(got)
                if not args.skip_restart and world == worlds[0]:
                    restarts.setdefault((world, size), []).append(
                        checkpoint_restart(size, world, args))
    after = {size: p2p_rate(size, args.optimizer) for size in sizes}
    # Warmed: the median of the later transfers; first: of the new pairs' first ones.
    gloo = {size: statistics.median(before[size][1][1:] + after[size][1][1:]) for size in sizes}
    new_pair = {size: statistics.median([before[size][1][0], after[size][1][0]])
                for size in sizes}

    print(f"\nkill of rank 1 after step {args.kill_step} of {args.steps}, {args.optimizer}, "
          f"{args.reps} reps (medians); load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print("gloo p2p rate (rank 1 -> rank 0, 4 MiB isends; before / after the recovery "
          "runs, median of 3 each): " + "; ".join(
              f"{size:g} MB ({before[size][0] / 1e6:.1f} MB): "
              f"{_rate(statistics.median(before[size][1][1:]))} / "
              f"{_rate(statistics.median(after[size][1][1:]))} warmed, "
              f"{_rate(new_pair[size])} a new pair's first transfer" for size in sizes))
    if restarts:
        print(f"restart from checkpoint ({args.restart_launcher}, torch.save every "
              f"{args.ckpt_every} steps) at {worlds[0]} ranks")
    print()
    extra = sorted({k for rs in runs.values() for r in rs for k, v in r["phases"].items()
                    if k not in PHASES and v is not None})
    cols = ["state", "ranks", "donors", "kill -> resumed (aim: 0.1 s + bytes / gloo rate)", "detect",
            *PHASES.values(), *extra,
            f"first step (normal step; aim <= {FIRST_STEP_AIM}x)", "bytes moved",
            "transfer rate", "gloo p2p rate", f"transfer / gloo (aim >= {RATE_AIM:.0%})",
            "kill -> step done"]
    if restarts:
        cols += ["checkpoint restart -> step done", "restart", "ckpt load",
                 "recompute (steps)", "restart attempts", "restart / spare"]
    print("| " + " | ".join(cols) + " |")
    print("|---" * len(cols) + "|")
    missing: set[str] = set()
    for (world, size, donors), rs in runs.items():
        for r in rs:
            missing.update(r["missing"])
        m = {k: _med([r[k] for r in rs])
             for k in ("resumed", "detect", "first_step", "normal", "bytes", "back")}
        ph = {k: _med([r["phases"].get(k) for r in rs]) for k in [*PHASES, *extra]}
        nbytes, transfer = m["bytes"], ph["transfer_s"]
        rate = nbytes / transfer if nbytes is not None and transfer else None
        aim = 0.1 + nbytes / gloo[size] if nbytes is not None else None
        cells = [f"{size:g} MB", str(world), "1" if world == 2 or donors == 1 else
                 f"{world - 1} (all survivors)"]
        cells.append(f"{_ms(m['resumed'])} ({_ms(aim)}: "
                     f"{_verdict(m['resumed'] <= aim)})"
                     if m["resumed"] is not None and aim is not None else _ms(m["resumed"]))
        cells += [_ms(m["detect"]), *(_ms(ph[k]) for k in [*PHASES, *extra])]
        first, normal = m["first_step"], m["normal"]
        cells.append(f"{_ms(first)} ({_ms(normal)}; {first / normal:.2f}x: "
                     f"{_verdict(first <= FIRST_STEP_AIM * normal)})"
                     if first is not None and normal else _ms(first))
        cells += ["?" if nbytes is None else f"{nbytes / 1e6:.1f} MB", _rate(rate),
                  _rate(gloo[size])]
        cells.append("?" if rate is None else
                     f"{rate / gloo[size]:.0%} ({_verdict(rate >= RATE_AIM * gloo[size])}); "
                     f"{rate / new_pair[size]:.0%} of a new pair's first")
        cells.append(_ms(m["back"]))
        if restarts:
            tr = restarts.get((world, size)) if donors == 0 else None
            if tr:
                rm = {k: statistics.median(r[k] for r in tr) for k in tr[0]}
                cells += [_ms(rm["total"]), _ms(rm["restart"]), _ms(rm["load"]),
                          f"{_ms(rm['recompute'])} ({rm['recomputed_steps']:.0f})",
                          f"{rm['attempts']:.0f}",
                          f"{rm['total'] / m['back']:.1f}x" if m["back"] else "?"]
            else:
                cells += ["–"] * 6
        print("| " + " | ".join(cells) + " |")
    for (world, size, donors), n in sorted(failed.items()):
        print(f"\n{size:g} MB, {world} ranks, donors {donors or 'all'}: {n} run(s) failed "
              "(left out above)")
    if missing:
        print(f"\nrecovery.jsonl lacked (or had null) in some records: {', '.join(sorted(missing))}")
    print("\nCompare the columns of one run (the transfer against the gloo rate measured "
          "beside it), not separate runs: the machine's load moves both.")


if __name__ == "__main__":
    main()
