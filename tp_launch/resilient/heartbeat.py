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

Stacks come from :mod:`faulthandler`, a signal handler that needs no lock and no Python
code to run, in two ways:

- the agent ends the culprit of a hang with ``SIGABRT`` to its main thread (then
  ``SIGCONT``: a stopped process runs the handler once it continues; why the main
  thread: :meth:`tp_launch.procs.worker.WorkerProcess.abort_with_stack`):
  :class:`Heartbeat` enables faulthandler for the fatal signals, unless the script or
  ``PYTHONFAULTHANDLER`` already did, so the process writes every thread's stack on its
  stderr and dies of it, as under torchrun with ``PYTHONFAULTHANDLER=1``. Its exit tells
  the agent the stack is complete (a dump has no end marker) and it runs no further (a
  continued culprit would otherwise go on training while the agent waits). A
  segmentation fault's stack is printed the same way;
- for a hang on every rank, where nothing is killed, the agent asks each rank's main
  thread with ``SIGUSR2``: every thread's stack goes into ``<board>.slot<N>.stack``, a
  file this process created in the agent's private control directory (without following
  links, owner only), which the agent reads and logs. A SIGUSR2 handler the script
  installed before ``run()`` still runs after the dump.

The script keeps every other signal for itself.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
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
        if not faulthandler.is_enabled() and sys.__stderr__ is not None:
            try:
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
            except (OSError, RuntimeError, ValueError) as e:  # no usable stderr
                logger.warning("this process cannot print its stack when it ends: %s", e)
        threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while True:
            self.board.beat(self.slot, time.monotonic(), group.sequence_number())
            time.sleep(progress.BEAT_S)
