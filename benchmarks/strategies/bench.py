"""Fault-tolerance strategies under the same injected failures, side by side, in one run.

    python benchmarks/strategies/bench.py [--reps N] [--quick] [--strategies a,b,...]
                                          [--out DIR] [--seed S]

One training job (:mod:`train_job`: a data-parallel MLP over gloo, deterministic data
from (step, rank)) runs once per strategy and repetition:

``reference``     torchrun, no failures: the failure-free time and parameters;
``ckpt_restart``  torchrun ``--max-restarts``, the script checkpoints every C steps
                  (rank 0, ``torch.save`` + atomic rename) and resumes from it;
``tprun_compat``  tp-run in compatible mode, the same unmodified script and flags;
``tprun_resilient`` tp-run ``--spares 1``, the script under ``tp_launch.resilient.run``;
``torchft``       TorchFT: a ``torchft_lighthouse`` and one replica group (a one-process
                  torchrun with ``--max-restarts``) per rank (:mod:`torchft_job`).

**Failures.** A seeded schedule of (rank, step) pairs, the same for every strategy. The
harness (outside the job) follows each process's progress file and SIGKILLs the
process that holds the scheduled rank as soon as it reports the scheduled step. A
failure only strikes a healthy job: the next kill waits until every rank has committed
a step after the previous kill (and, for tp-run resilient, until a spare is parked
again), so each strategy pays for each failure separately.

**Metrics** (per strategy, measured in the same repetition as its reference):
wall time (launch -> every launcher exited); time over the reference; time lost per
failure (that difference / failures); steps recomputed (committed steps executed
beyond N, on the rank that executed most; TorchFT: iterations whose step did not
commit); step-time overhead without failures (mean interval between a process's
consecutive commits outside recovery windows, over the reference's); whether the final
parameters (sha256 of rank 0's state dict) equal the reference's. Medians over
repetitions; ratios are taken within a repetition, then the median.

Outputs in ``--out`` (default ``benchmarks/results/strategies``): ``results.json``
(every sample with its timeline, kills and recovery records), ``results.md`` (the
table) and ``steps_vs_time.png`` (matplotlib; skipped with a warning if absent).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TRAIN = HERE / "train_job.py"
TORCHFT_TRAIN = HERE / "torchft_job.py"
STRATEGIES = ["reference", "ckpt_restart", "tprun_compat", "tprun_resilient", "torchft"]
LABELS = {
    "reference": "no failures (torchrun)",
    "ckpt_restart": "checkpoint restart (torchrun)",
    "tprun_compat": "tp-run compatible (restart)",
    "tprun_resilient": "tp-run resilient (spare)",
    "torchft": "TorchFT",
}
POLL_S = 0.01


@dataclass
class Config:
    nproc: int = 4
    steps: int = 500
    failures: int = 3
    ckpt_every: int = 50
    width: int = 512
    depth: int = 4
    seed: int = 0
    timeout_s: float = 240.0  # torchrun's restarts can fail to form for minutes
    # quick only: torchrun's restarts often never re-form the group (its reused store);
    # the smoke test should not wait the full timeout for that known outcome.
    torchrun_restart_timeout_s: float = 0.0
    init_timeout_s: float = 60.0  # a restarted torchrun group stuck in init gives up
    # quick only: a tiny model's steps outrun the 10 ms poll, and the job must outlast
    # the start of tp-run's spare (it starts once the ranks reach run(): an import of
    # torch, seconds on a loaded machine) or the kill waits for a spare that never parks.
    step_sleep: float = 0.0

    @classmethod
    def quick(cls) -> Config:
        return cls(nproc=2, steps=30, failures=1, ckpt_every=5, width=64, depth=2,
                   timeout_s=90.0, torchrun_restart_timeout_s=40.0, init_timeout_s=15.0,
                   step_sleep=0.3)


def schedule(cfg: Config) -> list[tuple[int, int]]:
    """Seeded (rank, step) kills, in step order, spread over the middle of the run.

    Each kill is more than a checkpoint interval after the previous one, so a
    checkpoint-restart rewind never goes back past the next scheduled step."""
    rng = random.Random(cfg.seed)
    lo, hi = int(cfg.steps * 0.15), int(cfg.steps * 0.85)
    gap = cfg.ckpt_every + 2
    for _ in range(1000):
        steps = sorted(rng.sample(range(lo, hi), cfg.failures))
        if all(b - a > gap for a, b in zip(steps, steps[1:])):
            return [(rng.randrange(cfg.nproc), s) for s in steps]
    raise ValueError(f"cannot place {cfg.failures} failures {gap} steps apart in {lo}..{hi}")


@dataclass
class Sample:
    strategy: str
    rep: int
    ok: bool = False
    available: bool = True
    error: str = ""
    wall_s: float | None = None
    train_s: float | None = None  # first committed step -> last (no launcher start-up)
    final_step: int | None = None
    checksum: str | None = None
    kills: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s since launch, job step)
    steps_recomputed: int | None = None
    mean_step_s: float | None = None
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    restarts: int = 0        # launcher restarts of the whole group (all groups: TorchFT)
    restarts_extra: int = 0  # restarts beyond one per failure (a group that failed to form)
    # Filled against the same repetition's reference:
    over_reference_s: float | None = None
    over_reference_ratio: float | None = None
    lost_per_failure_s: float | None = None
    step_overhead: float | None = None
    params_equal: bool | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resilient_available() -> tuple[bool, str]:
    """Is tp-run's resilient mode here (the worker API and the ``--spares`` option)?"""
    probe = subprocess.run(
        [sys.executable, "-c", "from tp_launch import resilient; resilient.run; resilient.State"],
        cwd=REPO, capture_output=True, text=True)
    if probe.returncode != 0:
        return False, "tp_launch.resilient not importable: " + probe.stderr.strip().splitlines()[-1]
    helptext = subprocess.run([sys.executable, "-m", "tp_launch", "--help"], cwd=REPO,
                              capture_output=True, text=True).stdout
    if "--spares" not in helptext:
        return False, "tp-run --help lists no --spares option"
    return True, ""


def torchft_available() -> tuple[bool, str]:
    probe = subprocess.run([sys.executable, "-c", "import torchft"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return False, "torchft not importable: " + probe.stderr.strip().splitlines()[-1]
    if shutil.which("torchft_lighthouse") is None:
        return False, "torchft_lighthouse not on PATH"
    return True, ""


class Job:
    """The processes of one strategy run, the progress they report, and the injector."""

    def __init__(self, strategy: str, cfg: Config, workdir: Path) -> None:
        self.strategy = strategy
        self.cfg = cfg
        self.dir = workdir
        self.tag = uuid.uuid4().hex  # in every process's environment: finds leftovers
        self.env = dict(os.environ)
        self.env.update({
            "BENCH_DIR": str(workdir), "BENCH_TAG": self.tag, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), str(REPO),
                                                         self.env.get("PYTHONPATH")])),
        })
        self.procs: list[subprocess.Popen] = []
        self.offsets: dict[Path, int] = {}
        self.lines: list[tuple[float, int, int, int]] = []  # (t, rank, step, pid)
        self.start = 0.0

    # -- launching -------------------------------------------------------------------
    def _popen(self, cmd: list[str], log: str, extra_env: dict[str, str] | None = None
               ) -> subprocess.Popen:
        env = {**self.env, **(extra_env or {})}
        with open(self.dir / log, "w") as f:
            # Own session: a timeout can signal the launcher's whole group.
            return subprocess.Popen(cmd, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def launch(self) -> None:
        cfg, s = self.cfg, self.strategy
        model = ["--steps", str(cfg.steps), "--width", str(cfg.width), "--depth", str(cfg.depth),
                 "--step-sleep", str(cfg.step_sleep)]
        # Headroom over one restart per failure: torchrun 2.13's restarts reuse the store
        # and often fail to form the group ("connectFullMesh ... Connection refused");
        # those extra attempts are retried, counted (restarts_extra) and their time paid.
        restarts = ["--max-restarts", str(5 * cfg.failures + 5)]
        torchrun = [sys.executable, "-m", "torch.distributed.run"]
        tprun = [sys.executable, "-m", "tp_launch"]
        # A free port, never torchrun's default 29500: on a shared machine another job may
        # hold it, and torchrun then waits for it.
        common = ["--nproc-per-node", str(cfg.nproc), "--master-port", str(free_port())]
        self.start = time.time()
        if s == "reference":
            self.procs.append(self._popen([*torchrun, *common, str(TRAIN), *model], "launcher.log"))
        elif s in ("ckpt_restart", "tprun_compat"):
            launcher = torchrun if s == "ckpt_restart" else tprun
            self.procs.append(self._popen(
                [*launcher, *common, *restarts, str(TRAIN), *model, "--ckpt-every",
                 str(cfg.ckpt_every), "--init-timeout", str(cfg.init_timeout_s)], "launcher.log"))
        elif s == "tprun_resilient":
            self.procs.append(self._popen(
                [*tprun, *common, "--spares", "1", "--spare-policy", "restart", *restarts,
                 "--log-dir", str(self.dir / "logs"), str(TRAIN), *model, "--resilient"],
                "launcher.log", {"LOGLEVEL": "INFO"}))  # restarts are logged at INFO
        elif s == "torchft":
            port = free_port()
            self.procs.append(self._popen(
                ["torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms", "100",
                 "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "1000",
                 "--bind", f"[::]:{port}"], "lighthouse.log"))
            for i in range(cfg.nproc):
                self.procs.append(self._popen(
                    [*torchrun, "--nproc-per-node", "1", *restarts, "--master-port",
                     str(free_port()), str(TORCHFT_TRAIN), *model, "--replica-id", str(i),
                     "--replicas", str(cfg.nproc)], f"group_{i}.log",
                    {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "REPLICA_GROUP_ID": str(i)}))
        else:
            raise ValueError(s)

    @property
    def launchers(self) -> list[subprocess.Popen]:
        """The processes whose exit ends the job (not the lighthouse)."""
        return self.procs[1:] if self.strategy == "torchft" else self.procs

    # -- progress and failures ------------------------------------------------------
    def poll_progress(self) -> list[tuple[float, int, int, int]]:
        new = []
        for path in self.dir.glob("progress_*.txt"):
            pid = int(path.stem.split("_")[1])
            with open(path) as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            complete = data[:data.rfind("\n") + 1]  # a line being written waits for the next poll
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.splitlines():
                rank, step, t = line.split()
                new.append((float(t), int(rank), int(step), pid))
        new.sort()
        self.lines.extend(new)
        return new

    def parked_spares(self) -> int:
        """Spares the tp-run agent reports parked (its status file), for gating kills."""
        try:
            from tp_launch.control_files import find_agents
        except ImportError:
            return 0
        pid = self.procs[0].pid
        return next((len(a.parked_spares) for a in find_agents() if a.pid == pid), 0)

    def run(self, kills: list[tuple[int, int]]) -> Sample:
        """Launch, inject the kills, wait for the end; the raw sample (no reference)."""
        sample = Sample(self.strategy, 0)
        try:
            return self._run(sample, kills)
        finally:
            self.stop()

    def _run(self, sample: Sample, kills: list[tuple[int, int]]) -> Sample:
        self.launch()
        pending = list(kills) if self.strategy != "reference" else []
        healthy_since: float = 0.0  # kill time after which every rank must report again
        reported_after: set[int] = set(range(self.cfg.nproc))
        live_pid: dict[int, int] = {}
        latest_step: dict[int, int] = {}
        limit = self.cfg.timeout_s
        if self.strategy == "ckpt_restart" and self.cfg.torchrun_restart_timeout_s:
            limit = min(limit, self.cfg.torchrun_restart_timeout_s)
        deadline = self.start + limit
        while any(p.poll() is None for p in self.launchers):
            if time.time() > deadline:
                sample.error = f"timed out after {limit:.0f} s"
                break
            for t, rank, step, pid in self.poll_progress():
                live_pid[rank] = pid
                latest_step[pid] = step
                if t > healthy_since:
                    reported_after.add(rank)
            if pending and len(reported_after) == self.cfg.nproc:
                krank, kstep = pending[0]
                pid = live_pid.get(krank)
                # The rank's newest report decides (a poll can bring several steps at
                # once); a rank that has finished its last step is not killed: it
                # would test the exit path, not recovery.
                if (pid is not None and kstep <= latest_step[pid] < self.cfg.steps
                        and psutil.pid_exists(pid)
                        and (self.strategy != "tprun_resilient" or self.parked_spares() >= 1)):
                    os.kill(pid, signal.SIGKILL)
                    now = time.time()
                    sample.kills.append({"t": now - self.start, "rank": krank,
                                         "step": latest_step[pid], "pid": pid,
                                         "scheduled_step": kstep})
                    pending.pop(0)
                    healthy_since, reported_after = now, set()
            time.sleep(POLL_S)
        end = time.time()
        self.stop()
        self.poll_progress()
        sample.wall_s = end - self.start
        codes = [p.returncode for p in self.launchers]
        final = self.dir / "final.json"
        if final.exists():
            data = json.loads(final.read_text())
            sample.final_step, sample.checksum = data["step"], data["checksum"]
        if not sample.error:
            if any(c != 0 for c in codes):
                sample.error = f"launcher exit codes {codes}: " + self._tail()
            elif sample.final_step != self.cfg.steps:
                sample.error = f"final step {sample.final_step} != {self.cfg.steps}"
            elif pending:
                sample.error = f"{len(pending)} scheduled failure(s) never injected"
        sample.ok = not sample.error
        # Restarts of the whole group = worker generations - 1 (every attempt's workers
        # open a progress file; torchrun and tp-run log their restarts only at INFO level).
        # TorchFT: per replica group. tp-run resilient: spares open files too, so its
        # restart-all fallbacks are counted from the agent's log.
        files = len(list(self.dir.glob("progress_*.txt")))
        if self.strategy in ("ckpt_restart", "tprun_compat"):
            sample.restarts = max(0, files // self.cfg.nproc - 1)
        elif self.strategy == "torchft":
            sample.restarts = max(0, files - self.cfg.nproc)
        elif self.strategy == "tprun_resilient":
            sample.restarts = (self.dir / "launcher.log").read_text(errors="replace").count(
                "will restart worker group")
        sample.restarts_extra = (max(0, sample.restarts - len(sample.kills))
                                 if self.strategy != "tprun_resilient" else sample.restarts)
        if sample.error and sample.restarts:
            sample.error += f" ({sample.restarts} group restarts, {sample.restarts_extra} beyond one per failure)"
        self._measure(sample)
        return sample

    def _tail(self) -> str:
        for log in sorted(self.dir.glob("*.log")):
            errs = [ln for ln in log.read_text(errors="replace").splitlines()
                    if "Error" in ln or "error" in ln]
            if errs:
                return f"{log.name}: {errs[-1].strip()[:300]}"
        return ""

    def stop(self) -> None:
        """End the lighthouse, then anything left with this job's tag (torchrun's
        workers can outlive it), so a run never leaks processes into the next."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("BENCH_TAG") == self.tag:
                    proc.kill()
            except psutil.Error:
                continue

    # -- metrics --------------------------------------------------------------------
    def _measure(self, sample: Sample) -> None:
        lines = sorted(self.lines)
        kill_t = [self.start + k["t"] for k in sample.kills]
        killed_pids = {k["pid"]: self.start + k["t"] for k in sample.kills}
        # Job step over time: the highest step among the ranks' latest reports; a
        # killed rank's report is dropped at its death (it no longer holds that step).
        latest: dict[int, tuple[int, int]] = {}
        for t, rank, step, pid in lines:
            for r, (_s, p) in list(latest.items()):
                if p in killed_pids and killed_pids[p] <= t:
                    del latest[r]
            latest[rank] = (step, pid)
            sample.timeline.append((round(t - self.start, 4), max(s for s, _ in latest.values())))
        sample.steps_recomputed = steps_recomputed(self.dir, self.strategy, self.cfg.steps)
        # Recovery windows: from a kill until every rank has committed after it.
        windows = []
        for tk in kill_t:
            after = {}
            for t, rank, _s, _p in lines:
                if t > tk and rank not in after:
                    after[rank] = t
            end = max(after.values()) if len(after) == self.cfg.nproc else float("inf")
            windows.append((tk, end))
        intervals = []
        last: dict[int, float] = {}
        for t, _rank, _s, pid in lines:
            if pid in last:
                a = last[pid]
                if not any(a < we and t > ws for ws, we in windows):
                    intervals.append(t - a)
            last[pid] = t
        sample.mean_step_s = statistics.fmean(intervals) if intervals else None
        firsts = [t for t, _r, step, _p in lines if step == 1]
        lasts = [t for t, _r, step, _p in lines if step == self.cfg.steps]
        if firsts and lasts:
            sample.train_s = max(lasts) - min(firsts)
        rec = list(self.dir.glob("logs/*/recovery.jsonl"))
        for path in rec:
            sample.recoveries += [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def steps_recomputed(run_dir: Path, strategy: str, steps: int) -> int | None:
    """Committed steps executed beyond ``steps`` on the rank that executed most (a
    restart from a checkpoint, or from scratch, redoes them); TorchFT adds iterations
    that did not commit (every group in a step's quorum discards that step)."""
    per_rank: dict[int, int] = {}
    for path in run_dir.glob("progress_*.txt"):
        for line in path.read_text().splitlines():
            r = int(line.split()[0])
            per_rank[r] = per_rank.get(r, 0) + 1
    if not per_rank:
        return None
    redone = max(0, max(per_rank.values()) - steps)
    if strategy == "torchft":
        wasted: dict[int, int] = {}
        for path in run_dir.glob("attempts_*.txt"):
            for line in path.read_text().splitlines():
                r = int(line.split()[0])
                wasted[r] = wasted.get(r, 0) + 1
        redone += max(wasted.values(), default=0)
    return redone


def compare(sample: Sample, ref: Sample | None) -> None:
    """Fill the fields measured against the same repetition's failure-free run."""
    if ref is None or not ref.ok or not sample.ok or sample.strategy == "reference":
        if sample.strategy == "reference" and sample.ok:
            sample.over_reference_s, sample.over_reference_ratio = 0.0, 1.0
            sample.step_overhead, sample.params_equal = 0.0, True
        return
    # Training span, not wall time: launcher start-up on a loaded shared machine varies
    # by tens of seconds between runs and is not a failure's cost (wall time is reported).
    if sample.train_s is None or not ref.train_s:
        return
    sample.over_reference_s = sample.train_s - ref.train_s
    sample.over_reference_ratio = sample.train_s / ref.train_s
    if sample.kills:
        sample.lost_per_failure_s = sample.over_reference_s / len(sample.kills)
    if sample.mean_step_s and ref.mean_step_s:
        sample.step_overhead = sample.mean_step_s / ref.mean_step_s - 1
    sample.params_equal = sample.checksum == ref.checksum


def run_bench(cfg: Config, strategies: list[str], reps: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    kills = schedule(cfg)
    unavailable: dict[str, str] = {}
    if "tprun_resilient" in strategies:
        ok, why = resilient_available()
        if not ok:
            unavailable["tprun_resilient"] = why
    if "torchft" in strategies:
        ok, why = torchft_available()
        if not ok:
            unavailable["torchft"] = why
    runnable = [s for s in strategies if s not in unavailable]
    if "reference" not in runnable:
        runnable.insert(0, "reference")
    samples: list[Sample] = []
    load = [os.getloadavg()[0]]
    t0 = time.time()
    for rep in range(reps):
        # The reference first, then the others in an order rotated by repetition, so a
        # change in machine load does not always hit the same strategy.
        others = [s for s in runnable if s != "reference"]
        k = rep % max(1, len(others))
        order = ["reference", *others[k:], *others[:k]]
        rep_samples: dict[str, Sample] = {}
        for strategy in order:
            workdir = Path(tempfile.mkdtemp(prefix=f"strat_{strategy}_"))
            try:
                sample = Job(strategy, cfg, workdir).run(kills)
            finally:
                keep = out / "runs" / f"rep{rep}_{strategy}"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(workdir, keep, ignore=shutil.ignore_patterns("*.pt", "*.tmp"))
                shutil.rmtree(workdir, ignore_errors=True)
            sample.rep = rep
            rep_samples[strategy] = sample
            print(f"[{time.time() - t0:6.1f} s] rep {rep + 1}/{reps} {strategy:16s} "
                  + (f"{sample.wall_s:7.1f} s  kills {len(sample.kills)}" if sample.wall_s else "")
                  + (f"  [{sample.error}]" if sample.error else ""), file=sys.stderr, flush=True)
        for s in rep_samples.values():
            compare(s, rep_samples.get("reference"))
        samples += rep_samples.values()
    for s, why in unavailable.items():
        samples.append(Sample(s, -1, available=False, error=why))
    load.append(os.getloadavg()[0])
    result = {"config": asdict(cfg), "schedule": [{"rank": r, "step": s} for r, s in kills],
              "reps": reps, "strategies": strategies, "load_average": load,
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "summary": summarize(samples, strategies), "samples": [asdict(s) for s in samples]}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "results.md").write_text(table)
    print(table)
    plot(result, out / "steps_vs_time.png")
    return result


def _median(values: list[Any]) -> Any:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    if isinstance(vals[0], bool):
        return all(vals)
    return statistics.median(vals)


def summarize(samples: list[Sample], strategies: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in strategies:
        mine = [s for s in samples if s.strategy == name]
        ok = [s for s in mine if s.ok]
        if not mine or not mine[0].available:
            out[name] = {"available": False, "error": mine[0].error if mine else "not run"}
            continue
        out[name] = {
            "available": True, "runs": len(mine), "ok_runs": len(ok),
            "errors": [s.error for s in mine if s.error],
            **{key: _median([getattr(s, key) for s in ok]) for key in (
                "wall_s", "train_s", "over_reference_s", "over_reference_ratio", "lost_per_failure_s",
                "steps_recomputed", "mean_step_s", "step_overhead", "params_equal",
                "restarts_extra")},
            "failures": _median([len(s.kills) for s in ok]),
        }
    return out


def _f(v: Any, fmt: str, suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{suffix}"


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"{cfg['nproc']} gloo ranks, {cfg['steps']} steps, {cfg['failures']} SIGKILLs at "
        f"(rank, step) {[(k['rank'], k['step']) for k in result['schedule']]}, checkpoint "
        f"every {cfg['ckpt_every']} steps; medians of {result['reps']} repetition(s); load "
        f"average {result['load_average'][0]:.1f} -> {result['load_average'][1]:.1f} on "
        f"{result['cpus']} CPUs",
        "",
        "| strategy | wall time | step 1 -> last step | over failure-free | time lost / failure "
        "| steps recomputed | step-time overhead (no failure) | final params = failure-free "
        "| extra group restarts | runs ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        if not s["available"]:
            lines.append(f"| {LABELS[name]} | not available: {s['error']} | | | | | | | | |")
            continue
        if not s["ok_runs"]:
            lines.append(f"| {LABELS[name]} | did not finish ({s['runs']} runs): "
                         f"{s['errors'][0][:160]} | | | | | | | | 0/{s['runs']} |")
            continue
        eq = s["params_equal"]
        lines.append(
            f"| {LABELS[name]} | {_f(s['wall_s'], '.1f', ' s')} | {_f(s.get('train_s'), '.1f', ' s')} "
            f"| {_f(s['over_reference_s'], '+.1f', ' s')} ({_f(s['over_reference_ratio'], '.2f', 'x')}) "
            f"| {_f(s['lost_per_failure_s'], '.1f', ' s')} | {_f(s['steps_recomputed'], '.0f')} "
            f"| {_f(None if s['step_overhead'] is None else 100 * s['step_overhead'], '+.1f', ' %')} "
            f"| {'n/a' if eq is None else ('yes' if eq else 'no')} "
            f"| {_f(s.get('restarts_extra'), '.0f')} | {s['ok_runs']}/{s['runs']} |")
    errs = [f"- {LABELS[n]}: {e}" for n, s in result["summary"].items() if s["available"]
            for e in s["errors"]]
    if errs:
        lines += ["", "Errors:", *errs]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Steps completed against wall time, one line per strategy, kills marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install matplotlib): no %s", path.name)
        print(f"warning: matplotlib not installed: no {path}", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    first = {}
    for s in result["samples"]:
        if s["available"] and s["timeline"] and s["strategy"] not in first:
            first[s["strategy"]] = s
    for i, (name, s) in enumerate(first.items()):
        color = f"C{i}"
        t, step = zip(*s["timeline"], (s["wall_s"], s["timeline"][-1][1]))  # flat to the exit
        label = (f"{LABELS[name]}: {s['wall_s']:.0f} s" if s["ok"] else
                 f"{LABELS[name]}: did not finish ({s['wall_s']:.0f} s)")
        ax.plot(t, step, color=color, lw=1.6, label=label)
        for k in s["kills"]:
            ax.plot(k["t"], k["step"], "x", color=color, ms=9, mew=2)
    ax.plot([], [], "kx", label="SIGKILL of a rank")
    cfg = result["config"]
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training step (committed)")
    ax.set_title(f"{cfg['nproc']} gloo ranks, {cfg['steps']} steps, {cfg['failures']} failures "
                 f"(repetition 1)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke size: 2 ranks, 30 steps, 1 failure (seconds)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "strategies")
    parser.add_argument("--seed", type=int, default=0, help="failure schedule seed")
    parser.add_argument("--steps", type=int, help="override the number of steps")
    parser.add_argument("--failures", type=int, help="override the number of failures")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                        help="only re-render results.md and the PNG from a results.json")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        # Re-derive what can be from the kept run directories (a metric fixed later).
        runs = args.render.parent / "runs"
        for smp in result["samples"]:
            d = runs / f"rep{smp['rep']}_{smp['strategy']}"
            if smp["available"] and d.is_dir():
                smp["steps_recomputed"] = steps_recomputed(d, smp["strategy"],
                                                           result["config"]["steps"])
        samples = [Sample(**{k: v for k, v in smp.items()}) for smp in result["samples"]]
        result["summary"] = summarize(samples, result["strategies"])
        args.render.write_text(json.dumps(result, indent=1))
        table = markdown(result)
        (args.render.parent / "results.md").write_text(table)
        print(table)
        plot(result, args.render.parent / "steps_vs_time.png")
        return
    logging.basicConfig(level=logging.WARNING)
    # SIGTERM unwinds like Ctrl-C, so every job's processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = Config.quick() if args.quick else Config()
    cfg.seed = args.seed
    if args.steps:
        cfg.steps = args.steps
    if args.failures is not None:
        cfg.failures = args.failures
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        parser.error(f"unknown strategies {bad}; choose from {STRATEGIES}")
    reps = args.reps or (1 if args.quick else 3)
    result = run_bench(cfg, strategies, reps, args.out)
    # Exit 1 when the reference or a tp-run strategy failed. torchrun's and TorchFT's
    # failures are results (recorded in the table and the JSON), not harness errors.
    failed = [n for n, s in result["summary"].items()
              if n in ("reference", "tprun_compat", "tprun_resilient")
              and s["available"] and not s["ok_runs"]]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
