"""The worker <-> local agent channel of resilient mode: JSON lines over a Unix socket.

Workers talk only to their own node's agent. The agent listens on a Unix socket whose
path it puts in each process's environment (``TP_RUN_CHANNEL``, with the process's slot
number in ``TP_RUN_SLOT``). A script that opts in (``tp_launch.resilient.run``)
connects; a script that does not never does, and the agent then treats it exactly as
torchrun would. This module holds the framing and the message names once, for both
sides; it does not import torch (the agent imports it before torch).

Messages, one JSON object per line, ``op`` naming the kind:

worker -> agent
    ``hello``     {slot, pid}: the process reached the wait point (model and optimizer
                  built); a spare is parked from now on.
    ``resumed``   {gen, rank, step, group_s, agree_s, transfer_s, bytes, donor}: the
                  process joined generation ``gen`` and holds the agreed state.
    ``stepped``   {gen, step, t}: first committed step after ``resumed``.
    ``finished``  {gen, step}: the training function returned; waiting for the exit
                  barrier (a failure before every rank finished is still recovered).
agent -> worker
    ``generation`` {gen, rank (None: not a rank), world_size, master_addr, master_port,
                  reason, boundary (step at which to stop, planned migration only),
                  handoff (planned migration: {role: "donor"|"receiver", prefix})}.
    ``exit``      {}: every rank finished (ranks return from ``run``), or the job is
                  over (spares exit 0).

The agent also shares a progress board with its processes: a small file mapped by
every process (``TP_RUN_PROGRESS``), one signed 64-bit committed step per slot, written
by the worker at each commit. Reading it costs the agent nothing and the worker one
store to memory, so the agent knows every rank's step (for planned migrations and
crash-loop detection) without a message per step.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
from typing import Any

ENV_SOCKET = "TP_RUN_CHANNEL"
ENV_SLOT = "TP_RUN_SLOT"
ENV_PROGRESS = "TP_RUN_PROGRESS"
ENV_VERIFY_EVERY = "TP_RUN_VERIFY_EVERY"

BOARD_SLOTS = 4096
_STEP = struct.Struct("q")


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Write one message (the whole line; the socket must be blocking)."""
    sock.sendall(json.dumps(msg).encode() + b"\n")


class LineReader:
    """Splits a byte stream into messages."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


class ProgressBoard:
    """The shared per-slot committed-step board.

    Args:
        path: the board file; created (zero-filled, every slot -1) if ``create``.
        create: True in the agent, False in workers.
    """

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        size = BOARD_SLOTS * _STEP.size
        if create:
            with open(path, "wb") as f:
                f.write(_STEP.pack(-1) * BOARD_SLOTS)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def write(self, slot: int, step: int) -> None:
        if 0 <= slot < BOARD_SLOTS:
            _STEP.pack_into(self._mm, slot * _STEP.size, step)

    def read(self, slot: int) -> int:
        if 0 <= slot < BOARD_SLOTS:
            return _STEP.unpack_from(self._mm, slot * _STEP.size)[0]
        return -1

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
