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
- A send never blocks the agent: connections are non-blocking, and what the socket
  does not take at once waits in the connection's own buffer, written as the selector
  says the socket can take more. A connection with more than :data:`MAX_PENDING` bytes
  unread is closed (a client that never reads its replies, or a process that is stuck
  or dying: its pidfd tells the agent which). A recovery never waits on a client.
- File descriptors are the agent's to spawn spares with: it keeps at most
  :func:`max_connections` connections (a quarter of its descriptor limit, at most 1024)
  and closes any beyond at once. Out of descriptors all the same (EMFILE: other
  processes' doing, or a low ``ulimit -n``), it closes the waiting connection with a
  descriptor it holds in reserve for that, so the listening socket does not stay
  readable (the agent used to spin on it, a warning per turn). Either is one warning
  line while it lasts and one when connections are taken again.
- ``<pid>.sock.json``: the agent's status (:meth:`write_status`, written atomically
  without following links: :func:`tp_launch.control_files.write_private`);
  ``<pid>.progress``: the progress board (:attr:`board`).
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import resource
import selectors
import socket
from dataclasses import dataclass, field
from typing import Callable

from tp_launch import channel, progress
from tp_launch.config import ConfigError
from tp_launch.control_files import (
    OWNER_FILE,
    AgentStatus,
    agent_progress_board,
    agent_socket,
    new_control_dir,
    status_path,
    write_status,
)

logger = logging.getLogger(__name__)

# What a connection may leave unread beyond the socket's own buffer (which holds hundreds
# of messages: a live worker never gets near it; a status reply is a few KiB).
MAX_PENDING = 1 << 20


@dataclass(eq=False)
class Conn:
    """One accepted connection and the peer the kernel vouches for."""

    sock: socket.socket
    pid: int
    uid: int
    reader: channel.LineReader = field(default_factory=channel.LineReader)
    unsent: bytearray = field(default_factory=bytearray)  # whole lines, the first in part


Handler = Callable[[Conn, channel.Message], "channel.Message | None"]


def max_connections() -> int:
    """How many connections the agent keeps open at once."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(1024, soft // 4 if soft != resource.RLIM_INFINITY else 1024))


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
        self._refusing = False  # connections are being closed unserved (said once)
        self._max_conns = max_connections()
        self._reserve: int | None = None  # a descriptor to free for closing a connection
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
            self._reserve = self._open_reserve()
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

    def on_event(self, conn: Conn | None, events: int = selectors.EVENT_READ) -> None:
        """``events``: the selector's mask for ``conn`` (readable, writable or both)."""
        if conn is None:
            self._accept()
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        if events & selectors.EVENT_READ and conn in self._conns:
            self._read(conn)

    def send(self, conn: Conn | None, msg: channel.Message) -> bool:
        """Queue ``msg`` on ``conn`` and write what the socket takes now; False if the
        connection is gone or was closed for leaving too much unread."""
        if conn is None or conn not in self._conns:
            return False
        line = channel.encode(msg)
        if len(conn.unsent) + len(line) > MAX_PENDING:
            logger.warning("control socket: pid %s has left %d bytes unread; closed its "
                           "connection", conn.pid, len(conn.unsent))
            self._drop(conn)
            return False
        conn.unsent += line
        return self._flush(conn)

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
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        board = self._board
        if board is not None:
            board.close()
        records = glob.glob(glob.escape(board.path) + ".slot*") if board is not None else []
        for path in (self.path, status_path(self.path),
                     os.path.join(self.directory, OWNER_FILE),
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
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                self._refuse_without_descriptor(e)
            else:
                logger.warning("control socket: cannot accept a connection: %s", e)
            return
        if len(self._conns) >= self._max_conns:
            self._refuse(f"{len(self._conns)} connections are open, the most this agent "
                         "keeps")
            sock.close()
            return
        if self._refusing:
            self._refusing = False
            logger.warning("control socket: taking connections again")
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
        sock.setblocking(False)  # reads follow a readable event; sends: _flush
        conn = Conn(sock, pid, uid)
        self._conns.add(conn)
        self._sel.register(sock, selectors.EVENT_READ, (self.KIND, conn))

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
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

    def _refuse(self, why: str) -> None:
        if not self._refusing:
            self._refusing = True
            logger.warning("control socket: %s; closing new connections unserved until "
                           "some close", why)

    def _refuse_without_descriptor(self, e: OSError) -> None:
        """Out of descriptors: close the waiting connection with the reserve one."""
        assert self._server is not None
        self._refuse(f"out of file descriptors ({e.strerror})")
        if self._reserve is None:
            return
        os.close(self._reserve)
        self._reserve = None
        try:
            self._server.accept()[0].close()
        except OSError:
            pass
        try:
            self._reserve = self._open_reserve()
        except OSError:
            pass  # taken meanwhile: the next turn tries again

    @staticmethod
    def _open_reserve() -> int:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _flush(self, conn: Conn) -> bool:
        """Write what the socket takes of ``conn``'s unsent lines; watch for it to take
        the rest. False if the connection is gone (then it is closed)."""
        try:
            while conn.unsent:
                conn.unsent = conn.unsent[conn.sock.send(conn.unsent):]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)  # it is dying: its pidfd says so in a moment
            return False
        if self._sel is not None:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.unsent else 0)
            try:
                if self._sel.get_key(conn.sock).events != events:
                    self._sel.modify(conn.sock, events, (self.KIND, conn))
            except (KeyError, ValueError, RuntimeError):
                pass  # the selector is closed already
        return True

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
