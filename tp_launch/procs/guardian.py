"""The guardian: kills the workers' process groups when the agent dies, however it dies.

``PR_SET_PDEATHSIG`` kills a worker when its agent dies, but not the processes the
worker started itself (a data loader's helpers, a shell's children, a ``--no-python``
wrapper's program): they would be orphaned. The guardian is a small forked child of the
agent, in a session of its own (so a signal to the agent's process group does not reach
it). The agent tells it each worker's process group through a pipe; when the pipe
reaches end-of-file — the agent exited or was SIGKILLed — the guardian SIGKILLs every
group it was told about and exits.

Protocol on the pipe, one line per event: ``+<pgid>`` a group to guard, ``-<pgid>`` a
group that is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)


class Guardian:
    """Start with :meth:`start` before the agent starts any thread (it forks)."""

    def __init__(self) -> None:
        self._w = -1
        self._pid = -1
        self._lock = threading.Lock()

    def start(self) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the guardian
            try:
                os.close(w)
                os.setsid()
                _guard(r)
            finally:
                os._exit(0)
        os.close(r)
        os.set_inheritable(w, False)
        self._w, self._pid = w, pid

    def watch_self(self) -> None:
        """Register the calling process's group; for a new worker between fork and exec.

        The parent cannot do it after ``Popen`` returns: on a loaded machine the worker
        can start helpers before the parent runs again, and a SIGKILL to the agent in
        that window would orphan them. One short ``write`` is atomic on a pipe and takes
        no lock (a lock is not safe to take in a forked child).
        """
        if self._w >= 0:
            try:
                os.write(self._w, f"+{os.getpgid(0)}\n".encode())
            except OSError:
                pass

    def watch(self, pgid: int) -> None:
        """Register a group the agent did not fork itself (a process the template forked,
        :mod:`tp_launch.procs.template`, which dies with the template until then)."""
        self._send(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        if self._w < 0:
            return
        with self._lock:
            try:
                os.write(self._w, line.encode())
            except OSError as e:  # the guardian is gone: workers still have PDEATHSIG
                logger.warning("guardian unreachable: %s", e)

    def stop(self) -> None:
        """Close the pipe (the guardian kills what is left and exits) and reap it."""
        if self._w >= 0:
            os.close(self._w)
            self._w = -1
        if self._pid > 0:
            try:
                os.waitpid(self._pid, 0)
            except ChildProcessError:
                pass
            self._pid = -1


# The agent's guardian; started by the agent, used by every WorkerProcess it spawns.
GUARDIAN = Guardian()


def _guard(fd: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"+"):
                groups.add(int(line[1:]))
            elif line.startswith(b"-"):
                groups.discard(int(line[1:]))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
