"""The agent's end of the worker channel: its control socket, status file and progress board.

One :class:`ControlServer` per attempt, in a control directory of its own
(:func:`tp_launch.control_files.new_control_dir`: fresh, mode 0700; :meth:`close`
removes it):

- ``<pid>.sock``: a Unix socket, mode 0600. Every connection's peer is checked with
  ``SO_PEERCRED`` as it is accepted: a process of another uid is refused (closed unread
  and unanswered, one line in the log), whatever the file modes say (root passes them).
- Each line a connection sends is decoded and checked against
  :data:`tp_launch.channel.TO_AGENT` (:func:`tp_launch.channel.decode`) and handed to the
  agent's handler, which may answer it (``migrate`` -> ``reply``) or reject it by raising
  :class:`~tp_launch.channel.ChannelError` (a ``hello`` for a slot the agent did not
  start). A line that is not a valid message, a line over
  :data:`~tp_launch.channel.MAX_LINE`, or a rejected message is logged once (one line)
  and its connection closed; the job goes on.
- A send never blocks the agent for long: a connection that takes no data for
  :data:`SEND_TIMEOUT_S` is closed (its process is stuck or dying; its pidfd tells the
  agent which).
- ``<pid>.sock.json``: the agent's status (:meth:`write_status`, written atomically
  without following links: :func:`tp_launch.control_files.write_private`);
  ``<pid>.progress``: the progress board (:attr:`board`).
"""

from __future__ import annotations

import glob
import logging
import os
import selectors
import socket
from dataclasses import dataclass, field
from typing import Callable

from tp_launch import channel, progress
from tp_launch.config import ConfigError
from tp_launch.control_files import (
    AgentStatus,
    agent_progress_board,
    agent_socket,
    new_control_dir,
    status_path,
    write_status,
)

logger = logging.getLogger(__name__)

# How long a send may wait for a connection that does not read (the socket buffer holds
# hundreds of messages: a live worker never gets near it).
SEND_TIMEOUT_S = 5.0


@dataclass(eq=False)
class Conn:
    """One accepted connection and the peer the kernel vouches for."""

    sock: socket.socket
    pid: int
    uid: int
    reader: channel.LineReader = field(default_factory=channel.LineReader)


Handler = Callable[[Conn, channel.Message], "channel.Message | None"]


class ControlServer:
    """The control socket, status file and progress board of one attempt.

    Args:
        handler: called with each valid message and its connection; what it returns
            (if not None) is sent back; a :class:`~tp_launch.channel.ChannelError` it
            raises drops the connection.
    """

    KIND = "control"  # the tag of this server's selector events: (KIND, Conn | None)

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._conns: set[Conn] = set()
        self._sel: selectors.BaseSelector | None = None
        self._server: socket.socket | None = None
        self._board: progress.ProgressBoard | None = None
        self._status_failing = False  # the last status write failed (said once)
        try:
            self.directory = new_control_dir()
        except OSError as e:
            raise ConfigError(f"cannot make a private control directory: {e}") from None
        self.path = agent_socket(self.directory, os.getpid())
        try:
            self._board = progress.ProgressBoard(agent_progress_board(self.directory, os.getpid()),
                                               create=True)
            self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server.bind(self.path)
            os.chmod(self.path, 0o600)
            self._server.listen(256)
            self._server.setblocking(False)
        except BaseException as e:
            self.close()
            if isinstance(e, OSError):
                raise ConfigError(f"cannot open the control socket {self.path}: {e}") from None
            raise

    @property
    def board(self) -> progress.ProgressBoard:
        """The attempt's progress board (the ranks' committed steps)."""
        assert self._board is not None  # made in __init__, or __init__ raised
        return self._board

    def register(self, sel: selectors.BaseSelector) -> None:
        """Have ``sel`` watch the socket and, later, every accepted connection; pass the
        data of their events, ``(KIND, obj)``, to :meth:`on_event`."""
        assert self._server is not None
        self._sel = sel
        sel.register(self._server, selectors.EVENT_READ, (self.KIND, None))

    def on_event(self, conn: Conn | None) -> None:
        if conn is None:
            self._accept()
        else:
            self._read(conn)

    def send(self, conn: Conn | None, msg: channel.Message) -> bool:
        """Send ``msg`` on ``conn``; False if it is gone (then it is closed)."""
        if conn is None or conn not in self._conns:
            return False
        try:
            channel.send(conn.sock, msg)
            return True
        except TimeoutError:
            logger.warning("control socket: pid %s has not read its messages for %.0f s; "
                           "closed its connection", conn.pid, SEND_TIMEOUT_S)
        except OSError:
            pass  # it is dying: its pidfd says so in a moment
        self._drop(conn)  # a partly sent line must not be followed by another
        return False

    def write_status(self, status: AgentStatus) -> None:
        """The status file, for ``tp-run status/migrate`` and ``parked_spares()``. A
        failure to write it (its temp directory full: ENOSPC) costs the file's freshness,
        never the job: one warning while it lasts, another when it is written again."""
        try:
            write_status(self.path, status)
        except OSError as e:
            if not self._status_failing:
                self._status_failing = True
                logger.warning("cannot write the status file beside %s (%s): tp-run status, "
                               "tp-run migrate and parked_spares() see an older one until "
                               "it can be written", self.path, e.strerror or e)
            return
        if self._status_failing:
            self._status_failing = False
            logger.warning("the status file is written again")

    def close(self) -> None:
        """Close every connection and the socket; remove the directory and its files."""
        for conn in list(self._conns):
            self._drop(conn)
        if self._server is not None:
            self._server.close()
        board = self._board
        if board is not None:
            board.close()
        records = glob.glob(glob.escape(board.path) + ".slot*") if board is not None else []
        for path in (self.path, status_path(self.path),
                     board.path if board is not None else None, *records):
            try:
                if path is not None:
                    os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.directory)
        except OSError as e:
            logger.debug("control directory %s left behind: %s", self.directory, e)

    # ---------------------------------------------------------------- internals

    def _accept(self) -> None:
        assert self._server is not None and self._sel is not None
        try:
            sock, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # out of file descriptors, say: the next accept may do
            logger.warning("control socket: cannot accept a connection: %s", e)
            return
        try:
            pid, uid, _ = channel.peer_credentials(sock)
        except OSError as e:
            logger.warning("control socket: refused a connection with no credentials: %s", e)
            sock.close()
            return
        if uid != os.getuid():
            logger.warning("control socket: refused a connection from pid %s of uid %s "
                           "(only uid %s may connect)", pid, uid, os.getuid())
            sock.close()  # unanswered: ``tp-run migrate`` says why on its own side
            return
        sock.settimeout(SEND_TIMEOUT_S)  # for sends: reads only follow a readable event
        conn = Conn(sock, pid, uid)
        self._conns.add(conn)
        self._sel.register(sock, selectors.EVENT_READ, (self.KIND, conn))

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        try:
            for line in conn.reader.lines(data):
                if conn not in self._conns:
                    return  # the handler's own sends found it gone
                reply = self._handler(conn, channel.decode(line, channel.TO_AGENT))
                if reply is not None:
                    self.send(conn, reply)
        except channel.ChannelError as e:
            logger.warning("control socket: bad message from pid %s (%s); closed its "
                           "connection", conn.pid, e)
            self._drop(conn)

    def _drop(self, conn: Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if self._sel is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError, RuntimeError):
                pass  # the selector is closed already
        conn.sock.close()
