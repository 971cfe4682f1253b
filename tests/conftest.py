"""Shared test fixtures: run tp-run (and torchrun) as real processes, and catch leaks.

Every process a test starts carries ``TP_TEST_MARKER=<unique id>`` in its environment,
inherited by the agent, its workers and their helpers. After the test, no process with
that marker may be alive: a leak fails the test (and the leaked processes are killed so
they cannot disturb the next one).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TP_RUN = [sys.executable, "-m", "tp_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Generous limits against hangs only; no test asserts a duration.
HANG_TIMEOUT = 180


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get("TP_TEST_MARKER") == marker:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_no_marked(marker: str, timeout: float = 10.0) -> list[psutil.Process]:
    """Wait for every marked process to exit; return the ones still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in marked_processes(marker) if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # exited since it was listed (ZombieProcess included)
        return False


def _describe(p: psutil.Process) -> tuple[int, list[str] | str]:
    try:
        return p.pid, p.cmdline()
    except psutil.Error as e:
        return p.pid, type(e).__name__


@pytest.fixture
def test_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment for launched processes, marked for the leak check."""
    marker = uuid.uuid4().hex
    env = dict(os.environ)
    env["TP_TEST_MARKER"] = marker
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    for key in [k for k in env if k.startswith("PET_")]:
        env.pop(key)
    yield env
    leaked = wait_no_marked(marker)
    described = [_describe(p) for p in leaked]  # before the kill makes them zombies
    for p in leaked:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leaked, f"processes leaked: {described}"


def run_launcher(launcher: list[str], args: list[str], env: dict[str, str], cwd: Path,
                 timeout: float = HANG_TIMEOUT) -> subprocess.CompletedProcess:
    """Run tp-run or torchrun to completion; a hang fails the test."""
    return subprocess.run([*launcher, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def start_launcher(launcher: list[str], args: list[str], env: dict[str, str],
                   cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*launcher, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def wait_for_file(path: Path, timeout: float = HANG_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch directory holding copies of tests/scripts."""
    shutil.copytree(SCRIPTS, tmp_path / "scripts")
    return tmp_path


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- etcd (rendezvous tests)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["EtcdServer"]:
    """One real etcd for the session (tests keep apart by run id); stopped at the end."""
    from tests.etcd_server import EtcdServer

    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server
