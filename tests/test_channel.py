"""The worker <-> agent channel's framing and the progress board, without processes."""

import json

import pytest

from tp_launch import channel
from tp_launch.channel import ChannelError

pytestmark = pytest.mark.unit

EXAMPLES: list[channel.Message] = [
    channel.Status(),
    channel.StatusReply(
        run_id="job", node="host", agent_pid=42, gen=1, world_size=2, state="training",
        ranks=(channel.RankStatus(rank=0, pid=7, slot=0, step=3, step_s=0.01, gen=1,
                                  stage="training", commit_age_s=0.2, beat_age_s=None),),
        ranks_total=2, parked=(channel.SpareStatus(slot=2, pid=9),), parked_total=1,
        recoveries=(channel.RecoveryStatus(gen=1, reason="failure", failed_ranks=(1,),
                                           promoted_pids=(8,), step=2),),
        log_dir="/tmp/x"),
    channel.Hello(slot=0, pid=1234),
    channel.Resumed(gen=2, rank=1, step=40, handoff_s=0.0, group_s=0.25, agree_s=0.01,
                    transfer_s=0.5, bytes=1 << 20, donor=0, t=1.7e9, verify_s=0.02,
                    inexact="python generator"),
    channel.Resumed(gen=2, rank=0, step=40, handoff_s=0, group_s=0, agree_s=0,
                    transfer_s=0, bytes=0, donor=None, t=1.7e9),
    channel.Stepped(gen=2, rank=1, step=41, t=1.7e9),
    channel.Finished(gen=3, rank=0, step=100),
    channel.Fatal(kind="state_lost", message="no rank holds the state", rank=None, gen=4),
    channel.Fatal(kind="diverged", message="ranks differ", rank=2, gen=4),
    channel.Migrate(rank=3),
    channel.NewGeneration(gen=1, rank=0, world_size=2, master_addr="127.0.0.1",
                          master_port=29500, reason="start"),
    channel.NewGeneration(gen=5, rank=None, world_size=2, master_addr="node1",
                          master_port=29500, reason="migrate", boundary=17,
                          handoff=channel.Handoff("donor", "tp-run/h5")),
    channel.NewGeneration(gen=5, rank=1, world_size=2, master_addr="node1",
                          master_port=29500, reason="failure", from_slot=3),
    channel.Exit(),
    channel.Recovering(),
    channel.Reply("ok: rank 3 moves to slot 4"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.op)
def test_every_message_round_trips(msg):
    line = channel.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert len(line) < channel.MAX_LINE
    accept = channel.TO_AGENT if type(msg) in channel.TO_AGENT else channel.TO_WORKER
    assert channel.decode(line, accept) == msg
    assert channel.decode(line.decode(), accept) == msg


def test_every_kind_has_an_example_and_a_distinct_op():
    kinds = channel.TO_AGENT + channel.TO_WORKER
    assert {type(m) for m in EXAMPLES} == set(kinds)
    assert len({k.op for k in kinds}) == len(kinds)


def test_the_docstring_names_every_message_and_field():
    doc = channel.__doc__ or ""
    for kind in channel.TO_AGENT + channel.TO_WORKER:
        assert f"``{kind.op}``" in doc, kind.op
        for name in kind.__dataclass_fields__:
            assert name in doc, f"{kind.op}.{name}"


def _line(**doc):
    return json.dumps(doc).encode()


@pytest.mark.parametrize("line, accept, error", [
    (b"not json", channel.TO_AGENT, "not a JSON line"),
    (b"\xff\xfe", channel.TO_AGENT, "not a JSON line"),
    (b"[1, 2]", channel.TO_AGENT, "not a JSON object"),
    (b"[" * 100000, channel.TO_AGENT, "not a JSON line"),
    (_line(slot=1, pid=2), channel.TO_AGENT, "op None is not one of"),
    (_line(op=7), channel.TO_AGENT, "op 7 is not one of"),
    (_line(op="exit"), channel.TO_AGENT, "op 'exit' is not one of"),
    (_line(op="hello", slot=1, pid=2), channel.TO_WORKER, "op 'hello' is not one of"),
    (_line(op="hello", slot=1), channel.TO_AGENT, "hello: pid is missing"),
    (_line(op="hello", slot="1", pid=2), channel.TO_AGENT, "slot must be an integer"),
    (_line(op="hello", slot=True, pid=2), channel.TO_AGENT, "slot must be an integer"),
    (_line(op="hello", slot=1.0, pid=2), channel.TO_AGENT, "slot must be an integer"),
    (_line(op="hello", slot=2**63, pid=2), channel.TO_AGENT, "slot must be an integer"),
    (_line(op="hello", slot=-1, pid=2), channel.TO_AGENT, "slot must be at least 0"),
    (_line(op="hello", slot=0, pid=0), channel.TO_AGENT, "pid must be at least 1"),
    (_line(op="stepped", gen=1, rank=0, step=1, t="now"), channel.TO_AGENT,
     "t must be a number"),
    (b'{"op":"stepped","gen":1,"rank":0,"step":1,"t":NaN}', channel.TO_AGENT,
     "t must be a number"),
    (_line(op="fatal", kind="oops", message="m", rank=None, gen=0), channel.TO_AGENT,
     "kind must be one of"),
    (_line(op="migrate", rank="1"), channel.TO_AGENT, "rank must be an integer"),
    (_line(op="generation", gen=1, rank=0, world_size=1, master_addr="a", master_port=0,
           reason="start"), channel.TO_WORKER, "master_port must be at least 1"),
    (_line(op="generation", gen=1, rank=0, world_size=1, master_addr="a", master_port=1,
           reason="start", handoff=[]), channel.TO_WORKER,
     "generation: handoff: must be an object"),
    (_line(op="generation", gen=1, rank=0, world_size=1, master_addr="a", master_port=1,
           reason="start", handoff={"role": "thief", "prefix": "p"}), channel.TO_WORKER,
     "handoff: role must be one of"),
    (_line(op="reply", message=None), channel.TO_WORKER, "message must be a string"),
])
def test_bad_lines_are_refused_in_one_line(line, accept, error):
    with pytest.raises(ChannelError, match=error) as e:
        channel.decode(line, accept)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


def test_unknown_fields_are_ignored():
    line = _line(op="migrate", rank=1, later="a field of a newer tp-run")
    assert channel.decode(line, channel.TO_AGENT) == channel.Migrate(rank=1)
    # No rank: every rank of the agent's node (tp-run migrate --node).
    assert channel.decode(b'{"op": "migrate"}', channel.TO_AGENT) == channel.Migrate()
    assert channel.decode(b'{"op": "migrate", "rank": null}', channel.TO_AGENT) == \
        channel.Migrate(rank=None)


def test_messages_are_checked_when_built():
    with pytest.raises(ChannelError, match="rank must be at least 0"):
        channel.Migrate(rank=-1)
    with pytest.raises(ChannelError, match="handoff must be an object"):
        channel.NewGeneration(gen=1, rank=0, world_size=1, master_addr="a", master_port=1,
                              reason="x", handoff={"role": "donor"})  # type: ignore[arg-type]


def test_line_reader_splits_and_bounds_lines():
    reader = channel.LineReader()
    assert reader.lines(b'{"a":') == []
    assert reader.lines(b'1}\n\n  \n{"b":2}\n{"c"') == [b'{"a":1}', b'{"b":2}']
    assert reader.lines(b":3}\n") == [b'{"c":3}']
    with pytest.raises(ChannelError, match="longer than"):
        channel.LineReader().lines(b"x" * (channel.MAX_LINE + 1))  # no newline yet
    with pytest.raises(ChannelError, match="longer than"):
        channel.LineReader().lines(b"x" * (channel.MAX_LINE + 1) + b"\n")
    assert channel.LineReader().lines(b"x" * channel.MAX_LINE + b"\n") == \
        [b"x" * channel.MAX_LINE]


def test_line_reader_then_decode_a_stream():
    stream = b"".join(channel.encode(m) for m in EXAMPLES if type(m) in channel.TO_WORKER)
    reader = channel.LineReader()
    got = []
    for i in range(0, len(stream), 7):  # arbitrary chunking
        got += [channel.decode(line, channel.TO_WORKER) for line in reader.lines(stream[i:i + 7])]
    assert got == [m for m in EXAMPLES if type(m) in channel.TO_WORKER]


# ---------------------------------------------------------------- the progress board
