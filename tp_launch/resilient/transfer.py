"""Carry out the agreement after a failure: move the committed state peer to peer.

:func:`agree_and_transfer`, on every rank of a new generation's group, brings the rank
back to its last commit (:mod:`tp_launch.resilient.rollback`), all-gathers every rank's
:class:`~tp_launch.resilient.wire.Holding` row, lets
:func:`tp_launch.resilient.agreement.decide` pick the state to go on from (the rule, and
when the state is lost, are that module's), then performs the decision:

* a fresh start: record what is each rank's own (the generators seeded per rank; the
  registered objects whose state differs between the ranks: one more gather) and refuse
  what could not travel later (``State(per_rank=...)`` naming unknown objects, a module
  keeping ``get_extra_state()``);
* a transfer: the donors send, the receivers take; a receiver then puts back its own
  generators and module buffers (:func:`_own_state`), from its own commit at the agreed
  step or its predecessor's record on this node (:mod:`tp_launch.resilient.per_rank`),
  else it says so (a warning, ``inexact`` in the recovery record); its own objects come
  from its holder's buddy copy when there is one;
* back to buddy copies (:mod:`tp_launch.resilient.copies`): a gather of the snapshots
  picks the step; each rank takes its own snapshot of it or receives its holder's copy.

The transfer and the copies end with ``TransferStats.compare``: the caller then has the
replicas compared (:mod:`tp_launch.resilient.replicas`, off the critical path).

What a donor sends (:func:`send_state`, in :mod:`tp_launch.resilient.wire`'s format, no
pickle): the position, ``extra``, every registered object's ``state_dict()``, the
random generators, which parameters had a gradient, the modules' training flags, and
the DDP bucket layouts (:mod:`tp_launch.resilient.ddp`). The receiver takes each tensor
into its own where path, shape and dtype match (a model's parameters and buffers: in
place, no copy), into a new one elsewhere (an optimizer's state on a fresh spare), then
calls ``load_state_dict`` where it must. The same functions serve a planned migration's
handoff, over a two-process group of the retiring rank and its replacement (any state,
replicated or not).

Why one module of this size (over 550 lines): sending, receiving and adopting a state,
the three ways of performing an agreement and the replicas' check all read and write the
same :class:`Carrier`, and each path's collectives must run in the same order on every
rank; split over modules, that order would no longer be read in one place. The decision,
which has no collective, is apart (:mod:`tp_launch.resilient.agreement`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tp_launch.resilient import per_rank, rng, sharding
from tp_launch.resilient.agreement import Kind, StateLost, decide, donor_plan
from tp_launch.resilient.copies import BuddyCopies, CopiesLost, copy_plan
from tp_launch.resilient.ddp import Layouts
from tp_launch.resilient.group import all_gather_flat
from tp_launch.resilient.rollback import Rollback
from tp_launch.resilient.replicas import differing_objects
from tp_launch.resilient.state import Cursor, ResilientUsageError, State
from tp_launch.resilient.wire import (
    DTYPES,
    CopyRow,
    Holding,
    StateMessage,
    WireError,
    Send,
    TensorSpec,
    Wait,
    alone,
    fill,
    leaves,
    receive_document,
    receive_message,
    receive_tensors,
    send_message,
    send_tensors,
    tensor_bytes,
    tensor_paths,
    wait_all,
)

logger = logging.getLogger(__name__)


@dataclass
class TransferStats:
    """What one rank did in the agreement and transfer."""

    step: int = 0
    agree_s: float = 0.0
    transfer_s: float = 0.0
    bytes: int = 0
    donor: int | None = None  # the rank this one received from
    inexact: list[str] = field(default_factory=list)  # per-rank generators lost
    compare: bool = False  # the replicas are to be compared (not at the job's start)


@dataclass
class Carrier:
    """Everything of this rank that the state transfer reads and writes."""

    state: State
    rollback: Rollback
    layouts: Layouts
    initial_rng: rng.RngState  # the generators when run() began (to tell unused ones)
    initial_buffers: int  # digest of the modules' buffers when run() began
    per_rank_generators: set[str] = field(default_factory=set)  # known at the fresh start
    per_rank_objects: set[str] = field(default_factory=set)  # likewise

    @staticmethod
    def of(state: State, rollback: Rollback | None = None,
           layouts: Layouts | None = None) -> Carrier:
        """A carrier for ``state`` as it is now (when run() begins)."""
        rollback = rollback or Rollback(state)
        layouts = layouts or Layouts(lambda: state.cursor.step)
        return Carrier(state, rollback, layouts, rng.capture(), _buffers_now(state))

    def first_built(self) -> None:
        """``State(build=...)`` built this process's objects for the first time: their
        buffers now are where this process started from."""
        self.initial_buffers = _buffers_now(self.state)

    def message(self) -> StateMessage:
        """The committed state as one message (call after a successful rollback)."""
        s, rb = self.state, self.rollback
        return StateMessage(cursor=s.cursor.to_tree(), extra=s.extra,
                            objects={n: sharding.local_tree(sharding.object_state(o))
                                     for n, o in s.objects.items()},
                            rng=rb.rng if rb.rng is not None else rng.capture(),
                            grads=rb.gradients(), modes=rb.modes(),
                            layouts=self.layouts.to_tree(),
                            per_rank_generators=sorted(self.per_rank_generators),
                            per_rank_objects=sorted(self.per_rank_objects))


# ---------------------------------------------------------------- send / receive

# Where a state moves: the generation's group, or a planned migration's bare gloo pair.
PeerGroup = Union[dist.ProcessGroup, dist.ProcessGroupGloo]


def _carries(pg: Any, t: torch.Tensor) -> bool:
    """Whether ``pg`` moves ``t`` from and to where it lies. gloo's point-to-point
    transport reads and writes host memory only: given a CUDA tensor, its ``writev``
    fails (EFAULT) in gloo's own thread and the exception ends the process (seen on an
    H200, in a planned migration's two-process gloo group and with ``backend="gloo"``)."""
    if t.device.type == "cpu":
        return True
    try:
        backend = pg._get_backend(t.device) if hasattr(pg, "_get_backend") else pg
        return backend.name() != "gloo"
    except Exception:
        return False


def _p2p(pg: Any, peer: int, receive: bool) -> Send:
    """Post one tensor's move to or from ``peer``; through a host copy where ``pg``
    needs it. Returns the wait for its completion (:data:`tp_launch.resilient.wire.Send`)."""
    op = pg.recv if receive else pg.send

    def move(t: torch.Tensor) -> Wait:
        if _carries(pg, t):
            return op([t], peer, 0).wait
        if receive:
            host = torch.empty(t.shape, dtype=t.dtype)
            work = op([host], peer, 0)

            def land() -> None:
                work.wait()
                t.copy_(host)
            return land
        return op([t.detach().to("cpu").contiguous()], peer, 0).wait
    return move


def send_state(carrier: Carrier, pg: PeerGroup, dst: int) -> int:
    """Send the committed state to ``dst`` in ``pg``; returns the tensor bytes sent."""
    return send_pieces(carrier.message(), pg, dst)


def send_pieces(message: StateMessage, pg: PeerGroup, dst: int) -> int:
    """Send a state kept as local pieces (a built state between two generations) to
    ``dst`` in ``pg``; returns the tensor bytes sent."""
    return send_message(message.to_tree(), _p2p(pg, dst, receive=False))


def recv_pieces(pg: PeerGroup, src: int) -> tuple[int, StateMessage]:
    """Receive a state of local pieces from ``src`` in ``pg`` into host memory (to be
    adopted once this process has built its objects); returns the bytes and the state.

    Raises:
        WireError: the message is malformed, or not a training state.
    """
    got, tree = receive_message(_p2p(pg, src, receive=True))
    return got, StateMessage.from_tree(tree)


def recv_state(carrier: Carrier, pg: PeerGroup, src: int,
               helpers: Sequence[int] = ()) -> int:
    """Receive a committed state from ``src`` in ``pg`` and adopt it; returns bytes.
    ``helpers``: other ranks holding the same state, which send their :func:`shares` of
    its large tensors in parallel (:func:`serve`).

    Raises:
        WireError: the message is malformed, or not a state of this script.
    """
    recv = _p2p(pg, src, receive=True)
    tree, specs = receive_document(recv)
    message = StateMessage.from_tree(tree)
    state = carrier.state
    if set(message.objects) != set(state.objects):
        raise WireError(f"the sender's state has objects {sorted(message.objects)}, "
                        f"this process's has {sorted(state.objects)}")
    own: dict[tuple[Any, ...], torch.Tensor] = {}
    for name, module in state.modules.items():
        own.update({("objects", name, k): sharding.local_piece(v)
                    for k, v in sharding.module_tensors(module).items()})
    in_place: dict[str, bool] = {name: True for name in state.modules}
    placed = sorted(leaves(tree), key=lambda pl: pl[1].index)
    if [leaf.index for _, leaf in placed] != list(range(len(specs))):
        raise WireError("the document's tensors and declarations disagree")
    buffers: list[torch.Tensor] = []
    for path, leaf in placed:
        spec = specs[leaf.index]
        mine = own.get(path)
        if mine is not None and tuple(mine.shape) == spec.shape \
                and mine.dtype == DTYPES[spec.dtype] and mine.is_contiguous():
            buffers.append(mine)
            continue
        if len(path) >= 2 and path[0] == "objects" and path[1] in in_place:
            in_place[path[1]] = False
        device = mine.device if mine is not None else _device_of(state, path)
        buffers.append(torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=device))
    paths = [path for path, _ in placed]
    split = shares(paths, specs, [src, *helpers], _sharable(state, message.per_rank_objects))
    got = receive_tensors(specs, buffers, recv,
                          [(_p2p(pg, h, receive=True), split[h]) for h in helpers])
    adopt(carrier, StateMessage.from_tree(fill(tree, buffers)), in_place)
    return got


def _sharable(state: State, per_rank: Collection[str]) -> Callable[[tuple[Any, ...]], bool]:
    """Whether a tensor at a path is the same on every holder of a state: one only the
    optimizer step changes (:meth:`State.stepped_only`: not a buffer, which can be a
    rank's own, DDP ranks' BatchNorm statistics), of an object the ranks do not keep
    their own."""
    stepped_only = state.stepped_only()
    return lambda path: len(path) > 1 and path[1] not in per_rank and stepped_only(path)


def shares(paths: Sequence[tuple[Any, ...]], specs: Sequence[TensorSpec],
           senders: Sequence[int], sharable: Callable[[tuple[Any, ...]], bool]
           ) -> dict[int, list[int]]:
    """Which of a message's tensors each of ``senders`` sends, beyond the first one's
    document: the large sharable tensors, in path order, each to the sender with the
    fewest bytes so far (the first one starts with what only it sends). Every sender and
    the receiver compute it alike from the same declarations; by path, so that holders
    whose state lists the same tensors in another order still agree. The first
    sender's share is what :func:`plan_sends` leaves it."""
    load = {s: 0 for s in senders}
    out: dict[int, list[int]] = {s: [] for s in senders}
    if len(senders) < 2:
        return out
    spread = sorted((i for i, spec in enumerate(specs) if alone(spec) and sharable(paths[i])),
                    key=lambda i: [str(x) for x in paths[i]])
    shared = set(spread)
    load[senders[0]] = sum(specs[i].nbytes for i in range(len(specs)) if i not in shared)
    for i in spread:
        s = min(senders, key=lambda x: (load[x], senders.index(x)))
        out[s].append(i)
        load[s] += specs[i].nbytes
    return out


def serve(carrier: Carrier, pg: PeerGroup, rank: int,
          receivers: Mapping[int, Sequence[int]]) -> int:
    """As ``rank`` of ``pg``, send this rank's part of the committed state to each of
    ``receivers`` (receiver -> its senders, the first one sending the document):
    everything posted, then waited for. Returns the tensor bytes sent."""
    message = carrier.message()
    tree = message.to_tree()
    tensors, paths = tensor_paths(tree)
    specs = [TensorSpec.of(t) for t in tensors]
    sharable = _sharable(carrier.state, message.per_rank_objects)
    pending: list[Optional[Wait]] = []
    sent = 0
    for receiver, senders in receivers.items():
        if rank not in senders:
            continue
        split = shares(paths, specs, senders, sharable)
        send = _p2p(pg, receiver, receive=False)
        if rank == senders[0]:
            others = {i for s in senders[1:] for i in split[s]}
            sent += send_message(tree, send, others, pending)
        else:
            sent += send_tensors([tensors[i] for i in split[rank]], send, pending)
    wait_all(pending)
    return sent


def adopt(carrier: Carrier, message: StateMessage,
          in_place: dict[str, bool] | None = None) -> None:
    """Make ``message`` (a donor's, or this rank's own from the last generation's
    objects) this rank's state. ``in_place``: the modules whose every tensor was
    received into their own."""
    state = carrier.state
    try:
        for name, obj in state.objects.items():
            sd = message.objects[name]
            if isinstance(obj, torch.nn.Module) and (in_place or {}).get(name) \
                    and set(sd) == set(sharding.module_tensors(obj)) \
                    and all(isinstance(v, torch.Tensor) for v in sd.values()):
                continue  # every tensor arrived in place
            if isinstance(obj, torch.nn.Module):
                sharding.load_module_pieces(obj, sd)
            elif isinstance(obj, torch.optim.Optimizer):
                obj.load_state_dict(sharding.optimizer_pieces_rehomed(obj, sd))
            else:
                obj.load_state_dict(sd)
        state.cursor = Cursor.from_tree(message.cursor)
        state.extra = dict(message.extra)
        rng.restore(message.rng)
        carrier.rollback.adopt(message.grads, message.modes)
        carrier.layouts.adopt(message.layouts)
        carrier.per_rank_generators = {g for g in message.per_rank_generators
                                       if g in rng.GENERATORS}
        carrier.per_rank_objects = {n for n in message.per_rank_objects
                                    if n in state.objects} | state.per_rank
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise WireError(f"the received state does not fit this script's: {e}") from None


def _device_of(state: State, path: tuple[Any, ...]) -> torch.device:
    """Where a received tensor without a counterpart here goes: an optimizer's state
    on its parameters' device, anything else on the CPU."""
    if len(path) >= 2 and path[0] == "objects":
        obj = state.objects.get(path[1])
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    return p.device
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                return p.device
    return torch.device("cpu")


# ---------------------------------------------------------------- the agreement


Predecessor = Callable[[int], Optional[per_rank.Entry]]


def agree_and_transfer(carrier: Carrier, fresh: bool,
                       predecessor: Predecessor | None = None,
                       copies: BuddyCopies | None = None,
                       most_donors: int = 0) -> TransferStats:
    """On the current default group: agree on the committed state and bring every rank
    to it (``compare`` in the result: the replicas are to be compared next).

    Args:
        carrier: this rank's state.
        fresh: the job's first generation (no rank can have received anything yet).
        predecessor: a newcomer's access to what its rank's previous process recorded
            on this node (:mod:`tp_launch.resilient.per_rank`), by step.
        copies: the buddy copies (:mod:`tp_launch.resilient.copies`) to go back to when
            no survivor holds some rank's pieces; the same on every rank (None or not).
        most_donors: the most ranks sending to one receiver (0: every holder of its
            state); the same on every rank.

    Raises:
        StateLost: no rank can provide the committed state exactly.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    state, rollback = carrier.state, carrier.rollback
    t0 = time.monotonic()
    held = state.holds_committed
    holds = fresh or (held and rollback.restore())
    own = rollback.rng if rollback.rng is not None else rng.capture()
    words = rng.digests(own)
    initial = rng.digests(carrier.initial_rng)
    used = sum(1 << i for i, g in enumerate(rng.GENERATORS) if words[g] != initial[g])
    buffers = buffers_digest(rollback.committed_buffers())
    used |= (buffers != carrier.initial_buffers) << _BUFFERS_BIT
    # Built state: the modules' only (an optimizer's state appears at its first step, a
    # newcomer's has none). Otherwise any DTensor means the state cannot travel.
    sharded = [] if fresh else \
        sharding.dtensor_paths(state.modules if state.build is not None else state.objects)
    mine = Holding(step=state.step if holds else -1, own_step=state.step if held else -1,
                   used=used, buffers=buffers, sharded=len(sharded),
                   generators=tuple(words[g] for g in rng.GENERATORS))
    gathered = torch.zeros(world * Holding.width(len(rng.GENERATORS)), dtype=torch.int64)
    all_gather_flat(gathered, mine.to_tensor())
    rows = Holding.rows(gathered, world)
    built = state.build is not None
    classes = sharding.copy_classes(state.modules, world) \
        if not fresh and built and any(r.sharded for r in rows) else None
    # Every rank decides alike, from the same rows: none waits in a collective another
    # rank skips.
    agreement = decide(rows, fresh=fresh, copies=copies is not None, built=built,
                       classes=classes, example=sharded[0] if sharded else None,
                       most_donors=most_donors)
    top, plan = agreement.step, agreement.plan
    stats = TransferStats(step=top, agree_s=time.monotonic() - t0)
    if agreement.kind is Kind.FRESH:
        # Every rank is here: which generators were seeded differently is known now.
        carrier.per_rank_generators = set(agreement.per_rank_generators)
        unknown = state.per_rank - set(state.objects)
        if unknown:
            raise ResilientUsageError(f"State(per_rank=...) names {sorted(unknown)}, which "
                                      "are not registered objects")
        extra = sharding.extra_state_holders(state.objects)
        if extra:
            # Not carried, and not received either: what set_extra_state() takes is the
            # module's to decode (pickled, for some), and nothing off the network is.
            raise ResilientUsageError(
                f"{extra[0]} keeps state in get_extra_state(), which resilient mode does "
                "not carry: a newcomer would go on without it; keep it in buffers, or run "
                "without --spares")
        carrier.per_rank_objects = differing_objects(state, world) | state.per_rank
        state.took_committed()
        return stats
    if agreement.kind is Kind.FROM_COPIES:
        assert copies is not None
        return _back_to_copies(carrier, copies, stats, pg)
    donors = list(agreement.donors)
    t1 = time.monotonic()
    if rank in plan:
        own_buffers = [b.clone() if b is not None else None
                       for b in rollback.committed_buffers()]
        stats.donor = plan[rank]
        stats.bytes = recv_state(carrier, pg, plan[rank], agreement.senders[rank][1:])
    else:
        stats.bytes = serve(carrier, pg, rank, agreement.senders)
    # Every rank alike: the plan is the same everywhere, and so are the objects each
    # rank keeps its own (a receiver has the donor's list now).
    from_copy = False
    if copies is not None and plan and carrier.per_rank_objects:
        everyone, from_copy = _own_objects_from_copies(carrier, copies, plan, top, pg)
        if not everyone and _copies_reach(copies, rank, world):
            # A receiver's own objects have no copy of the committed step (its holder's
            # copy of it was still on its way when the rank died): every rank goes back
            # to the latest step the copies hold, exact, as when a shard is lost. With
            # no such step the receiver goes on with the donor's, and says so below.
            return _back_to_copies(carrier, copies, stats, pg)
    if rank in plan:
        mine_at_top = None
        if rows[rank].own_step == top:
            mine_at_top = per_rank.Entry(top, False, own, own_buffers)
        elif predecessor is not None:
            mine_at_top = predecessor(top)
        stats.inexact = _own_state(carrier, rows, donors, own, mine_at_top, from_copy)
    stats.transfer_s = time.monotonic() - t1
    state.took_committed()
    if plan:
        logger.info("rank %s: state at step %s %s (%d bytes, %.3f s)", rank, top,
                    f"received from rank {plan[rank]}" if rank in plan else "sent",
                    stats.bytes, stats.transfer_s)
    stats.compare = True
    return stats


_BUFFERS_BIT = len(rng.GENERATORS)
_SETTLE_S = 60.0  # the last exchange of copies: its peers are gone or in this generation


def _back_to_copies(carrier: Carrier, copies: BuddyCopies, stats: TransferStats,
                    pg: PeerGroup) -> TransferStats:
    """Some rank's pieces are held by no survivor: every rank goes back to the latest
    snapshot step all can reach, from its own snapshot or its holder's copy of it
    (:mod:`tp_launch.resilient.copies`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    rows = copy_rows(copies, rank, world)
    try:
        step, plan = copy_plan(rows, copies.holders(world))
    except CopiesLost as e:
        raise StateLost(str(e)) from None
    stats.step, stats.agree_s = step, stats.agree_s + time.monotonic() - t0
    t1 = time.monotonic()
    served = [receiver for receiver, holder in plan.items() if holder == rank]
    serving = _Background(lambda: sum(copies.serve(step, _p2p(pg, r, receive=False))
                                      for r in served)) if served else None
    if rank in plan:
        stats.donor = plan[rank]
        stats.bytes = recv_state(carrier, pg, plan[rank])
    else:
        adopt(carrier, StateMessage.from_tree(copies.own_state(step)))
    if serving is not None:
        stats.bytes += serving.result()
    stats.transfer_s = time.monotonic() - t1
    carrier.state.took_committed()
    logger.info("rank %s: back to step %s from buddy copies (%s, %d bytes, %.3f s)", rank,
                step, f"received from rank {plan[rank]}" if rank in plan else "its own",
                stats.bytes, stats.transfer_s)
    stats.compare = True
    return stats


def _copies_reach(copies: BuddyCopies, rank: int, world: int) -> bool:
    """Whether the buddy copies hold a step every rank can go back to. Collective."""
    try:
        copy_plan(copy_rows(copies, rank, world), copies.holders(world))
    except CopiesLost:
        return False
    return True


def _own_objects_from_copies(carrier: Carrier, copies: BuddyCopies, plan: dict[int, int],
                             step: int, pg: PeerGroup) -> tuple[bool, bool]:
    """The receivers were served by donors of their pieces (HSDP replica peers), whose
    own objects (a data loader's position) are not the receivers': each receiver whose
    holder survived with a copy of ``step`` gets its own objects from that copy.
    Collective (every rank gathers the copy rows). Whether every receiver got its own
    (alike on every rank), and whether this rank did."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = copy_rows(copies, rank, world)
    holders = copies.holders(world)
    served = {r: holders[r] for r in sorted(plan)
              if holders[r] not in plan and step in rows[holders[r]].ward}
    names = sorted(carrier.per_rank_objects)
    for receiver, holder in served.items():
        if holder == rank:
            copies.serve(step, _p2p(pg, receiver, receive=False), objects=names)
    everyone = len(served) == len(plan)
    if rank not in served:
        return everyone, False
    _, tree = receive_message(_p2p(pg, served[rank], receive=True))
    try:
        for name in names:
            carrier.state.objects[name].load_state_dict(tree[name])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise WireError(f"the buddy copy's objects do not fit this script's: {e}") from None
    return everyone, True


def copy_rows(copies: BuddyCopies, rank: int, world: int) -> list[CopyRow]:
    """Every rank's :class:`CopyRow`, once the exchange in flight has ended (or not
    within ``_SETTLE_S``: what it was receiving is then not counted). Collective."""
    if not copies.settle(timeout=_SETTLE_S):
        logger.warning("rank %s: the last exchange of buddy copies did not end within "
                       "%.0f s; what it was receiving is not counted", rank, _SETTLE_S)
    gathered = torch.zeros(world * CopyRow.width(), dtype=torch.int64)
    all_gather_flat(gathered, copies.row().to_tensor())
    return CopyRow.rows(gathered, world)


class _Background:
    """A function run on a thread of its own; :meth:`result` waits for it and raises
    what it raised (a holder serves a newcomer while it receives from another)."""

    def __init__(self, fn: Callable[[], int]) -> None:
        self._result = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], int]) -> None:
        try:
            self._result = fn()
        except BaseException as e:
            self._error = e

    def result(self) -> int:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def buffers_digest(buffers: Sequence[torch.Tensor | None]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for b in buffers:
        h.update(b"-" if b is None else tensor_bytes(b))
    return int.from_bytes(h.digest(), "little", signed=True)


def _buffers_now(state: State) -> int:
    return buffers_digest([b for m in state.modules.values()
                           for _, b in sharding.persistent_buffers(m)])


def _own_state(carrier: Carrier, rows: list[Holding], donors: list[int],
               own: rng.RngState, mine: per_rank.Entry | None,
               own_objects: bool = False) -> list[str]:
    """A receiver took the donor's state; put back what is this rank's own (generators
    seeded per rank, module buffers), from its own commit at the agreed step or its
    predecessor's record of it (``own_objects``: its own objects came from a buddy
    copy already). Returns what could not be had and mattered."""
    used = 0
    for d in donors:  # a receiver's own row says nothing: it may hold no commit at all
        used |= rows[d].used
    lost: list[str] = []
    keep_own: set[str] = set()
    from_mine: set[str] = set()
    for i, g in enumerate(rng.GENERATORS):
        if g not in carrier.per_rank_generators:
            continue  # replicated: the donor's is this rank's
        if mine is not None:
            from_mine.add(g)
        else:
            keep_own.add(g)
            if used & (1 << i):
                lost.append(f"{g} generator")  # drawn from: its state mattered
    rng.restore(own, keep_own)
    if mine is not None and from_mine:
        rng.restore(mine.generators, from_mine)
    restored = mine is not None and mine.buffers is not None and \
        carrier.rollback.set_buffers(mine.buffers)
    if not restored and used & (1 << _BUFFERS_BIT):
        lost.append("module buffers")
    # Each rank's own objects (a data stream of its own) came from the donor unless a
    # buddy copy (--shard-copy-every) had this rank's.
    if not own_objects:
        lost += sorted(carrier.per_rank_objects)
    if lost:
        logger.warning("rank %s: its own %s at step %s died with its previous process; it "
                       "goes on with a donor's (results may differ from a run without the "
                       "failure)", dist.get_rank(), " and ".join(lost), rows[donors[0]].step)
    return lost


__all__ = ["Carrier", "PeerGroup", "StateLost", "TransferStats", "adopt",
           "agree_and_transfer", "buffers_digest", "copy_rows", "donor_plan", "recv_pieces",
           "recv_state", "send_pieces", "send_state", "serve", "shares"]
