"""The health check's bounds (issue 25): checked at start, output kept to its tail, its
processes ended with it, no secrets in its environment. Real shells, no training job."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from rendezvous.etcd import PASSWORD_ENV
from tp_launch.agent.health import OUTPUT_KEEP, HealthCheck, check_command, run_bounded
from tp_launch.config import ConfigError


def _shell(command: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_endless_output_keeps_only_its_tail():
    output, code = run_bounded(_shell("yes 'a line of output'"), 0.5)
    assert code is None  # timed out, killed
    assert 0 < len(output.encode()) <= OUTPUT_KEEP and output.endswith(("\n", "t", "a"))


def test_a_background_child_neither_holds_the_check_nor_outlives_it(tmp_path):
    pid_file = tmp_path / "child"
    t0 = time.monotonic()
    output, code = run_bounded(_shell(f"sleep 60 & echo $! > {pid_file}; echo fine"), 30)
    assert code == 0 and output.strip() == "fine"
    assert time.monotonic() - t0 < 20  # not the child's 60 s, nor the 30 s timeout
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != "zombie" \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_the_check_does_not_see_the_etcd_password(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
    check = HealthCheck(f'echo "password: ${PASSWORD_ENV}"; exit 1', 0.05)
    check.start()
    try:
        deadline = time.monotonic() + 10
        while (line := check.failure()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        check.stop()
    assert line is not None and "exited with 1" in line and "s3cret-pw" not in line


@pytest.mark.parametrize("command, interval, words", [
    ("", 30.0, "the command is empty"),
    ("   ", 30.0, "the command is empty"),
    ("nvidia-smii -q", 30.0, "nvidia-smii: command not found"),
    ("FOO=1 /no/such/check --x", 30.0, "/no/such/check: command not found"),
    ("if true; then", 30.0, "does not parse"),
    ("true", 1e-9, "--health-interval"),
])
def test_bad_health_checks_are_refused_at_start(command, interval, words):
    with pytest.raises(ConfigError, match=words.replace("-", r"\-").replace("/", "/")):
        check_command(command, interval)


@pytest.mark.parametrize("command", ["true", "test ! -e /no/such/flag", "[ -e / ]",
                                     "echo ok | grep -q ok", "FOO=1 true",
                                     "cd / && ls >/dev/null", "exit 0"])
def test_good_health_checks_pass_the_start_check(command):
    check_command(command, 0.5)
