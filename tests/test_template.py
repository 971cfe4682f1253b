"""The process template (tp_launch/procs/template.py): a forked spare is the process
``python -u script.py`` would have been, and the agent learns how it ended.

Real processes: a real template importing torch, real forks, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest

from rendezvous.store_host import StoreHost
from tp_launch.agent.worker_env import PER_WORKER_VARS
from tp_launch.procs import template
from tp_launch.procs.worker import WorkerProcess, spawn

SCRIPT = '''
import json, os, random, signal, sys, time
out = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
       "spare": os.environ.get("TP_RUN_SPARE"), "random": random.random(),
       "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
       "term_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
       "sid": os.getsid(0) == os.getpid(), "torch_loaded": "torch" in sys.modules}
print("to stdout")
print("to stderr", file=sys.stderr)
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
if sys.argv[2] == "hang":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
'''


def _started() -> template.ProcessTemplate:
    t = template.ProcessTemplate(sys.executable, dict(os.environ), PER_WORKER_VARS,
                               lambda a, env, fds: spawn(a, env, subprocess.DEVNULL, None, fds))
    deadline = time.monotonic() + 120
    while t.starting() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert t.ready, "the template did not start"
    return t


@pytest.fixture(scope="module")
def tmpl():
    t = _started()
    yield t
    t.close()


def _fork(tmpl: template.ProcessTemplate, tmp_path: Path, name: str, code: str,
          ignore: tuple[int, ...] = ()) -> tuple[template.ForkedChild, Path]:
    script = tmp_path / "sub" / "script.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "TP_RUN_SPARE": "1", "LOCAL_RANK": "3"}
    child = tmpl.fork([sys.executable, "-u", str(script), str(out), code], env, ignore)
    assert child is not None
    return child, out


def test_a_forked_spare_is_the_script_run_as_main(tmpl, tmp_path):
    a, out_a = _fork(tmpl, tmp_path, "a", "0", ignore=(signal.SIGUSR1,))
    b, out_b = _fork(tmpl, tmp_path, "b", "3")
    assert a.wait(60) == 0 and b.wait(60) == 3
    got_a, got_b = json.loads(out_a.read_text()), json.loads(out_b.read_text())
    assert got_a["name"] == "__main__"
    assert got_a["argv"] == [str(tmp_path / "sub" / "script.py"), str(out_a), "0"]
    assert got_a["path0"] == str(tmp_path / "sub") and got_a["cwd"] == os.getcwd()
    assert got_a["spare"] == "1" and got_a["sid"] and got_a["torch_loaded"]
    assert got_a["usr1_ignored"] and not got_b["usr1_ignored"] and got_a["term_default"]
    assert got_a["random"] != got_b["random"], "Python's random was not reseeded at fork"
    assert a.stdout is not None and a.stdout.read() == b"to stdout\n"
    assert a.stderr is not None and a.stderr.read() == b"to stderr\n"


def test_a_forked_spare_killed_by_a_signal_reads_as_under_popen(tmpl, tmp_path):
    child, out = _fork(tmpl, tmp_path, "k", "hang")
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None
    # ps and pgrep -f see the script's command line, not the template's.
    assert psutil.Process(child.pid).cmdline() == \
        [sys.executable, "-u", str(tmp_path / "sub" / "script.py"), str(out), "hang"]
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        _fork(tmpl, tmp_path, "t", "hang")[0].wait(0.2)


def test_a_dead_template_takes_its_children_and_spares_start_anew(tmp_path):
    tmpl = _started()
    child, _ = _fork(tmpl, tmp_path, "d", "hang")
    tmpl.proc.kill()
    assert child.wait(30) != 0  # PDEATHSIG: it died with the template
    assert tmpl.fork([sys.executable, "-u", "x.py"], dict(os.environ), ()) is None
    assert not tmpl.alive
    tmpl.close()


def _store_children(tmpl: template.ProcessTemplate) -> list[psutil.Process]:
    return [p for p in psutil.Process(tmpl.proc.pid).children()
            if p.cmdline()[:2] == ["tp-run", "store"]]


def _set_and_get(port: int) -> bytes:
    from torch.distributed import TCPStore

    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    client.set("k", "v")
    return client.get("k")


def test_a_store_served_from_the_template_serves_until_stopped(tmpl):
    """The agent's store served by a child of the template (the agent imports no torch):
    clients use it; close() kills the child and frees the port."""
    host = StoreHost("127.0.0.1", 0, tmpl)
    assert _set_and_get(host.port) == b"v"
    (child,) = _store_children(tmpl)
    assert f"127.0.0.1:{host.port}" in " ".join(child.cmdline())
    host.close()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    StoreHost("127.0.0.1", host.port).close()  # the port is free again
    host.close()  # twice is fine


def test_a_store_asked_of_a_template_given_up_is_served_here(tmp_path):
    """Asked while the template still imports, which is then given up before it forked
    the store's child: the store is served by this process after all."""
    tmpl = template.ProcessTemplate(sys.executable, dict(os.environ), PER_WORKER_VARS,
                                    lambda a, env, fds: spawn(a, env, subprocess.DEVNULL,
                                                              None, fds))
    host = StoreHost("127.0.0.1", 0, tmpl)
    tmpl.close()
    assert _set_and_get(host.port) == b"v"
    host.close()
    # A template already gone is not asked.
    with socket.socket() as sock:
        assert tmpl.serve_store(sock, "127.0.0.1", 1, lambda: None) is None


def test_worker_process_forks_a_spare_only_where_it_is_the_same_process(tmpl, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys; sys.exit(5)\n")
    env = {**tmpl.env, "TP_RUN_SPARE": "1"}
    w = WorkerProcess([sys.executable, "-u", str(script)], env, None, None, 0, piped=True,
                      template=tmpl)
    assert isinstance(w.popen, template.ForkedChild) and w.popen.wait(30) == 5
    assert w.returncode == 5
    w.close()
    # A rank: its streams to its log files.
    script.write_text("import sys; print('out'); print('err', file=sys.stderr); sys.exit(4)\n")
    logs = tmp_path / "out.log", tmp_path / "err.log"
    w = WorkerProcess([sys.executable, "-u", str(script)], env, str(logs[0]), str(logs[1]), 0,
                      template=tmpl)
    assert isinstance(w.popen, template.ForkedChild) and w.popen.wait(30) == 4
    w.close()
    assert logs[0].read_text() == "out\n" and logs[1].read_text() == "err\n"
    for argv, e in (([sys.executable, "-u", "-m", "json.tool"], env),  # not a script
                    ([sys.executable, "-u", str(script)], {**env, "PATH": "/nowhere"})):
        w = WorkerProcess(argv, e, None, None, 0, piped=True, template=tmpl)
        assert isinstance(w.popen, subprocess.Popen)
        w.popen.kill()
        w.popen.wait()
        w.close()


def test_forkable_and_usable_for():
    py = sys.executable
    assert template.forkable([py, "-u", "train.py", "--x"]) == "train.py"
    assert template.forkable([py, "-u", "-m", "mod"]) is None
    assert template.forkable(["/bin/true", "-u", "train.py"]) is None
    assert template.forkable([py, "train.py"]) is None
    t = object.__new__(template.ProcessTemplate)
    t.env = {"A": "1", "LOCAL_RANK": "0"}
    t.per_worker = PER_WORKER_VARS
    assert t.usable_for({"A": "1", "LOCAL_RANK": "5", "RANK": "2", "TP_RUN_SPARE": "1"})
    assert not t.usable_for({"A": "2"}) and not t.usable_for({"LOCAL_RANK": "0"})
