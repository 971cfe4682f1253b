"""The settings record a resilient agent hands its processes: environment round trip,
defaults, and one clear error per malformed variable. No processes."""

import ast
import dataclasses
from pathlib import Path

import pytest

from tp_launch import worker_settings as ws
from tp_launch.worker_settings import SettingsError, WorkerSettings, from_env

pytestmark = pytest.mark.unit

FULL = WorkerSettings(channel="/run/tp/123.sock", slot=3, progress="/run/tp/123.board",
                      verify_every=10, shard_copy_every=5, heartbeat=False, spare=True)


@pytest.mark.parametrize("settings", [
    FULL,
    WorkerSettings(channel="/s", slot=0),
    WorkerSettings(channel="/s", slot=7, progress=None, heartbeat=True, spare=False),
])
def test_round_trip(settings):
    env = settings.to_env()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert from_env(env) == settings


def test_names_are_the_interface():
    """Scripts, tests and docs use these names: they must not change."""
    assert FULL.to_env() == {
        "TP_RUN_CHANNEL": "/run/tp/123.sock",
        "TP_RUN_SETTINGS_VERSION": str(ws.VERSION),
        "TP_RUN_SLOT": "3",
        "TP_RUN_PROGRESS": "/run/tp/123.board",
        "TP_RUN_VERIFY_EVERY": "10",
        "TP_RUN_SHARD_COPY_EVERY": "5",
        "TP_RUN_HEARTBEAT": "0",
        "TP_RUN_SPARE": "1",
        "TP_RUN_RECOVERY_WAIT_S": "60.0",
        "TP_RUN_DONORS": "0",
    }
    # A rank's: every variable written, so nothing the agent inherited leaks through.
    rank = WorkerSettings(channel="/s", slot=0).to_env()
    assert rank["TP_RUN_SPARE"] == "0" and rank["TP_RUN_HEARTBEAT"] == "1"
    assert "TP_RUN_PROGRESS" not in rank


@pytest.mark.parametrize("env", [{}, {"TP_RUN_CHANNEL": ""},
                                 # not a resilient agent's process: nothing else is read
                                 {"TP_RUN_SLOT": "x", "TP_RUN_SPARE": "maybe",
                                  "TP_RUN_SETTINGS_VERSION": "99"}])
def test_no_channel_is_none(env):
    assert from_env(env) is None


def test_defaults_when_only_the_channel_and_slot_are_set():
    """An agent from before the version variable wrote only what differed from these."""
    got = from_env({"TP_RUN_CHANNEL": "/s", "TP_RUN_SLOT": "2", "TP_RUN_PROGRESS": "",
                    "TP_RUN_VERIFY_EVERY": ""})
    assert got == WorkerSettings(channel="/s", slot=2, progress=None, verify_every=0,
                                 shard_copy_every=0, heartbeat=True, spare=False,
                                 version=ws.VERSION)


def test_reads_os_environ_by_default(monkeypatch):
    for k in FULL.to_env():
        monkeypatch.delenv(k, raising=False)
    assert from_env() is None
    for k, v in FULL.to_env().items():
        monkeypatch.setenv(k, v)
    assert from_env() == FULL


BASE = {"TP_RUN_CHANNEL": "/s", "TP_RUN_SLOT": "1"}


@pytest.mark.parametrize("name, value", [
    ("TP_RUN_SLOT", "x"),
    ("TP_RUN_SLOT", "-1"),
    ("TP_RUN_SLOT", "1.5"),
    ("TP_RUN_SLOT", " 1"),
    ("TP_RUN_SLOT", "²"),  # str.isdigit() says yes, int() says no
    ("TP_RUN_VERIFY_EVERY", "often"),
    ("TP_RUN_VERIFY_EVERY", "-3"),
    ("TP_RUN_SHARD_COPY_EVERY", "1e3"),
    ("TP_RUN_HEARTBEAT", "yes"),
    ("TP_RUN_HEARTBEAT", "2"),
    ("TP_RUN_SPARE", "true"),
    ("TP_RUN_SPARE", "1\nRANK=0"),
    ("TP_RUN_SETTINGS_VERSION", "one"),
    ("TP_RUN_RECOVERY_WAIT_S", "soon"),
    ("TP_RUN_RECOVERY_WAIT_S", "0"),
    ("TP_RUN_RECOVERY_WAIT_S", "-5"),
    ("TP_RUN_RECOVERY_WAIT_S", "inf"),
    ("TP_RUN_RECOVERY_WAIT_S", "nan"),
])
def test_malformed_value_is_one_line_naming_the_variable(name, value):
    with pytest.raises(SettingsError) as e:
        from_env({**BASE, name: value})
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert msg.startswith(f"{name}=") and "\n" not in msg, msg


def test_missing_slot():
    for env in ({"TP_RUN_CHANNEL": "/s"}, {"TP_RUN_CHANNEL": "/s", "TP_RUN_SLOT": ""}):
        with pytest.raises(SettingsError, match=r"^TP_RUN_SLOT is not set, but TP_RUN_CHANNEL is"):
            from_env(env)


def test_version_mismatch():
    newer = dataclasses.replace(FULL, version=ws.VERSION + 1).to_env()
    with pytest.raises(SettingsError) as e:
        from_env(newer)
    msg = str(e.value)
    assert msg.startswith(f"TP_RUN_SETTINGS_VERSION={ws.VERSION + 1}:") and "\n" not in msg
    assert f"version {ws.VERSION} only" in msg
    with pytest.raises(SettingsError, match="^TP_RUN_SETTINGS_VERSION=0:"):
        from_env({**BASE, "TP_RUN_SETTINGS_VERSION": "0"})


def test_the_recovery_wait_is_one_setting_for_agent_and_worker():
    """The agent reads it from its own environment and hands the same value on."""
    assert ws.recovery_wait_from({}) == ws.RECOVERY_WAIT_S == 60.0
    assert ws.recovery_wait_from({"TP_RUN_RECOVERY_WAIT_S": "7.5"}) == 7.5
    got = from_env({**BASE, "TP_RUN_RECOVERY_WAIT_S": "7.5"})
    assert got is not None and got.recovery_wait_s == 7.5
    assert from_env(WorkerSettings("/s", 0, recovery_wait_s=7.5).to_env()) == \
        WorkerSettings("/s", 0, recovery_wait_s=7.5)


def test_absent_version_is_version_1():
    assert ws.VERSION == 1  # bump: decide what an absent version means then
    assert from_env(BASE) == WorkerSettings(channel="/s", slot=1)


@pytest.mark.parametrize("kwargs, name", [
    ({"channel": "", "slot": 0}, "TP_RUN_CHANNEL"),
    ({"channel": "/s", "slot": -1}, "TP_RUN_SLOT"),
    ({"channel": "/s", "slot": True}, "TP_RUN_SLOT"),
    ({"channel": "/s", "slot": 0, "verify_every": -1}, "TP_RUN_VERIFY_EVERY"),
    ({"channel": "/s", "slot": 0, "shard_copy_every": 2.0}, "TP_RUN_SHARD_COPY_EVERY"),
    ({"channel": "/s", "slot": 0, "recovery_wait_s": 0.0}, "TP_RUN_RECOVERY_WAIT_S"),
])
def test_the_agent_cannot_build_a_bad_record(kwargs, name):
    with pytest.raises(SettingsError, match=f"^{name}"):
        WorkerSettings(**kwargs)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.slot = 4  # type: ignore[misc]


def test_imports_neither_side():
    """Both the agent and the worker import it: it imports neither (nor torch)."""
    path = Path(ws.__file__)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level
            names.add(node.module or "")
    assert not {n for n in names if n.startswith(("tp_launch", "rendezvous", "torch"))}, names
