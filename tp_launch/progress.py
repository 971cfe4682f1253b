"""The progress board: what every process of a node is doing, readable by its agent for free.

A small file in the agent's private control directory (``TP_RUN_PROGRESS``), mapped by
the agent and by every process it starts; one fixed record of eight 64-bit words per
slot (a slot names one process of the attempt). A process writes only its own record,
with plain stores to memory: no message, no system call, so the marks can be written at
every step and every heartbeat. The agent reads every record when it wants to (crash
loops, planned migrations, hang and straggler detection, ``tp-run status``).

The record of a slot (:class:`Mark`):

``step``
    the last committed step (-1: none yet), written at each commit.
``commit_t``
    ``time.monotonic()`` at that commit (CLOCK_MONOTONIC is one clock for every process
    of the machine, so the agent compares it with its own), 0 before the first.
``step_s``
    how long the committed iteration took (the time since the previous commit; 0 for
    the first commit of a generation, which includes the recovery).
``beat_t``
    the process's heartbeat: a thread of the worker writes the time every
    :data:`BEAT_S` (:mod:`tp_launch.resilient.heartbeat`). A process that is stopped
    (SIGSTOP, a debugger, the kernel) or holds the interpreter lock forever stops
    beating: its record says so, whatever the other threads it has.
``gen``
    the generation the process is in (-1: parked, or before its first).
``stage``
    where it is in that generation (:class:`Stage`).
``seq``
    the position of the process in its generation's collectives: the default group's
    sequence number (how many collectives it issued), written with the heartbeat. Ranks
    of one group issue the same collectives in the same order, so a rank whose number is
    behind its peers' has not reached the collective they wait in.
``long_until``
    the end of a phase the script marked as long (``state.long_phase()``: evaluation,
    a checkpoint save): while it runs no step is expected; 0 when none.

Words a process wrote are numbers only: a hostile or torn record reads as odd numbers,
never as anything else (the file is the job owner's, made ``0600`` without following
links, like every control file).
"""

from __future__ import annotations

import enum
import mmap
import os
import signal
import struct
from dataclasses import dataclass

BOARD_SLOTS = 4096
# How often a worker's heartbeat thread writes its time and collective position.
BEAT_S = 0.05
# Asks a worker for its Python stack (faulthandler writes it to stack_path()).
STACK_SIGNAL = signal.SIGUSR2

# step, commit_t, beat_t, gen, stage, seq, step_s, long_until
_RECORD = struct.Struct("qddqqqdd")
_OFF_STEP, _OFF_COMMIT, _OFF_BEAT, _OFF_GEN, _OFF_STAGE, _OFF_SEQ, _OFF_STEP_S, _OFF_LONG = \
    range(0, 64, 8)
_Q = struct.Struct("q")
_D = struct.Struct("d")


def stack_path(board: str, slot: int) -> str:
    """Where the process in ``slot`` writes its stack when asked (:data:`STACK_SIGNAL`)."""
    return f"{board}.slot{slot}.stack"


class Stage(enum.IntEnum):
    """Where a process is in its generation (the ``stage`` word)."""

    IDLE = 0       # parked, or not started
    JOINING = 1    # at the arrival barrier / building the group
    AGREEING = 2   # agreeing on the step, sending or receiving the state
    TRAINING = 3   # in the script's training function
    WAITING = 4    # a collective failed: waiting for the next generation
    FINISHED = 5   # training returned: waiting for the exit barrier


@dataclass(frozen=True)
class Mark:
    """One slot's record, as read."""

    step: int = -1
    commit_t: float = 0.0
    step_s: float = 0.0
    beat_t: float = 0.0
    gen: int = -1
    stage: int = Stage.IDLE
    seq: int = 0
    long_until: float = 0.0


_EMPTY = _RECORD.pack(-1, 0.0, 0.0, -1, Stage.IDLE, 0, 0.0, 0.0)


class ProgressBoard:
    """The shared board of one attempt.

    Args:
        path: the board file. ``create`` (the agent): a new file, made without following
            links and readable by the owner only (every record empty); else an existing
            one (a worker).
        create: True in the agent, False in workers.
    """

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        size = BOARD_SLOTS * _RECORD.size
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600) if create else \
            os.open(path, flags)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if create:
            self._mm[:] = _EMPTY * BOARD_SLOTS

    def _at(self, slot: int, offset: int) -> int | None:
        return slot * _RECORD.size + offset if 0 <= slot < BOARD_SLOTS else None

    def _put(self, fmt: struct.Struct, slot: int, offset: int, value: float) -> None:
        at = self._at(slot, offset)
        if at is not None:
            fmt.pack_into(self._mm, at, value)

    # ------------------------------------------------------------ the worker's side

    def commit(self, slot: int, step: int, t: float, step_s: float) -> None:
        """The process committed ``step`` at monotonic time ``t`` after ``step_s`` s."""
        self._put(_D, slot, _OFF_STEP_S, step_s)
        self._put(_D, slot, _OFF_COMMIT, t)
        self._put(_Q, slot, _OFF_STEP, step)

    def write(self, slot: int, step: int) -> None:
        """Set the committed step alone (a newcomer's agreed step)."""
        self._put(_Q, slot, _OFF_STEP, step)

    def beat(self, slot: int, t: float, seq: int) -> None:
        self._put(_Q, slot, _OFF_SEQ, seq)
        self._put(_D, slot, _OFF_BEAT, t)

    def enter(self, slot: int, gen: int, stage: Stage) -> None:
        """The process is now at ``stage`` of generation ``gen``."""
        self._put(_Q, slot, _OFF_GEN, gen)
        self._put(_Q, slot, _OFF_STAGE, int(stage))

    def long_phase(self, slot: int, until: float) -> None:
        """A phase the script marked as long runs until ``until`` (0: it ended)."""
        self._put(_D, slot, _OFF_LONG, until)

    # ------------------------------------------------------------- the agent's side

    def read(self, slot: int) -> int:
        """The slot's committed step (-1: none, or no such slot)."""
        at = self._at(slot, _OFF_STEP)
        return -1 if at is None else _Q.unpack_from(self._mm, at)[0]

    def mark(self, slot: int) -> Mark:
        at = self._at(slot, 0)
        if at is None:
            return Mark()
        step, commit_t, beat_t, gen, stage, seq, step_s, long_until = \
            _RECORD.unpack_from(self._mm, at)
        return Mark(step, commit_t, step_s, beat_t, gen, stage, seq, long_until)

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
