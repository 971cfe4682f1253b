"""The job owner's control files: where a resilient agent keeps them, how they are written
and read, so that no other user can plant, read or redirect them.

A resilient agent keeps its channel socket (``<pid>.sock``), its status
(``<pid>.sock.json``: run id, generation, ranks, parked spares; for ``tp-run migrate``,
the workers' ``parked_spares()`` and people) and its progress board (``<pid>.progress``)
in a control directory of its own, made by :func:`new_control_dir`:
``tp-run-<uid>-XXXXXXXX``, a fresh directory (``mkdtemp``: created, never reused, mode
0700) in ``$XDG_RUNTIME_DIR`` when that is a private directory of this user, else in the
temp dir. No name there is predictable before the agent creates it, so nobody else can
have created it first, and nothing in it can be reached by anyone else.

A directory tp-run removes when it exits (a control directory, a temporary log
directory) holds an owner file, ``.tp-run-owner``: the pid of the agent that made it and
that process's start time in clock ticks since boot (``/proc/<pid>/stat``), which a reused
pid does not share. An agent that was SIGKILLed cannot remove its own: the next agent of
the same user removes them (:func:`remove_stale`) where the owner file names a process
that is gone, in a directory :func:`check_private_dir` accepts. A directory with no owner
file (another tool's, or one being made this instant) is never touched.

Readers find the agents of *their own* user with :func:`find_agents`, which trusts a
directory only when :func:`check_private_dir` accepts it (a real directory, not a link,
owned by the caller, no access for group or others, in a parent nobody else can rename
it in) and a file only when it is a regular file opened without following links and
owned by the caller (:func:`read_private`). Files are written by :func:`write_private`:
a new temporary file (``O_EXCL | O_NOFOLLOW``, mode 0600) renamed over the target, so a
link planted at either name is replaced, never followed.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Iterable

# A status file is a few hundred bytes per rank; anything much larger is not one.
_READ_LIMIT = 4 * 1024 * 1024


class ControlFileError(OSError):
    """A control directory or file that is not the caller's alone (the reason, one line)."""


def check_private_dir(path: str) -> None:
    """Accept ``path`` only as a directory that the calling user alone controls.

    Raises:
        ControlFileError: missing, a link, not a directory, owned by another uid, open to
            group or others, or in a parent where others could rename it.
    """
    uid = os.getuid()
    try:
        st = os.lstat(path)
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise ControlFileError(f"{path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ControlFileError(f"{path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise ControlFileError(f"{path} is not a directory")
    if st.st_uid != uid:
        raise ControlFileError(f"{path} belongs to uid {st.st_uid}, not to uid {uid}")
    if st.st_mode & 0o077:
        raise ControlFileError(f"{path} is open to other users "
                               f"(mode {stat.S_IMODE(st.st_mode):o}, not 700)")
    others_write = parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if parent.st_uid not in (0, uid) or (others_write and not parent.st_mode & stat.S_ISVTX):
        raise ControlFileError(f"{os.path.dirname(os.path.abspath(path))} lets other users "
                               f"rename {os.path.basename(path)}")


def _bases() -> list[str]:
    """Where control directories are made and looked for: ``$XDG_RUNTIME_DIR`` (if it
    is a private directory of this user), then the temp dir."""
    bases = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        try:
            check_private_dir(xdg)
            bases.append(xdg)
        except ControlFileError:
            pass  # not ours or not private (a stale value from another session): unused
    tmp = tempfile.gettempdir()
    return bases + [tmp] if tmp not in bases else bases


def _prefix() -> str:
    return f"tp-run-{os.getuid()}-"


def new_control_dir() -> str:
    """A fresh control directory for one agent (the caller removes it when done)."""
    path = tempfile.mkdtemp(prefix=_prefix(), dir=_bases()[0])
    try:
        check_private_dir(path)  # a TMPDIR others may write to without the sticky bit
        mark_owner(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


OWNER_FILE = ".tp-run-owner"


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The fields after the command name (which may hold spaces and parentheses):
            # the 22nd field, starttime, is the 20th of them.
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def mark_owner(directory: str) -> None:
    """Name this process as ``directory``'s owner (it removes it when it exits)."""
    write_private(os.path.join(directory, OWNER_FILE),
                  f"{os.getpid()} {_start_ticks(os.getpid())}".encode())


def _owner_gone(directory: str) -> bool:
    try:
        pid, ticks = read_private(os.path.join(directory, OWNER_FILE), 64).split()
        return _start_ticks(int(pid)) != int(ticks)
    except (OSError, ValueError):
        return False  # no owner file (or not tp-run's): not ours to remove


def remove_stale(paths: Iterable[str]) -> list[str]:
    """Remove those of ``paths`` that are private directories of this user whose owner
    process is gone (a SIGKILLed agent's); the ones removed."""
    removed = []
    for path in paths:
        try:
            check_private_dir(path)
        except OSError:
            continue
        if _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def control_dirs() -> list[str]:
    """This user's control directories (a look-alike of another user's is skipped)."""
    found = []
    for base in _bases():
        for path in sorted(glob.glob(os.path.join(glob.escape(base), _prefix() + "*"))):
            try:
                check_private_dir(path)
            except ControlFileError:
                continue
            found.append(path)
    return found


def write_private(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, readable by the owner only, through a
    new temporary file beside it; a link at ``path`` is replaced, not followed."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path),
                               prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_private(path: str, limit: int = _READ_LIMIT) -> bytes:
    """The contents of ``path`` if it is a regular file of the caller's (never through a
    link, never blocking on a planted FIFO).

    Raises:
        ControlFileError: a link, not a regular file, another user's, larger than ``limit``.
        OSError: it cannot be opened or read (FileNotFoundError: no such file).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a link
            raise ControlFileError(f"{path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ControlFileError(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ControlFileError(f"{path} belongs to uid {st.st_uid}, not to uid "
                                   f"{os.getuid()}")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ControlFileError(f"{path} is larger than {limit} bytes")
    return data


# ---------------------------------------------------------------- the agent's status


@dataclass
class AgentStatus:
    """What ``<control dir>/<pid>.sock.json`` says about a running resilient agent.

    Args:
        run_id: the job's ``--rdzv-id``.
        pid: the agent's pid.
        generation: the generation the agent's ranks are in.
        ranks: global rank -> pid of this node's process holding it.
        parked_spares: pids of this node's parked spares.
        socket: the agent's control socket (not stored: the file's own name says it).
    """

    run_id: str
    pid: int
    generation: int
    ranks: dict[int, int]
    parked_spares: list[int]
    socket: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "pid": self.pid,
                           "generation": self.generation,
                           "ranks": {str(r): p for r, p in self.ranks.items()},
                           "parked_spares": self.parked_spares}).encode()


# The names in a control directory: the agent's pid plus a suffix; the status file is
# named after the socket it describes.
_SOCKET_SUFFIX = ".sock"
_STATUS_SUFFIX = ".json"
_PROGRESS_SUFFIX = ".progress"


def agent_socket(directory: str, pid: int) -> str:
    """The channel socket of agent ``pid`` in its control ``directory``."""
    return os.path.join(directory, f"{pid}{_SOCKET_SUFFIX}")


def agent_progress_board(directory: str, pid: int) -> str:
    """The progress board of agent ``pid`` in its control ``directory``."""
    return os.path.join(directory, f"{pid}{_PROGRESS_SUFFIX}")


def status_path(socket_path: str) -> str:
    """The status file beside the agent's socket."""
    return socket_path + _STATUS_SUFFIX


def write_status(socket_path: str, status: AgentStatus) -> None:
    write_private(status_path(socket_path), status.to_json())


def read_status(socket_path: str) -> AgentStatus | None:
    """The status beside ``socket_path``; None when there is none, or it is not a valid
    status file of the caller's own."""
    try:
        doc = json.loads(read_private(status_path(socket_path)))
        status = AgentStatus(doc["run_id"], doc["pid"], doc["generation"],
                             {int(r): p for r, p in doc["ranks"].items()},
                             list(doc["parked_spares"]), socket_path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    ints = [status.pid, status.generation, *status.ranks.values(), *status.parked_spares]
    if type(status.run_id) is not str or any(type(i) is not int for i in ints):
        return None
    return status


def find_agents() -> list[AgentStatus]:
    """The running resilient agents of the calling user, from their status files."""
    found = []
    for directory in control_dirs():
        pattern = os.path.join(glob.escape(directory), "*" + status_path(_SOCKET_SUFFIX))
        for path in sorted(glob.glob(pattern)):
            status = read_status(path[: -len(_STATUS_SUFFIX)])
            if status is None:
                continue
            try:
                os.kill(status.pid, 0)
            except OSError:
                continue  # a SIGKILLed agent's leftovers (its pid gone)
            if _owner_gone(directory):
                continue  # the same, its pid reused by another process since
            found.append(status)
    return found
