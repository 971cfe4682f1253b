"""Emulated hosts on one machine: network namespaces on a bridge, each with its own address.

Spec:

- ``Cluster(n, tag)`` (a context manager) makes ``n`` hosts. Each host is a network
  namespace with ``lo`` up and one link, ``eth0`` (a veth pair whose other end is in the
  root namespace, enslaved to the cluster's bridge), addressed from one /24 of the
  benchmarking range 198.18.0.0/15 (RFC 2544: never routed, never a real machine's). The
  bridge holds ``.bridge_addr`` (``.1``), so the test process in the root namespace
  reaches every host; host ``i`` is ``.<i + 2>``. Each /24 is used by one live cluster of
  the whole machine at a time (chosen under a lock file, skipping any /24 already on a
  link), so parallel runs never share an address.
- Inside a host, the machine's hostname resolves to the host's own address (``ip netns
  exec`` bind-mounts ``/etc/netns/<netns>/hosts`` over ``/etc/hosts``): gloo and anything
  else that resolves the hostname binds the host's address, as on a real node; every
  host's ``name`` resolves to its address in every host.
- ``Host``: ``.name`` (``host<i>``), ``.addr`` (str IPv4), ``.netns``, ``.link`` (the root
  end of its veth pair). ``.popen(argv, **kw)`` / ``.run(argv, **kw)`` run ``argv`` in the
  namespace (``ip netns exec``, which execs: the returned pid is ``argv``'s own process;
  the environment, working directory and file system are the caller's). ``.pids()``: the
  live processes in the namespace (zombies not counted). ``.kill()``: SIGKILL them all,
  again until none is left (every process of the host dies at once; the kernel closes
  their sockets, so peers see FIN/RST at once, as for a SIGKILLed process on loopback).
  ``.cut()``: the host's link down (root end): from then on no packet leaves or reaches
  the host, no RST, no FIN, its processes keep running; a peer's sends are buffered, its
  receives time out (the silent vanish of a host that loses power or its network).
  ``.restore()``: the link up again (a partition that heals).
- Names: namespaces ``tph<pid>_<k>_<i>``, links ``tpv<pid>_<k>_<i>``, bridge
  ``tpb<pid>_<k>`` (``pid``: the creating process, ``k``: the cluster's number in it,
  both so that nothing collides; a link name fits Linux's 15 characters for any pid and
  up to 36*36 clusters of 36 hosts). ``tag`` is a label for logs only.
- Cleanup: leaving the ``with`` block, or ``close()``, SIGKILLs every process in every
  host (and waits for them), deletes the namespaces, links, bridge and ``/etc/netns``
  entries. Every open cluster is closed at interpreter exit too (atexit), and a new
  cluster first sweeps whatever a *dead* process of the same naming scheme left behind
  (a run killed by a signal, which runs no atexit): the processes in its namespaces,
  then the namespaces, links and ``/etc/netns`` entries (``sweep_dead_runs``). Cleanup
  never raises: a failure is printed and the rest goes on.
- ``cannot_emulate()``: None where this works, else one line saying why (not root, no
  ``ip``, namespaces not permitted); tests skip with it.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from tp_launch.control_files import find_agents

NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
_LOCK = Path("/tmp/tp-run-hosts.lock")
_ETC_NETNS = Path("/etc/netns")
_NAME = re.compile(r"^tp[hvb](\d+)_")
_open: list["Cluster"] = []
_count = 0
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"


def _b36(n: int) -> str:
    return _B36[n] if n < 36 else _b36(n // 36) + _B36[n % 36]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


_cannot: list[str | None] = []


def cannot_emulate() -> str | None:
    """None if emulated hosts can be made here, else one line saying why not."""
    if _cannot:
        return _cannot[0]
    why: str | None = None
    if os.geteuid() != 0:
        why = "emulated hosts need root (network namespaces, veth links, a bridge)"
    elif shutil.which("ip") is None:
        why = "emulated hosts need iproute2's `ip` (apt-get install iproute2)"
    else:
        probe = f"tph{os.getpid()}_probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            why = f"network namespaces are not permitted here: {made.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _cannot.append(why)
    return why


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns(netns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` until none is left (a dying agent may still
    fork: keep at it)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _netns_pids(netns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            print(f"tests/hosts.py: processes {pids} in {netns} survive SIGKILL",
                  file=sys.stderr)
            return
        time.sleep(0.05)


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    # Zombies are still listed until reaped (by us, for the processes we started: the
    # Popen objects' owners wait on them); a zombie is no process left running.
    pids = []
    for word in out.stdout.split():
        pid = int(word)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            pids.append(pid)
    return pids


def sweep_dead_runs() -> None:
    """Remove the namespaces, links and /etc/netns entries of runs whose process is dead."""
    names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
             if line.strip()]
    for netns in names:
        m = _NAME.match(netns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns(netns)
            _ip("netns", "del", netns, check=False)
    if _ETC_NETNS.is_dir():
        for d in _ETC_NETNS.iterdir():
            m = _NAME.match(d.name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@", 1)[0]
        m = _NAME.match(link)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", link, check=False)


class Host:
    """One emulated host (see the module docstring)."""

    def __init__(self, name: str, addr: str, netns: str, link: str) -> None:
        self.name = name
        self.addr = addr
        self.netns = netns
        self.link = link

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr}, netns={self.netns})"

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *map(str, argv)]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self._argv(argv), **kw)

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self._argv(argv), **kw)

    def pids(self) -> list[int]:
        """The live processes in this host's namespace (zombies not counted)."""
        return _netns_pids(self.netns)

    def kill(self) -> None:
        """SIGKILL every process in the host (the whole host dies at once)."""
        _kill_netns(self.netns)

    def cut(self) -> None:
        """The host's link down: it vanishes silently (no RST, no FIN), its processes run on."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        """The host's link up again."""
        _ip("link", "set", self.link, "up")


class HostAgent:
    """One tp-run agent on an emulated host; its stderr lines kept with their arrival time."""

    def __init__(self, host: Host, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.host = host
        self.proc = host.popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def count(self, text: str) -> int:
        """How many stderr lines so far contain ``text``."""
        return sum(text in line for _, line in list(self.lines))

    def first(self, text: str, after: float = 0.0) -> float | None:
        """When a stderr line containing ``text`` arrived (after ``after``), or None."""
        return next((t for t, line in list(self.lines) if text in line and t >= after), None)

    def status(self):
        return next((a for a in find_agents() if a.pid == self.proc.pid), None)

    def ranks(self) -> set[int]:
        s = self.status()
        return set() if s is None else set(s.ranks)

    def parked(self) -> int:
        s = self.status()
        return 0 if s is None else len(s.parked_spares)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc


class Cluster:
    """``with Cluster(3, "kill") as c: c.hosts[0].popen([...])`` (see the module docstring)."""

    def __init__(self, n: int, tag: str = "") -> None:
        global _count
        if not 1 <= n <= 36:
            raise ValueError(f"Cluster(n={n}): 1 to 36 hosts")
        why = cannot_emulate()
        if why:
            raise RuntimeError(why)
        self.tag = tag
        self.hosts: list[Host] = []
        self.k = _b36(_count)
        _count += 1
        pid = os.getpid()
        self.bridge = f"tpb{pid}_{self.k}"
        self._netns_names: list[str] = []
        self._closed = False
        _open.append(self)
        try:
            with open(_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                sweep_dead_runs()
                subnet = self._free_subnet()
                self.bridge_addr = str(subnet[1])
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
                _ip("link", "set", self.bridge, "up")
            for i in range(n):
                self.hosts.append(self._make_host(i, pid, str(subnet[i + 2])))
            hostname = socket.gethostname()
            for host in self.hosts:
                # Every host's name resolves (and reverse-resolves: c10d asks) everywhere.
                lines = ["127.0.0.1\tlocalhost"] + [
                    f"{h.addr}\t{hostname + ' ' if h is host else ''}{h.name}"
                    for h in self.hosts]
                (_ETC_NETNS / host.netns / "hosts").write_text("\n".join(lines) + "\n")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A /24 of NETWORK no link of the machine has an address in (under the lock)."""
        used: set[ipaddress.IPv4Network] = set()
        for m in re.finditer(r"inet (\S+)", _ip("-o", "-4", "addr", "show", check=False).stdout):
            addr = ipaddress.ip_interface(m.group(1)).ip
            if addr in NETWORK:
                used.add(ipaddress.IPv4Network(f"{addr}/24", strict=False))
        subnets = list(NETWORK.subnets(new_prefix=24))
        start = os.getpid() % len(subnets)
        for j in range(len(subnets)):
            s = subnets[(start + j) % len(subnets)]
            if s not in used:
                return s
        raise RuntimeError("no free /24 left in 198.18.0.0/15")

    def _make_host(self, i: int, pid: int, addr: str) -> Host:
        netns = f"tph{pid}_{self.k}_{_b36(i)}"
        link = f"tpv{pid}_{self.k}_{_b36(i)}"
        inner = f"tpi{pid}_{self.k}_{_b36(i)}"
        self._netns_names.append(netns)
        (_ETC_NETNS / netns).mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", netns)
        _ip("link", "add", link, "type", "veth", "peer", "name", inner, "netns", netns)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", netns, "link", "set", inner, "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return Host(f"host{i}", addr, netns, link)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the hosts, delete what the cluster made. Never raises."""
        if self._closed:
            return
        self._closed = True
        for netns in self._netns_names:
            try:
                _kill_netns(netns)
            except Exception as e:  # noqa: BLE001 -- cleanup goes on
                print(f"tests/hosts.py: killing {netns}: {e}", file=sys.stderr)
        for netns in self._netns_names:
            _ip("netns", "del", netns, check=False)
            shutil.rmtree(_ETC_NETNS / netns, ignore_errors=True)
        for host in self.hosts:
            _ip("link", "del", host.link, check=False)  # gone with its peer, normally
        _ip("link", "del", self.bridge, check=False)
        if self in _open:
            _open.remove(self)


@atexit.register
def _close_all() -> None:
    for cluster in list(_open):
        cluster.close()
