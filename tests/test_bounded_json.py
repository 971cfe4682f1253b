"""Documents read from etcd or a store are bounded before use (issue 25): a forged
``P/state``, ``P/status/<node>`` or lease record is one error, never an agent's crash."""

from __future__ import annotations

import json

import pytest

from rendezvous.bounded_json import MAX_BYTES, MAX_DEPTH, BoundsError, loads
from rendezvous.state import RoundState, StateError
from tp_launch.agent.control import Generation

pytestmark = pytest.mark.unit


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("text, words", [
    (_nested(100_000), "nested deeper"),  # past json's own recursion limit
    (_nested(MAX_DEPTH + 1), "nested deeper"),  # parses, but deeper than any of ours
    ('{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1), "nested deeper"),
    ("x" * (MAX_BYTES + 1), "more than"),
    ("{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
])
def test_forged_documents_are_bounds_errors(text, words):
    with pytest.raises(BoundsError, match=words):
        loads(text)


def test_documents_within_the_bounds_parse():
    assert loads(_nested(MAX_DEPTH)) == json.loads(_nested(MAX_DEPTH))
    assert loads('{"node": {"ranks": {"0": 1}, "parked_spares": [1, 2]}}')["node"]["ranks"]


def test_a_bounds_error_is_a_value_error():  # every reader's "malformed" path takes it
    assert issubclass(BoundsError, ValueError)


@pytest.mark.parametrize("text", [_nested(50_000), '{"v": ' + _nested(40) + "}", "7" * 10])
def test_a_forged_rendezvous_state_is_a_state_error(text):
    with pytest.raises(StateError, match="malformed rendezvous state"):
        RoundState.loads(text)


@pytest.mark.parametrize("placement", [
    {}, {"ranks": {"0": "a"}}, {"ranks": {"x": "a"}, "store": "h:1"},
    {"ranks": {"0": ["a"]}, "store": "h:1"}, {"ranks": {"0": "a"}, "store": "h:port"},
    {"ranks": {"0": "a"}, "store": "h:1", "replaced": [[0]]},
    {"ranks": {"0": "a"}, "store": "h:1", "boundary": "12"},
    {"ranks": [], "store": "h:1"}, {"ranks": {"0": "a"}, "store": 5},
])
def test_a_forged_placement_is_a_state_error(placement):
    with pytest.raises(StateError, match="malformed placement of generation 3"):
        Generation.from_json(3, placement)


def test_a_placement_round_trips():
    g = Generation(4, {0: "a", 1: "b"}, ("10.0.0.1", 29500), [1], "failure", 12)
    assert Generation.from_json(4, g.to_json()) == g
