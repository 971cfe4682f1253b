"""A readable file descriptor that says "look again": the self-pipe trick.

A thread (a watch callback, a signal handler through ``signal.set_wakeup_fd``) writes a
byte; a ``select`` loop wakes up on :attr:`fd`, drains it and looks at the state it
guards. Both ends are non-blocking and close-on-exec: a full pipe already says "look
again", so a poke never blocks, and no worker inherits either end.
"""

from __future__ import annotations

import os


class WakeupPipe:
    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        """The read end, for ``select``."""
        return self._r

    @property
    def write_fd(self) -> int:
        """The write end, for ``signal.set_wakeup_fd``."""
        return self._w

    def poke(self) -> None:
        try:
            os.write(self._w, b"!")
        except OSError:  # full (already readable) or closed (shutting down)
            pass

    def drain(self) -> None:
        try:
            while os.read(self._r, 512):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
