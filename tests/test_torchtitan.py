"""TorchTitan's own ``Trainer`` under resilient mode (``examples/torchtitan``).

The Llama-3 debug model, FSDP2 by TorchTitan's ``parallelize_llama``, its AdamW, its
warmup/decay schedule and its ``c4_test`` data loader (on the locally made stand-in
assets), built per generation by ``State(build=...)``, on CPU over gloo with the recipe's
``cpu_patches``. A rank SIGKILLed at the start of a step, after the forward pass (the
root module holds its parameters unsharded then), inside the backward pass
(reduce-scatters in flight) or after the optimizer step comes back from its buddy copy
on the other rank, and the job ends with the parameters of the same job run
failure-free under torchrun, bit for bit: the loader's position (each rank's own) came
back with it.

Needs ``pip install -e '.[torchtitan]'`` (TorchTitan 0.3.0 and triton, which it imports):
CI installs it (the README's recipe command); elsewhere the module is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHRUN, TP_RUN, run_launcher

if importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("torchtitan is not installed (pip install -e '.[torchtitan]')",
                allow_module_level=True)

RECIPE = REPO / "examples" / "torchtitan"
STEPS = ["--steps", "8"]


def checksum(proc: subprocess.CompletedProcess, world: int = 2) -> str:
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.findall(rf"^done: 8 steps on {world} ranks, params ([0-9a-f]{{16}})$",
                       proc.stdout, re.M)
    assert len(found) == 1, proc.stdout[-2000:]
    return found[0]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("titan-assets")
    subprocess.run([sys.executable, str(RECIPE / "make_assets.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def recipe(assets: Path, tmp: Path, *extra: str) -> list[str]:
    return [str(RECIPE / "train_llama3.py"), *STEPS, "--assets", str(assets),
            "--dump", str(tmp / "dump"), *extra]


def torchrun_checksum(assets: Path, tmp: Path, world: int, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = str(REPO)
    return checksum(run_launcher(TORCHRUN, ["--nproc-per-node", str(world),
                                            *recipe(assets, tmp, *extra)], env, tmp), world)


@pytest.fixture(scope="module")
def reference(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    return torchrun_checksum(assets, tmp_path_factory.mktemp("titan-reference"), 2)


# forward: before the step's first collective, as at the start (the newcomer's state is
# the step's committed one either way): in the matrix.
@pytest.mark.parametrize("where", [
    "start",
    pytest.param("forward", marks=pytest.mark.matrix),
    "backward",
    pytest.param("optimizer", marks=pytest.mark.slow),
])
def test_torchtitan_rank_comes_back_at_the_same_step(tmp_path, test_env, assets, reference,
                                                     where):
    proc = run_launcher(TP_RUN, ["--nproc-per-node", "2", "--spares", "1",
                                 "--shard-copy-every", "1",
                                 *recipe(assets, tmp_path, "--kill-rank", "1",
                                         "--kill-step", "4", "--kill-where", where)],
                        test_env, tmp_path)
    assert checksum(proc) == reference
    assert f"rank 1: SIGKILL myself at step 4 ({where})" in proc.stdout
    assert "failed with exit code -9" in proc.stderr, proc.stderr[-3000:]
    said = [x for x in proc.stderr.splitlines() if x.startswith("tp-run:")]
    assert len(said) == 1 and said[0].startswith("tp-run: failure: rank(s) [1] -> spare"), said
    assert "inexact" not in proc.stderr


def test_torchtitan_hsdp_newcomer_gets_its_loader_position_from_its_copy(
        tmp_path, tmp_path_factory, test_env, assets):
    """HSDP on 4 ranks (2 replicas x 2 shards): the newcomer's shard comes from its
    replica peer, its data loader's position (declared each rank's own) from the copy its
    holder keeps; the job ends as under torchrun, nothing reported inexact."""
    reference = torchrun_checksum(assets, tmp_path_factory.mktemp("titan-hsdp-reference"), 4,
                                  "--replicas", "2")
    proc = run_launcher(TP_RUN, ["--nproc-per-node", "4", "--spares", "1",
                                 "--shard-copy-every", "1",
                                 *recipe(assets, tmp_path, "--replicas", "2", "--kill-rank",
                                         "1", "--kill-step", "4", "--kill-where", "backward")],
                        test_env, tmp_path)
    assert checksum(proc, 4) == reference
    assert "rank 1: SIGKILL myself at step 4 (backward)" in proc.stdout
    assert "inexact" not in proc.stderr and "goes on with a donor's" not in proc.stderr
