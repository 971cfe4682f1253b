"""The transfer's typed metadata (wire.py), in memory: a state message and the agreement
row round-trip through the wire format, and anything else is a WireError."""

from __future__ import annotations

import json

import pytest
import torch

from tp_launch.resilient import rng
from tp_launch.resilient.state import Cursor
from tp_launch.resilient.wire import (
    DTYPES,
    MAGIC,
    VERSION,
    Holding,
    StateMessage,
    WireError,
    decode,
    encode,
    fill,
    leaves,
    receive_document,
    receive_message,
    receive_tensors,
    send_message,
)

pytestmark = pytest.mark.unit


def _message() -> StateMessage:
    return StateMessage(
        cursor=Cursor(step=7, epoch=1, batch=2).to_tree(),
        extra={"tokens": 10, 3: (1.5, None)},
        objects={"model": {"w": torch.arange(4.0), "b": torch.zeros(2, dtype=torch.int64)},
                 "sched": {"last_epoch": 7, "mode_worse": float("inf")}},
        rng={"torch": torch.get_rng_state()},
        grads={"model": [True, False]}, modes={"model": [True]},
        layouts={"fp": {"buckets": [[1, 0]], "limits": [100], "from_step": 1}},
        per_rank_generators=["python"], per_rank_objects=["sched"])


def _pipe() -> tuple[list[torch.Tensor], object]:
    sent: list[torch.Tensor] = []

    def recv(t: torch.Tensor) -> None:
        t.copy_(sent.pop(0).view(t.shape))
    return sent, recv


def test_state_message_round_trips_through_the_wire():
    msg = _message()
    sent, recv = _pipe()
    send_message(msg.to_tree(), lambda t: sent.append(t.clone()))
    tree, specs = receive_document(recv)  # type: ignore[arg-type]
    placeholders = StateMessage.from_tree(tree)  # checked before any tensor arrives
    assert set(placeholders.objects) == {"model", "sched"}
    assert sorted(leaf.index for _, leaf in leaves(tree)) == list(range(len(specs)))
    buffers = [torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs]
    receive_tensors(specs, buffers, recv)  # type: ignore[arg-type]
    assert not sent
    back = StateMessage.from_tree(fill(tree, buffers))
    assert torch.equal(back.objects["model"]["w"], torch.arange(4.0))
    assert back.objects["model"]["b"].dtype == torch.int64
    assert back.objects["sched"]["mode_worse"] == float("inf")
    assert back.extra == {"tokens": 10, 3: (1.5, None)}
    assert Cursor.from_tree(back.cursor) == Cursor(step=7, epoch=1, batch=2)
    assert torch.equal(back.rng["torch"], torch.get_rng_state())
    assert (back.grads, back.modes, back.per_rank_generators, back.per_rank_objects) == \
        ({"model": [True, False]}, {"model": [True]}, ["python"], ["sched"])
    assert back.layouts == msg.layouts


def test_a_message_received_whole_into_host_memory():
    sent, recv = _pipe()
    send_message(_message().to_tree(), lambda t: sent.append(t.clone()))
    got, tree = receive_message(recv)  # type: ignore[arg-type]
    back = StateMessage.from_tree(tree)
    assert got == sum(t.numel() * t.element_size() for t in encode(_message().to_tree())[1])
    assert not sent
    assert torch.equal(back.objects["model"]["w"], torch.arange(4.0))


def _tree(**changes: object) -> dict:
    doc, tensors = encode(_message().to_tree())
    tree = decode(json.loads(json.dumps(doc)), len(tensors))
    tree.update(changes)
    return tree


@pytest.mark.parametrize("tree, error", [
    ([], "not a training state"),
    ({"cursor": {}, "extra": {}, "rng": {}, "objects": {"evil": {}}}, "not a training state"),
    (_tree(more=1), "not a training state"),
    (_tree(objects=[]), "objects is not an object"),
    (_tree(cursor=7), "cursor is not an object"),
    (_tree(rng={1: 2}), "rng has a key that is not a string"),
    (_tree(grads={"model": [1, 0]}), "grads are not lists of booleans"),
    (_tree(modes={"model": True}), "modes are not lists of booleans"),
    (_tree(per_rank_generators="python"), "per_rank_generators are not a list"),
    (_tree(per_rank_generators=[None]), "per_rank_generators are not a list"),
    (_tree(per_rank_objects={"data": 1}), "per_rank_objects are not a list"),
])
def test_state_message_is_parsed_strictly(tree, error):
    with pytest.raises(WireError, match=error):
        StateMessage.from_tree(tree)


def test_state_message_from_a_peer_in_memory():
    assert StateMessage.from_tree(_tree()).per_rank_generators == ["python"]


def test_holding_rows_round_trip_through_an_all_gather():
    n = len(rng.GENERATORS)
    rows = [Holding(step=40, own_step=40, used=0b101, buffers=-5, sharded=3,
                    generators=tuple(range(n))),
            Holding(step=-1, own_step=39, used=0, buffers=2**62, sharded=0,
                    generators=tuple(-i for i in range(n)))]
    gathered = torch.cat([r.to_tensor() for r in rows])
    assert gathered.numel() == 2 * Holding.width(n)
    assert Holding.rows(gathered, 2) == rows


@pytest.mark.parametrize("gathered, world", [
    (torch.zeros(7, dtype=torch.int64), 2),  # not a whole number of rows
    (torch.zeros(6, dtype=torch.int64), 2),  # rows shorter than the fixed words
    (torch.zeros(8, dtype=torch.float32), 1),
])
def test_holding_rows_refuse_a_malformed_agreement(gathered, world):
    with pytest.raises(WireError, match="bad agreement"):
        Holding.rows(gathered, world)


def test_header_of_another_version_is_refused():
    sent, recv = _pipe()
    sent.append(torch.tensor([MAGIC, VERSION + 1, 2]))
    with pytest.raises(WireError, match=f"version {VERSION + 1}"):
        receive_document(recv)  # type: ignore[arg-type]


@pytest.mark.parametrize("body, error", [
    (b"\xff\xfe", "not JSON"),
    (b"[]", "lacks its tree"),
    (b'{"tree": 1}', "lacks its tree"),
    (b'{"tree": 1, "tensors": {}}', "lacks its tree"),
    (b'{"tree": 1, "tensors": [], "more": 2}', "lacks its tree"),
    (b'{"tree": {"$t": 0}, "tensors": [[[2], "object"]]}', "tensor declaration"),
    (b'{"tree": {"$t": 0}, "tensors": [[[2, 3]]]}', "tensor declaration"),
    (b'{"tree": {"$t": 0}, "tensors": [[[true], "float32"]]}', "tensor declaration"),
    (b'{"tree": {"$t": 0}, "tensors": [[[' + b"1," * 40 + b'1], "float32"]]}',
     "tensor declaration"),  # more dimensions than MAX_DIMS
    (b'{"tree": {"$t": 1}, "tensors": [[[2], "float32"]]}', "bad tensor reference"),
    # Nested past the parser's recursion limit, and past decode()'s depth bound.
    (b'{"tree": ' + b"[" * 100_000 + b"]" * 100_000 + b', "tensors": []}', "nests too deep"),
    (b'{"tree": ' + b'{"$tuple": [' * 80 + b"1" + b"]}" * 80 + b', "tensors": []}',
     "nests too deep"),
])
def test_documents_are_parsed_strictly(body, error):
    sent, recv = _pipe()
    sent += [torch.tensor([MAGIC, VERSION, len(body)]),
             torch.frombuffer(bytearray(body), dtype=torch.uint8)]
    with pytest.raises(WireError, match=error):
        receive_document(recv)  # type: ignore[arg-type]


def test_a_declared_tensor_no_machine_can_hold_is_a_wire_error():
    """Within the declaration's bounds (each dimension under 2**48), far beyond memory:
    the allocation's failure is the sender's error, a WireError like any other."""
    body = b'{"tree": {"$t": 0}, "tensors": [[[4194304, 4194304, 4194304], "float64"]]}'
    sent, recv = _pipe()
    sent += [torch.tensor([MAGIC, VERSION, len(body)]),
             torch.frombuffer(bytearray(body), dtype=torch.uint8)]
    with pytest.raises(WireError, match="cannot allocate"):
        receive_message(recv)  # type: ignore[arg-type]
