"""Agent events for --event-log-handler (tp_launch.agent.events), without processes."""

from __future__ import annotations

import json

import pytest

from tp_launch.agent.events import EventLog
from tp_launch.config import ConfigError

pytestmark = pytest.mark.unit


def test_console_events_are_torchruns_json(capsys):
    EventLog("console").record("torchelastic.worker.status.SUCCEEDED", run_id="j", group_rank=0)
    event = json.loads(capsys.readouterr().err)
    assert event["name"] == "torchelastic.worker.status.SUCCEEDED"
    assert event["source"] == "AGENT" and isinstance(event["timestamp"], int)
    assert event["metadata"] == {"run_id": "j", "group_rank": 0}


@pytest.mark.parametrize("destination", ["null", "dynamic_rendezvous"])
def test_the_other_handlers_discard(destination, capsys):
    EventLog(destination).record("anything")
    assert capsys.readouterr().err == ""


def test_an_unknown_handler_is_a_usage_error():
    with pytest.raises(ConfigError, match="--event-log-handler='file' is not one of"):
        EventLog("file")
