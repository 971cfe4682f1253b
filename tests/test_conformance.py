"""Conformance: the same command lines through the real torchrun 2.13 and through tp-run.

Each case launches both launchers at once (black box, real processes) with the same
arguments, each with its own dump dir, log dir and ports, and compares what a user can
observe: the worker environment and argv (dumped by ``scripts/dump_env.py``), exit
codes, the failure summary and its root-cause rank, the log-dir layout and the console
output. Values that differ by design (ports, run ids, random path parts) are compared
by shape.

Where tp-run deliberately differs from torchrun, the case is named ``*_differs_*`` and
asserts both behaviours, so a change on either side shows up here.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import HANG_TIMEOUT, TORCHRUN, TP_RUN, wait_for_file, wait_no_marked

LAUNCHERS = {"torchrun": TORCHRUN, "tp-run": TP_RUN}

OMP_WARNING = "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# <base>/<run_id>_<mkdtemp suffix>/attempt_<n>/<local_rank>/error.json
ERROR_FILE = re.compile(
    r"^(?P<base>.+)/(?P<run>[^/]+)_[a-z0-9_]{8}/attempt_(?P<attempt>\d+)/(?P<local>\d+)/error\.json$"
)
TEMP_BASE = re.compile(re.escape(tempfile.gettempdir()) + r"/torchelastic_[a-z0-9_]{8}$")


@dataclass
class Launch:
    """One launcher's run of a case."""

    name: str
    rc: int
    stdout: str
    stderr: str
    dump: Path
    logs: Path
    port: int

    def dumps(self) -> dict[int, dict]:
        return {int(p.stem): json.loads(p.read_text()) for p in self.dump.glob("*.json")}

    def run_dirs(self) -> list[Path]:
        return sorted(self.logs.iterdir()) if self.logs.exists() else []

    def layout(self) -> set[str]:
        """Every file and dir under the log dir, the run dir's name replaced by <run>."""
        (run_dir,) = self.run_dirs()
        return {"<run>/" + str(p.relative_to(run_dir)) for p in run_dir.rglob("*")}

    def file(self, rel: str) -> str:
        (run_dir,) = self.run_dirs()
        return (run_dir / rel).read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_both(workdir: Path, env: dict[str, str], args: list[str],
                extra_env: dict[str, str] | None = None,
                timeout: float = HANG_TIMEOUT) -> dict[str, Launch]:
    """Run ``args`` through torchrun and tp-run concurrently; ``{dump}``, ``{logs}``,
    ``{port}`` and ``{python}`` in an argument or an ``extra_env`` value are filled in
    per launcher."""
    procs = {}
    for name, launcher in LAUNCHERS.items():
        base = workdir / name
        dump, logs = base / "dump", base / "logs"
        dump.mkdir(parents=True)
        port = free_port()
        fill = {"dump": dump, "logs": logs, "port": port, "python": sys.executable}
        run_env = {**env, **{k: _fill(v, fill) for k, v in (extra_env or {}).items()},
                   "DUMP_DIR": str(dump)}
        cmd = [*launcher, *(_fill(a, fill) for a in args)]
        procs[name] = (subprocess.Popen(cmd, env=run_env, cwd=workdir, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        stdin=subprocess.DEVNULL), dump, logs, port)
    results = {}
    for name, (proc, dump, logs, port) in procs.items():
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, *_ in procs.values():
                p.kill()
            raise
        results[name] = Launch(name, proc.returncode, out, err, dump, logs, port)
    return results


def _fill(text: str, fill: dict[str, object]) -> str:
    for key, value in fill.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def normalized_env(launch: Launch, env: dict[str, str], log_base: Path | None) -> dict[str, str]:
    """A worker env with the by-design differences replaced by their checked shape."""
    env = dict(env)
    if env.get("MASTER_PORT", "").isdigit():
        env["MASTER_PORT"] = "<port>"
    if UUID.match(env.get("TORCHELASTIC_RUN_ID", "")):
        env["TORCHELASTIC_RUN_ID"] = "<uuid>"
    if "TORCHELASTIC_ERROR_FILE" in env:
        m = ERROR_FILE.match(env["TORCHELASTIC_ERROR_FILE"])
        assert m, f"{launch.name}: error file {env['TORCHELASTIC_ERROR_FILE']} is not in the layout"
        if log_base is None:
            assert TEMP_BASE.match(m["base"]), f"{launch.name}: temp log base {m['base']}"
        else:
            assert m["base"] == str(log_base), f"{launch.name}: log base {m['base']}"
        run = "<uuid>" if UUID.match(m["run"]) else m["run"]
        env["TORCHELASTIC_ERROR_FILE"] = f"<base>/{run}_<rand>/attempt_{m['attempt']}/{m['local']}/error.json"
    return env


def compare_workers(runs: dict[str, Launch], logs_given: bool = False) -> dict[int, dict]:
    """Assert both launchers gave every worker the same env and argv; return tp-run's dumps."""
    t, p = runs["torchrun"], runs["tp-run"]
    td, pd = t.dumps(), p.dumps()
    assert sorted(td) == sorted(pd) and td, (sorted(td), sorted(pd))
    for rank in td:
        assert pd[rank]["argv"] == td[rank]["argv"], rank
        assert normalized_env(p, pd[rank]["env"], p.logs if logs_given else None) == \
            normalized_env(t, td[rank]["env"], t.logs if logs_given else None), rank
    return pd


def assert_success(runs: dict[str, Launch]) -> None:
    for r in runs.values():
        assert r.rc == 0, f"{r.name} exited {r.rc}:\n{r.stderr[-3000:]}"


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tp-run: error: "), stderr
    return lines[0]


# ---------------------------------------------------------------- worker env and argv


def test_default_env_argv_tee_and_log_layout(workdir, test_env):
    """Automatic standalone, 2 workers: env, argv (``${local_rank}``, script options and
    ``--`` untouched), the OMP warning, ``--tee 3`` console prefixes and the log layout."""
    test_env.pop("OMP_NUM_THREADS", None)
    args = ["--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", "{logs}", "--tee", "3",
            "scripts/dump_env.py", "--lr=${local_rank}", "${local_rank}", "--",
            "--nproc-per-node", "7", "-m", "x"]
    runs = launch_both(workdir, test_env, args,
                       extra_env={"TP_CONF_INHERITED": "kept", "CUDA_VISIBLE_DEVICES": "3,4"})
    assert_success(runs)
    dumps = compare_workers(runs, logs_given=True)
    for rank, d in dumps.items():
        assert d["argv"] == ["scripts/dump_env.py", f"--lr={rank}", str(rank), "--",
                             "--nproc-per-node", "7", "-m", "x"]
        env = d["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["CUDA_VISIBLE_DEVICES"] == "3,4"
        assert env["TP_CONF_INHERITED"] == "kept"
        assert UUID.match(env["TORCHELASTIC_RUN_ID"])
    t_dumps = runs["torchrun"].dumps()
    for rank in dumps:  # python -u script ..., the same interpreter
        assert dumps[rank]["orig_argv"] == t_dumps[rank]["orig_argv"]
        assert dumps[rank]["orig_argv"][:3] == [sys.executable, "-u", "scripts/dump_env.py"]
    for r in runs.values():
        assert OMP_WARNING in r.stderr, r.name
        for rank in (0, 1):
            assert f"[default{rank}]:dumped rank {rank}" in r.stdout.splitlines(), r.name
            assert f"[default{rank}]:stderr of rank {rank}" in r.stderr.splitlines(), r.name
            assert r.file(f"attempt_0/{rank}/stdout.log") == f"dumped rank {rank}\n"
            assert r.file(f"attempt_0/{rank}/stderr.log") == f"stderr of rank {rank}\n"
    assert runs["tp-run"].layout() == runs["torchrun"].layout()
    assert runs["tp-run"].run_dirs()[0].name.startswith(
        dumps[0]["env"]["TORCHELASTIC_RUN_ID"] + "_")


@pytest.mark.slow
def test_module_with_launcher_like_script_options(workdir, test_env):
    """``-m`` and underscore spellings; the script's own options (which look like the
    launcher's) reach it untouched; one worker: no OMP_NUM_THREADS and no warning."""
    test_env.pop("OMP_NUM_THREADS", None)
    args = ["--nproc_per_node", "1", "--max_restarts=0", "-m", "scripts.dump_env",
            "--nproc-per-node", "5", "-r", "3", "--", "--standalone"]
    runs = launch_both(workdir, test_env, args)
    assert_success(runs)
    dumps = compare_workers(runs)
    assert dumps[0]["argv"][1:] == ["--nproc-per-node", "5", "-r", "3", "--", "--standalone"]
    assert dumps[0]["argv"][0].endswith("dump_env.py")
    assert dumps[0]["orig_argv"] == runs["torchrun"].dumps()[0]["orig_argv"]
    assert dumps[0]["orig_argv"][:4] == [sys.executable, "-u", "-m", "scripts.dump_env"]
    assert "OMP_NUM_THREADS" not in dumps[0]["env"]
    for r in runs.values():
        assert OMP_WARNING not in r.stderr, r.name
        assert "dumped rank 0" in r.stdout


def test_no_python_and_leading_double_dash(workdir, test_env):
    """``--no-python -- PROGRAM ARGS``: the program runs as given (no ``python -u``)."""
    args = ["--no-python", "--", "{python}", "scripts/dump_env.py", "--no-python", "${local_rank}"]
    runs = launch_both(workdir, test_env, args)
    assert_success(runs)
    dumps = compare_workers(runs)
    assert dumps[0]["argv"] == ["scripts/dump_env.py", "--no-python", "0"]
    assert dumps[0]["orig_argv"] == [sys.executable, "scripts/dump_env.py", "--no-python", "0"]
    assert dumps[0]["orig_argv"] == runs["torchrun"].dumps()[0]["orig_argv"]


@pytest.mark.slow
def test_run_path_differs_in_how_the_script_is_hosted(workdir, test_env):
    """``--run-path``: same argv and env. Named difference: torchrun runs the script in
    a multiprocessing child of the agent, tp-run in a fresh ``python -u -m
    tp_launch.procs.run_path`` (so the interpreter's own command line differs)."""
    args = ["--run-path", "--nproc-per-node", "2", "scripts/dump_env.py", "a", "${local_rank}"]
    runs = launch_both(workdir, test_env, args, extra_env={"OMP_NUM_THREADS": "2"})
    assert_success(runs)
    dumps = compare_workers(runs)
    assert dumps[1]["argv"] == ["scripts/dump_env.py", "a", "1"]
    assert dumps[1]["orig_argv"][1:4] == ["-u", "-m", "tp_launch.procs.run_path"]
    assert "multiprocessing" in " ".join(runs["torchrun"].dumps()[1]["orig_argv"])


def test_pet_environment_fallbacks(workdir, test_env):
    """PET_* variables stand for options (flags as integers); the command line wins;
    OMP_NUM_THREADS set by the user: kept, and no warning."""
    extra = {"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "2", "PET_STANDALONE": "1",
             "PET_RDZV_ID": "ignored-by-standalone", "PET_ROLE": "from-env",
             "PET_TEE": "1", "PET_LOG_DIR": "{logs}", "OMP_NUM_THREADS": "3",
             # without PET_STANDALONE this would make it a static rendezvous
             "PET_MASTER_PORT": "{port}"}
    runs = launch_both(workdir, test_env, ["--role", "trainer", "scripts/dump_env.py"],
                       extra_env=extra)
    assert_success(runs)
    dumps = compare_workers(runs, logs_given=True)
    for rank, d in dumps.items():
        env = d["env"]
        assert env["WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["ROLE_NAME"] == "trainer"
        assert env["OMP_NUM_THREADS"] == "3"
        assert env["MASTER_ADDR"] == "localhost"
        assert UUID.match(env["TORCHELASTIC_RUN_ID"])  # standalone ignores PET_RDZV_ID
    for r in runs.values():
        assert OMP_WARNING not in r.stderr, r.name
        assert "[trainer1]:dumped rank 1" in r.stdout.splitlines(), r.name
        assert r.file("attempt_0/1/stdout.log") == "dumped rank 1\n"


# ---------------------------------------------------------------- rendezvous setups


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["standalone", "static", "c10d-one-node"])
def test_rendezvous_setups(workdir, test_env, setup):
    """``--standalone`` (ignores --rdzv-id), ``static`` with master addr/port/node rank,
    and ``c10d`` on one node with an endpoint: the same worker env."""
    args = {
        "standalone": ["--standalone", "--rdzv-id", "ignored", "--rdzv-backend", "c10d"],
        "static": ["--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                   "--master-port", "{port}", "--node-rank", "0", "--nnodes", "1"],
        "c10d-one-node": ["--rdzv-backend", "c10d", "--nnodes", "1", "--rdzv-id", "job7",
                          "--rdzv-endpoint", "localhost:{port}"],
    }[setup]
    runs = launch_both(workdir, test_env,
                       [*args, "--nproc-per-node", "2", "scripts/dump_env.py"],
                       extra_env={"OMP_NUM_THREADS": "1"})
    assert_success(runs)
    dumps = compare_workers(runs)
    env = dumps[1]["env"]
    assert env["WORLD_SIZE"] == "2" and env["RANK"] == "1"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    if setup == "static":
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == str(runs["tp-run"].port)
        assert runs["torchrun"].dumps()[1]["env"]["MASTER_PORT"] == str(runs["torchrun"].port)
        assert env["TORCHELASTIC_RUN_ID"] == "none"
    elif setup == "standalone":
        assert UUID.match(env["TORCHELASTIC_RUN_ID"])
    else:
        assert env["TORCHELASTIC_RUN_ID"] == "job7"


def test_virtual_local_rank(workdir, test_env):
    """``--virtual-local-rank``: LOCAL_RANK=0, each worker sees its own device."""
    runs = launch_both(workdir, test_env, ["--virtual-local-rank", "--nproc-per-node", "2",
                                           "scripts/dump_env.py"],
                       extra_env={"CUDA_VISIBLE_DEVICES": "5,7", "OMP_NUM_THREADS": "1"})
    assert_success(runs)
    dumps = compare_workers(runs)
    assert [dumps[r]["env"]["LOCAL_RANK"] for r in (0, 1)] == ["0", "0"]
    assert [dumps[r]["env"]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == ["5", "7"]


# ---------------------------------------------------------------- logs


@pytest.mark.slow
def test_local_ranks_filter_prefix_template_and_duplicate_filters(workdir, test_env):
    """``-t 3 --local-ranks-filter 1``, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE and the
    duplicate-stream filters (``,,`` escapes a comma): same console, files and layout."""
    args = ["--nproc-per-node", "2", "--log-dir", "{logs}", "-t", "3",
            "--local-ranks-filter", "1", "--duplicate-stdout-filters", "dumped rank,,nothing,rank 1",
            "--duplicate-stderr-filters", "stderr of", "scripts/dump_env.py"]
    runs = launch_both(workdir, test_env, args, extra_env={
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}> "})
    assert_success(runs)
    compare_workers(runs, logs_given=True)
    for r in runs.values():
        out = [line for line in r.stdout.splitlines() if line.strip()]
        assert out == ["<default|1|1> dumped rank 1"], (r.name, r.stdout)
        assert "<default|1|1> stderr of rank 1" in r.stderr.splitlines(), r.name
        assert "rank 0" not in r.stdout + r.stderr, r.name
        assert r.file("attempt_0/0/stdout.log") == "dumped rank 0\n"
    t, p = runs["torchrun"], runs["tp-run"]
    assert p.layout() == t.layout()
    for name in ("filtered_stdout.log", "filtered_stderr.log"):
        assert p.file(f"attempt_0/{name}") == t.file(f"attempt_0/{name}"), name
    assert p.file("attempt_0/filtered_stdout.log") == "<default|1|1> dumped rank 1\n"


def test_multi_digit_redirect_map_differs(workdir, test_env):
    """Named difference: ``-r 10:1`` (a local rank of two digits) is rejected by
    torchrun 2.13 (exit 1, traceback); tp-run redirects rank 10's stdout as asked."""
    args = ["--nproc-per-node", "11", "--log-dir", "{logs}", "-r", "10:1,1:2",
            "scripts/dump_env.py"]
    runs = launch_both(workdir, test_env, args, extra_env={"OMP_NUM_THREADS": "1"})
    t, p = runs["torchrun"], runs["tp-run"]
    assert t.rc == 1 and "Traceback" in t.stderr and "10:1" in t.stderr
    assert p.rc == 0, p.stderr
    assert p.file("attempt_0/10/stdout.log") == "dumped rank 10\n"
    assert p.file("attempt_0/1/stderr.log") == "stderr of rank 1\n"
    assert "dumped rank 10" not in p.stdout and "dumped rank 9" in p.stdout
    assert sorted(p.dumps()) == list(range(11))


# ---------------------------------------------------------------- failures


@pytest.mark.slow
def test_failure_restarts_summary_and_attempt_dirs(workdir, test_env):
    """Rank 1 raises under @record in every attempt; one restart: both launchers run
    attempts 0 and 1 (fresh attempt dirs, TORCHELASTIC_RESTART_COUNT 0 then 1), stop the
    peer with SIGTERM, print the summary with rank 1 as root cause, exit 1, and copy
    the root cause to their own TORCHELASTIC_ERROR_FILE."""
    args = ["--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", "{logs}",
            "-r", "0:3", "scripts/worker.py", "--fail-rank", "1", "--fail-mode", "raise"]
    runs = launch_both(workdir, test_env, args, extra_env={
        "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": "{dump}/../agent_error.json"})
    agent_errors = {}
    for r in runs.values():
        assert r.rc == 1, (r.name, r.stderr[-3000:])
        agent_errors[r.name] = json.loads((r.dump.parent / "agent_error.json").read_text())
        summary = r.stderr[r.stderr.index("scripts/worker.py FAILED"):]
        failures, root = summary.split("Root Cause (first observed failure):")
        assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root), (r.name, root)
        # numbered as torchrun does: the failure that ended the attempt first
        assert root.strip().startswith("[0]:") and "[1]:" in failures, (r.name, summary)
        assert "exitcode  : 1 " in root
        assert "RuntimeError: deliberate failure on rank 1" in root
        assert re.search(r"error_file: \S+/attempt_1/1/error\.json", root), root
        assert re.search(r"rank\s+: 0 \(local_rank: 0\)", failures)
        assert "Signal 15 (SIGTERM) received by PID" in failures
        assert sorted(p.name for p in r.dump.iterdir()) == [
            "sig_0_0", "sig_1_0", "start_0_0", "start_0_1", "start_1_0", "start_1_1"]
        assert (r.dump / "sig_1_0").read_text() == "SIGTERM"
        assert "rank 0 started (restart 1)" in r.file("attempt_1/0/stdout.log")
        err = json.loads(r.file("attempt_1/1/error.json"))
        assert "deliberate failure on rank 1" in err["message"]["message"]
    assert runs["tp-run"].layout() == runs["torchrun"].layout()
    # The launcher's own error file: the root cause's, with errorCode added.
    t, p = agent_errors["torchrun"], agent_errors["tp-run"]
    assert p["message"]["errorCode"] == t["message"]["errorCode"] == 1
    assert p["message"]["message"] == t["message"]["message"]
    assert sorted(p["message"]) == sorted(t["message"])
    assert sorted(p["message"]["extraInfo"]) == sorted(t["message"]["extraInfo"])


# ---------------------------------------------------------------- bad input

# (id, args, what torchrun 2.13 does): tp-run always answers with exit 2 and one line.
BAD_INPUT_DIFFERENCES = [
    ("nproc-not-int", ["--nproc-per-node", "abc", "scripts/dump_env.py"], "traceback"),
    ("nnodes-min-gt-max", ["--nnodes", "3:2", "scripts/dump_env.py"], "traceback"),
    ("no-python-with-module", ["--no-python", "-m", "scripts.dump_env"], "traceback"),
    ("malformed-rdzv-conf", ["--rdzv-conf", "a=1,oops", "scripts/dump_env.py"], "traceback"),
    # torchrun starts the workers, which fail: summary and exit 1.
    ("missing-script", ["scripts/no_such_script.py"], "summary"),
    # torchrun silently ignores the map entry for a rank it does not run.
    ("redirect-rank-out-of-range", ["--nproc-per-node", "2", "-r", "0:1,5:2",
                                    "scripts/dump_env.py"], "ignored"),
]


@pytest.mark.parametrize("case,args,torchrun_does", BAD_INPUT_DIFFERENCES,
                         ids=[c[0] for c in BAD_INPUT_DIFFERENCES])
def test_bad_input_differs(workdir, test_env, case, args, torchrun_does):
    """Named difference: torchrun answers these with a Python traceback (exit 1), runs
    the job anyway, or fails late; tp-run stops up front with one line and exit 2."""
    runs = launch_both(workdir, test_env, args, extra_env={"OMP_NUM_THREADS": "1"})
    t, p = runs["torchrun"], runs["tp-run"]
    assert p.rc == 2, p.stderr
    one_line_error(p.stderr)
    assert not any(p.dump.iterdir())  # no worker ran
    if torchrun_does == "traceback":
        assert t.rc == 1 and "Traceback (most recent call last)" in t.stderr
    elif torchrun_does == "summary":
        assert t.rc == 1 and "no_such_script.py FAILED" in t.stderr
    else:
        assert t.rc == 0 and sorted(t.dumps()) == [0, 1]


def test_unknown_option_same_exit_code(workdir, test_env):
    """An unknown option is a usage error (exit 2) for both; tp-run says it in one line."""
    runs = launch_both(workdir, test_env, ["--no-such-option", "scripts/dump_env.py"])
    assert runs["torchrun"].rc == runs["tp-run"].rc == 2
    assert "--no-such-option" in one_line_error(runs["tp-run"].stderr)
    assert "--no-such-option" in runs["torchrun"].stderr


# ---------------------------------------------------------------- agent killed


@pytest.mark.slow
def test_sigkill_of_launcher_differs_orphans(workdir, test_env):
    """Named difference: SIGKILL to the launcher. torchrun 2.13's workers live on as
    orphans; tp-run's die with it (PR_SET_PDEATHSIG)."""
    marker = test_env["TP_TEST_MARKER"]
    procs = {}
    for name, launcher in LAUNCHERS.items():
        dump = workdir / name / "dump"
        dump.mkdir(parents=True)
        env = {**test_env, "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1",
               "TP_TEST_MARKER": f"{marker}-{name}"}
        procs[name] = subprocess.Popen(
            [*launcher, "--nproc-per-node", "2", "scripts/worker.py", "--fail-rank", "99"],
            env=env, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL)
    try:
        for name in LAUNCHERS:
            for rank in (0, 1):
                wait_for_file(workdir / name / "dump" / f"start_0_{rank}")
        for proc in procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait(HANG_TIMEOUT)
        assert wait_no_marked(f"{marker}-tp-run") == []
        time.sleep(1)
        orphans = wait_no_marked(f"{marker}-torchrun", timeout=0)
        assert len(orphans) == 2, orphans  # torchrun's two workers, still running
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in wait_no_marked(f"{marker}-torchrun", timeout=0):
            p.kill()
        assert wait_no_marked(f"{marker}-torchrun") == []
