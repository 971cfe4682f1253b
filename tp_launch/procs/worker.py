"""One worker process: spawned so that it can never outlive its agent.

Each worker starts in a session of its own (so a signal reaches the worker's whole
process group, its helpers included, as in torchrun) with ``PR_SET_PDEATHSIG=SIGKILL``:
if the agent dies, even by SIGKILL, the kernel kills the worker. torchrun 2.13 leaves
its workers running in that case.

PDEATHSIG fires when the *thread* that forked the child exits, so workers must be
spawned from a thread that lives as long as the agent: the agent spawns from its main
thread only. The processes a worker starts itself are covered by the agent's guardian
(:mod:`tp_launch.procs.guardian`).

A preemption notice (``--on-preempt``, :mod:`tp_launch.agent.advance`) is for the agent:
a scheduler may send it to every process of the job (Slurm's ``--signal`` signals the
whole step), so workers start with it ignored (:func:`ignore_in_workers`; a script may
still install its own handler). When the notice is the signal workers are stopped with
(``--preempt-signal TERM``), :func:`stop_workers` does not wait for a worker that still
ignores it (the kernel's ``SigIgn`` mask says so): such a stop used to wait out the whole
shutdown timeout before its SIGKILL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import subprocess
import time
from typing import IO, Any, Protocol

from tp_launch.procs.guardian import GUARDIAN
from tp_launch.procs.logs import log_write_failed
from tp_launch.procs.template import ProcessTemplate, forkable

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_SIG_IGN = ctypes.c_void_p(1)
_ignored: tuple[int, ...] = ()  # signals workers start with ignored


def ignore_in_workers(sigs: list[signal.Signals]) -> None:
    """Workers spawned from now on start with ``sigs`` ignored (kept across exec)."""
    global _ignored
    _ignored = tuple(int(s) for s in sigs)


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for sig in _ignored:
        _libc.signal(sig, _SIG_IGN)
    GUARDIAN.watch_self()  # the child is its own group leader by now (start_new_session)
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def spawn(argv: list[str], env: dict[str, str], stdout: Any, stderr: Any,
          pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start a worker (or the process template) in a session of its own, tied to the agent."""
    agent_pid = os.getpid()
    return subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
                            start_new_session=True,
                            preexec_fn=lambda: _die_with_parent(agent_pid))


class Child(Protocol):
    """What the agent uses of a worker's process: a :class:`subprocess.Popen`, or a
    :class:`~tp_launch.procs.template.ForkedChild`."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class WorkerProcess:
    """A spawned worker and the files its streams go to.

    Args:
        argv: the command line.
        env: the complete environment.
        stdout, stderr: file paths for the streams; None inherits the agent's console.
        local_rank: the worker's local rank (for messages).
        piped: both streams go to pipes the agent reads (``popen.stdout``/``stderr``)
            instead; ``stdout``/``stderr`` are then ignored.
        template: fork it from this template where it can (:mod:`tp_launch.procs.template`).
    """

    def __init__(self, argv: list[str], env: dict[str, str], stdout: str | None,
                 stderr: str | None, local_rank: int, piped: bool = False,
                 template: ProcessTemplate | None = None) -> None:
        self.local_rank = local_rank
        self.error_file = env.get("TORCHELASTIC_ERROR_FILE", "")
        self._files: list[IO] = []
        self.log_files: list[str] = []  # the files its streams go to
        self.log_loss_said = False  # a full log disk's loss was reported
        out: Any = subprocess.PIPE
        err: Any = subprocess.PIPE
        if not piped:
            out, err = self._open(stdout), self._open(stderr)
        forked = None
        if template is not None and forkable(argv) and template.usable_for(env):
            forked = template.fork(argv, env, _ignored, None if piped else (out, err))
        if forked is not None:
            GUARDIAN.watch(forked.pid)
            self.popen: Child = forked
        else:
            self.popen = spawn(argv, env, out, err)
        self.pid = self.popen.pid
        self.started = time.time()
        self.exit_time: float | None = None
        self.pidfd = os.pidfd_open(self.pid)

    def _open(self, path: str | None) -> IO | None:
        """The stream's log file; the console (None) if it cannot be made (a full or
        read-only log disk costs the file, not the worker)."""
        if path is None:
            return None
        try:
            f = open(path, "w")  # noqa: SIM115 - closed in close()
        except OSError as e:
            log_write_failed(path, e)
            return None
        self._files.append(f)
        self.log_files.append(path)
        return f

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped: negative for a signal, as in subprocess.

        The first time the worker is seen dead, whatever it left in its process group is
        SIGKILLed: the DataLoader workers it forked hold copies of its sockets (gloo's
        connections to its peers among them), so a rank killed alone (the OOM killer
        kills one process, not its group) would otherwise stay connected through them,
        its peers blocked in a collective that never fails, and no recovery would start
        (they also watch their parent only every 5 s, and not while blocked)."""
        code = self.popen.poll()
        if code is not None and self.exit_time is None:
            self.exit_time = time.time()
            self.signal_group(signal.SIGKILL)
        return code

    def written(self) -> int:
        """Bytes the worker itself wrote so far (its output, its files; 0 if unknown):
        ``wchar`` of ``/proc/<pid>/io``, readable by its owner without privileges."""
        try:
            with open(f"/proc/{self.pid}/io", "rb") as f:
                for line in f:
                    if line.startswith(b"wchar:"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def abort_with_stack(self) -> None:
        """End a hung worker with its Python stack on its stderr: SIGABRT, which
        :mod:`faulthandler` turns into a dump of every thread (enabled by
        ``PYTHONFAULTHANDLER``, which the agent sets when hang detection is on, or by
        :mod:`tp_launch.resilient.heartbeat`); no core file (RLIMIT_CORE 0); SIGCONT
        after, in case it is stopped.

        The signal goes to the main thread (``tgkill``), not to the process: faulthandler
        reads the other threads' frames without the interpreter lock, and a thread that
        runs meanwhile can change them under it (CPython gh-116008: the dump segfaults
        and the main thread's frames, printed last, are lost). Sent to the process, a
        stopped worker's SIGABRT goes to whichever thread runs first after SIGCONT (a
        gloo thread, say) while the main thread trains on. Taken by the main thread, it
        freezes the one that matters, and the lock the main thread holds (a stopped or
        lock-holding hang) keeps every other Python thread still."""
        try:
            resource.prlimit(self.pid, resource.RLIMIT_CORE, (0, 0))
        except (OSError, ValueError):
            pass
        try:
            signal_main_thread(self.pid, signal.SIGABRT)
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            return

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (the worker and its helpers)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        """Release the pidfd and log files; the process must be reaped already."""
        GUARDIAN.forget(self.pid)
        for f in self._files:
            f.close()
        self._files.clear()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to process ``pid``'s main thread (whose thread id is ``pid``), or,
    where libc has no ``tgkill`` (glibc < 2.30, musl), to the process."""
    tgkill = getattr(_libc, "tgkill", None)
    if tgkill is None:
        os.kill(pid, sig)
    elif tgkill(pid, pid, sig) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))  # ESRCH: ProcessLookupError, as os.kill


def abort_with_stacks(workers: list[WorkerProcess], wait_s: float = 2.0) -> None:
    """End hung workers, each with its stack on its stderr
    (:meth:`WorkerProcess.abort_with_stack`); one that has not ended ``wait_s`` later (it
    handles SIGABRT itself, or cannot run) is SIGKILLed with its process group. Their
    exit is how the caller learns it: the dump is complete once the process is gone."""
    for w in workers:
        w.abort_with_stack()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(w.returncode is None for w in workers):
        time.sleep(0.01)
    for w in workers:
        if w.returncode is None:
            w.signal_group(signal.SIGKILL)


def on_a_full_disk(paths: list[str]) -> str | None:
    """The first of ``paths`` on a disk with no room left, if any: what a worker wrote to
    it since (a traceback, say) was lost, ENOSPC, and nobody saw it."""
    for path in paths:
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        if (st.f_bfree if os.geteuid() == 0 else st.f_bavail) == 0:  # root's reserve
            return path
    return None


def ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` now (False if it cannot be told)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def stop_workers(workers: list[WorkerProcess], sig: int, timeout: float,
                 level: int = logging.WARNING) -> None:
    """Send ``sig`` to every live worker's group, wait up to ``timeout``, then SIGKILL.

    On return every worker is reaped and no process of their groups is left. ``level``:
    of the "closing signal" lines (torchrun's WARNING; INFO for a normal end).
    """
    live = [w for w in workers if w.returncode is None]
    for w in live:
        if sig != signal.SIGKILL:
            logger.log(level, "Sending process %s closing signal %s", w.pid,
                       signal.Signals(sig).name)
        w.signal_group(sig)
    # Started ignoring the notice and never took it back: SIGKILLed without a wait.
    deaf = {w.pid for w in live if sig in _ignored and ignores(w.pid, sig)}
    deadline = time.monotonic() + timeout
    for w in live:
        if w.pid in deaf:
            continue
        remaining = max(0.0, deadline - time.monotonic())
        try:
            w.popen.wait(remaining)
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w.returncode is None and w.pid not in deaf:
            logger.warning("Process %s did not stop within %ss; sending SIGKILL", w.pid, timeout)
        # Also clears helpers a worker left in its group after it exited itself.
        w.signal_group(signal.SIGKILL)
    for w in workers:
        w.popen.wait()
        w.returncode  # noqa: B018 - records exit_time
