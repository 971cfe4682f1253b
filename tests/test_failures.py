"""Failure paths of tp-run: failing workers, restarts, shutdown, signals, bad input.

Real processes and real signals throughout; timeouts are generous and guard against
hangs only. Workers are ``scripts/worker.py`` (a chosen rank fails in a chosen way, the
others wait) and ``scripts/gloo_restart.py`` (a real gloo job). Every test also passes
the ``test_env`` leak check: no process it started may outlive it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    HANG_TIMEOUT,
    TP_RUN,
    Live,
    fill,
    run_launcher,
    start_launcher,
    wait_for_file,
    wait_no_marked,
)

SUMMARY_TITLE = "scripts/worker.py FAILED"
ROOT = "Root Cause (first observed failure):"


def tp_run(workdir: Path, env: dict[str, str], args: list[str],
           timeout: float = HANG_TIMEOUT, **extra_env: str) -> subprocess.CompletedProcess:
    dump = workdir / "dump"
    dump.mkdir(exist_ok=True)
    run_env = {**env, "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", **extra_env}
    return run_launcher(TP_RUN, args, run_env, workdir, timeout=timeout)


def split_summary(stderr: str) -> tuple[str, str]:
    """(other failures, root cause) of the failure summary; asserts there is one."""
    assert SUMMARY_TITLE in stderr, stderr
    summary = stderr[stderr.index(SUMMARY_TITLE):]
    others, root = summary.split(ROOT)
    return others, root


def root_rank(root: str) -> int:
    m = re.search(r"rank\s+: (\d+) \(local_rank: \d+\)", root)
    assert m, root
    return int(m.group(1))


def dumped(workdir: Path) -> list[str]:
    return sorted(p.name for p in (workdir / "dump").iterdir())


# ---------------------------------------------------------------- a worker fails


def test_raise_under_record_error_shown_and_copied(workdir, test_env, tmp_path):
    """A worker raising under @record: its traceback is the summary's root cause (rank 2
    of 3), its peers are stopped with SIGTERM, exit 1, and tp-run's own
    TORCHELASTIC_ERROR_FILE receives the root cause with errorCode."""
    agent_error = tmp_path / "agent_error.json"
    r = tp_run(workdir, test_env, ["--nproc-per-node", "3", "scripts/worker.py",
                                   "--fail-rank", "2", "--fail-mode", "raise"],
               TORCHELASTIC_ERROR_FILE=str(agent_error))
    assert r.returncode == 1, r.stderr
    others, root = split_summary(r.stderr)
    assert root_rank(root) == 2
    assert "RuntimeError: deliberate failure on rank 2" in root
    assert re.search(r"error_file: \S+/attempt_0/2/error\.json", root)
    for rank in (0, 1):
        assert f"rank      : {rank} (local_rank: {rank})" in others
        assert (workdir / "dump" / f"sig_0_{rank}").read_text() == "SIGTERM"
    assert others.count("Signal 15 (SIGTERM) received by PID") == 2
    data = json.loads(agent_error.read_text())
    assert data["message"]["errorCode"] == 1
    assert "deliberate failure on rank 2" in data["message"]["message"]
    assert "py_callstack" in data["message"]["extraInfo"]


@pytest.mark.parametrize("mode,exitcode,message", [
    ("exit3", "3", "To enable traceback see"),
    ("sigkill", "-9", "Signal 9 (SIGKILL) received by PID"),
])
def test_worker_exit_code_or_signal(workdir, test_env, tmp_path, mode, exitcode, message):
    """Rank 0 exits 3 / is SIGKILLed: it is the root cause, with its exit code; tp-run's
    error file gets a synthesized entry with that code (no child error file)."""
    agent_error = tmp_path / "agent_error.json"
    r = tp_run(workdir, test_env, ["--nproc-per-node", "2", "scripts/worker.py",
                                   "--fail-rank", "0", "--fail-mode", mode],
               TORCHELASTIC_ERROR_FILE=str(agent_error))
    assert r.returncode == 1, r.stderr
    others, root = split_summary(r.stderr)
    assert root_rank(root) == 0
    assert f"exitcode  : {exitcode} " in root
    assert message in root
    assert "error_file: <N/A>" in root
    assert "rank      : 1 (local_rank: 1)" in others
    assert json.loads(agent_error.read_text())["message"]["errorCode"] == int(exitcode)


# ---------------------------------------------------------------- restarts


def test_restarts_used_then_success(workdir, test_env):
    """Rank 1 fails in attempts 0 and 1, the job succeeds in attempt 2 of 4 allowed:
    exit 0, TORCHELASTIC_RESTART_COUNT 0, 1, 2, one fresh attempt dir per attempt."""
    logs = workdir / "logs"
    r = tp_run(workdir, test_env, ["--nproc-per-node", "2", "--max-restarts", "3",
                                   "--log-dir", str(logs), "scripts/worker.py",
                                   "--fail-rank", "1", "--fail-until", "2"],
               LOGLEVEL="INFO")  # restarts are logged at INFO, as torchrun's
    assert r.returncode == 0, r.stderr
    assert SUMMARY_TITLE not in r.stderr
    assert dumped(workdir) == ["sig_0_0", "sig_1_0", "start_0_0", "start_0_1", "start_1_0",
                               "start_1_1", "start_2_0", "start_2_1"]
    (run_dir,) = logs.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1", "attempt_2"]
    assert r.stderr.count("Worker group FAILED") == 2


def test_restarts_exhausted(workdir, test_env):
    """Rank 1 always fails, --max-restarts 2: three attempts, then the summary (root
    cause rank 1, from the last attempt) and exit 1."""
    logs = workdir / "logs"
    r = tp_run(workdir, test_env, ["--nproc-per-node", "2", "--max-restarts", "2",
                                   "--log-dir", str(logs), "-r", "3", "scripts/worker.py",
                                   "--fail-rank", "1"])
    assert r.returncode == 1, r.stderr
    _, root = split_summary(r.stderr)
    assert root_rank(root) == 1 and "exitcode  : 3 " in root
    starts = [n for n in dumped(workdir) if n.startswith("start_")]
    assert starts == [f"start_{a}_{rank}" for a in range(3) for rank in (0, 1)]
    (run_dir,) = logs.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt_0", "attempt_1", "attempt_2"]
    for attempt in range(3):
        assert (run_dir / f"attempt_{attempt}/1/stderr.log").read_text() == "rank 1 exits 3\n"
        assert (run_dir / f"attempt_{attempt}/0/stdout.log").read_text() == \
            f"rank 0 started (restart {attempt})\n"


# Each restart hosts a fresh store, whatever the count: three in CI; the twenty that made
# torchrun 2.13 fail about 4 runs in 6, in the matrix.
@pytest.mark.slow
@pytest.mark.parametrize("restarts", [3, pytest.param(20, marks=pytest.mark.matrix)])
def test_gloo_restarts_all_succeed(workdir, test_env, restarts):
    """Consecutive restarts of a real 2-rank gloo job (init_process_group +
    all_reduce): every attempt's group forms. torchrun 2.13 fails about 4 in 6 runs of
    twenty with connectFullMesh, reusing a dead attempt's store; tp-run hosts a fresh
    store per attempt."""
    r = tp_run(workdir, test_env, ["--nproc-per-node", "2", "--max-restarts", str(restarts),
                                   "scripts/gloo_restart.py", "--fail-until", str(restarts)],
               timeout=900)
    assert r.returncode == 0, r.stderr[-5000:]
    assert "connectFullMesh" not in r.stderr
    oks = set(dumped(workdir))
    missing = [f"ok_{a}_{rank}" for a in range(restarts + 1) for rank in (0, 1)
               if f"ok_{a}_{rank}" not in oks]
    assert not missing, missing


# ---------------------------------------------------------------- stopping workers


@pytest.mark.parametrize("how", ["option", "env"])
def test_shutdown_timeout_on_failure_path(workdir, test_env, how):
    """A peer that ignores SIGTERM is SIGKILLed after --shutdown-timeout (or
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT) when another worker fails, not after torchrun's
    hard 30 s. The one time bound (< 20 s from the failure to the SIGKILL, read from
    tp-run's log) only separates 1 s from 30 s, with room for a loaded machine."""
    args = ["--nproc-per-node", "2", "scripts/worker.py", "--fail-rank", "1",
            "--peer", "ignore-term"]
    extra = {}
    if how == "option":
        args = ["--shutdown-timeout", "1", *args]
    else:
        extra["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    r = tp_run(workdir, test_env, args, **extra)
    assert r.returncode == 1, r.stderr
    others, root = split_summary(r.stderr)
    assert root_rank(root) == 1
    assert "exitcode  : -9 " in others and "(SIGKILL)" in others
    assert "sig_0_0" not in dumped(workdir)  # it ignored SIGTERM
    # From the agent's own log lines: failure seen (the peer is sent SIGTERM) -> SIGKILL.
    failed = log_time(r.stderr, r"closing signal SIGTERM")
    killed = log_time(r.stderr, r"did not stop within 1(\.0)?s; sending SIGKILL")
    assert 0.5 < killed - failed < 20


def log_time(stderr: str, pattern: str) -> float:
    """Seconds since midnight of the agent's first log line matching ``pattern``."""
    for line in stderr.splitlines():
        m = re.match(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\] ", line)
        if m and re.search(pattern, line):
            return int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])
    raise AssertionError(f"no log line matches {pattern!r}:\n{stderr}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_tp_run_is_forwarded(workdir, test_env, sig):
    """SIGTERM/SIGINT to tp-run: forwarded to every worker, tp-run exits 1, no leak."""
    dump = workdir / "dump"
    dump.mkdir()
    env = {**test_env, "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1"}
    proc = start_launcher(TP_RUN, ["--nproc-per-node", "2", "scripts/worker.py",
                                   "--fail-rank", "99"], env, workdir)
    try:
        for rank in (0, 1):
            wait_for_file(dump / f"start_0_{rank}")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=HANG_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    for rank in (0, 1):
        assert (dump / f"sig_0_{rank}").read_text() == sig.name
    assert "Traceback" not in err
    assert wait_no_marked(test_env["TP_TEST_MARKER"]) == []


def not_log_lines(stderr: str) -> list[str]:
    """stderr without the agent's own log lines (torchrun's ``I1203 12:00:00.000000 ...]``)."""
    return [line for line in stderr.splitlines()
            if line.strip() and not re.match(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ ", line)]


@pytest.mark.parametrize("backend,sig", [("etcd", signal.SIGTERM), ("c10d", signal.SIGINT)])
def test_signal_during_rendezvous_is_honoured(workdir, test_env, etcd_server, backend, sig):
    """--nnodes 2 and only one agent: it waits for the other node (join_timeout=600). A
    signal ends it at once (torchrun: at once too), not after join_timeout: exit 1, one
    line, no traceback, no worker started. The 60 s limit only guards against the hang."""
    from tests.etcd_server import free_port

    endpoint = etcd_server.endpoint if backend == "etcd" else f"127.0.0.1:{free_port()}"
    job = Live(TP_RUN, ["--nnodes", "2", "--rdzv-backend", backend, "--rdzv-endpoint",
                        endpoint, "--rdzv-id", f"sig-{uuid.uuid4().hex[:8]}", "--rdzv-conf",
                        "join_timeout=600", "scripts/worker.py"],
               {**test_env, "LOGLEVEL": "INFO", "DUMP_DIR": str(workdir)}, workdir)
    try:
        job.wait_for("opened rendezvous round")
        job.proc.send_signal(sig)
        rc, _, err = job.finish(timeout=60)
    finally:
        job.kill()
    assert rc == 1
    assert not_log_lines(err) == [f"tp-run: stopped by {sig.name}; workers shut down"], err
    assert not list(workdir.glob("start_*"))


def test_signal_while_connecting_is_honoured(workdir, test_env):
    """Nothing listens at the etcd endpoint and reaching it may take read_timeout=600: a
    signal while tp-run keeps trying ends it at once, in one line."""
    from tests.etcd_server import free_port

    job = Live(TP_RUN, ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-conf",
                        "join_timeout=600,read_timeout=600", "scripts/worker.py"],
               test_env, workdir)
    try:
        agent = psutil.Process(job.proc.pid)
        deadline = time.monotonic() + HANG_TIMEOUT
        while agent.num_threads() < 2:  # gRPC's threads: the agent is connecting
            assert time.monotonic() < deadline and job.proc.poll() is None, job.stderr
            time.sleep(0.05)
        job.proc.send_signal(signal.SIGTERM)
        rc, _, err = job.finish(timeout=60)
    finally:
        job.kill()
    assert rc == 1
    assert not_log_lines(err) == ["tp-run: stopped by SIGTERM"], err


def test_signal_in_the_exit_barrier_is_honoured(workdir, test_env, etcd_server):
    """One agent's worker is done and it waits in the exit barrier for the other node,
    whose worker runs on (exit_barrier_timeout=600): a signal ends the waiting one at
    once."""
    run_id = f"bar-{uuid.uuid4().hex[:8]}"
    dump = workdir / "dump"
    dump.mkdir()
    env = {**test_env, "LOGLEVEL": "INFO", "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1"}
    conf = "join_timeout=60,last_call_timeout=1,keep_alive_interval=0.5,lease_ttl=3," \
           "exit_barrier_timeout=600"
    jobs = [Live(TP_RUN, ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                          etcd_server.endpoint, "--rdzv-id", run_id, "--rdzv-conf", conf,
                          "--local-addr", f"127.0.0.{node + 2}", "scripts/worker.py",
                          *(["--fail-rank", "9"] if node else [])], env, workdir)  # 9: sleeps
            for node in range(2)]
    try:
        jobs[0].wait_for("Waiting for other agents to finish")
        jobs[0].proc.send_signal(signal.SIGTERM)
        rc, _, err = jobs[0].finish(timeout=60)
    finally:
        for job in jobs:
            job.kill()
    assert rc == 1, err
    assert not_log_lines(err) == ["tp-run: stopped by SIGTERM; workers shut down"], err


# ---------------------------------------------------------------- temp dirs and log disks


@pytest.mark.parametrize("outcome", ["success", "failure", "signal"])
def test_no_temp_directory_left_behind(workdir, test_env, tmp_path, outcome):
    """Without --log-dir, tp-run's temporary log dir (and nothing else it made) is gone
    after it exits, whatever the outcome."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    args = {"success": [], "failure": ["--fail-rank", "1"], "signal": ["--fail-rank", "99"]}
    dump = workdir / "dump"
    dump.mkdir()
    env = {**test_env, "TMPDIR": str(tmp), "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1"}
    job = Live(TP_RUN, ["--nproc-per-node", "2", "scripts/worker.py", *args[outcome]], env,
               workdir)
    try:
        wait_for_file(dump / "start_0_1")
        assert [p.name for p in tmp.iterdir()][0].startswith("torchelastic_")
        if outcome == "signal":
            job.proc.send_signal(signal.SIGTERM)
        rc, _, err = job.finish()
    finally:
        job.kill()
    assert rc == {"success": 0, "failure": 1, "signal": 1}[outcome], err
    assert list(tmp.iterdir()) == []


def test_redirected_output_in_the_temp_dir_is_kept(workdir, test_env, tmp_path):
    """-r 3 without --log-dir: the workers' output lives only in the temporary log dir,
    so it stays (as torchrun's does)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = tp_run(workdir, test_env, ["--nproc-per-node", "2", "-r", "3", "scripts/worker.py"],
               TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    (base,) = tmp.iterdir()
    assert [p.read_text() for p in sorted(base.glob("*/attempt_0/*/stdout.log"))] == [
        "rank 0 started (restart 0)\n", "rank 1 started (restart 0)\n"]


def test_full_log_disk_on_restart_degrades_logging(workdir, test_env, small_disk):
    """The log disk has room for attempt 0's directories only (its inodes are used up):
    attempt 1, after a failure, cannot make its directory. One warning; attempt 1's
    workers write to the console instead, and the job succeeds."""
    fill(small_disk, keep_inodes=4)  # the run dir, attempt_0, attempt_0/0, attempt_0/1
    r = tp_run(workdir, test_env, ["--nproc-per-node", "2", "--max-restarts", "1",
                                   "--log-dir", str(small_disk), "scripts/worker.py",
                                   "--fail-rank", "1", "--fail-until", "1"])
    assert r.returncode == 0, r.stderr
    assert "start_1_1" in dumped(workdir)
    (run_dir,) = [p for p in small_disk.iterdir() if p.name != "filler"]
    assert [p.name for p in run_dir.iterdir()] == ["attempt_0"]
    warnings = [line for line in r.stderr.splitlines() if "cannot write" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], r.stderr
    assert "Traceback" not in r.stderr
    assert "rank 1 started (restart 1)" in r.stdout  # the console took the attempt's output


def test_a_worker_whose_log_disk_filled_up_is_reported_as_such(workdir, test_env, small_disk):
    """-r 3 (both streams to files) on a log disk that fills up: the failing worker's
    traceback cannot be written (ENOSPC) and is lost, as under torchrun; tp-run says so,
    in a warning and in the failure summary, instead of a failure with no trace at all."""
    fill(small_disk, keep_inodes=8)  # the run dir, attempt_0, 0/, its logs, error file
    r = tp_run(workdir, test_env, ["--nproc-per-node", "1", "-r", "3", "--log-dir",
                                   str(small_disk), "scripts/worker.py", "--fail-rank", "0",
                                   "--fail-mode", "raise"])
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if "attempt_0/0) are on a full disk" in line]
    assert len(lines) == 2, r.stderr  # the warning, then the summary's traceback line
    assert "rank 0 (pid" in lines[0] and "traceback included, is lost" in lines[0], r.stderr


def test_unwritable_log_dir_is_one_line_error(workdir, test_env, small_disk):
    """A --log-dir on a read-only filesystem (EROFS: even root cannot write there)."""
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    r = tp_run(workdir, test_env, ["--log-dir", str(small_disk / "logs"), "scripts/worker.py"])
    assert r.returncode == 2
    assert_one_error_line(r, workdir, "Read-only file system")


def test_sigkill_to_tp_run_leaves_no_worker(workdir, test_env):
    """SIGKILL to tp-run: its workers die with it (PR_SET_PDEATHSIG), even those that
    ignore SIGTERM, and so do the helper processes the workers started (the guardian)."""
    dump = workdir / "dump"
    dump.mkdir()
    env = {**test_env, "DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1"}
    proc = start_launcher(TP_RUN, ["--nproc-per-node", "3", "scripts/worker.py",
                                   "--fail-rank", "99", "--peer", "ignore-term", "--helper"],
                          env, workdir)
    try:
        for rank in range(3):
            wait_for_file(dump / f"start_0_{rank}")
        pids = [int((dump / f"{kind}_0_{rank}").read_text())
                for kind in ("start", "helper") for rank in range(3)]
        assert all(psutil.pid_exists(pid) for pid in pids)
        proc.kill()
        proc.communicate(timeout=HANG_TIMEOUT)
        assert wait_no_marked(test_env["TP_TEST_MARKER"]) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---------------------------------------------------------------- bad input

ETCD_2 = ["--rdzv-backend", "etcd", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:9"]

BAD_INPUT = [
    ("missing-script", ["scripts/no_such_script.py"], "no_such_script.py"),
    ("missing-run-path-script", ["--run-path", "nope.py"], "nope.py"),
    ("missing-no-python-program", ["--no-python", "no-such-program-xyz"], "no-such-program-xyz"),
    ("nproc-not-int", ["--nproc-per-node", "abc", "scripts/worker.py"], "abc"),
    ("nproc-zero", ["--nproc-per-node", "0", "scripts/worker.py"], "--nproc-per-node"),
    ("nnodes-min-gt-max", ["--nnodes", "3:2", "scripts/worker.py"], "3:2"),
    ("nnodes-garbage", ["--nnodes", "two", "scripts/worker.py"], "two"),
    ("no-python-with-module", ["--no-python", "-m", "scripts.worker"], "--no-python"),
    ("malformed-rdzv-conf", ["--rdzv-conf", "join_timeout", "scripts/worker.py"], "join_timeout"),
    ("redirect-rank-out-of-range", ["--nproc-per-node", "2", "-r", "0:1,2:2",
                                    "scripts/worker.py"], "local rank 2"),
    ("tee-garbage", ["-t", "4", "scripts/worker.py"], "--tee"),
    ("local-ranks-filter-garbage", ["--local-ranks-filter", "0,x", "scripts/worker.py"],
     "--local-ranks-filter"),
    ("unknown-option", ["--no-such-option", "scripts/worker.py"], "--no-such-option"),
    ("unknown-signal", ["--signals-to-handle", "SIGTERM,SIGNOPE", "scripts/worker.py"],
     "SIGNOPE"),
    ("bad-master-port", ["--master-port", "99999", "scripts/worker.py"], "99999"),
    ("no-script", [], "TRAINING_SCRIPT"),
    ("virtual-local-rank-too-few-devices", ["--virtual-local-rank", "--nproc-per-node", "2",
                                            "scripts/worker.py"], "CUDA_VISIBLE_DEVICES"),
    ("node-rank-out-of-range", ["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "2",
                                "--master-port", "29999", "scripts/worker.py"], "--node-rank"),
    # Multi-node etcd comes with the etcd backend; until then (and with nothing at the
    # endpoint afterwards) it must still be one clear line, not a hang or a traceback.
    ("etcd-multi-node", ["--rdzv-backend", "etcd", "--nnodes", "2",
                         "--rdzv-endpoint", "127.0.0.1:9", "--rdzv-conf", "join_timeout=5",
                         "scripts/worker.py"], "etcd"),
    # Durations that are not finite would wait forever (nan) or never time out (inf).
    ("monitor-interval-nan", ["--monitor-interval", "nan", "scripts/worker.py"],
     "--monitor-interval"),
    ("spare-wait-timeout-inf", ["--spare-wait-timeout", "inf", "scripts/worker.py"],
     "--spare-wait-timeout"),
    ("join-timeout-nan", [*ETCD_2, "--rdzv-conf", "join_timeout=nan", "scripts/worker.py"],
     "join_timeout='nan' is not a finite"),
    ("lease-ttl-inf", [*ETCD_2, "--rdzv-conf", "lease_ttl=inf", "scripts/worker.py"],
     "lease_ttl='inf' is not a finite"),
    # A misspelled security setting would silently mean no TLS.
    ("misspelled-tls-key", [*ETCD_2, "--rdzv-conf", "protocol=https,ca-cert=ca.pem",
                            "scripts/worker.py"], "did you mean 'ca_cert'"),
    ("misspelled-timeout", [*ETCD_2, "--rdzv-conf", "join_timout=5", "scripts/worker.py"],
     "did you mean 'join_timeout'"),
    # One node does not use the backend, but a misspelled one is still a mistake.
    ("unknown-backend-one-node", ["--rdzv-backend", "bogus", "--rdzv-endpoint", "h:1",
                                  "scripts/worker.py"], "unknown --rdzv-backend 'bogus'"),
    ("unknown-backend", ["--rdzv-backend", "etcd3", "--nnodes", "2", "--rdzv-endpoint",
                         "127.0.0.1:9", "scripts/worker.py"], "unknown --rdzv-backend 'etcd3'"),
    ("log-dir-is-a-file", ["--log-dir", "scripts/worker.py", "scripts/worker.py"],
     "is a file"),
    ("log-dir-unwritable", ["--log-dir", "scripts/worker.py/logs", "scripts/worker.py"],
     "cannot write there"),
]
# (id, environment, args, what the line names)
BAD_ENVIRONMENT = [
    ("shutdown-timeout-nan", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "nan"}, ["scripts/worker.py"],
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
    ("password-over-plain-http", {"TP_RUN_ETCD_PASSWORD": "s3cret"},
     [*ETCD_2, "--rdzv-conf", "user=root", "scripts/worker.py"], "clear text"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case,args,mentions", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_one_line_error(workdir, test_env, case, args, mentions):
    """Each bad command line: one ``tp-run: error:`` line naming the problem, non-zero
    exit, no traceback, no worker started, no hang."""
    r = tp_run(workdir, test_env, args, timeout=120, CUDA_VISIBLE_DEVICES="0")
    assert_one_error_line(r, workdir, mentions)


@pytest.mark.parametrize("case,extra_env,args,mentions", BAD_ENVIRONMENT,
                         ids=[c[0] for c in BAD_ENVIRONMENT])
def test_bad_environment_one_line_error(workdir, test_env, case, extra_env, args, mentions):
    """The same for settings that come from the environment: exit 2 before anything."""
    r = tp_run(workdir, test_env, args, timeout=120, **extra_env)
    assert r.returncode == 2
    assert_one_error_line(r, workdir, mentions)


def assert_one_error_line(r: subprocess.CompletedProcess, workdir: Path, mentions: str) -> None:
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tp-run: error: "), r.stderr
    assert mentions in lines[0], lines[0]
    assert r.stdout == ""
    assert dumped(workdir) == []
