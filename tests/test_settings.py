"""Settings checked before anything starts: --rdzv-conf, durations, the etcd login, and
where a promoted spare's output goes. Pure functions; the command-line behaviour (one
``tp-run: error:`` line, exit 2) is tested in test_failures.py and test_rendezvous_e2e.py."""

from __future__ import annotations

import pytest

from rendezvous.conf import timeouts_from_conf, validate
from rendezvous.etcd import PASSWORD_ENV, etcd_settings
from rendezvous.kv import KVError
from tp_launch.config import ConfigError, LaunchConfig, Std, check_seconds
from tp_launch.procs.logs import LogLayout


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999", "soon"])
def test_durations_must_be_finite(value):
    with pytest.raises(ConfigError, match="join_timeout"):
        timeouts_from_conf({"join_timeout": value})


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
