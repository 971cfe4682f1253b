"""The progress board (tp_launch.progress): records per slot, shared by agent and workers."""

import os
import stat
import time

import pytest

from tp_launch import progress
from tp_launch.progress import Mark, Stage

pytestmark = pytest.mark.unit


def test_board_write_read(tmp_path):
    path = str(tmp_path / "board")
    agent = progress.ProgressBoard(path, create=True)
    worker = progress.ProgressBoard(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert [agent.read(s) for s in (0, 1, progress.BOARD_SLOTS - 1)] == [-1, -1, -1]
        worker.write(1, 41)
        worker.write(progress.BOARD_SLOTS - 1, 2**62)
        worker.write(progress.BOARD_SLOTS, 5)  # out of range: ignored
        worker.write(-1, 5)
        assert agent.read(1) == 41 and agent.read(0) == -1
        assert agent.read(progress.BOARD_SLOTS - 1) == 2**62
        assert agent.read(progress.BOARD_SLOTS) == -1 and agent.read(-1) == -1
    finally:
        worker.close()
        agent.close()
        agent.close()  # twice is fine


def test_board_is_created_once_and_never_through_a_link(tmp_path):
    path = str(tmp_path / "board")
    progress.ProgressBoard(path, create=True).close()
    with pytest.raises(FileExistsError):
        progress.ProgressBoard(path, create=True)
    link = str(tmp_path / "link")
    os.symlink(path, link)
    with pytest.raises(OSError):
        progress.ProgressBoard(link)
    with pytest.raises(OSError):
        progress.ProgressBoard(str(tmp_path / "missing"))


def test_board_refuses_a_short_file_and_reads_hostile_words_as_numbers(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError):
        progress.ProgressBoard(str(short))
    path = str(tmp_path / "board")
    board = progress.ProgressBoard(path, create=True)
    try:
        with open(path, "r+b") as f:  # anything the owner writes is just numbers
            f.write(b"\xff" * 64 + b"\x80" + b"\x00" * 63)
        assert board.read(0) == -1 and board.mark(0).stage == -1
        assert board.read(1) == 0x80 and board.mark(1).gen == 0
    finally:
        board.close()


def test_marks_round_trip(tmp_path):
    path = str(tmp_path / "board")
    agent = progress.ProgressBoard(path, create=True)
    worker = progress.ProgressBoard(path)
    try:
        assert agent.mark(3) == Mark() and agent.mark(progress.BOARD_SLOTS) == Mark()
        now = time.monotonic()
        worker.enter(3, 7, Stage.TRAINING)
        worker.commit(3, 12, now, 0.25)
        worker.beat(3, now + 0.05, 345)
        worker.long_phase(3, now + 60)
        m = agent.mark(3)
        assert (m.step, m.commit_t, m.step_s, m.beat_t, m.gen, m.stage, m.seq, m.long_until) \
            == (12, now, 0.25, now + 0.05, 7, Stage.TRAINING, 345, now + 60)
        assert agent.mark(2) == Mark() and agent.mark(4) == Mark()  # neighbours untouched
        worker.write(3, 20)
        assert agent.read(3) == 20 and agent.mark(3).commit_t == now
    finally:
        worker.close()
        agent.close()
