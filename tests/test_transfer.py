"""The state transfer between two real processes over gloo: every tensor arrives exact,
large ones in place, small ones packed (tp_launch.resilient.transfer.plan_sends)."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import torch

from tests.etcd_server import free_port
from tp_launch.resilient.transfer import plan_sends


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


def _side(rank: int, port: int, queue: mp.Queue) -> None:
    import torch.distributed as dist

    from tp_launch.resilient.state import State
    from tp_launch.resilient.transfer import recv_state, send_state

    torch.manual_seed(rank)
    model = Mixed(fill=2.0 if rank == 0 else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:  # the donor has optimizer state; the receiver's is empty (a fresh spare)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    state = State(model=model, optimizer=opt)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, 2)
    big_before = model.big.data_ptr()
    moved = send_state(state, pg, 1) if rank == 0 else recv_state(state, pg, 0)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    mom = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    # Plain pickle: tensors by value (the queue's own pickler would share them by fd,
    # which dies with this process).
    queue.put(pickle.dumps((rank, moved, sd, mom, model.big.data_ptr() == big_before)))


def test_state_arrives_exact_with_small_tensors_packed():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_side, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = pickle.loads(queue.get(timeout=120))
        results[rank] = rest
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (sent, sd0, mom0, _), (got, sd1, mom1, in_place) = results[0], results[1]
    assert sent == got > 600 * 600 * 4
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert torch.equal(sd0[k], sd1[k]), k
    assert all(torch.equal(a, b) for a, b in zip(mom0, mom1))
    assert in_place  # the large parameter was received into the receiver's own tensor


def test_plan_packs_small_tensors_by_dtype_and_keeps_large_ones_alone():
    specs = [((10,), "float32"), ((1024, 1024), "float32"), ((3,), "float32"),
             ((4,), "int64"), ((2,), "int64"), ((), "float32"), ((0,), "float32")]
    assert plan_sends(specs) == [[1], [0, 2], [3, 4], [5, 6]]
    many = [((1000,), "float32")] * 8000  # 4 KB each: packs of at most 16 MiB
    packs = plan_sends(many)
    assert sum(map(len, packs)) == 8000 and all(len(p) * 4000 <= 16 << 20 for p in packs)
    assert len(packs) == 2
