"""What is one rank's own rather than the job's: its random generators and buffers.

Replicated state (parameters, optimizer state, schedulers...) is the same on every rank,
so any survivor can give it to a newcomer. Two things are not:

* **random generators** that each rank seeded differently (or not at all:
  :mod:`tp_launch.resilient.rng`);
* **module buffers** updated by the forward pass: under DDP every rank updates its
  BatchNorm statistics from its own batch; DDP broadcasts rank 0's at the start of the
  next forward, so between a forward and the next one the ranks' buffers differ, and
  rank 0's are the ones the job goes on with.

Which generators are per rank is found at the job's fresh start, where every rank is
present (their digests differ); buffers are always taken as the rank's own (under DDP
they are, between forward passes). A newcomer cannot get these from a donor; they died
with its rank's previous process.
So each rank writes them into a :class:`Record` at every commit, and again at its
optimizer step (a *provisional* entry for the step being committed: the forward and
backward, which change them, are over by then; this covers a rank that dies between
its optimizer step and its commit while the survivors commit). The record is a file
beside the agent's progress board, so it outlives the process; a newcomer that takes
the rank on the same node reads its predecessor's. Where the agreed step's entry is not
there (the node was lost), the newcomer goes on with the donor's and the recovery
says it is inexact.

Buffers on a GPU are not recorded (copying them to the host at every step would stall
the GPU): only the generators are. Recording costs one write of a few KiB per commit.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from tp_launch.resilient import rng

_FILE = struct.Struct("<qq")  # magic, capacity (bytes per region)
_ENTRY = struct.Struct("<qqqqq")  # magic, kind, step, length, crc32
_MAGIC = 0x5450_5045_5252_4E4B  # "TPPERRNK"
COMMITTED, PROVISIONAL = 1, 2


@dataclass
class Entry:
    """A rank's own state at a step."""

    step: int
    provisional: bool
    generators: rng.RngState
    # From a record: the buffers' bytes (None: not recorded, GPU buffers or too large);
    # a survivor's own commit: its saved buffers themselves.
    buffers: Sequence[bytes] | Sequence[torch.Tensor | None] | None


def encode(generators: rng.RngState, buffers: list[bytes] | None) -> bytes:
    g = rng.to_bytes(generators)
    out = [struct.pack("<q", len(g)), g]
    if buffers is None:
        out.append(struct.pack("<q", -1))
    else:
        out.append(struct.pack("<q", len(buffers)))
        for b in buffers:
            out += [struct.pack("<q", len(b)), b]
    return b"".join(out)


def decode(data: bytes, step: int, provisional: bool) -> Entry:
    try:
        (n,) = struct.unpack_from("<q", data, 0)
        generators = rng.from_bytes(data[8:8 + n])
        off = 8 + n
        (count,) = struct.unpack_from("<q", data, off)
        off += 8
        buffers: list[bytes] | None = None
        if count >= 0:
            buffers = []
            for _ in range(count):
                (k,) = struct.unpack_from("<q", data, off)
                buffers.append(data[off + 8:off + 8 + k])
                off += 8 + k
    except struct.error as e:
        raise ValueError(f"bad per-rank record: {e}") from None
    return Entry(step, provisional, generators, buffers)


class Record:
    """A rank's entries in a file that outlives the process.

    Two regions; an entry is written into the one that does not hold the last committed
    entry, data first and its header (with a CRC) last, so a process killed while
    writing leaves a region that reads as invalid, never a torn entry.

    Args:
        path: the file (created 0600, links not followed).
        create: True in the writing process (truncates), False to read.
    """

    def __init__(self, path: str, create: bool) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._committed_region = -1
        self._capacity = 0
        if not create:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size
                if size < _FILE.size:
                    raise ValueError("short per-rank record")
                self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            magic, self._capacity = _FILE.unpack_from(self._mm, 0)
            if magic != _MAGIC or size < _FILE.size + 2 * (self._capacity + _ENTRY.size):
                raise ValueError("not a per-rank record")
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            os.close(fd)

    def _ensure(self, length: int) -> None:
        if self._mm is not None and length <= self._capacity:
            return
        capacity = max(64 << 10, 2 * length)
        size = _FILE.size + 2 * (capacity + _ENTRY.size)
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, 0)  # regrow from empty: old entries are not valid any more
            os.ftruncate(fd, size)
            if self._mm is not None:
                self._mm.close()
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _FILE.pack_into(self._mm, 0, _MAGIC, capacity)
        self._capacity = capacity
        self._committed_region = -1

    def _region(self, i: int) -> int:
        return _FILE.size + i * (self._capacity + _ENTRY.size)

    def write(self, step: int, provisional: bool, data: bytes) -> None:
        self._ensure(len(data))
        assert self._mm is not None
        region = 1 if self._committed_region == 0 else 0
        start = self._region(region)
        _ENTRY.pack_into(self._mm, start, 0, 0, 0, 0, 0)  # invalid while it is rewritten
        self._mm[start + _ENTRY.size:start + _ENTRY.size + len(data)] = data
        _ENTRY.pack_into(self._mm, start, _MAGIC, PROVISIONAL if provisional else COMMITTED,
                         step, len(data), zlib.crc32(data))
        if not provisional:
            self._committed_region = region

    def entries(self) -> list[Entry]:
        """The valid entries (at most one committed and one provisional)."""
        if self._mm is None:
            return []
        found = []
        for i in (0, 1):
            start = self._region(i)
            magic, kind, step, length, crc = _ENTRY.unpack_from(self._mm, start)
            if magic != _MAGIC or kind not in (COMMITTED, PROVISIONAL) \
                    or not 0 <= length <= self._capacity:
                continue
            data = bytes(self._mm[start + _ENTRY.size:start + _ENTRY.size + length])
            if zlib.crc32(data) != crc:
                continue
            found.append(decode(data, step, kind == PROVISIONAL))
        return found

    def at(self, step: int) -> Entry | None:
        """The entry for ``step``: a committed one, else a provisional one."""
        entries = [e for e in self.entries() if e.step == step]
        entries.sort(key=lambda e: e.provisional)
        return entries[0] if entries else None

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except (BufferError, ValueError):
                pass
            self._mm = None
