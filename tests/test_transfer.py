"""The state transfer: its wire format (typed JSON, no pickle) and real transfers between
two processes over gloo: every tensor arrives exact, large ones in place, small ones
packed; a malformed or hostile message is a clear error on the receiver."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import pickle

import pytest
import torch

from tests.etcd_server import free_port
from tp_launch.resilient.wire import (
    MAGIC,
    VERSION,
    EncodeError,
    TensorSpec,
    WireError,
    decode,
    encode,
    fill,
    leaves,
    plan_sends,
    receive_document,
)


class Mixed(torch.nn.Module):
    """Large and small parameters, an int64 buffer, a 0-d buffer, an empty one."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.full((600, 600), fill))
        self.small = torch.nn.Parameter(torch.full((7,), fill))
        self.register_buffer("count", torch.arange(5, dtype=torch.int64) * int(fill))
        self.register_buffer("scalar", torch.tensor(fill))
        self.register_buffer("empty", torch.zeros(0))
        self.tail = torch.nn.Parameter(torch.full((3, 2), fill))


def _state(rank: int):  # type: ignore[no-untyped-def]
    from tp_launch.resilient.state import State
    from tp_launch.resilient.transfer import Carrier

    torch.manual_seed(rank)
    model = Mixed(fill=2.0 if rank == 0 else 0.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # holds inf
    if rank == 0:  # the donor has optimizer state; the receiver's is empty (a fresh spare)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        sched.step(1.0)
    state = State(model=model, optimizer=opt, scheduler=sched,
                  extra={"tokens": 123, "name": "run", 7: (1.5, None)})
    state.step = 40 if rank == 0 else 0
    return model, opt, Carrier.of(state)


def _side(rank: int, port: int, queue: mp.Queue, hostile: tuple[str, ...]) -> None:
    import torch.distributed as dist

    from tp_launch.resilient.transfer import recv_state, send_state

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    if hostile:  # each kind on a process group of its own: no case sees another's bytes
        errors = []
        for kind in hostile:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(kind, store), rank, 2)
            if rank == 0:
                _send_hostile(pg, kind)
                continue
            try:
                recv_state(_state(rank)[2], pg, 0)
                errors.append(f"{kind}: received without an error")
            except Exception as e:  # the receiver of a hostile message
                errors.append(f"{type(e).__name__}: {e}")
        queue.put(pickle.dumps((rank, errors)))
        return
    pg = dist.ProcessGroupGloo(store, rank, 2)
    model, opt, carrier = _state(rank)
    big_before = model.big.data_ptr()
    moved = send_state(carrier, pg, 1) if rank == 0 else recv_state(carrier, pg, 0)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    adam = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    queue.put(pickle.dumps((rank, moved, sd, adam, model.big.data_ptr() == big_before,
                            carrier.state.step, carrier.state.extra,
                            carrier.state.scheduler.state_dict())))


def _trio(rank: int, port: int, queue: mp.Queue) -> None:
    """Ranks 0 and 2 hold the same state; rank 1 receives it from both at once."""
    import torch.distributed as dist

    from tp_launch.resilient.transfer import recv_state, serve

    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, 3)
    model, opt, carrier = _state(1 if rank == 1 else 0)
    big_before = model.big.data_ptr()
    moved = recv_state(carrier, pg, 0, (2,)) if rank == 1 else \
        serve(carrier, pg, rank, {1: (0, 2)})
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    adam = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    queue.put(pickle.dumps((rank, moved, sd, adam, model.big.data_ptr() == big_before,
                            carrier.state.step, carrier.state.extra,
                            carrier.state.scheduler.state_dict())))


def _send_hostile(pg, kind: str) -> None:  # type: ignore[no-untyped-def]
    """A fake peer: what an attacker on the gloo port, or a broken sender, could send."""
    def send(t: torch.Tensor) -> None:
        pg.send([t], 1, 0).wait()

    if kind == "pickle":  # a pickle that would run code if it were ever unpickled
        body = pickle.dumps(os.system)
        send(torch.tensor([len(body), 0, 0], dtype=torch.int64))
        return
    if kind == "version":
        body = b"{}"
        send(torch.tensor([MAGIC, VERSION + 1, len(body)], dtype=torch.int64))
        return
    docs = {
        "json": b"{not json",
        "tag": json.dumps({"tree": {"$pickle": "gASV"}, "tensors": []}).encode(),
        "dtype": json.dumps({"tree": {"$t": 0}, "tensors": [[[2], "object"]]}).encode(),
        "objects": json.dumps({"tree": {"cursor": {}, "extra": {}, "rng": {},
                                        "objects": {"evil": {}}}, "tensors": []}).encode(),
    }
    body = docs[kind]
    send(torch.tensor([MAGIC, VERSION, len(body)], dtype=torch.int64))
    send(torch.frombuffer(bytearray(body), dtype=torch.uint8))


def _run_pair(hostile: tuple[str, ...] = ()) -> dict:
    return _run(2, _side, hostile)


def _run(world: int, side, *args) -> dict:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=side, args=(r, port, queue, *args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = pickle.loads(queue.get(timeout=120))
        results[rank] = rest
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


@pytest.mark.slow
def test_state_arrives_exact_with_small_tensors_packed():
    results = _run_pair()
    (sent, sd0, adam0, _, step0, extra0, sched0) = results[0]
    (got, sd1, adam1, in_place, step1, extra1, sched1) = results[1]
    assert sent == got > 600 * 600 * 4
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    for a, b in zip(adam0, adam1):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert in_place  # the large parameter was received into the receiver's own tensor
    assert step1 == step0 == 40 and extra1 == extra0
    assert sched1 == sched0 and math.isinf(sched1["mode_worse"])


@pytest.mark.slow
def test_a_newcomer_receives_from_two_donors_at_once():
    results = _run(3, _trio)
    (got, sd1, adam1, in_place, step1, extra1, sched1) = results[1]
    sent = {r: results[r][0] for r in (0, 2)}
    assert sent[0] > 0 and sent[2] > 0  # both sent a share...
    assert sent[0] + sent[2] == got  # ...and nothing twice
    (_, sd0, adam0, _, step0, extra0, sched0) = results[0]
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    for a, b in zip(adam0, adam1):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert in_place and step1 == step0 == 40 and extra1 == extra0 and sched1 == sched0


HOSTILE = ("pickle", "version", "json", "tag", "dtype", "objects")


@pytest.mark.slow
def test_malformed_or_hostile_messages_are_clear_errors():
    """Every kind, one after the other, between one pair of processes."""
    (errors,) = _run_pair(HOSTILE)[1]
    assert len(errors) == len(HOSTILE), errors
    for kind, error in zip(HOSTILE, errors):
        assert error.startswith("WireError: ") and "\n" not in error, (kind, error)


# ---------------------------------------------------------------- the format, in memory


def test_typed_tree_round_trip():
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": t}},
            "param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "params": [0],
                              "nan": float("nan"), "inf": float("-inf")}],
            "$weird": b"\x00\x01", "dtype": torch.bfloat16, "none": None, "big": 2 ** 70}
    doc, tensors = encode(tree)
    json.dumps(doc, allow_nan=False)  # strictly JSON
    back = fill(decode(json.loads(json.dumps(doc)), len(tensors)), tensors)
    assert back["state"][0]["exp_avg"] is t
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert math.isnan(back["param_groups"][0]["nan"])
    assert back["param_groups"][0]["inf"] == float("-inf")
    assert back["$weird"] == b"\x00\x01" and back["dtype"] is torch.bfloat16
    assert back["big"] == 2 ** 70 and back["none"] is None
    assert [path for path, _ in leaves(decode(doc, len(tensors)))] == \
        [("state", 0, "step"), ("state", 0, "exp_avg")]


def test_values_without_a_wire_form_are_refused_on_the_sender():
    with pytest.raises(EncodeError, match=r"\.extra\.hook: a function"):
        encode({"extra": {"hook": lambda: 0}})
    with pytest.raises(EncodeError, match="object"):
        encode({"x": object()})


@pytest.mark.parametrize("doc", [
    {"$t": 5}, {"$t": "0"}, {"$f": "1e400"}, {"$map": [[1]]}, {"$dtype": "object"},
    {"$bytes": "***"}, {"$unknown": 1}, {"$map": [[[1, 2], 3]]},
])
def test_decoder_rejects_malformed_documents(doc):
    with pytest.raises(WireError):
        decode(doc, 1)


def test_receiver_checks_header_and_declarations():
    def feeder(*tensors: torch.Tensor):  # type: ignore[no-untyped-def]
        queue = list(tensors)

        def recv(t: torch.Tensor) -> None:
            t.copy_(queue.pop(0))
        return recv

    with pytest.raises(WireError, match="magic"):
        receive_document(feeder(torch.tensor([1, VERSION, 2])))
    with pytest.raises(WireError, match="length"):
        receive_document(feeder(torch.tensor([MAGIC, VERSION, 1 << 40])))
    body = json.dumps({"tree": {"$t": 0}, "tensors": [[[-1], "float32"]]}).encode()
    with pytest.raises(WireError, match="tensor declaration"):
        receive_document(feeder(torch.tensor([MAGIC, VERSION, len(body)]),
                                torch.frombuffer(bytearray(body), dtype=torch.uint8)))


def test_plan_packs_small_tensors_by_dtype_and_keeps_large_ones_alone():
    def specs(*pairs):  # type: ignore[no-untyped-def]
        return [TensorSpec(shape, dtype) for shape, dtype in pairs]

    assert plan_sends(specs(((10,), "float32"), ((1024, 1024), "float32"), ((3,), "float32"),
                            ((4,), "int64"), ((2,), "int64"), ((), "float32"),
                            ((0,), "float32"))) == [[1], [0, 2], [3, 4], [5, 6]]
    many = specs(*[((1000,), "float32")] * 8000)  # 4 KB each: packs of at most 16 MiB
    packs = plan_sends(many)
    assert sum(map(len, packs)) == 8000 and all(len(p) * 4000 <= 16 << 20 for p in packs)
    assert len(packs) == 2


def test_shares_spread_the_large_sharable_tensors_by_path():
    from tp_launch.resilient.transfer import shares

    mb = 1 << 18  # float32 elements in a MiB
    specs = [TensorSpec((4 * mb,), "float32"), TensorSpec((2,), "float32"),
             TensorSpec((2 * mb,), "float32"), TensorSpec((2 * mb,), "float32"),
             TensorSpec((3 * mb,), "float32")]
    paths = [("objects", "model", "w"), ("objects", "model", "b"),
             ("objects", "opt", "state", 0, "exp_avg"), ("objects", "model", "bn.mean"),
             ("objects", "opt", "state", 0, "exp_avg_sq")]

    def sharable(path):  # type: ignore[no-untyped-def]
        return path[-1] != "bn.mean"

    # The first sender starts with what only it sends (b, bn.mean: 2 MiB + 8 bytes);
    # then by path: model.w (4 MiB) to 1, opt's exp_avg (2 MiB) to 0, exp_avg_sq
    # (3 MiB) to 1 (4 MiB against 4 MiB + 8 bytes).
    assert shares(paths, specs, (0, 1), sharable) == {0: [2], 1: [0, 4]}
    # The order in which a holder lists its tensors does not matter, only their paths.
    order = [4, 3, 2, 1, 0]
    got = shares([paths[i] for i in order], [specs[i] for i in order], (0, 1), sharable)
    assert {s: sorted(order[i] for i in v) for s, v in got.items()} == {0: [2], 1: [0, 4]}
    assert shares(paths, specs, (3,), sharable) == {3: []}  # one sender: all its own
