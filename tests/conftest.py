"""Shared test fixtures: run tp-run (and torchrun) as real processes, and catch leaks.

Every process a test starts carries ``TP_TEST_MARKER=<unique id>`` in its environment,
inherited by the agent, its workers and their helpers. After the test, no process with
that marker may be alive: a leak fails the test (and the leaked processes are killed so
they cannot disturb the next one).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import psutil
import pytest

if TYPE_CHECKING:
    from tests.hosts import Cluster

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TP_RUN = [sys.executable, "-m", "tp_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# scripts/resilient_train.py as most resilient-mode tests run it (see `reference`).
RESILIENT_SCRIPT = "scripts/resilient_train.py"
RESILIENT_STEPS = 24

# Generous limits against hangs only; no test asserts a duration.
HANG_TIMEOUT = 180

# The test files that take longest, longest first (as measured in a clean-clone CI run):
# the order they are handed out in under -n N. Only the order: a stale list costs
# minutes, never a result.
LONGEST_FILES = (
    "test_sharded.py", "test_resilient.py", "test_hang_recovery.py", "test_etcd_outages.py",
    "test_exactness.py", "test_loops.py", "test_rendezvous_e2e.py", "test_hosts.py",
    "test_failures.py", "test_conformance.py", "test_advance.py", "test_slurm_cluster.py",
    "test_control_security.py", "test_transfer.py", "test_rendezvous_security.py",
    "test_status.py", "test_rendezvous.py", "test_forged_documents.py",
)


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


class Live:
    """A launcher in the background whose output the test reads while it runs.

    ``wait_for(pattern)`` blocks until a stderr line matches; ``finish()`` waits for the
    exit and returns (status, stdout, stderr). Killed if the test leaves it running.
    """

    def __init__(self, launcher: list[str], args: list[str], env: dict[str, str],
                 cwd: Path) -> None:
        import threading

        self.proc = start_launcher(launcher, args, env, cwd)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out),
                                               (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def count(self, pattern: str) -> int:
        import re

        return sum(1 for line in list(self.err) if re.search(pattern, line))

    def wait_for(self, pattern: str, times: int = 1, timeout: float = HANG_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.count(pattern) < times:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                for t in self._threads:
                    t.join(5)
                raise AssertionError(f"no {times} stderr line(s) match {pattern!r} "
                                     f"(exit {self.proc.poll()}):\n{self.stderr[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = HANG_TIMEOUT) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout)
        finally:
            self.kill()
        for t in self._threads:
            t.join(10)
        return self.proc.returncode, "".join(self.out), self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


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


# ---------------------------------------------------------------- the tiers
#
# unit: decisions and codecs, no process (asserted: starting one fails the test), the
#   whole tier in well under a minute (`pytest -m unit`).
# slow: longer failure-path launches (run in CI; `-m "not slow"` is the inner loop).
# matrix: the combinatorial kill matrices (every kill point x loop x rank), whose
#   decisions the unit tier covers; run on demand: `pytest --matrix` (or
#   TP_RUN_MATRIX=1), outside CI.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--matrix", action="store_true",
                     help="also run the combinatorial kill matrices (marker: matrix)")
    parser.addoption("--repeat", type=int, default=1, metavar="N",
                     help="run the selected tests N times, round after round (hunting a "
                          "flaky case: next to `yes > /dev/null`, say)")


def pytest_configure(config: pytest.Config) -> None:
    # xdist's schedulers key tests by id: a test listed N times would not run N times.
    if config.getoption("--repeat") > 1 and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("--repeat runs the tests in one process: leave out -n "
                                "(run two such commands side by side for two)")


def _matrix_wanted(config: pytest.Config) -> bool:
    return bool(config.getoption("--matrix") or os.environ.get("TP_RUN_MATRIX") == "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest files first (their order kept inside each file): under -n N each file
    # runs whole in one process (--dist loadfile), and a long file started last would
    # leave the other processes idle until it ends.
    # (A stable sort: the files not listed keep their collection order, after these.)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    # Rounds, not each test N times in a row: a session fixture is shared, and each
    # round meets the others' leftovers as the suite would.
    items[:] = items * max(1, config.getoption("--repeat"))
    if _matrix_wanted(config):
        return
    skip = pytest.mark.skip(reason="the combinatorial matrix: run with --matrix")
    for item in items:
        if item.get_closest_marker("matrix") is not None:
            item.add_marker(skip)


class ProcessStarted(AssertionError):
    """A unit test started a process."""


def _no_process(*_args: object, **_kwargs: object) -> None:
    raise ProcessStarted("a unit test started a process (the unit tier starts none)")


@pytest.fixture(autouse=True)
def _unit_tier_starts_no_process(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the unit marker, every way to start a process fails the test: subprocess
    (its own name for _posixsubprocess.fork_exec, or posix_spawn), multiprocessing
    (_posixsubprocess.fork_exec), os.fork and os.forkpty."""
    if request.node.get_closest_marker("unit") is None:
        return
    import _posixsubprocess

    monkeypatch.setattr(_posixsubprocess, "fork_exec", _no_process)
    monkeypatch.setattr(subprocess, "_fork_exec", _no_process)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _no_process)


_UNIT_TIMES: list[float] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and "unit" in report.keywords:
        _UNIT_TIMES.append(report.duration)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _UNIT_TIMES:
        terminalreporter.write_line(
            f"unit tier: {len(_UNIT_TIMES)} tests, {sum(_UNIT_TIMES):.1f} s of test time, "
            "no process started")


# ---------------------------------------------------------------- a disk that fills up


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A filesystem of the test's own, small enough to fill: a 4 MiB tmpfs with 512
    inodes, so that a full disk is a real ENOSPC from the kernel. Mounting needs root
    (CAP_SYS_ADMIN): skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = tmp_path / "disk"
    path.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=512", "tmpfs",
                            str(path)], capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path, keep_inodes: int = 0) -> None:
    """Use up ``disk``: all its space, and all its inodes but ``keep_inodes``."""
    filler = disk / "filler"
    filler.mkdir(exist_ok=True)
    fd = os.open(filler / "blocks", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    made = []
    try:
        while True:
            path = filler / str(len(made))
            path.touch()
            made.append(path)
    except OSError:
        pass
    for path in made[len(made) - keep_inodes:] if keep_inodes else []:
        path.unlink()


# ---------------------------------------------------------------- etcd (rendezvous tests)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator["EtcdServer"]:
    """One real etcd for the session (tests keep apart by run id); stopped at the end."""
    from tests.etcd_server import EtcdServer

    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The failure-free result of RESILIENT_SCRIPT (4 ranks, RESILIENT_STEPS steps) under
    torchrun: what every module running that script compares with, computed once per
    session. (Modules of other scripts define their own ``reference``.)"""
    workdir = tmp_path_factory.mktemp("reference")
    shutil.copytree(SCRIPTS, workdir / "scripts")
    out = workdir / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    proc = run_launcher(TORCHRUN, ["--nproc-per-node", "4", RESILIENT_SCRIPT, "--steps",
                                   str(RESILIENT_STEPS), "--no-resilient"],
                        {**env, "OUT": str(out), "OMP_NUM_THREADS": "1"}, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "final_0.json").read_text())["checksum"]


# ---------------------------------------------------------------- emulated hosts


@pytest.fixture
def emulated_cluster() -> Iterator[Callable[..., "Cluster"]]:
    """``emulated_cluster(n, tag)``: a :class:`tests.hosts.Cluster` of ``n`` emulated hosts
    (network namespaces on a bridge), removed with every process in it after the test,
    whatever the outcome (and at exit, should the test be interrupted). Skipped, with one
    line saying why, where hosts cannot be emulated."""
    from tests.hosts import Cluster, cannot_emulate

    why = cannot_emulate()
    if why:
        pytest.skip(why)
    made: list[Cluster] = []

    def make(n: int, tag: str = "") -> Cluster:
        made.append(Cluster(n, tag))
        return made[-1]

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
