"""Worker failures and torchrun's summary (tp_launch.agent.failures), without processes."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tp_launch.agent.failures import (
    ProcessFailure,
    copy_root_cause,
    exit_description,
    first_observed,
    format_summary,
)

pytestmark = pytest.mark.unit


@dataclass
class _Exited:
    """What ProcessFailure.of_exit reads of a worker that has exited."""

    local_rank: int
    pid: int
    returncode: int | None
    error_file: str = ""
    exit_time: float | None = 1_700_000_000.5
    log_files: tuple[str, ...] = ()
    log_loss_said: bool = False


def test_a_signal_death_without_error_file_says_which_signal():
    f = ProcessFailure.of_exit(_Exited(local_rank=1, pid=42, returncode=-9), rank=3)
    assert (f.rank, f.local_rank, f.pid, f.exitcode) == (3, 1, 42, -9)
    assert f.message == "Signal 9 (SIGKILL) received by PID 42"
    assert (f.signal_name, f.error_file, f.timestamp) == ("SIGKILL", "<N/A>", 1_700_000_000)
    assert not f.has_error_file


def test_an_error_exit_without_error_file_says_how_to_get_a_traceback():
    f = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=1, error_file="", observed=0.0)
    assert "To enable traceback" in f.message and f.signal_name == "<N/A>"


def test_the_error_file_gives_message_and_time(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {
        "message": "RuntimeError: boom",
        "extraInfo": {"py_callstack": "Traceback...\nRuntimeError: boom", "timestamp": "7"}}}))
    f = ProcessFailure(rank=2, local_rank=0, pid=5, exitcode=1, error_file=str(path),
                       observed=100.0)
    assert f.has_error_file and f.timestamp == 7
    assert "traceback : Traceback...\n  RuntimeError: boom" in f.format(0)


def test_an_unreadable_error_file_falls_back_to_the_exit(tmp_path):
    path = tmp_path / "error.json"
    path.write_text("{not json")
    f = ProcessFailure(rank=0, local_rank=0, pid=5, exitcode=-15, error_file=str(path),
                       observed=3.0)
    assert not f.has_error_file and f.message.startswith("Signal 15 (SIGTERM)")


def test_the_summary_lists_the_others_then_the_root_cause_last():
    root = ProcessFailure(rank=1, local_rank=1, pid=11, exitcode=1, error_file="",
                          observed=10.0)
    peer = ProcessFailure(rank=0, local_rank=0, pid=10, exitcode=-15, error_file="",
                          observed=11.0)
    text = format_summary("train.py", root, [root, peer])
    failures, root_cause = text.split("Root Cause (first observed failure):")
    assert "train.py FAILED" in failures and "[1]:" in failures and "pid: 10" in failures
    assert "[0]:" in root_cause and "pid: 11" in root_cause and "pid: 10" not in root_cause
    alone = format_summary("train.py", root, [root])
    assert "<NO_OTHER_FAILURES>" in alone


def test_the_root_cause_is_the_first_failure_observed():
    late = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=1, error_file="", observed=5.0)
    early = ProcessFailure(rank=1, local_rank=1, pid=2, exitcode=1, error_file="",
                           observed=4.0)
    assert first_observed([late, early]) is early
    assert first_observed([]) is None


def test_exit_description():
    assert exit_description(-9) == "was killed by SIGKILL"
    assert exit_description(3) == "exited with code 3"
    assert exit_description(-999) == "exited with code -999"  # no such signal


def test_the_root_cause_is_copied_to_tp_runs_error_file(tmp_path, monkeypatch):
    target = tmp_path / "tp-run-error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))
    root = ProcessFailure(rank=0, local_rank=0, pid=1, exitcode=-6, error_file="",
                          observed=8.0)
    copy_root_cause(root)
    message = json.loads(target.read_text())["message"]
    assert message["errorCode"] == -6 and message["message"].startswith("Signal 6 (SIGABRT)")
