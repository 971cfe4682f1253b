"""Startup and restart cost of tp-run and torchrun, side by side, in one run.

    python benchmarks/startup_restart.py [--reps N] [--nproc N]

Each repetition launches the same 2-worker gloo job (``barrier_worker.py``) once under
each launcher, in alternating order (interleaved, so a change in machine load hits both
alike), and measures:

- **startup**: launcher process start -> every worker past its first barrier
  (``init_process_group("gloo")`` + ``barrier()``);
- **restart**: in attempt 0, right after that barrier, rank 1 dies (exit 1); the
  launcher restarts the group (``--max-restarts``), and the cost is that death -> every
  worker of the new group past its first barrier. An attempt whose group fails to form
  (torchrun 2.13's "connectFullMesh ... Connection refused" on a reused store) counts
  as an extra attempt and its time is part of the restart's cost.

The medians, their ratio (tp-run / torchrun, below 1 means tp-run is faster) and the
extra-attempt counts are printed as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "barrier_worker.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "tp-run": [sys.executable, "-m", "tp_launch"],
}
MAX_RESTARTS = 3
TIMEOUT = 300


@dataclass
class Sample:
    startup: float | None = None
    restart: float | None = None
    extra_attempts: int = 0
    timed_out: bool = False
    error: str = ""


def run_once(name: str, nproc: int) -> Sample:
    bench_dir = Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    env = dict(os.environ)
    env.update({
        "BENCH_DIR": str(bench_dir),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    cmd = [*LAUNCHERS[name], "--nproc-per-node", str(nproc), "--max-restarts",
           str(MAX_RESTARTS), "--log-dir", str(bench_dir / "logs"), str(WORKER)]
    sample = Sample()
    try:
        start = time.time()
        proc = _run(cmd, env)
        barriers = _read_barriers(bench_dir)
        first = [barriers.get((0, r)) for r in range(nproc)]
        if all(first):
            sample.startup = max(first) - start
        later = sorted({a for a, _ in barriers if a > 0})
        done = [a for a in later if all((a, r) in barriers for r in range(nproc))]
        if done and (bench_dir / "death").exists():
            death = float((bench_dir / "death").read_text())
            sample.restart = max(barriers[(done[0], r)] for r in range(nproc)) - death
            sample.extra_attempts = done[0] - 1
        if proc.returncode != 0 or sample.restart is None:
            why = [line for line in proc.stderr.splitlines()
                   if "connectFullMesh" in line or "Error" in line][-1:]
            sample.error = f"exit {proc.returncode}: {(why or [''])[0].strip()[:200]}"
    except subprocess.TimeoutExpired:
        sample.timed_out = True
        sample.error = f"timed out after {TIMEOUT}s"
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)
    return sample


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a launcher; on timeout kill it and every process under it (torchrun's
    workers outlive a killed torchrun), then raise TimeoutExpired."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, None, err)


def _read_barriers(bench_dir: Path) -> dict[tuple[int, int], float]:
    out = {}
    for p in bench_dir.glob("barrier_*"):
        _, attempt, rank = p.name.split("_")
        out[(int(attempt), int(rank))] = float(p.read_text())
    return out


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per launcher")
    parser.add_argument("--nproc", type=int, default=2, help="workers (gloo ranks)")
    args = parser.parse_args()

    samples: dict[str, list[Sample]] = {name: [] for name in LAUNCHERS}
    load_before = os.getloadavg()[0]
    for rep in range(args.reps):
        order = list(LAUNCHERS) if rep % 2 == 0 else list(reversed(LAUNCHERS))
        for name in order:
            s = run_once(name, args.nproc)
            samples[name].append(s)
            print(f"rep {rep + 1}/{args.reps} {name:8s} startup {_fmt(s.startup)}  "
                  f"restart {_fmt(s.restart)}  extra attempts {s.extra_attempts}"
                  + (f"  [{s.error}]" if s.error else ""), file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0]

    med = {name: (_median([s.startup for s in ss]), _median([s.restart for s in ss]))
           for name, ss in samples.items()}
    t, p = med["torchrun"], med["tp-run"]

    def extra(name: str) -> str:
        ss = samples[name]
        needed = sum(1 for s in ss if s.extra_attempts)
        hung = sum(1 for s in ss if s.timed_out)
        failed = sum(1 for s in ss if s.restart is None and not s.timed_out)
        text = f"{needed}/{len(ss)} restarts needed extra attempts"
        if failed:
            text += f", {failed} never re-formed in {MAX_RESTARTS} restarts"
        if hung:
            text += f", {hung} hung ({TIMEOUT} s timeout)"
        return text

    print(f"\n{args.nproc} gloo workers, {args.reps} interleaved repetitions, medians "
          f"(load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs)\n")
    print("| | torchrun | tp-run | tp-run / torchrun |")
    print("|---|---|---|---|")
    print(f"| start -> all workers past first barrier | {_fmt(t[0])} | {_fmt(p[0])} "
          f"| {_ratio(p[0], t[0])} |")
    print(f"| restart: worker death -> new group past first barrier | {_fmt(t[1])} "
          f"| {_fmt(p[1])} | {_ratio(p[1], t[1])} |")
    print(f"| group formation on restart | {extra('torchrun')} | {extra('tp-run')} | |")


if __name__ == "__main__":
    main()
