"""Agree on the step, then move the state peer to peer, tensor by tensor, in place.

After a new group is built, every rank all-gathers its committed step (-1: holds no
state, a promoted spare). For replicated (data-parallel) state the highest committed
step wins: ranks at it are donors, every other rank receives. Receivers are spread over
the donors round-robin, so several newcomers are served in parallel by different
donors. A donor sends, to each of its receivers in turn:

1. the length of the pickled metadata (one int64) and the metadata (step, extra values,
   each object's non-tensor state, every tensor's path, shape and dtype);
2. every tensor, one ``send`` each, into a tensor the receiver already holds where path,
   shape and dtype match (a model's parameters: in place, no copy) or into a new one.
   Small tensors (biases, norms, small layers: under 1 MiB) travel packed, several to
   one ``send`` of up to 16 MiB (:func:`plan_sends`, computed from the metadata on both
   sides): each send has a fixed cost that dominates for them (measured with
   ``benchmarks/recovery.py``: a 10 MB state of small layers took 123 ms one send per
   tensor, 30 ms packed).

``torch.save`` is never on this path: it serialises at a fraction of the link's speed.

The same two functions serve a planned migration's handoff, over a two-process gloo
group of the retiring rank and its replacement (any state, replicated or not).
"""

from __future__ import annotations

import ctypes
import logging
import math
import pickle
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from tp_launch.resilient.state import State

logger = logging.getLogger(__name__)

_SMALL_BYTES = 1 << 20  # a tensor under this is packed with its neighbours
_PACK_BYTES = 16 << 20  # at most this much in one packed send


@dataclass
class TransferStats:
    """What one rank did in the agreement and transfer."""

    step: int = 0
    agree_s: float = 0.0
    transfer_s: float = 0.0
    bytes: int = 0
    donor: int | None = None  # the rank this one received from


def _send(pg: dist.ProcessGroup, t: torch.Tensor, dst: int) -> None:
    pg.send([t], dst, 0).wait()


def _recv(pg: dist.ProcessGroup, t: torch.Tensor, src: int) -> None:
    pg.recv([t], src, 0).wait()


def plan_sends(specs: Sequence[tuple[tuple[int, ...], str]]) -> list[list[int]]:
    """Group tensor indices into sends: a large tensor alone; consecutive small tensors
    of one dtype together, up to ``_PACK_BYTES``. Donor and receiver compute the same
    plan from the same metadata (shapes and dtype names)."""
    sends: list[list[int]] = []
    pack: list[int] = []
    pack_bytes, pack_dtype = 0, ""
    for i, (shape, dtype) in enumerate(specs):
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if nbytes >= _SMALL_BYTES:
            sends.append([i])
            continue
        if pack and (dtype != pack_dtype or pack_bytes + nbytes > _PACK_BYTES):
            sends.append(pack)
            pack, pack_bytes = [], 0
        pack.append(i)
        pack_bytes += nbytes
        pack_dtype = dtype
    if pack:
        sends.append(pack)
    return sends


def send_state(state: State, pg: dist.ProcessGroup, dst: int) -> int:
    """Send the whole state to ``dst`` in ``pg``; returns the tensor bytes sent."""
    meta, tensors = state.snapshot()
    blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
    _send(pg, torch.tensor([blob.numel()], dtype=torch.int64), dst)
    _send(pg, blob, dst)
    sent = 0
    for group in plan_sends(meta["specs"]):
        if len(group) == 1:
            t = tensors[group[0]].detach()
            t = t if t.is_contiguous() else t.contiguous()
        else:
            device = tensors[group[0]].device
            t = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in group])
        _send(pg, t, dst)
        sent += t.numel() * t.element_size()
    return sent


def recv_state(state: State, pg: dist.ProcessGroup, src: int) -> int:
    """Receive the whole state from ``src`` in ``pg`` into ``state``; returns bytes."""
    size = torch.zeros(1, dtype=torch.int64)
    _recv(pg, size, src)
    blob = torch.empty(int(size.item()), dtype=torch.uint8)
    _recv(pg, blob, src)
    meta = pickle.loads(ctypes.string_at(blob.data_ptr(), blob.numel()))
    buffers, to_load = state.receive_buffers(meta)
    got = 0
    with torch.no_grad():
        for group in plan_sends(meta["specs"]):
            if len(group) == 1:
                t = buffers[group[0]]
                _recv(pg, t, src)
            else:
                first = buffers[group[0]]
                t = torch.empty(sum(buffers[i].numel() for i in group), dtype=first.dtype,
                                device=first.device)
                _recv(pg, t, src)
                offset = 0
                for i in group:
                    n = buffers[i].numel()
                    buffers[i].copy_(t[offset:offset + n].view(buffers[i].shape))
                    offset += n
            got += t.numel() * t.element_size()
    state.load(meta, buffers, to_load)
    return got


def agree_and_transfer(state: State) -> TransferStats:
    """On the current default group: agree on the step and bring every rank to it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    t0 = time.monotonic()
    mine = torch.tensor([state.step if state.valid else -1], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, mine)
    steps = [int(s.item()) for s in gathered]
    top = max(steps)
    stats = TransferStats(step=top, agree_s=time.monotonic() - t0)
    if top < 0:
        # Nobody holds state (a fresh start): every rank's freshly built state is it.
        state.valid = True
        state.step = 0
        stats.step = 0
        return stats
    donors = [r for r, s in enumerate(steps) if s == top]
    plan = {r: donors[i % len(donors)] for i, r in enumerate(r for r, s in enumerate(steps) if s != top)}
    t1 = time.monotonic()
    if rank in plan:
        stats.donor = plan[rank]
        stats.bytes = recv_state(state, pg, plan[rank])
    else:
        for receiver, donor in plan.items():
            if donor == rank:
                stats.bytes += send_state(state, pg, receiver)
    stats.transfer_s = time.monotonic() - t1
    if plan:
        logger.info("rank %s: state at step %s %s (%d bytes, %.3f s)", rank, top,
                    f"received from rank {plan[rank]}" if rank in plan else "sent",
                    stats.bytes, stats.transfer_s)
    return stats
