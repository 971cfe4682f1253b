"""A job's control files are its owner's alone, and no input on the control socket crashes
the agent.

The "another user cannot" tests run the other side as a second local user, uid 65534
(nobody), so they need root (they skip without it) and a Python that uid can run with
this environment's packages (``sys.executable``, or the system's python of the same
version with the packages on PYTHONPATH; they skip if there is none). Root passes every
file permission, so each test picks its direction: a root job attacked by uid 65534
tests what file modes and ownership checks stop (pre-created control directories,
planted links, a foreign ``tp-run migrate``); a uid 65534 job that root connects to tests
what only the socket's peer check (``SO_PEERCRED``) stops. Both users share a fresh
stand-in for /tmp (mode 1777) as their TMPDIR, so nothing here touches the real one.

Real processes throughout: real jobs with spares, a real second uid, real sockets.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import resource
import selectors
import shutil
import site
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.conftest import HANG_TIMEOUT, REPO, SCRIPTS, TP_RUN, run_launcher
from tp_launch import channel, control_files
from tp_launch.agent import control_server
from tp_launch.agent.control_server import ControlServer

OTHER = 65534  # nobody
AS_OTHER = {"user": OTHER, "group": OTHER, "extra_groups": []}
STEPS = 12
HOLD = 3  # ranks wait after this step until the test releases them
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the other side runs "
                                f"as a second local user (uid {OTHER})")


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def other_python() -> tuple[str, str]:
    """(interpreter, PYTHONPATH) that uid 65534 can run tp-run and torch with."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: the other side runs as a second local user (uid {OTHER})")
    pythonpath = os.pathsep.join([str(REPO), *site.getsitepackages()])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    on_path = [os.path.join(d, version) for d in os.environ.get("PATH", "").split(os.pathsep)]
    for exe in dict.fromkeys([sys.executable, *filter(os.path.isfile, on_path)]):
        try:
            probe = subprocess.run([exe, "-c", "import torch, click, psutil, tp_launch"],
                                   env={"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath,
                                        "HOME": "/"},
                                   cwd="/", capture_output=True, timeout=120, **AS_OTHER)
        except OSError:
            continue
        if probe.returncode == 0:
            return exe, pythonpath
    pytest.skip(f"no Python that uid {OTHER} can run with this environment's packages "
                f"({sys.executable} is in a directory it cannot enter)")


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh stand-in for /tmp (mode 1777), the temp dir of this process and its jobs."""
    path = Path(tempfile.mkdtemp(prefix="tp-shared-"))
    path.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def server_log() -> Iterator[list[str]]:
    """The control server's log messages during the test (caplog misses them when the
    CLI's logging setup, which stops propagation, ran in this process)."""
    handler = _Collect()
    log = logging.getLogger("tp_launch.agent.control_server")
    log.addHandler(handler)
    yield handler.messages
    log.removeHandler(handler)


def _wait(cond, what: str, timeout: float = HANG_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _job_args(nproc: int = 2) -> list[str]:
    return ["--nproc-per-node", str(nproc), "--spares", "1", "--monitor-interval", "0.1",
            "scripts/resilient_train.py", "--steps", str(STEPS), "--hold-at", str(HOLD)]


def _held(out: Path, nproc: int = 2) -> bool:
    return all((out / f"held_{r}").exists() for r in range(nproc))


def _check_finished(proc: subprocess.Popen, out: Path, nproc: int = 2) -> str:
    """The job ended well: every rank at the last step with the same parameters."""
    _, stderr = proc.communicate(timeout=HANG_TIMEOUT)
    assert proc.returncode == 0, stderr[-4000:]
    finals = [json.loads((out / f"final_{r}.json").read_text()) for r in range(nproc)]
    assert {f["step"] for f in finals} == {STEPS}, finals
    assert len({f["checksum"] for f in finals}) == 1, finals
    return stderr


@contextlib.contextmanager
def _running(argv: list[str], env: dict[str, str], cwd: Path,
             **kw) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


TALK = """\
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
s.connect(sys.argv[1])
try:
    s.sendall(sys.stdin.buffer.read())
except BrokenPipeError:
    pass  # closed on us already: what it said before is still there to read
got = b""
try:
    while (chunk := s.recv(65536)):
        got += chunk
except ConnectionResetError:
    pass  # closed with our lines unread
sys.stdout.buffer.write(got)
"""


def _talk(path: str, data: bytes) -> bytes:
    """Send ``data`` on a new connection to ``path``; everything received until the
    other end closes it (in-process: the socket's peer is this process)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        with contextlib.suppress(BrokenPipeError):
            s.sendall(data)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                got += chunk
        return got


# ---------------------------------------------------------------- messages


def test_every_message_kind_round_trips():
    msgs = [channel.Hello(slot=3, pid=77),
            channel.Resumed(gen=2, rank=1, step=40, handoff_s=0.0, group_s=0.5, agree_s=0.01,
                            transfer_s=0.2, bytes=1024, donor=None, t=1.5e9),
            channel.Stepped(gen=2, rank=1, step=41, t=1.5e9),
            channel.Finished(gen=2, rank=1, step=300),
            channel.Migrate(rank=4),
            channel.NewGeneration(gen=3, rank=None, world_size=4, master_addr="::1",
                                  master_port=29500, reason="migration", boundary=42,
                                  handoff=channel.Handoff("donor", "tp-run/g3/handoff/1")),
            channel.Exit(), channel.Recovering(), channel.Reply("ok: moved")]
    for msg in msgs:
        line = channel.encode(msg)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert channel.decode(line, channel.TO_AGENT + channel.TO_WORKER) == msg
    # The worker's messages as it sends them today (plain dicts) decode as the typed ones.
    today = {"op": "resumed", "gen": 1, "rank": 0, "step": 5, "handoff_s": 0.0, "group_s": 1,
             "agree_s": 0.1, "transfer_s": 0.0, "bytes": 0, "donor": 2, "t": 1.0, "new": "x"}
    assert channel.decode(json.dumps(today), channel.TO_AGENT).donor == 2


@pytest.mark.parametrize("line, error", [
    (b"{not json", "not a JSON line"),
    (b"\xff\xfe", "not a JSON line"),
    (b"[" * 100_000, "not a JSON line"),  # nesting deeper than the decoder's recursion
    (b"[1, 2]", "not a JSON object"),
    (b'{"slot": 1}', "op None is not one of"),
    (b'{"op": "generation", "gen": 1}', "op 'generation' is not one of"),  # wrong direction
    (b'{"op": "hello"}', "hello: slot is missing"),
    (b'{"op": "hello", "slot": 0}', "hello: pid is missing"),
    (b'{"op": "hello", "slot": true, "pid": 5}', "slot must be an integer, not True"),
    (b'{"op": "hello", "slot": -1, "pid": 5}', "slot must be at least 0"),
    (b'{"op": "hello", "slot": 1e400, "pid": 5}', "slot must be an integer"),
    (b'{"op": "hello", "slot": 99999999999999999999, "pid": 5}', "slot must be an integer"),
    (b'{"op": "migrate", "rank": "x"}', "migrate: rank must be an integer, not 'x'"),
    (b'{"op": "migrate", "rank": 1.5}', "rank must be an integer, not 1.5"),  # null: --node
    (b'{"op": "finished", "gen": "0", "rank": 0, "step": 1}', "gen must be an integer"),
    (b'{"op": "stepped", "gen": 0, "rank": 0, "step": 1, "t": NaN}', "t must be a number"),
    (b'{"op": "stepped", "gen": 0, "rank": 0, "step": 1, "t": "now"}', "t must be a number"),
])
def test_bad_lines_are_one_line_channel_errors(line, error):
    with pytest.raises(channel.ChannelError) as e:
        channel.decode(line, channel.TO_AGENT)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_workers_bad_generation_is_a_channel_error():
    base = {"op": "generation", "gen": 1, "rank": 0, "world_size": 2, "master_addr": "h",
            "master_port": 1, "reason": "failure"}
    assert channel.decode(json.dumps(base), channel.TO_WORKER).handoff is None
    for bad, error in [({"handoff": {"role": "thief", "prefix": "p"}},
                        "generation: handoff: role must be one of ['donor', 'receiver']"),
                       ({"handoff": [1]}, "handoff: must be an object"),
                       ({"master_port": 0}, "master_port must be at least 1"),
                       ({"boundary": 1.5}, "boundary must be an integer")]:
        with pytest.raises(channel.ChannelError, match=re.escape(error)):
            channel.decode(json.dumps({**base, **bad}), channel.TO_WORKER)


def test_messages_are_checked_when_built():
    with pytest.raises(channel.ChannelError, match="slot must be at least 0"):
        channel.Hello(slot=-1, pid=3)
    with pytest.raises(channel.ChannelError, match="message must be a string"):
        channel.Reply(message=3)  # type: ignore[arg-type]


def test_line_reader_caps_a_line():
    reader = channel.LineReader()
    assert reader.lines(b'{"a": 1}\n\n{"b"') == [b'{"a": 1}']
    assert reader.lines(b': 2}\n') == [b'{"b": 2}']
    with pytest.raises(channel.ChannelError, match="longer than"):
        reader.lines(b"x" * (channel.MAX_LINE + 1))  # no newline ever comes
    with pytest.raises(channel.ChannelError, match="longer than"):
        channel.LineReader().lines(b"y" * (channel.MAX_LINE + 1) + b"\n{}\n")


# ---------------------------------------------------------------- control files


def test_private_dir_checks(tmp_path: Path):
    uid = os.getuid()
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    control_files.check_private_dir(str(good))
    cases = {}
    (tmp_path / "link").symlink_to(good)
    cases["link"] = "is a symbolic link"
    (tmp_path / "file").write_text("")
    cases["file"] = "is not a directory"
    (tmp_path / "open").mkdir(mode=0o700)
    (tmp_path / "open").chmod(0o755)
    cases["open"] = "is open to other users (mode 755, not 700)"
    unsafe_parent = tmp_path / "shared"
    unsafe_parent.mkdir()
    unsafe_parent.chmod(0o777)  # writable by all, no sticky bit: ours could be renamed
    (unsafe_parent / "in").mkdir(mode=0o700)
    cases["shared/in"] = "lets other users rename in"
    cases["missing"] = "No such file"
    if uid == 0:
        (tmp_path / "theirs").mkdir(mode=0o700)
        os.chown(tmp_path / "theirs", OTHER, OTHER)
        cases["theirs"] = f"belongs to uid {OTHER}, not to uid 0"
    for name, error in cases.items():
        with pytest.raises(control_files.ControlFileError, match=re.escape(error)):
            control_files.check_private_dir(str(tmp_path / name))


def test_new_control_dir_is_fresh_and_private(shared_tmp: Path):
    a, b = control_files.new_control_dir(), control_files.new_control_dir()
    assert a != b
    for path in (a, b):
        st = os.lstat(path)
        assert Path(path).parent == shared_tmp
        assert Path(path).name.startswith(f"tp-run-{os.getuid()}-")
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
    assert control_files.control_dirs() == sorted([a, b])


def test_unsafe_temp_dir_is_refused(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    unsafe = shared_tmp / "unsafe"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(unsafe))
    with pytest.raises(control_files.ControlFileError, match="lets other users rename"):
        control_files.new_control_dir()
    assert list(unsafe.iterdir()) == []  # the directory it made is gone again


@pytest.mark.parametrize("case", ["unsafe", "too long"])
def test_agent_in_an_unusable_temp_dir_is_one_line_error(workdir, test_env, shared_tmp, case):
    """A TMPDIR others may write to without the sticky bit (the agent will not make its
    control directory there), or one too long for a socket path: one error line, exit 2,
    nothing started, nothing left behind."""
    tmp = shared_tmp / ("unsafe" if case == "unsafe" else "x" * 90)
    tmp.mkdir()
    tmp.chmod(0o777 if case == "unsafe" else 0o700)
    r = run_launcher(TP_RUN, ["--nproc-per-node", "1", "--spares", "1",
                              "scripts/resilient_train.py", "--steps", "2"],
                     {**test_env, "TMPDIR": str(tmp), "OUT": str(workdir)}, workdir)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    if case == "unsafe":
        assert line.startswith(f"tp-run: error: cannot make a private control directory: "
                               f"{tmp} lets other users rename tp-run-{os.getuid()}-"), line
    else:
        assert line.startswith(f"tp-run: error: cannot open the control socket {tmp}/"), line
        assert line.endswith("AF_UNIX path too long"), line
    assert not list(tmp.glob("tp-run-*")) and not list(workdir.glob("entry_*"))


def test_xdg_runtime_dir_only_when_private(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch):
    xdg = shared_tmp / "run-user"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert Path(control_files.new_control_dir()).parent == xdg
    xdg.chmod(0o777)  # not private: not used (nor looked in)
    assert Path(control_files.new_control_dir()).parent == shared_tmp
    assert [Path(p).parent for p in control_files.control_dirs()] == [shared_tmp]


def test_control_dirs_skip_look_alikes(shared_tmp: Path):
    real = control_files.new_control_dir()
    prefix = f"tp-run-{os.getuid()}-"
    (shared_tmp / f"{prefix}open").mkdir(mode=0o700)
    (shared_tmp / f"{prefix}open").chmod(0o777)
    (shared_tmp / f"{prefix}link").symlink_to(real)
    if os.getuid() == 0:
        (shared_tmp / f"{prefix}theirs").mkdir(mode=0o700)
        os.chown(shared_tmp / f"{prefix}theirs", OTHER, OTHER)
    assert control_files.control_dirs() == [real]


def test_a_gone_agents_directories_are_removed_and_nothing_else(shared_tmp: Path):
    """remove_stale: a directory whose owner file names a process that is gone (its pid
    free, or reused by a process that started later) is removed; one whose owner lives,
    one with no owner file, one open to others, and a link are kept."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    me = control_files._start_ticks(os.getpid())
    owners = {"dead": f"{gone.pid} 1", "reused": f"{os.getpid()} {me - 1}",
              "live": f"{os.getpid()} {me}", "none": None, "open": f"{gone.pid} 1"}
    for name, owner in owners.items():
        d = shared_tmp / name
        d.mkdir(mode=0o700)
        if owner is not None:
            (d / control_files.OWNER_FILE).write_text(owner)
        (d / "log").write_text("x")
    (shared_tmp / "open").chmod(0o755)
    (shared_tmp / "link").symlink_to(shared_tmp / "dead")
    paths = [str(shared_tmp / n) for n in ["link", *owners]]
    assert control_files.remove_stale(paths) == [str(shared_tmp / "dead"),
                                                 str(shared_tmp / "reused")]
    assert sorted(p.name for p in shared_tmp.iterdir()) == ["link", "live", "none", "open"]
    made = control_files.new_control_dir()  # marked as this process's
    assert control_files.remove_stale([made]) == [] and os.path.isdir(made)
    shutil.rmtree(made)


def test_a_gone_agents_status_is_not_a_running_agent(shared_tmp: Path):
    """find_agents: a SIGKILLed agent's status file whose pid was since reused by a live
    process (here, this one) is not listed; the live agent's is (a reused pid made
    ``tp-run status --agent-pid`` see two agents with one pid)."""
    live, gone = control_files.new_control_dir(), control_files.new_control_dir()
    me = control_files._start_ticks(os.getpid())
    (Path(gone) / control_files.OWNER_FILE).write_text(f"{os.getpid()} {me - 1}")
    for directory, run_id in ((live, "live"), (gone, "gone")):
        control_files.write_status(os.path.join(directory, f"{os.getpid()}.sock"),
                                   control_files.AgentStatus(run_id, os.getpid(), 1, {}, []))
    assert [a.run_id for a in control_files.find_agents()] == ["live"]


def test_status_is_written_without_following_links(tmp_path: Path):
    precious = tmp_path / "precious"
    precious.write_text("mine\n")
    precious.chmod(0o600)
    sock = tmp_path / "1.sock"
    Path(str(sock) + ".json").symlink_to(precious)
    status = control_files.AgentStatus("job", os.getpid(), 4, {0: 11, 1: 12}, [13])
    control_files.write_status(str(sock), status)
    assert precious.read_text() == "mine\n"
    st = os.lstat(str(sock) + ".json")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    status.socket = str(sock)
    assert control_files.read_status(str(sock)) == status
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.sock.json", "precious"]


def test_read_private_refuses_links_fifos_and_other_owners(tmp_path: Path):
    (tmp_path / "real").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.mkfifo(tmp_path / "fifo")  # opening it would block forever without O_NONBLOCK
    assert control_files.read_private(str(tmp_path / "real")) == b"{}"
    with pytest.raises(control_files.ControlFileError, match="is a symbolic link"):
        control_files.read_private(str(tmp_path / "link"))
    with pytest.raises(control_files.ControlFileError, match="not a regular file"):
        control_files.read_private(str(tmp_path / "fifo"))
    with pytest.raises(FileNotFoundError):
        control_files.read_private(str(tmp_path / "missing"))
    (tmp_path / "big").write_bytes(b" " * 100)
    with pytest.raises(control_files.ControlFileError, match="larger than 10 bytes"):
        control_files.read_private(str(tmp_path / "big"), limit=10)
    if os.getuid() == 0:
        os.chown(tmp_path / "real", OTHER, OTHER)
        with pytest.raises(control_files.ControlFileError, match=f"belongs to uid {OTHER}"):
            control_files.read_private(str(tmp_path / "real"))
    assert control_files.read_status(str(tmp_path / "none")) is None


# ---------------------------------------------------------------- the control server


class _Served:
    """A ControlServer pumped by this thread; what its handler saw."""

    def __init__(self) -> None:
        self.got: list[tuple[int, channel.Message]] = []
        self.conns: list = []  # each connection's, in the order of their messages
        self.server = ControlServer(self._handle)
        self.sel = selectors.DefaultSelector()
        self.server.register(self.sel)

    def _handle(self, conn, msg: channel.Message) -> channel.Message | None:
        self.got.append((conn.pid, msg))
        self.conns.append(conn)
        if isinstance(msg, channel.Hello) and msg.slot > 7:
            raise channel.ChannelError(f"hello from slot {msg.slot}, which this agent did "
                                       "not start")
        return channel.Reply(f"ok: {msg.rank}") if isinstance(msg, channel.Migrate) else None

    def pump(self, until, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "timed out"
            for key, events in self.sel.select(0.05):
                self.server.on_event(key.data[1], events)

    def close(self) -> None:
        self.server.close()
        self.sel.close()


def _client(path: str, lines: list[bytes], python: str = sys.executable,
            **kw) -> subprocess.Popen:
    """A client process: sends ``lines``, prints what it gets until the server closes."""
    client = subprocess.Popen([python, "-c", TALK, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd="/", **kw)
    client.stdin.write(b"".join(lines))
    client.stdin.close()
    return client


def test_control_server_files_are_private(shared_tmp: Path):
    served = _Served()
    try:
        directory = Path(served.server.directory)
        assert directory.parent == shared_tmp
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(served.server.path).st_mode) == 0o600
        board = Path(served.server.board.path)
        assert stat.S_IMODE(board.stat().st_mode) == 0o600 and board.parent == directory
        served.server.write_status(control_files.AgentStatus("r", os.getpid(), 0, {}, []))
        assert stat.S_IMODE(os.stat(served.server.path + ".json").st_mode) == 0o600
        assert [a.pid for a in control_files.find_agents()] == [os.getpid()]
    finally:
        served.close()
    assert not directory.exists()  # socket, status, board and directory: all gone


def test_control_server_drops_bad_lines_and_serves_good_ones(shared_tmp: Path, server_log):
    served = _Served()
    try:
        hello = channel.encode(channel.Hello(slot=1, pid=5))
        cases = [
            # (lines sent on one connection, what comes back before the server closes it)
            ([hello, b'{"op":"migrate","rank":"x"}\n', hello], ""),
            ([channel.encode(channel.Migrate(rank=2)), b"[1]\n"], '"message":"ok: 2"'),
            ([b'{"op":"hello","slot":9,"pid":5}\n'], ""),  # the handler rejects it
            ([b"z" * (channel.MAX_LINE + 10)], ""),
            ([b"\x00\xff\n"], ""),
        ]
        for lines, reply in cases:
            before = len(served.got)
            client = _client(served.server.path, lines)
            served.pump(lambda: client.poll() is not None)
            out = client.stdout.read().decode()
            assert client.wait() == 0  # the server closed the connection: EOF
            assert (reply in out) if reply else out == "", (lines, out)
            new = [m for _, m in served.got[before:]]
            if lines[0] == hello:
                assert new == [channel.Hello(slot=1, pid=5)]  # the line after the bad one: unread
        bad = [m for m in server_log if "bad message from pid" in m]
        assert len(bad) == len(cases), server_log
        assert all("\n" not in m for m in bad)
        # Still serving: a good connection after all that.
        client = _client(served.server.path, [channel.encode(channel.Migrate(rank=0))])
        served.pump(lambda: any(isinstance(m, channel.Migrate) and m.rank == 0
                                for _, m in served.got))
        client.kill()
        client.wait()
    finally:
        served.close()


def test_a_client_that_does_not_read_never_blocks_the_agent(shared_tmp: Path, server_log,
                                                           monkeypatch: pytest.MonkeyPatch):
    """Replies to a client that does not read wait in its connection's buffer: every send
    returns at once (they used to block the agent up to 5 s each, a recovery included:
    four such clients held one up for 20 s); what was queued arrives whole and in order
    once it reads; past MAX_PENDING unread bytes the connection is closed, one line."""
    served = _Served()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(served.server.path)
        client.sendall(channel.encode(channel.Migrate(rank=0)))
        served.pump(lambda: served.conns)
        conn = served.conns[0]
        big = [channel.Reply(f"{i:04d}" + "x" * 1000) for i in range(800)]  # > the socket's
        assert all(served.server.send(conn, m) for m in big)  # buffer: queued, not waited on
        got = b""
        client.setblocking(False)
        want = b"".join(channel.encode(m) for m in [channel.Reply("ok: 0"), *big])
        deadline = time.monotonic() + HANG_TIMEOUT
        while len(got) < len(want):
            assert time.monotonic() < deadline, "timed out"
            for key, events in served.sel.select(0.01):
                served.server.on_event(key.data[1], events)
            with contextlib.suppress(BlockingIOError):
                got += client.recv(1 << 16)
        assert got == want
        monkeypatch.setattr(control_server, "MAX_PENDING", 4096)
        sent = [served.server.send(conn, m) for m in big]
        assert False in sent and not any(sent[sent.index(False):])
        assert any("has left" in m and "unread; closed its connection" in m
                   for m in server_log), server_log
    finally:
        client.close()
        served.close()


HOLD_CONNECTIONS = """\
import socket, sys
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    socks.append(s)
print("connected", flush=True)
sys.stdin.read()
"""


def _pump_until_quiet(served: _Served) -> int:
    """Serve until the selector has nothing for a while; how many events it served."""
    events, quiet = 0, 0
    deadline = time.monotonic() + HANG_TIMEOUT
    while quiet < 5:
        assert time.monotonic() < deadline, f"still busy after {events} events: a spin"
        ready = served.sel.select(0.05)
        quiet = 0 if ready else quiet + 1
        for key, mask in ready:
            served.server.on_event(key.data[1], mask)
            events += 1
    return events


@pytest.mark.parametrize("short_of", ["connections", "descriptors"])
def test_too_many_connections_are_closed_with_one_line(shared_tmp: Path, server_log, short_of):
    """40 connections held open by one process, beyond what the agent keeps (its cap, or
    its descriptor limit): the surplus is closed unserved, one warning says so (out of
    descriptors, the agent used to spin on the listening socket, a warning per turn),
    and once they close, connections are served again."""
    served = _Served()
    holder = None
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_CONNECTIONS,
                                   served.server.path, "40"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert holder.stdout.readline() == b"connected\n"
        if short_of == "connections":
            served.server._max_conns = 10
        else:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (len(os.listdir("/proc/self/fd")) + 10, limits[1]))
        events = _pump_until_quiet(served)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        kept = len(served.server._conns)
        assert 0 < kept < 40 and events < 200, (kept, events)
        refused = [m for m in server_log if "closing new connections unserved" in m]
        assert len(refused) == 1, server_log
        assert ("out of file descriptors" if short_of == "descriptors" else
                "connections are open") in refused[0]
        holder.stdin.close()
        holder.wait(timeout=HANG_TIMEOUT)
        _pump_until_quiet(served)
        client = _client(served.server.path, [channel.encode(channel.Migrate(rank=3))])
        served.pump(lambda: client.poll() is not None or any(
            isinstance(m, channel.Migrate) and m.rank == 3 for _, m in served.got))
        client.kill()
        client.wait()
        assert any(isinstance(m, channel.Migrate) and m.rank == 3 for _, m in served.got)
        assert server_log[-1] == "control socket: taking connections again", server_log
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        served.close()


@needs_root
def test_control_server_refuses_another_uid(shared_tmp: Path, other_python, server_log):
    """Root passes file modes; the peer check does not care: a connection from another
    uid is refused however it got through (here the test opens the modes on purpose)."""
    python, pythonpath = other_python
    served = _Served()
    try:
        os.chmod(served.server.directory, 0o711)
        os.chmod(served.server.path, 0o666)
        lines = [b'{"op":"hello","slot":0,"pid":1}\n', b'{"op":"migrate","rank":1}\n']
        intruder = _client(served.server.path, lines, python, env={"PYTHONPATH": pythonpath},
                           **AS_OTHER)
        served.pump(lambda: intruder.poll() is not None)
        assert intruder.returncode == 0
        assert intruder.stdout.read() == b""  # closed unanswered
        assert served.got == []  # neither the hello nor the migrate reached the agent
        refused = [m for m in server_log if "refused" in m]
        assert len(refused) == 1 and f"of uid {OTHER} (only uid 0 may connect)" in refused[0]
    finally:
        served.close()


@needs_root
def test_migrate_refuses_a_socket_served_by_another_uid(shared_tmp: Path, other_python):
    """Even in the caller's own control directory, a socket (here a link planted by the
    owner himself) that another uid serves is not talked to."""
    python, pythonpath = other_python
    theirs = shared_tmp / "theirs.sock"
    code = ("import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n"
            "import os; os.chmod(sys.argv[1], 0o777); print('ready', flush=True)\n"
            "time.sleep(60)\n")
    server = subprocess.Popen([python, "-c", code, str(theirs)], env={"PYTHONPATH": pythonpath},
                              cwd="/", stdout=subprocess.PIPE, text=True, **AS_OTHER)
    try:
        assert server.stdout.readline().strip() == "ready"
        mine = control_files.new_control_dir()
        sock = os.path.join(mine, f"{os.getpid()}.sock")
        os.symlink(theirs, sock)
        control_files.write_status(sock, control_files.AgentStatus("j", os.getpid(), 0, {}, []))
        r = subprocess.run([*TP_RUN, "migrate", "--rank", "0"], capture_output=True, text=True,
                           env={**os.environ, "TMPDIR": str(shared_tmp)}, cwd=REPO,
                           timeout=HANG_TIMEOUT)
        assert r.returncode == 1
        assert r.stderr.strip() == (f"tp-run migrate: error: the socket {sock} is served by "
                                    f"uid {OTHER}, not by you")
    finally:
        server.kill()
        server.communicate()


# ---------------------------------------------------------------- real jobs


@pytest.mark.slow
@needs_root
def test_another_user_cannot_touch_a_running_job(workdir, test_env, shared_tmp, other_python):
    """uid 65534 against a root job: it pre-creates the predictable control directories,
    plants links to the owner's file at every name it can reach, connects to every socket
    it finds, fakes an agent, and runs ``tp-run migrate``. Nothing works, nothing of the
    owner's is overwritten, and the job (and its owner's own migrate) goes on."""
    python, pythonpath = other_python
    intruder = [python, str(SCRIPTS / "intruder.py")]
    other_env = {**test_env, "PYTHONPATH": pythonpath, "TMPDIR": str(shared_tmp), "HOME": "/"}
    precious = shared_tmp / "precious"
    precious.write_text("the owner's\n")
    precious.chmod(0o600)

    def as_other(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=other_env, cwd=shared_tmp, capture_output=True,
                              text=True, timeout=HANG_TIMEOUT, **AS_OTHER)

    prep = as_other(*intruder, "prepare", "0", str(precious))
    assert prep.returncode == 0, prep.stderr
    out = workdir / "out"
    out.mkdir()
    env = {**test_env, "TMPDIR": str(shared_tmp), "OUT": str(out), "OMP_NUM_THREADS": "1"}
    with _running([*TP_RUN, *_job_args()], env, workdir) as job:
        _wait(lambda: _held(out) and any(a.pid == job.pid and a.parked_spares
                                         for a in control_files.find_agents()),
              "the ranks hold and a spare parks")
        (status,) = [a for a in control_files.find_agents() if a.pid == job.pid]
        control = os.path.dirname(status.socket)
        attack = as_other(*intruder, "attack", "0", str(precious), str(job.pid))
        assert attack.returncode == 0, attack.stderr
        report = json.loads(attack.stdout)
        theirs = [as_other(python, "-m", "tp_launch", "migrate", "--rank", "1"),
                  as_other(python, "-m", "tp_launch", "migrate", "--rank", "1",
                           "--agent-pid", str(job.pid))]
        mine = run_launcher(TP_RUN, ["migrate", "--rank", "1"], env, workdir)
        (out / "release").touch()
        stderr = _check_finished(job, out)

    assert precious.read_text() == "the owner's\n"
    assert stat.S_IMODE(precious.stat().st_mode) == 0o600
    assert report["replies"] == {}  # no socket of the job's was visible to connect to
    assert report["listed"][control] == "Permission denied"  # the real one: closed to it
    assert all(not p.startswith(control) for p in report["planted"])
    assert report["planted"]  # (it did plant links where it could: its own directories)
    assert theirs[0].returncode == 1 and "no running tp-run agent" in theirs[0].stderr
    assert theirs[1].returncode == 1 and theirs[1].stderr.strip() == (
        f"tp-run migrate: error: pid {job.pid} belongs to uid 0, not to you (uid {OTHER}): "
        "tp-run migrate acts only on your own jobs")
    assert mine.returncode == 0 and "ok: rank 1" in mine.stdout, mine.stdout + mine.stderr
    assert "tp-run: migration: rank(s) [1]" in stderr
    for made in json.loads(prep.stdout)["made"]:  # the job wrote nothing in its directories
        assert all(os.lstat(p).st_uid == OTHER for p in glob.glob(os.path.join(made, "*")))
    assert not os.path.exists(control)


@pytest.mark.slow
@needs_root
def test_another_users_agent_refuses_root(workdir, test_env, shared_tmp, other_python):
    """A job of uid 65534; root reaches its socket (file modes do not stop root) and
    sends a hello for rank 0's slot and a migrate: the agent refuses the connection, the
    job is unaffected. Root's ``tp-run migrate`` refuses up front."""
    python, pythonpath = other_python
    home = shared_tmp / "home"
    shutil.copytree(SCRIPTS, home / "scripts")
    (home / "out").mkdir()
    for path in [home, *home.rglob("*")]:
        os.chown(path, OTHER, OTHER)
    out = home / "out"
    env = {**test_env, "PYTHONPATH": pythonpath, "TMPDIR": str(shared_tmp), "HOME": str(home),
           "OUT": str(out), "OMP_NUM_THREADS": "1"}
    with _running([python, "-m", "tp_launch", *_job_args()], env, home, **AS_OTHER) as job:
        sockets = []

        def ready() -> bool:
            sockets[:] = glob.glob(str(shared_tmp / f"tp-run-{OTHER}-*" / f"{job.pid}.sock"))
            if not (_held(out) and sockets):
                return False
            with contextlib.suppress(OSError, ValueError):
                return bool(json.loads(Path(sockets[0] + ".json").read_text())["parked_spares"])
            return False

        _wait(ready, "the ranks hold and a spare parks")
        (sock,) = sockets
        control = os.path.dirname(sock)
        assert os.stat(control).st_uid == OTHER
        assert stat.S_IMODE(os.stat(control).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(sock + ".json").st_mode) == 0o600
        got = _talk(sock, b'{"op":"hello","slot":0,"pid":1}\n{"op":"migrate","rank":1}\n')
        root_migrate = run_launcher(TP_RUN, ["migrate", "--rank", "1", "--agent-pid",
                                             str(job.pid)], test_env, workdir)
        (out / "release").touch()
        stderr = _check_finished(job, out)

    assert got == b""  # closed unanswered
    assert f"refused a connection from pid {os.getpid()} of uid 0" in stderr
    assert root_migrate.returncode == 1 and root_migrate.stderr.strip() == (
        f"tp-run migrate: error: pid {job.pid} belongs to uid {OTHER}, not to you (uid 0): "
        "tp-run migrate acts only on your own jobs")
    assert "tp-run: migration" not in stderr and "tp-run: failure" not in stderr
    # Every rank kept its first process: nobody took rank 0's slot or moved rank 1.
    entries = {f.name: f.read_text().split() for f in out.glob("entry_*")}
    assert len(entries) == 2 and all(e[1] == "0" for e in entries.values()), entries


BAD_LINES = [
    b"{not json\n",
    b'{"op": "hello"}\n',
    b'{"op": "migrate", "rank": "x"}\n',
    b'{"op": "hello", "slot": true, "pid": 1}\n',
    b'{"op": "hello", "slot": 99, "pid": 1}\n',  # a slot this agent did not start
    b'{"op": "finished", "gen": 0, "rank": 0}\n',
    b'{"op": "resumed", "gen": 0}\n',
    b'{"op": "exit"}\n',
    b"[1, 2]\n",
    b"\xff\xfe\n",
    b"[" * 100_000 + b"\n",
    b"x" * (channel.MAX_LINE + 1),  # and never a newline
]


@pytest.mark.slow
def test_malformed_lines_never_crash_the_agent(workdir, test_env, shared_tmp):
    """Each bad line, on a connection of the job's own user: one line in the log, that
    connection closed; the job trains on, and the agent still serves a migrate."""
    out = workdir / "out"
    out.mkdir()
    env = {**test_env, "TMPDIR": str(shared_tmp), "OUT": str(out), "OMP_NUM_THREADS": "1"}
    with _running([*TP_RUN, *_job_args()], env, workdir) as job:
        _wait(lambda: _held(out) and any(a.pid == job.pid and a.parked_spares
                                         for a in control_files.find_agents()),
              "the ranks hold and a spare parks")
        (status,) = [a for a in control_files.find_agents() if a.pid == job.pid]
        replies = [_talk(status.socket, line) for line in BAD_LINES]
        # A good request, then a bad line, on one connection: answered, then closed.
        replies.append(_talk(status.socket, channel.encode(channel.Migrate(rank=7)) + b"{\n"))
        mine = run_launcher(TP_RUN, ["migrate", "--rank", "1"], env, workdir)
        (out / "release").touch()
        stderr = _check_finished(job, out)

    assert replies[:-1] == [b""] * len(BAD_LINES)  # closed without an answer
    assert channel.decode(replies[-1], (channel.Reply,)).message.startswith(
        "error: no rank 7 on this node")
    logged = [line for line in stderr.splitlines() if "bad message from pid" in line]
    assert len(logged) == len(BAD_LINES) + 1, stderr[-4000:]
    assert mine.returncode == 0 and "ok: rank 1" in mine.stdout, mine.stdout + mine.stderr
    assert "tp-run: migration: rank(s) [1]" in stderr


# ---------------------------------------------------------------- the agent-hosted store

HOLD_SCRIPT = """\
import os, pathlib, time
out = pathlib.Path(os.environ["OUT"])
(out / "port").write_text(os.environ["MASTER_ADDR"] + " " + os.environ["MASTER_PORT"])
while not (out / "release").exists():
    time.sleep(0.05)
"""


def _other_addresses() -> list[str]:
    """This machine's addresses that are not loopback ones."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and "%" not in a.address:
                if not a.address.startswith(("127.", "::1", "fe80")):
                    found.append(a.address)
    return found


def _reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=5).close()
        return True
    except OSError:
        return False


def test_single_node_store_listens_on_loopback_only(workdir, test_env):
    others = _other_addresses()
    if not others:
        pytest.skip("this machine has no address but loopback ones")
    out = workdir / "out"
    out.mkdir()
    (workdir / "hold.py").write_text(HOLD_SCRIPT)
    env = {**test_env, "OUT": str(out)}
    with _running([*TP_RUN, "--nproc-per-node", "1", "hold.py"], env, workdir) as job:
        _wait(lambda: (out / "port").exists() and (out / "port").read_text(), "the worker")
        addr, port = (out / "port").read_text().split()
        reached = {a: _reachable(a, int(port)) for a in ["127.0.0.1", *others]}
        (out / "release").touch()
        _, stderr = job.communicate(timeout=HANG_TIMEOUT)
    assert job.returncode == 0, stderr
    assert addr == "localhost"
    assert reached == {"127.0.0.1": True, **{a: False for a in others}}


def test_store_host_binds_the_address_it_is_given():
    from rendezvous.store_host import StoreHost

    host = StoreHost("127.0.0.2", 0)
    try:
        store = host.wait_ready(60)
        store.set("k", "v")  # the server's own client reaches it on the bound address
        assert host.addr == "127.0.0.2"
        assert _reachable("127.0.0.2", host.port)
        assert not _reachable("127.0.0.1", host.port)
    finally:
        host.close()
    for bad, error in [("192.0.2.254", "cannot host the store on 192.0.2.254:0: "),
                       ("no-such-host.invalid", "cannot host the store on no-such-host"),
                       ("", "no address to bind")]:
        if bad == "192.0.2.254" and "192.0.2.254" in _other_addresses():
            continue
        with pytest.raises(OSError, match=error):
            StoreHost(bad, 0)


def test_a_full_temp_directory_costs_the_status_file_not_the_agent(small_disk, monkeypatch,
                                                                  caplog):
    """The control directory's filesystem fills up (a real ENOSPC from the kernel): the
    status write says so once and the agent goes on; once there is room it is written
    again (issue 25: the agent crashed at the first rank death)."""
    monkeypatch.setenv("TMPDIR", str(small_disk))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    served = _Served()
    try:
        status = control_files.AgentStatus("r", os.getpid(), 3, {0: 11}, [12])
        filler = small_disk / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while f.write(b"\0" * (64 << 10)):  # unbuffered: nothing left to flush at close
                pass
        with caplog.at_level(logging.WARNING):
            served.server.write_status(status)
            served.server.write_status(status)
        said = [r.getMessage() for r in caplog.records if "status file" in r.getMessage()]
        assert len(said) == 1 and "No space left" in said[0], said
        filler.unlink()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            served.server.write_status(status)
        assert control_files.read_status(served.server.path).generation == 3
        assert any("written again" in r.getMessage() for r in caplog.records)
    finally:
        served.server.close()
