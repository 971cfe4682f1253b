"""The worker's end of the agent channel (:mod:`tp_launch.channel`): :class:`AgentLink`.

A process connects to its agent's socket when it reaches :func:`tp_launch.resilient.run`
and says ``hello``; a thread then reads what the agent sends and keeps the latest of
it: the newest generation announced (``generation``), whether the job is over
(``exit``, or the agent went away) and whether the agent waits for a spare
(``recovering``: wait for the next generation without a limit). A ``generation`` that
is not a planned migration's aborts NCCL's communicators at once from that thread
(:func:`tp_launch.resilient.group.abort_nccl`), and shuts the TCP connections to the
nodes it replaced as lost (:func:`tp_launch.resilient.peers.shut_connections_to`). The
training thread asks
(:meth:`AgentLink.newer`, :meth:`AgentLink.wait`) and sends its own messages
(:meth:`AgentLink.send`). A line the agent sent that does not decode is logged and
treated as the agent going away.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from tp_launch import channel, progress
from tp_launch.resilient import group, peers
from tp_launch.worker_settings import WorkerSettings

logger = logging.getLogger(__name__)


class AgentLink:
    """This process's connection to its agent; a thread receives the announcements."""

    def __init__(self, path: str, slot: int, board: str | None) -> None:
        self.slot = slot
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.board = progress.ProgressBoard(board) if board else None
        self._cond = threading.Condition()
        self._latest: channel.NewGeneration | None = None
        self._exit = False
        self._recovering = False  # the agent is waiting for a spare: wait without limit
        self.current_gen = -1
        self.report_first_step = False
        self.send(channel.Hello(slot=slot, pid=os.getpid()))
        threading.Thread(target=self._read, name="tp-agent-link", daemon=True).start()

    @classmethod
    def connect(cls, settings: WorkerSettings) -> AgentLink:
        """Connect to the agent that ``settings`` (this process's) name."""
        return cls(settings.channel, settings.slot, settings.progress)

    def _read(self) -> None:
        reader = channel.LineReader()
        while True:
            try:
                data = self.sock.recv(65536)
                lines = reader.lines(data) if data else []
                messages = [channel.decode(line, channel.TO_WORKER) for line in lines]
            except channel.ChannelError as e:
                logger.error("the agent sent a message this process cannot read: %s", e)
                data = b""
            except OSError:
                data = b""
            if not data:
                # The agent is gone: PR_SET_PDEATHSIG ends this process in a moment.
                with self._cond:
                    self._exit = True
                    self._cond.notify_all()
                return
            for msg in messages:
                with self._cond:
                    if isinstance(msg, channel.NewGeneration):
                        if self._latest is None or msg.gen > self._latest.gen:
                            self._latest = msg
                    elif isinstance(msg, channel.Exit):
                        self._exit = True
                    elif isinstance(msg, channel.Recovering):
                        self._recovering = True
                    self._cond.notify_all()
                if isinstance(msg, channel.NewGeneration) and msg.boundary is None:
                    group.abort_nccl()  # gloo needs no help: see group.py...
                    if msg.lost_addrs:  # ...unless a peer vanished without closing
                        peers.shut_connections_to(msg.lost_addrs)

    def joined(self) -> None:
        """This process holds the agreed state of the current generation: a wait for a
        spare is over, and its first commit is reported (``stepped``)."""
        with self._cond:
            self._recovering = False
        self.report_first_step = True

    def send(self, msg: channel.Message) -> None:
        channel.send(self.sock, msg)

    def newer(self) -> channel.NewGeneration | None:
        """The announced generation if it is newer than the current one."""
        latest = self._latest
        return latest if latest is not None and latest.gen > self.current_gen else None

    def stale(self) -> bool:
        return self.newer() is not None

    def wait_exit(self, timeout: float) -> None:
        """Block until the agent says exit (or goes away), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._exit and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())

    def wait(self, timeout: float | None) -> channel.NewGeneration | channel.Exit | None:
        """Block until a newer generation or the exit arrives (None: ``timeout``
        passed). A parked spare also leaves on exit: the job is over."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                newer = self.newer()
                if newer is not None:
                    return newer
                if self._exit:
                    return channel.Exit()
                if self._recovering:
                    deadline = None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
