"""Worker failures: what is reported, in torchrun's summary format.

A worker that fails under ``torch.distributed.elastic.multiprocessing.errors.record``
writes a JSON error file (``TORCHELASTIC_ERROR_FILE``); the failure's message and
traceback come from it. Otherwise the message says which signal killed the worker or
how to get a traceback. The summary block is torchrun's ``ChildFailedError`` text,
without the agent's own Python traceback around it.

The root cause is the first failure the agent observed, not the earliest error-file
timestamp (whole seconds, so ties between the culprit and the peers that the agent
stopped afterwards are common in torchrun).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from string import Template
from typing import TYPE_CHECKING, Any

from tp_launch.procs.worker import on_a_full_disk

if TYPE_CHECKING:
    from tp_launch.procs.worker import WorkerProcess

logger = logging.getLogger(__name__)

_NA = "<N/A>"
_NO_TRACEBACK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

_FAILURE = """[${idx}]:
  time      : ${time}
  host      : ${hostname}
  rank      : ${rank} (local_rank: ${local_rank})
  exitcode  : ${exitcode} (pid: ${pid}) ${signal_name}
  error_file: ${error_file}
  traceback : ${message}"""

_SUMMARY = """
${border}
${title}
${section}
Failures:
${other_failures}
${section}
Root Cause (first observed failure):
${root_failure}
${border}"""


@dataclass
class ProcessFailure:
    """A worker that exited with a non-zero status.

    Args:
        rank: its global rank.
        local_rank: its local rank.
        pid: its process id.
        exitcode: its status; negative for the signal that killed it.
        error_file: the TORCHELASTIC_ERROR_FILE it was given.
        observed: when the agent saw it exit (time.time()).
    """

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    observed: float
    data: dict[str, Any] = field(init=False, default_factory=dict)
    message: str = field(init=False, default="")
    timestamp: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.timestamp = int(self.observed)
        if self.error_file and os.path.isfile(self.error_file):
            try:
                with open(self.error_file) as f:
                    self.data = json.load(f)
                self.message, self.timestamp = _message_of(self.data, self.timestamp)
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("cannot read error file %s: %s", self.error_file, e)
                self.data = {}
        else:
            self.error_file = _NA
        if not self.message:
            if self.exitcode < 0:
                self.message = (f"Signal {-self.exitcode} ({self.signal_name}) received by "
                                f"PID {self.pid}")
            else:
                self.message = _NO_TRACEBACK

    @classmethod
    def of_exit(cls, worker: WorkerProcess, rank: int) -> ProcessFailure:
        """The failure of ``worker``, which held global ``rank`` (-1: a spare) and exited
        with a non-zero status."""
        failure = cls(rank=rank, local_rank=worker.local_rank, pid=worker.pid,
                      exitcode=worker.returncode or 0, error_file=worker.error_file,
                      observed=worker.exit_time or time.time())
        full = on_a_full_disk(worker.log_files)
        if full is not None and not failure.has_error_file:
            failure.message = (f"its log files ({os.path.dirname(full)}) are on a full "
                               "disk: what it wrote there last, its traceback included, "
                               "is lost")
            if not worker.log_loss_said:  # a failure is built more than once
                worker.log_loss_said = True
                logger.warning("rank %s (pid %s) exited with code %s; %s", rank, worker.pid,
                               failure.exitcode, failure.message)
        return failure

    @property
    def signal_name(self) -> str:
        if self.exitcode >= 0:
            return _NA
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return _NA

    @property
    def has_error_file(self) -> bool:
        return bool(self.data)

    def format(self, idx: int) -> str:
        msg = self.message
        if isinstance(msg, dict):
            msg = msg.get("extraInfo", {}).get("py_callstack", msg.get("message", _NA))
            msg = msg.replace("\n", "\n  ")
        sig = f" ({self.signal_name})" if self.signal_name != _NA else ""
        return Template(_FAILURE).substitute(
            idx=idx,
            time=datetime.fromtimestamp(self.timestamp).isoformat(sep="_"),
            hostname=socket.getfqdn(),
            rank=self.rank,
            local_rank=self.local_rank,
            exitcode=self.exitcode,
            pid=self.pid,
            signal_name=sig,
            error_file=self.error_file,
            message=msg,
        )


def first_observed(failures: list[ProcessFailure]) -> ProcessFailure | None:
    """The root cause among ``failures``: the one the agent saw first (None: none)."""
    return min(failures, key=lambda f: f.observed, default=None)


def exit_description(code: int | None) -> str:
    """How a process ended, in words: ``was killed by SIGKILL``, ``exited with code 1``."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


def _message_of(data: dict[str, Any], default_ts: int) -> tuple[Any, int]:
    message = data["message"]
    if isinstance(message, str):
        return message, int(data.get("timestamp", default_ts))
    return message, int(message["extraInfo"]["timestamp"])


def format_summary(name: str, root: ProcessFailure, failures: list[ProcessFailure]) -> str:
    """torchrun's failure block: every failure, the root cause last.

    Failures are numbered in the order given (the agent passes torchrun's order).
    """
    title = f"{name} FAILED"
    root_fmt = ""
    others: list[str] = []
    width = len(title)
    for idx, failure in enumerate(failures):
        fmt = failure.format(idx)
        width = max(width, *(len(line) for line in fmt.split("\n")))
        if failure is root:
            root_fmt = fmt
        else:
            others.append(fmt)
    width = min(width, 60)
    return Template(_SUMMARY).substitute(
        border="=" * width,
        title=title,
        section="-" * width,
        root_failure=root_fmt,
        other_failures="\n".join(others or ["  <NO_OTHER_FAILURES>"]),
    )


def copy_root_cause(root: ProcessFailure) -> None:
    """Copy the root cause's error file to tp-run's own TORCHELASTIC_ERROR_FILE.

    As torchrun's ``@record`` does: the child's JSON with ``errorCode`` set to its exit
    status, so a scheduler that watches tp-run's error file sees the worker's error.
    """
    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not target:
        return
    if root.has_error_file:
        data = json.loads(json.dumps(root.data))
        if isinstance(data.get("message"), dict) and root.exitcode:
            data["message"]["errorCode"] = root.exitcode
    else:
        data = {
            "message": {
                "message": root.message,
                "extraInfo": {"py_callstack": root.message, "timestamp": str(root.timestamp)},
                "errorCode": root.exitcode,
            }
        }
    try:
        with open(target, "w") as f:
            json.dump(data, f)
    except OSError as e:
        logger.warning("cannot write tp-run's error file %s: %s", target, e)
