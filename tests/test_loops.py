"""Resilient mode is exact for the training loops people write, whatever the failure.

Each loop style of scripts/loops.py (zero_grad at the top or after the step, a
scheduler per step or per epoch, gradient accumulation with no_sync(), clipping, CPU
autocast with a GradScaler that skips steps, BatchNorm, dropout, an EMA copy, a
DistributedSampler with set_epoch, a StatefulDataLoader, torch.compile, a loss
all-reduce after the step, a loss log) runs once under torchrun without failures (the
reference) and once under tp-run with SIGKILLs at every phase of an iteration: step 0,
forward, backward, inside the all-reduce, inside optimizer.step(), between the step and
the scheduler, inside a collective after the step, after the last step. Every rank's
final state (the whole State's digest: model, optimizer, scheduler, loader position,
scaler, EMA, buffers, position) must be bit-identical to the reference's same rank, and
every rank's loss log must hold the reference's lines, each once.

A log line is written by ``state.on_commit``, so a step is never logged twice. A rank
killed after its optimizer step but before its commit takes that step's line with it
when the survivors commit the step (they do not roll back a committed step); with a
collective after the optimizer step (style "after") the survivors are stopped inside
it, so the job rolls back instead and no line is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, TORCHRUN, TP_RUN, run_launcher

SCRIPT = "scripts/loops.py"
STEPS = 12  # epochs style: 3 epochs of 4 batches

# Per style, the faults injected in one job (RANK:STEP:WHERE), for 2 ranks (one at a
# time) and 4 ranks (two at once at some points: with one spare, one after the other).
_TWO = {
    "basic": "1:0:forward,0:2:backward,1:4:optimizer,0:6:after-step,1:11:end",
    "after": "1:0:forward,0:2:backward,1:3:collective,0:5:optimizer,1:7:after-step,0:11:end",
    "accum": "0:0:forward,1:2:allreduce,0:4:backward,1:6:optimizer,0:8:after-step,1:11:end",
    "epochs": "1:0:forward,0:2:backward,1:5:after-step,0:6:optimizer,1:11:end",
    "stateful": "1:0:forward,0:2:backward,1:4:optimizer,0:6:after-step,1:11:end",
    "compile": "1:0:forward,0:3:backward,1:5:optimizer,0:7:after-step,1:11:end",
}
_FOUR = {
    "basic": "1:0:forward,2:0:forward,0:3:backward,3:3:optimizer,1:6:after-step,2:11:end",
    "after": "2:0:forward,3:2:collective,0:2:collective,1:5:optimizer,2:7:after-step,0:11:end",
    "accum": "3:0:forward,1:2:allreduce,0:4:backward,2:4:optimizer,3:8:after-step,1:11:end",
    "epochs": "2:0:forward,3:2:backward,0:5:after-step,1:5:optimizer,2:11:end",
    "stateful": "0:0:forward,3:3:backward,1:3:backward,2:6:optimizer,0:8:after-step,3:11:end",
    "compile": "2:0:forward,0:3:backward,3:5:optimizer,1:7:after-step,2:11:end",
}


# torch.compile's own risks (the compiled module's state keys, a newcomer compiling
# from the received state) need one newcomer before and one after an optimizer step;
# each kill costs a compilation, so CI kills twice, the matrix at every phase.
_COMPILE_CI = "1:0:forward,0:5:optimizer"


def _one_at_a_time(faults: str) -> str:
    """With one spare, two ranks cannot die in one iteration: the second one later."""
    seen: set[str] = set()
    out = []
    for f in faults.split(","):
        rank, step, where = f.split(":")
        while step in seen:
            step = str(int(step) + 1)
        seen.add(step)
        out.append(f"{rank}:{step}:{where}")
    return ",".join(out)


CASES = [(style, 2, spares, _COMPILE_CI if (style, spares) == ("compile", 1) else faults)
         for style, faults in _TWO.items() for spares in (1, 2)] + \
        [(style, 4, 2, faults) for style, faults in _FOUR.items()] + \
        [(style, 4, 1, _one_at_a_time(faults)) for style, faults in _FOUR.items()]
# Past the optimizer step: a rank killed there takes its own log line for that step.
_PAST_STEP = {"optimizer", "after-step"}


def _launch(launcher: list[str], workdir: Path, env: dict[str, str], out: Path,
            launcher_args: list[str], script_args: list[str]) -> subprocess.CompletedProcess:
    out.mkdir(parents=True)
    return run_launcher(launcher, [*launcher_args, SCRIPT, "--steps", str(STEPS), *script_args],
                        {**env, "OUT": str(out), "OMP_NUM_THREADS": "1"}, workdir, timeout=600)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory):
    """(style, world) -> the failure-free run's output dir, under torchrun (cached)."""
    cache: dict[tuple[str, int], Path] = {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SCRIPTS.parent.parent),
                                                      env.get("PYTHONPATH")]))

    def get(style: str, world: int) -> Path:
        if (style, world) not in cache:
            workdir = tmp_path_factory.mktemp(f"ref-{style}-{world}")
            shutil.copytree(SCRIPTS, workdir / "scripts")
            proc = _launch(TORCHRUN, workdir, env, workdir / "out",
                           ["--nproc-per-node", str(world)], ["--style", style, "--no-resilient"])
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[(style, world)] = workdir / "out"
        return cache[(style, world)]

    return get


def _final(out: Path, rank: int) -> dict:
    return json.loads((out / f"final_{rank}.json").read_text())


def _log(out: Path, rank: int) -> list[str]:
    return (out / f"loss_{rank}.log").read_text().splitlines()


def check_exact(proc: subprocess.CompletedProcess, out: Path, ref: Path, world: int,
                faults: str, style: str) -> None:
    assert proc.returncode == 0, proc.stderr[-5000:]
    kills = [tuple(f.split(":")) for f in faults.split(",")]
    for rank in range(world):
        got, want = _final(out, rank), _final(ref, rank)
        assert got["step"] == want["step"] == STEPS
        assert got["digest"] == want["digest"], f"rank {rank}: state differs from the reference"
        lines, ref_lines = _log(out, rank), _log(ref, rank)
        assert len(lines) == len(set(lines)), f"rank {rank}: a step was logged twice"
        assert set(lines) <= set(ref_lines), f"rank {rank}: a logged step differs"
        missing = {int(line.split()[0]) for line in set(ref_lines) - set(lines)}
        allowed = set() if style == "after" else \
            {int(s) for r, s, w in kills if int(r) == rank and w in _PAST_STEP}
        assert missing <= allowed, f"rank {rank}: steps {sorted(missing)} never logged"
    assert "tp-run: failure: rank(s)" in proc.stderr
    assert "inexact" not in proc.stderr and "died with its previous process" not in proc.stderr


def _tier(style: str, world: int, spares: int) -> tuple[pytest.MarkDecorator, ...]:
    """Every style once in CI, at 2 ranks with 1 spare (every kill point of the style;
    the replacement spare must park before the next kill), and once 4 ranks with 2
    spares (two newcomers served at once by different donors). The other combinations
    differ only in decisions the unit tier covers (how many spares, which donor, one
    failure or two per tick): the matrix (``pytest --matrix``)."""
    if (style, world, spares) == ("basic", 2, 1):
        return ()
    if world == 2 and spares == 1 or (style, world, spares) == ("basic", 4, 2):
        return (pytest.mark.slow,)
    return (pytest.mark.matrix,)


@pytest.mark.parametrize(
    "style,world,spares,faults",
    [pytest.param(*c, id=f"{c[0]}-{c[1]}ranks-{c[2]}spares", marks=_tier(*c[:3]))
     for c in CASES])
def test_loop_is_exact_through_failures(workdir, test_env, references, style, world, spares,
                                        faults):
    ref = references(style, world)
    out = workdir / "out"
    proc = _launch(TP_RUN, workdir, test_env, out,
                   ["--nproc-per-node", str(world), "--spares", str(spares)],
                   ["--style", style, "--fault", faults])
    check_exact(proc, out, ref, world, faults, style)
