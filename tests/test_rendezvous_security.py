"""etcd with TLS (certificates generated here) and with user/password authentication.

Real etcd servers, started per module with their own data directory and ports: one
with TLS and client-certificate authentication, one with TLS and authentication enabled
(user root, role root, via etcdctl). The password reaches tp-run only through
``TP_RUN_ETCD_PASSWORD``, travels only over TLS, and never reaches the workers.
"""

from __future__ import annotations

import threading
import uuid
from typing import Iterator

import pytest

from rendezvous.etcd import PASSWORD_ENV, EtcdKV
from rendezvous.kv import KVError
from rendezvous.membership import Membership, Timeouts
from tests.etcd_server import EtcdServer, make_tls
from tests.test_rendezvous_e2e import Agents, one_error_line

PASSWORD = "s3cret-Pa55"


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory) -> Iterator[tuple[EtcdServer, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("etcd-tls")
    certs = make_tls(tmp / "certs")
    with EtcdServer(tmp, tls=(certs["ca"], certs["server_cert"], certs["server_key"]),
                    client_cert_auth=True) as server:
        yield server, certs


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory) -> Iterator[tuple[EtcdServer, dict[str, str]]]:
    """Password authentication, over TLS (tp-run refuses to send a password in clear
    text; this etcd, given a CA, also asks for client certificates)."""
    tmp = tmp_path_factory.mktemp("etcd-auth")
    certs = make_tls(tmp / "certs")
    with EtcdServer(tmp, tls=(certs["ca"], certs["server_cert"], certs["server_key"]),
                    client_cert_auth=True, root_password=PASSWORD) as server:
        yield server, certs


def _auth_conf(certs: dict[str, str]) -> str:
    return (f"protocol=https,cacert={certs['ca']},cert={certs['client_cert']},"
            f"key={certs['client_key']},keep_alive_interval=0.5,lease_ttl=3")


def _form_world(make_kv) -> None:
    rid = f"job-{uuid.uuid4().hex[:8]}"
    t = Timeouts(join_timeout=30, last_call_timeout=0.5, keep_alive_interval=0.3, lease_ttl=2)
    ms = [Membership(make_kv(), "/tp-test", rid, 2, 2, f"127.0.0.{i + 2}", t, 0.3)
          for i in range(2)]
    worlds: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: worlds.setdefault(i, ms[i].join(1)))
               for i in range(2)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert sorted(w.node_rank for w in worlds.values()) == [0, 1]  # type: ignore[attr-defined]
    finally:
        for m in ms:
            m.close()


def test_tls_with_client_certificates_forms_a_world(tls_etcd):
    server, certs = tls_etcd
    _form_world(lambda: EtcdKV("127.0.0.1", server.port, ca_cert=certs["ca"],
                               cert=certs["client_cert"], key=certs["client_key"],
                               connect_timeout=10))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["wrong-ca", "no-client-cert"])
def test_refused_tls_handshake_is_a_clear_error(tls_etcd, case):
    server, certs = tls_etcd
    kw = ({"ca_cert": certs["other_ca"], "cert": certs["client_cert"],
           "key": certs["client_key"]} if case == "wrong-ca" else {"ca_cert": certs["ca"]})
    with pytest.raises(KVError, match=r"cannot reach etcd .* within 2s \(TLS, .*handshake"):
        EtcdKV("127.0.0.1", server.port, connect_timeout=2, **kw)


def _tls_conf(certs: dict[str, str], ca: str | None = None) -> str:
    return (f"protocol=https,cacert={ca or certs['ca']},cert={certs['client_cert']},"
            f"key={certs['client_key']},join_timeout=30,last_call_timeout=1,"
            "keep_alive_interval=0.5,lease_ttl=3")


@pytest.mark.slow
def test_two_agents_over_tls(workdir, test_env, tls_etcd):
    server, certs = tls_etcd
    job = Agents(workdir, test_env, "etcd", server.endpoint, "2")
    for node in range(2):
        job.start(node, conf=_tls_conf(certs))
    results = job.finish()
    assert [rc for rc, _ in results] == [0, 0], results
    assert sorted(job.oks()) == ["ok_0_0", "ok_0_1"]


@pytest.mark.slow
def test_tp_run_with_the_wrong_ca_is_one_line_error(workdir, test_env, tls_etcd):
    server, certs = tls_etcd
    job = Agents(workdir, test_env, "etcd", server.endpoint, "2")
    job.start(0, conf=_tls_conf(certs, ca=certs["other_ca"]).replace("join_timeout=30",
                                                                       "join_timeout=3"))
    (rc, err), = job.finish(timeout=120)
    assert rc == 1
    line = one_error_line(err)
    assert "cannot reach etcd" in line and "CERTIFICATE_VERIFY_FAILED" in line


def test_password_login_forms_a_world(auth_etcd):
    server, certs = auth_etcd
    _form_world(lambda: EtcdKV("127.0.0.1", server.port, user="root", password=PASSWORD,
                               ca_cert=certs["ca"], cert=certs["client_cert"],
                               key=certs["client_key"], connect_timeout=10))


def test_wrong_password_is_one_line_error(workdir, test_env, auth_etcd):
    """tp-run reads the password from TP_RUN_ETCD_PASSWORD; a wrong one reaches etcd
    (over TLS) and is refused, in one line."""
    server, certs = auth_etcd
    env = {**test_env, PASSWORD_ENV: "wrong"}
    job = Agents(workdir, env, "etcd", server.endpoint, "2")
    job.start(0, conf="user=root," + _auth_conf(certs) + ",join_timeout=5")
    (rc, err), = job.finish(timeout=120)
    assert rc == 1
    assert "authentication failed" in one_error_line(err)


@pytest.mark.slow
def test_missing_login_is_one_line_error(workdir, test_env, tmp_path):
    """An etcd with authentication on, reached over plain http without a login (no
    password sent, so plain http is allowed): the first write says a login is needed."""
    env = dict(test_env)
    env.pop(PASSWORD_ENV, None)
    with EtcdServer(tmp_path, root_password=PASSWORD) as server:
        job = Agents(workdir, env, "etcd", server.endpoint, "2")
        job.start(0, conf="join_timeout=5,keep_alive_interval=0.5,lease_ttl=3")
        (rc, err), = job.finish(timeout=120)
    assert rc == 1
    assert "requires a login" in one_error_line(err)


@pytest.mark.slow
def test_password_never_reaches_the_workers(workdir, test_env, auth_etcd):
    """A job that logs in with TP_RUN_ETCD_PASSWORD: its workers' environment has
    everything else of the agent's (TP_RUN_ETCD_USER, say), not the password."""
    server, certs = auth_etcd
    env = {**test_env, PASSWORD_ENV: PASSWORD, "TP_RUN_ETCD_USER": "root"}
    job = Agents(workdir, env, "etcd", server.endpoint, "1:2")
    job.start(0, conf=_auth_conf(certs) + ",join_timeout=30,last_call_timeout=1")
    (rc, err), = job.finish()
    assert rc == 0, err
    (dumped,) = job.oks().values()
    assert dumped["TP_RUN_ETCD_USER"] == "root"
    assert PASSWORD_ENV not in dumped
    assert PASSWORD not in dumped.values()
