"""Settings checked before anything starts: the endpoint and duration grammars,
--rdzv-conf, the etcd TLS and login rule, and where a promoted spare's output goes. Pure
functions; the command-line behaviour (one ``tp-run: error:`` line, exit 2) is tested in
test_failures.py and test_rendezvous_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

import tp_launch.config
from rendezvous.conf import timeouts_from_conf, validate, with_resilient_lease
from rendezvous.etcd import PASSWORD_ENV, USER_ENV, EtcdSettings, etcd_settings
from rendezvous.grammar import ConfigError, parse_duration, split_endpoint
from rendezvous.kv import KVError
from tp_launch.config import LaunchConfig, Std, check_seconds, parse_rdzv_conf
from tp_launch.procs.logs import LogLayout

pytestmark = pytest.mark.unit


def test_tp_launch_raises_the_grammar_error():
    assert tp_launch.config.ConfigError is ConfigError


@pytest.mark.parametrize("endpoint,host,port", [
    ("etcd1:2379", "etcd1", 2379),
    ("etcd1", "etcd1", 99),
    (" 10.0.0.1:0 ", "10.0.0.1", 0),
    ("[::1]:29400", "::1", 29400),
    ("[fe80::1%eth0]", "fe80::1%eth0", 99),
    ("::1", "::1", 99),  # bare IPv6: no port can be told apart, the default applies
])
def test_endpoints(endpoint, host, port):
    assert split_endpoint(endpoint, 99) == (host, port)


@pytest.mark.parametrize("endpoint,says", [
    ("", "has no host"), (":2379", "has no host"), ("[]:1", "has no host"),
    ("h:port", "'port' is not an integer"), ("h:65536", "65536 is out of range"),
    ("h:-1", "-1 is out of range"), ("[::1]:x", "'x' is not an integer"),
])
def test_bad_endpoints(endpoint, says):
    with pytest.raises(ConfigError, match=says):
        split_endpoint(endpoint, 99)


@pytest.mark.parametrize("value,seconds", [("5", 5.0), ("0.25", 0.25), (" 1e1 ", 10.0),
                                           ("-3", -3.0)])
def test_durations(value, seconds):
    assert parse_duration(value, "k") == seconds  # the sign is the caller's rule


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "", "5s"])
def test_durations_are_finite_numbers(value):
    with pytest.raises(ConfigError, match=r"--rdzv-conf k=.* is not a finite number"):
        parse_duration(value, "k")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999", "soon"])
def test_durations_must_be_finite(value):
    with pytest.raises(ConfigError, match="join_timeout"):
        timeouts_from_conf({"join_timeout": value})


@pytest.mark.parametrize("value", ["0", "-1"])
def test_rdzv_conf_durations_must_be_positive(value):
    with pytest.raises(ConfigError, match="must be positive"):
        timeouts_from_conf({"timeout": value})


def test_rdzv_conf_timeouts():
    t = timeouts_from_conf({"timeout": "7", "heartbeat_timeout": "4", "read_timeout": "2",
                            "keep_alive_interval": "1", "keep_alive_max_attempt": "5",
                            "some_plugin_key": "x"})
    assert (t.join_timeout, t.heartbeat_timeout, t.read_timeout) == (7.0, 4.0, 2.0)
    assert t.lease_ttl == 4.0  # default: heartbeat_timeout
    assert t.keep_alive_max_attempt == 5
    assert timeouts_from_conf({"ttl": "9", "heartbeat_timeout": "4",
                               "keep_alive_interval": "1"}).lease_ttl == 9.0


@pytest.mark.parametrize("conf,ttl,interval", [
    ({}, 3.0, 0.5),  # resilient mode's default: a lost node noticed in seconds
    ({"etcd_prefix": "/x"}, 3.0, 0.5),
    ({"lease_ttl": "20"}, 20.0, 5.0),  # anything said about the lease is the user's
    ({"ttl": "20"}, 20.0, 5.0),
    ({"heartbeat_timeout": "30"}, 30.0, 5.0),
    ({"keep_alive_interval": "2"}, 30.0, 2.0),
])
def test_resilient_lease_defaults(conf, ttl, interval):
    t = timeouts_from_conf(with_resilient_lease(conf))
    assert (t.lease_ttl, t.keep_alive_interval) == (ttl, interval)


def _cli_config(*args: str, nnodes: str = "2", backend: str = "etcd") -> LaunchConfig:
    import os

    from tp_launch.cli import config_from_options, tp_run

    ctx = tp_run.make_context("tp-run", [*args, "--rdzv-backend", backend, "--rdzv-endpoint",
                                         "198.18.0.1:2379", "--nnodes", nnodes,
                                         str(Path(__file__).parent.parent / "examples/train_ddp.py")])
    old = dict(os.environ)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "PET_"))]:
        del os.environ[key]
    try:
        with ctx:
            return config_from_options(ctx.params)
    finally:
        os.environ.clear()
        os.environ.update(old)


def _cli_rdzv_conf(*args: str) -> dict[str, str]:
    return _cli_config(*args).rdzv_configs


@pytest.mark.parametrize("backend,store", [("etcd", ("localhost", 0)),
                                           ("c10d", ("198.18.0.1", 2379))])
def test_a_single_node_hosts_its_store_where_its_workers_reach_it(backend, store):
    """--nnodes 1 with a backend: the embedded default. etcd's endpoint is etcd's, not
    where this machine can host the store (it would fail to bind there); c10d's endpoint
    is the store's own, as under torchrun."""
    from rendezvous import create_handler

    handler = create_handler(_cli_config("--spares", "1", nnodes="1", backend=backend))
    assert (handler._master_addr, handler._master_port) == store


def test_the_cli_gives_resilient_mode_the_short_lease():
    assert _cli_rdzv_conf("--spares", "1")["lease_ttl"] == "3"
    assert "lease_ttl" not in _cli_rdzv_conf()  # torchrun's mode: torchrun's 30 s
    assert _cli_rdzv_conf("--spares", "1", "--rdzv-conf", "lease_ttl=30") == {"lease_ttl": "30"}


@pytest.mark.parametrize("conf,says", [
    ({"keep_alive_max_attempt": "two"}, "is not an integer"),
    ({"keep_alive_max_attempt": "0"}, "must be at least 1"),
    ({"keep_alive_interval": "3", "lease_ttl": "3"}, "must be shorter than the lease TTL"),
    ({"keep_alive_interval": "5", "heartbeat_timeout": "4"}, "must be shorter"),
])
def test_bad_rdzv_conf_timeouts(conf, says):
    with pytest.raises(ConfigError, match=says):
        timeouts_from_conf(conf)


def test_rdzv_conf_grammar():
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf(" a = 1 ,b=x:y,c=") == {"a": "1", "b": "x:y", "c": ""}
    for bad in ("a", "a=1,,b=2", "=1"):
        with pytest.raises(ConfigError, match="is not key=value"):
            parse_rdzv_conf(bad)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_duration_options_must_be_finite(value):
    with pytest.raises(ConfigError, match="--monitor-interval"):
        check_seconds(value, "--monitor-interval")
    assert check_seconds(0.0, "x") == 0.0


@pytest.mark.parametrize("key,meant", [("ca-cert", "ca_cert"), ("CACERT", "cacert"),
                                       ("ssl-cert-key", "ssl_cert_key"),
                                       ("join_timout", "join_timeout"),
                                       ("pasword", "password")])
def test_misspelled_keys_are_errors(key, meant):
    with pytest.raises(ConfigError, match=f"did you mean '{meant}'"):
        validate("etcd", "127.0.0.1:2379", {key: "x"})


def test_unrelated_unknown_keys_are_ignored_as_torchrun_does():
    validate("etcd", "127.0.0.1:2379", {"some_plugin_setting": "1"})
    validate("c10d", "127.0.0.1:29400", {"store_type": "tcp", "use_libuv": "1"})


@pytest.mark.parametrize("backend,endpoint,conf,says", [
    ("etcd", "", {}, "needs --rdzv-endpoint"),
    ("c10d", "", {}, "needs --rdzv-endpoint"),
    ("c10d", "h:99999", {}, "out of range"),
    ("etcd", "https://[::1]:x/", {}, "'x' is not an integer"),
    ("c10d", "h:1", {"is_host": "maybe"}, "is_host='maybe' is not a boolean"),
    ("etcd", "h:1", {"protocol": "grpc"}, "must be http or https"),
    ("etcd", "h:1", {"protocol": "https"}, "needs cacert="),
    ("etcd", "h:1", {"password": "x"}, "TP_RUN_ETCD_PASSWORD instead"),
    ("etcd", "h:1", {"cert": "/no/such.pem"}, "needs both cert= and key="),
    ("etcd", "h:1", {"cacert": "/no/such.pem"}, "TLS file not found: /no/such.pem"),
])
def test_bad_backend_settings(monkeypatch, backend, endpoint, conf, says):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    with pytest.raises(ConfigError, match=says):
        validate(backend, endpoint, conf)


def test_etcd_settings_from_the_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv(PASSWORD_ENV, "pw")
    monkeypatch.setenv(USER_ENV, "alice")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert etcd_settings("https://etcd1/", {"cacert": str(ca)}) == \
        EtcdSettings("etcd1", 2379, str(ca), user="alice", password="pw")
    with pytest.raises(KVError, match="needs cacert="):  # the scheme is the protocol
        etcd_settings("https://etcd1", {})
    s = etcd_settings("[::1]:1", {"ssl_cert": str(ca), "ssl_cert_key": str(ca),
                                  "user": "bob"})  # a client certificate: TLS
    assert (s.host, s.port, s.ca_cert, s.cert, s.key, s.user) == \
        ("::1", 1, None, str(ca), str(ca), "bob")
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(KVError, match="needs a user and a password"):
        etcd_settings("etcd1", {})  # TP_RUN_ETCD_USER alone


def test_a_login_needs_both_halves(tmp_path):
    """The rule every connection follows (EtcdKV checks its arguments with it too)."""
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    for user, password in (("root", None), (None, "pw")):
        with pytest.raises(KVError, match="needs a user and a password"):
            EtcdSettings("h", 1, str(ca), user=user, password=password)
    with pytest.raises(KVError, match="both cert= and key="):
        EtcdSettings("h", 1, key=str(ca))
    assert EtcdSettings("h", 1, str(ca), str(ca), str(ca), "root", "pw").password == "pw"


def test_password_never_in_clear_text(monkeypatch, tmp_path):
    monkeypatch.setenv(PASSWORD_ENV, "s3cret")
    with pytest.raises(KVError, match="clear text"):
        etcd_settings("127.0.0.1:2379", {"user": "root"})
    with pytest.raises(KVError, match="clear text"):
        etcd_settings("http://127.0.0.1:2379", {"user": "root", "protocol": "https"})
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    s = etcd_settings("127.0.0.1:2379", {"user": "root", "protocol": "https",
                                         "cacert": str(ca)})
    assert (s.password, s.ca_cert) == ("s3cret", str(ca))
    s = etcd_settings("127.0.0.1:2379", {"user": "root", "ca_cert": str(ca)})  # TLS meant
    assert s.ca_cert == str(ca)
    monkeypatch.delenv(PASSWORD_ENV)
    assert etcd_settings("127.0.0.1:2379", {}).password is None  # no login: http is fine


def test_a_promoted_spare_shows_as_its_rank():
    cfg = LaunchConfig(nproc_per_node=3, log_dir="/dev/null", role="trainer",
                       redirects={0: Std.NONE, 1: Std.ALL, 2: Std.ERR},
                       tee={0: Std.OUT, 1: Std.NONE, 2: Std.NONE})
    layout = LogLayout(cfg, "job")
    assert layout.console_streams(0, 0) == {"stdout": "[trainer0]:", "stderr": ""}
    assert layout.console_streams(1, 1) == {"stdout": None, "stderr": None}
    assert layout.console_streams(2, 5) == {"stdout": "", "stderr": None}
    cfg.local_ranks_filter = {1}
    assert layout.console_streams(0, 0) == {"stdout": None, "stderr": None}


@pytest.mark.parametrize("run_id", ["../escaped", "a/b", "../../x/.."])
def test_the_run_directory_stays_in_the_log_dir(tmp_path, run_id):
    """--rdzv-id names a directory in --log-dir, whatever slashes it holds."""
    logs = tmp_path / "logs"
    layout = LogLayout(LaunchConfig(nproc_per_node=1, log_dir=str(logs)), run_id)
    try:
        run_dir = Path(layout.run_dir).resolve()
        assert run_dir.parent == logs.resolve(), run_dir
        assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    finally:
        layout.close()


@pytest.mark.parametrize("virtual", [False, True])
def test_per_worker_variables_are_what_worker_env_sets(monkeypatch, virtual):
    """The template forks a process only if its environment differs from the template's
    in PER_WORKER_VARS: every variable worker_env sets per worker must be there."""
    from rendezvous.api import RendezvousInfo
    from tp_launch.agent.worker_env import PER_WORKER_VARS, worker_env

    monkeypatch.setattr("os.environ", {"PATH": "/bin"})
    cfg = LaunchConfig(nproc_per_node=2, log_dir="/dev/null", virtual_local_rank=virtual,
                       hang_timeout=5)
    info = RendezvousInfo(round=0, node_rank=0, nnodes=1, rank_offset=0, world_size=2,
                          master_addr="127.0.0.1", master_port=29500, use_agent_store=True)
    env = worker_env(cfg, info, 1, 0, "/tmp/error.json")
    assert set(env) - {"PATH"} <= PER_WORKER_VARS, set(env) - {"PATH"} - PER_WORKER_VARS
