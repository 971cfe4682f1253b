"""What the agent sees of a worker that does not exit: its heartbeat and, on demand, its stack.

A worker under a resilient agent runs one more daemon thread, :class:`Heartbeat`: every
:data:`tp_launch.progress.BEAT_S` it writes the time and the default group's collective
count (:func:`tp_launch.resilient.group.sequence_number`) into its record on the progress
board (:mod:`tp_launch.progress`). Two stores to memory, twenty times a second: nothing
to measure against a training step (``benchmarks/hang_detection.py`` measures it). The
thread needs the interpreter lock for a moment each time, so a process that is stopped
or whose main thread holds the lock forever (a C extension that never releases it) stops
beating; one blocked in a collective, a data loader or a lock (the lock released) goes
on beating, and its collective count says how far it got.

The agent, when it takes a rank for the culprit of a hang, asks for the rank's Python
stack before it kills it: ``SIGUSR2`` makes :mod:`faulthandler` (a signal handler that
needs no lock and no Python code to run) write every thread's stack into
``<board>.slot<N>.stack``, a file this process created in the agent's private control
directory (without following links, owner only); the agent then sends ``SIGCONT`` (a
stopped process runs the handler once it continues), reads the file and logs it. The
script keeps every other signal for itself, and a SIGUSR2 handler it installed before
``run()`` still runs after the dump.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from typing import IO

from tp_launch import progress
from tp_launch.resilient import group

logger = logging.getLogger(__name__)



class Heartbeat:
    """This process's heartbeat on the board, and its stack-dump handler."""

    def __init__(self, board: progress.ProgressBoard, slot: int) -> None:
        self.board = board
        self.slot = slot
        self._stack: IO[str] | None = None
        try:
            fd = os.open(progress.stack_path(board.path, slot),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            self._stack = os.fdopen(fd, "w")
            # A handler the script installed keeps running after the dump (chained); the
            # default action (terminate) must not.
            mine = signal.getsignal(progress.STACK_SIGNAL)
            faulthandler.register(progress.STACK_SIGNAL, file=self._stack, all_threads=True,
                                  chain=callable(mine))
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("this process cannot write its stack when asked: %s", e)
        threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            self.board.beat(self.slot, time.monotonic(), group.sequence_number())
            time.sleep(progress.BEAT_S)
