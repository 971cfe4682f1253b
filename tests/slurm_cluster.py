"""A real Slurm cluster on emulated hosts (tests/hosts.py), for end-to-end tests.

Spec:

- ``SlurmCluster(cluster, workdir, nodes, controller)`` (a context manager) runs Debian's
  Slurm on hosts of a :class:`tests.hosts.Cluster`: its own ``munged`` (a fresh key, pid
  file, seed and log under ``workdir/slurm``; the system's ``/etc/munge`` and
  ``/run/munge`` are neither read nor written), ``slurmctld`` on the host ``controller``
  (also the login node: every Slurm command runs there), and one
  ``slurmd -N <host name>`` inside each host of ``nodes`` (``NodeAddr`` = the host's
  address, a ``Port`` of its own). Every daemon runs in the foreground as this process's
  child, so it is stopped by its own pid. munge's socket is a path: every namespace
  reaches it.
- Each node's slurmd runs with the host's name as its hostname (a UTS namespace of its
  own), as on a real cluster: srun tells slurmctld its hostname for the node-failure
  messages it must get, and with every host named like the machine those went to the
  wrong host (srun then waited for a dead node's task forever).
- munged's socket, each slurmd's spool directory (slurmstepd's sockets are there) and
  each node's temp dir are under ``/tmp/tp-slurm-XXXX``: a Unix socket's path must fit
  in 108 bytes, which a pytest temp path (``popen-gw0/`` under xdist) need not.
- The configuration is ``workdir/slurm/slurm.conf`` (``AuthInfo=socket=`` points at the
  cluster's munged); ``.env`` is the environment for every Slurm command
  (``SLURM_CONF``); ``.cmd(argv)`` runs one on the controller host (``sbatch``,
  ``squeue``, ``scancel``, ``srun --jobid`` ...) and ``.job(job_id)`` returns
  ``scontrol show job`` as a dict. One partition ``tp``
  holds every node, each declared with 8 CPUs whatever the machine has
  (``SlurmdParameters=config_overrides``), so the example's ``--cpus-per-task=8`` fits.
  Jobs run as root, with the submitter's environment.
- Each node has a temp directory of its own (``TMPDIR`` set by a ``TaskProlog``), as
  each machine has its own ``/tmp``: tp-run's control directories are per node.
- ``SlurmdTimeout`` is 5 s (a killed host is marked DOWN in seconds, not Slurm's 300 s)
  and ``KillWait`` 2 s, so teardown paths show up within a test's time.
- Inside a host, ``ip netns exec`` mounts a fresh ``/sys`` without cgroups, and slurmd
  22.05 will not start without a cgroup mount it recognises even with
  ``proctrack/linuxproc`` and ``task/none``: each slurmd is started under a private
  tmpfs at ``/sys/fs/cgroup`` holding a named (controller-less) v1 hierarchy, in its own
  mount namespace, so nothing of the machine's cgroups changes.
- Leaving the ``with`` block (also on failure or interrupt: ``atexit``) cancels every
  job, stops slurmd, slurmctld and munged (SIGTERM, then SIGKILL), waits for them and
  removes the state directory. ``cannot_run_slurm()`` is None where this can work, else
  one line saying why (tests skip with it).
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

DAEMONS = ("slurmctld", "slurmd", "munged")
COMMANDS = ("sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol")
_open: list["SlurmCluster"] = []


def cannot_run_slurm() -> str | None:
    """None if a Slurm cluster can be started here, else one line saying why not."""
    from tests.hosts import cannot_emulate

    missing = [name for name in DAEMONS + COMMANDS
               if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
               is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm munge")
    return cannot_emulate()


def _which(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    assert found, name
    return found


# ip netns exec gives the host a sysfs without cgroups; see the module docstring.
_SLURMD_WRAPPER = ("hostname \"$1\" && shift && mount -t tmpfs tp-run-cgroup /sys/fs/cgroup && "
                   "mkdir /sys/fs/cgroup/systemd && "
                   "mount -t cgroup -o none,name=systemd tp-run-cgroup /sys/fs/cgroup/systemd"
                   " && exec \"$@\"")


# Each node's tasks get a temp dir of their own, as each machine has its own /tmp (tp-run
# finds its agents through control directories there: `tp-run migrate --node` run on a
# node must find that node's agent only).
_TASK_PROLOG = """#!/bin/sh
echo "export TMPDIR={tmp}/$SLURMD_NODENAME"
"""


class SlurmCluster:
    """``with SlurmCluster(cluster, tmp_path, cluster.hosts[:3]) as slurm: ...``."""

    def __init__(self, cluster: Any, workdir: Path, nodes: Sequence[Any],
                 controller: Any) -> None:
        self.cluster = cluster
        self.controller = controller
        self.dir = Path(workdir) / "slurm"
        self.nodes = list(nodes)
        self.conf = self.dir / "slurm.conf"
        self.env = {**{k: v for k, v in os.environ.items() if k != "TP_TEST_MARKER"},
                    "SLURM_CONF": str(self.conf)}
        self.partition = "tp"
        self.short: Path | None = None
        self.cpus = 8
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._closed = False

    # ------------------------------------------------------------------ start

    def __enter__(self) -> "SlurmCluster":
        why = cannot_run_slurm()
        if why:
            raise RuntimeError(why)
        _open.append(self)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        d = self.dir
        # Sockets live here: AF_UNIX paths are short (108 bytes), a test's tmp_path is not.
        self.short = Path(tempfile.mkdtemp(prefix="tp-slurm-"))
        for sub in ("munge", "state", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses a key or socket directory others can write to.
        for path in (d, d / "munge"):
            path.chmod(0o755)
        key = d / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        self.munge_socket = self.short / "munge.socket"
        self._spawn("munged", [_which("munged"), "--foreground", "--force",
                               f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={d / 'munge' / 'munged.pid'}",
                               f"--seed-file={d / 'munge' / 'munged.seed'}",
                               f"--log-file={d / 'log' / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket", d / "log/munged.log")

        self.ctld_port = 6817  # the controller host's own network: free
        self.conf.write_text(self._conf_text())
        self._spawn("slurmctld", ["ip", "netns", "exec", self.controller.netns,
                                  _which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait(self._ctld_up, "slurmctld", d / "log/slurmctld.log")
        prolog = d / "task_prolog.sh"
        prolog.write_text(_TASK_PROLOG.format(tmp=self.short))
        prolog.chmod(0o755)
        for host in self.nodes:
            (self.short / f"spool-{host.name}").mkdir(exist_ok=True)
            (self.short / host.name).mkdir(mode=0o700)
            self._spawn(f"slurmd {host.name}", [
                "ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
                _SLURMD_WRAPPER, "slurmd", host.name,
                _which("slurmd"), "-D", "-f", str(self.conf), "-N", host.name])
        self._wait(self._all_idle, f"{len(self.nodes)} idle node(s) in sinfo",
                   d / f"log/slurmd-{self.nodes[0].name}.log")

    def _conf_text(self) -> str:
        d = self.dir
        lines = [
            "ClusterName=tprun",
            # "localhost" lets slurmctld recognise itself; the address is where the
            # slurmds and commands inside the hosts reach it.
            f"SlurmctldHost=localhost({self.controller.addr})",
            f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={self.short}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "MpiDefault=none", "ReturnToService=2",
            "SlurmdTimeout=5", "KillWait=2", "MessageTimeout=5", "InactiveLimit=0",
            "JobAcctGatherType=jobacct_gather/none", "SwitchType=switch/none",
            # Nodes as big as the example asks for (--cpus-per-task=8), on 2 real cores.
            "SlurmdParameters=config_overrides",
            f"TaskProlog={d / 'task_prolog.sh'}",
        ]
        for i, host in enumerate(self.nodes):
            lines.append(f"NodeName={host.name} NodeAddr={host.addr} Port={6818 + i} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        names = ",".join(h.name for h in self.nodes)
        lines.append(f"PartitionName={self.partition} Nodes={names} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=YES")
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name.replace(' ', '-')}.out", "ab")
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                    env=self.env, start_new_session=True)
        finally:
            log.close()
        self._procs.append((name, proc))

    def _wait(self, ready: Any, what: str, log: Path, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [(n, p.returncode) for n, p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                why = f"exited: {dead}" if dead else f"not ready in {timeout:.0f} s"
                raise RuntimeError(f"Slurm cluster: {what} {why}; {log.name}:\n{tail}")
            time.sleep(0.2)

    def _ctld_up(self) -> bool:
        return self.cmd(["sinfo", "-h"], check=False).returncode == 0

    def _all_idle(self) -> bool:
        out = self.cmd(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(h.name) == "idle" for h in self.nodes)

    # ------------------------------------------------------------------ use

    def cmd(self, argv: Sequence[str], check: bool = True, timeout: float = 30,
            env: dict[str, str] | None = None, **kw: Any) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster (SLURM_CONF set)."""
        proc = subprocess.run(["ip", "netns", "exec", self.controller.netns, *argv], env={**self.env, **(env or {}),
                                               "SLURM_CONF": str(self.conf)},
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: "
                               f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = self.cmd(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job has ended (any final state); return its record."""
        deadline = time.monotonic() + timeout
        while True:
            rec = self.job(job_id)
            if rec.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING",
                                           "COMPLETING", "SUSPENDED"):
                return rec
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {rec.get('JobState')} after "
                                   f"{timeout:.0f} s")
            time.sleep(0.2)

    def node_states(self) -> dict[str, str]:
        out = self.cmd(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
        return dict(zip(out[::2], out[1::2]))

    # ------------------------------------------------------------------ stop

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel every job, stop every daemon, remove the state. Never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            if any(n == "slurmctld" and p.poll() is None for n, p in self._procs):
                self.cmd(["scancel", "--full", "-u", "root"], check=False, timeout=10)
        except Exception as e:  # noqa: BLE001 -- cleanup goes on
            print(f"tests/slurm_cluster.py: scancel: {e}")
        # slurmds first, then the controller, then munge, which both still talk to.
        order = ([np for np in self._procs if np[0].startswith("slurmd")]
                 + [np for np in self._procs if np[0] == "slurmctld"]
                 + [np for np in self._procs if np[0] == "munged"])
        for name, proc in order:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        print(f"tests/slurm_cluster.py: {name} (pid {proc.pid}) survives "
                              "SIGKILL")
        shutil.rmtree(self.dir / "state", ignore_errors=True)
        if self.short is not None:
            shutil.rmtree(self.short, ignore_errors=True)
        if self in _open:
            _open.remove(self)


@atexit.register
def _close_all() -> None:
    for slurm in list(_open):
        slurm.close()
