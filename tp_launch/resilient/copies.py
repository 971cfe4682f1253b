"""Buddy copies: each rank's committed state, also held in another rank's host memory.

Plain FSDP keeps one copy of each shard: when a rank dies, its shard of the parameters
and of the optimizer state, and everything that is its own (its data loader's position,
generators seeded per rank), exist nowhere else. With ``--shard-copy-every K``
(``State(build=...)`` scripts) every rank, when it enters a generation and at every
commit of a step that is a multiple of K:

1. copies its committed state (:meth:`Carrier.message`: every local piece, the
   position, the generators, every registered object's ``state_dict()``) into host
   memory: its **own snapshot**;
2. sends that snapshot to its **holder** in the background (a thread, over a gloo group
   made for the copies), while another thread receives its **ward**'s snapshot: the next
   step's compute overlaps both. The holder of rank r is ``r + ranks per node`` (another
   node) when the job spans nodes, else ``r + 1``, modulo the world size; r's ward is
   the rank whose holder r is.

At a generation's entry the exchange carries only what is missing (:func:`entry_exchange`:
every rank's :class:`CopyRow` gathered first): after a recovery the survivors already
hold their own snapshot of the step they resume at and their holders a copy of it, so
the newcomers' wards send them theirs and the newcomers snapshot their own for their
holders, which served them from it; nothing else moves.

A rank keeps its last :data:`CopyRow.KEPT` own snapshots and complete copies of its
ward's: the copy that was arriving when its sender died is torn, the one before it must
still be there. Training never waits for a copy: at a commit whose snapshot would start
while some rank's last exchange is still on its way, the snapshot is skipped, on every
rank alike (each due commit, the ranks vote on a gloo group of its own: one word, from
the training thread). So every rank's snapshots are of the same steps, and a new
exchange starts only once the last one has ended everywhere: the snapshot before the
one in flight is whole on every holder. (Skipped rank by rank, as at first, a loaded
machine left ranks with snapshots of different steps and no step every rank could go
back to.)

After a failure the agreement (:mod:`tp_launch.resilient.agreement`) first tries to
recover at the same step from live holders of every piece (replicated state, HSDP's
replica peers). Only when some rank's pieces are held by no survivor does every rank
gather a :class:`CopyRow`, and :func:`copy_plan` picks the latest snapshot step T that
every rank can go back to: from its own snapshot, or from its holder's copy of it.
Every rank goes back to T, survivors from their own snapshots, the others receiving
their holder's copy; the steps after T are computed again. T is the last committed
step when its copies had arrived (every step: the step in flight is the only one
recomputed); at most ``2K`` steps back, more when exchanges take longer than K steps.
No such T (a rank died with its holder, or before its first copy arrived):
:class:`StateLost`, and ``--spare-policy`` applies.

Cost, per rank: host memory for ``2 * KEPT`` copies of a rank's state (its shard of the
parameters and optimizer state and its own objects), one memory copy of it on the
training thread per snapshot, and one send plus one receive of it in the background.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tp_launch.resilient.sharding import map_tensors
from tp_launch.resilient.state import Cursor, GenerationChanged
from tp_launch.resilient.wire import CopyRow, Send, receive_message, send_message

logger = logging.getLogger(__name__)


class CopiesLost(RuntimeError):
    """No snapshot step every rank can go back to."""


def _shift(world: int, local_world: int) -> int:
    return local_world if 0 < local_world < world and world % local_world == 0 else 1


def holder_of(rank: int, world: int, local_world: int) -> int:
    """The rank that holds ``rank``'s copies: the same local rank on the next node when
    the job spans nodes (a node lost takes no copy with it), else the next rank."""
    return (rank + _shift(world, local_world)) % world


def ward_of(rank: int, world: int, local_world: int) -> int:
    """The rank whose copies ``rank`` holds (:func:`holder_of` inverted)."""
    return (rank - _shift(world, local_world)) % world


def copy_plan(rows: Sequence[CopyRow], holders: Sequence[int]) -> tuple[int, dict[int, int]]:
    """The step every rank goes back to, and receiver -> the holder that serves it.

    The latest step T held as an own snapshot by some rank such that every rank holds
    its own snapshot of T or its holder (another rank) holds a complete copy of it.

    Raises:
        CopiesLost: no such step.
    """
    steps = sorted({s for row in rows for s in row.own}, reverse=True)
    latest = ""
    for t in steps:
        plan: dict[int, int] = {}
        missing = []
        for r, row in enumerate(rows):
            if t in row.own:
                continue
            h = holders[r]
            if h != r and t in rows[h].ward:
                plan[r] = h
            else:
                missing.append(r)
        if not missing:
            return t, plan
        latest = latest or f" (at step {t}: rank(s) {missing})"
    raise CopiesLost("no buddy copy every rank can go back to" + latest +
                     ": a rank was lost together with the rank holding its copy, or "
                     "before its first copy arrived")


def entry_exchange(rows: Sequence[CopyRow], holders: Sequence[int], rank: int,
                   step: int) -> tuple[bool, bool]:
    """At a generation's entry at ``step``: whether ``rank`` sends its snapshot of it to
    its holder, and whether it receives its ward's. Only to a holder without a complete
    copy of it (a newcomer, or one whose copy was torn): both ends of each pair decide
    alike from the same rows."""
    ward = holders.index(rank)
    return (holders[rank] != rank and step not in rows[holders[rank]].ward,
            ward != rank and step not in rows[rank].ward)


def _step_of(tree: dict[str, Any]) -> int:
    return Cursor.from_tree(tree["cursor"]).step


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(tree, found.append)
    return found


def _host_copy(tree: Any, spare: Any = None) -> Any:
    """``tree`` with its tensors copied into host memory: into the tensors of ``spare``
    (a dropped copy of the same state) where they fit, else into new ones. Fresh pages
    cost a fault each: for a large shard, most of the copy's time."""
    pool = iter(_tensors(spare))

    def copy(t: torch.Tensor) -> torch.Tensor:
        old, t = next(pool, None), t.detach()
        if old is not None and old.shape == t.shape and old.dtype == t.dtype:
            return old.copy_(t)
        return t.to("cpu", copy=True)
    return map_tensors(tree, copy)


def _freeze(tree: Any, stepped_only: Callable[[tuple[Any, ...]], bool],
            path: tuple[Any, ...] = ()) -> Any:
    """``tree`` as it is now, for a copy taken later: its containers rebuilt, its
    tensors cloned but those only the optimizer step changes (kept live)."""
    if isinstance(tree, torch.Tensor):
        return tree if stepped_only(path) else tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _freeze(v, stepped_only, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_freeze(v, stepped_only, (*path, i)) for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_freeze(v, stepped_only, (*path, i)) for i, v in enumerate(tree))
    return tree


class BuddyCopies:
    """This rank's own snapshots and its copies of its ward's, and their exchange."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.own: dict[int, Any] = {}  # step -> the snapshot's tree (host tensors)
        self.ward: dict[int, Any] = {}  # step -> a complete copy of the ward's
        self._lock = threading.Lock()  # self.ward: written by the receiving thread
        self._threads: list[threading.Thread] = []
        self._copied = threading.Event()  # no snapshot is being copied in the background
        self._copied.set()
        self._pg: Any = None
        self._vote: Any = None  # whether every rank's last exchange ended: at commits
        self.rank = self.holder = self.ward_rank = 0
        self.world = self.local_world = 1

    def open(self, rank: int, world: int, local_world: int) -> None:
        """On every rank of a new generation, after its group is built (a collective):
        the group the copies travel on, and who holds whose."""
        self._pg = dist.new_group(backend="gloo")
        # Not the copy group: its worker threads may be busy with the exchange, which
        # the vote must not wait for.
        self._vote = dist.new_group(backend="gloo")
        self.rank, self.world, self.local_world = rank, world, local_world
        self.holder = holder_of(rank, world, local_world)
        self.ward_rank = ward_of(rank, world, local_world)

    def holders(self, world: int) -> list[int]:
        """Every rank's holder in a world of ``world`` ranks."""
        return [holder_of(r, world, self.local_world) for r in range(world)]

    def close(self) -> None:
        """Training stopped: let go of the generation's copy group (its peers blocked
        in an exchange with this rank are released when the groups are destroyed)."""
        self._pg = self._vote = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def snapshot(self, message: Callable[[], Any],
                 stepped_only: Callable[[tuple[Any, ...]], bool] | None = None) -> None:
        """At a due commit, on every rank (a collective: the vote): copy the committed
        state (``message()``: its tree) and start its exchange, unless some rank's last
        exchange is still on the way: then every rank skips it. Training never waits
        for a copy's exchange, and a holder that hangs does not hang its ward beyond the
        next collective (the hang detection must find the one that is stuck).

        ``stepped_only``: which tensors of the tree only the optimizer step changes
        (:meth:`tp_launch.resilient.state.State.stepped_only`'s, by path). Given, only the
        rest is copied here (small: buffers, the position...); those (the parameters and
        the optimizer's state, nearly all of it) are copied on the exchange's thread
        while the next iteration's forward and backward run, and the optimizer step
        waits for that copy (:meth:`copied`, from its pre-hook)."""
        if self._pg is None:
            return
        ended = torch.tensor([0 if any(t.is_alive() for t in self._threads) else 1])
        try:
            dist.all_reduce(ended, op=dist.ReduceOp.MIN, group=self._vote)
        except Exception as e:  # a peer died: the commit stands, the next check says so
            logger.info("buddy copy skipped: the vote failed (%s)", e)
            return
        if not int(ended.item()):
            logger.debug("buddy copy skipped: a rank's last one is still on its way")
            return
        if stepped_only is None:
            tree = self._own_snapshot(message)
            self._exchange(tree, _step_of(tree), receive=True)
            return
        live = message()
        step = _step_of(live)
        frozen = _freeze(live, stepped_only)
        del live
        self._exchange(None, step, receive=True, copy=frozen)

    def copied(self) -> None:
        """Wait until the snapshot being copied on the exchange's thread is complete (the
        optimizer step is about to change what it reads)."""
        self._copied.wait()

    def enter(self, step: int, message: Callable[[], Any],
              rows: Callable[[], Sequence[CopyRow]]) -> None:
        """On every rank of a new generation at ``step`` (the last exchange ended:
        :meth:`settle`): hold the generation's first state. ``rows()`` gathers every
        rank's row (a collective); this rank's own snapshot of ``step`` is taken unless
        it has one (the state it went back to, or committed and rolled back to), and
        only what a holder lacks is exchanged (:func:`entry_exchange`)."""
        if self._pg is None:
            return
        send, receive = entry_exchange(rows(), self.holders(self.world), self.rank, step)
        if step in self.own:
            self.own = _keep(self.own, step, CopyRow.KEPT)
            tree = self.own[step]
        else:
            tree = self._own_snapshot(message)
        self._exchange(tree if send else None, step, receive)

    def _own_snapshot(self, message: Callable[[], Any]) -> Any:
        """The committed state copied into host memory, kept as this rank's own."""
        return self._keep_own(message())

    def _keep_own(self, live: Any) -> Any:
        step = _step_of(live)
        kept = _keep(self.own, step - 1, CopyRow.KEPT - 1)
        tree = _host_copy(live, _dropped(self.own, kept))
        self.own = {**kept, step: tree}
        return tree

    def _exchange(self, tree: Any, step: int, receive: bool, copy: Any = None) -> None:
        """Send ``tree`` (None: nothing) to the holder and, with ``receive``, take the
        ward's copy of ``step``, in the background. ``copy``: a tree to copy into this
        rank's own snapshot first, on the sending thread, then send."""
        with self._lock:  # room for the copy about to arrive
            ward = _keep(self.ward, step - 1 if receive else step,
                         CopyRow.KEPT - 1 if receive else CopyRow.KEPT)
            spare = _dropped(self.ward, ward)
            self.ward = ward
        if self.holder == self.ward_rank == self.rank:
            return  # a world of one: nobody to hold it
        pg = self._pg
        self._threads = []
        if copy is not None:
            self._copied.clear()
            self._threads.append(threading.Thread(target=self._copy_and_send, args=(pg, copy),
                                                  daemon=True, name="tp-run buddy copy send"))
        elif tree is not None:
            self._threads.append(threading.Thread(target=self._send, args=(pg, tree),
                                                  daemon=True, name="tp-run buddy copy send"))
        if receive:
            self._threads.append(threading.Thread(target=self._receive, args=(pg, spare),
                                                  daemon=True,
                                                  name="tp-run buddy copy receive"))
        for t in self._threads:
            t.start()

    def settle(self, timeout: float | None = None,
               stale: Callable[[], bool] | None = None) -> bool:
        """Wait for the exchange in flight; whether it ended (False: ``timeout`` passed).

        Raises:
            GenerationChanged: ``stale()`` turned true while waiting.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            while t.is_alive():
                if stale is not None and stale():
                    raise GenerationChanged("a newer generation was announced")
                if deadline is not None and time.monotonic() > deadline:
                    return False
                t.join(0.05)
        self._threads = []
        return True

    def row(self) -> CopyRow:
        with self._lock:
            ward = sorted(self.ward, reverse=True)
        return CopyRow(tuple(sorted(self.own, reverse=True)), tuple(ward))

    def own_state(self, step: int) -> Any:
        """This rank's own snapshot of ``step``, copied (what adopts it may keep the
        tensors, and the snapshot must stay as it was)."""
        return map_tensors(self.own[step], torch.clone)

    def serve(self, step: int, send: Send,
              objects: Sequence[str] | None = None) -> int:
        """Send the ward's copy of ``step`` (``objects``: only those registered objects
        of it, by name); returns the tensor bytes sent."""
        with self._lock:
            tree = self.ward[step]
        if objects is not None:
            tree = {n: tree["objects"][n] for n in objects}
        return send_message(tree, send)

    def _copy_and_send(self, pg: Any, frozen: Any) -> None:
        try:
            with torch.no_grad():
                tree = self._keep_own(frozen)
        finally:
            self._copied.set()
        self._send(pg, tree)

    def _send(self, pg: Any, tree: Any) -> None:
        try:
            send_message(tree, lambda t: pg.send([t], self.holder, 0).wait())
        except Exception as e:  # the holder died, or the generation ended
            logger.info("buddy copy to rank %s not sent: %s", self.holder, e)

    def _receive(self, pg: Any, spare: Any) -> None:
        def recv(t: torch.Tensor) -> None:
            pg.recv([t], self.ward_rank, 0).wait()

        try:
            _, copy = receive_message(recv, _tensors(spare))
            step = _step_of(copy)
        except Exception as e:  # torn: the ward died, or the generation ended
            logger.info("buddy copy from rank %s not received: %s", self.ward_rank, e)
            return
        with self._lock:
            self.ward = _keep({**self.ward, step: copy}, step, CopyRow.KEPT)


def _dropped(copies: dict[int, Any], kept: dict[int, Any]) -> Any:
    """One of the copies ``kept`` leaves out (its memory is reused), or None."""
    gone = [s for s in copies if s not in kept]
    return copies[max(gone)] if gone else None


def _keep(copies: dict[int, Any], newest: int, count: int) -> dict[int, Any]:
    """The ``count`` latest copies up to ``newest`` (a later one belongs to a timeline
    the job went back from)."""
    steps = sorted((s for s in copies if s <= newest), reverse=True)[:count]
    return {s: copies[s] for s in steps}


__all__ = ["BuddyCopies", "CopiesLost", "copy_plan", "entry_exchange", "holder_of",
           "ward_of"]
