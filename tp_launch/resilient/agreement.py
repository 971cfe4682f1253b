"""The agreement after a failure: from every rank's row, the state the job goes on from.

When a generation's group is built every rank first brings itself back to its last
commit (:mod:`tp_launch.resilient.rollback`), then all the ranks all-gather one
:class:`~tp_launch.resilient.wire.Holding` row each: the committed step the rank can
provide (-1: none, a promoted spare, or a rank whose commit cannot be restored), its
last commit restorable or not (``own_step``), which of its generators and buffers were
used, how many sharded tensors (DTensors) its state holds, and one digest per random
generator. :func:`decide` turns those rows, which every rank has alike, and a few facts
every rank shares into one :class:`Agreement`. It is a pure function: every rank reaches
the same decision, so no rank ever waits in a collective a peer decided to skip.
:func:`tp_launch.resilient.transfer.agree_and_transfer` gathers the rows and carries
the decision out.

The rule, in this order (the first that applies decides):

1. **The job's first generation** (``fresh``): no rank can have received anything yet;
   every rank's own state is the state, :attr:`Kind.FRESH`. The ranks must be at the
   same step (a checkpoint loaded by some ranks only is an error: :class:`StateLost`).
   This is the one time every rank is present with the generators it seeded, so the
   generators whose digests differ between the rows are each rank's own
   (:func:`per_rank_generators`); later they are put back per rank, never taken from a
   donor.
2. Some rank's state holds sharded tensors but is not built with ``State(build=...)``:
   such a state cannot be rebuilt on a newcomer, :class:`StateLost`
   (:func:`tp_launch.resilient.sharding.not_recovered`'s line).
3. No rank holds the state (every row's step is -1) and there are no buddy copies:
   every rank that held it died, or cannot roll back. :class:`StateLost`, never a
   silent start from scratch.
4. The ranks' counts of sharded tensors differ (``build`` must make the same objects on
   every rank): :class:`StateLost`.
5. No rank holds the state, but buddy copies exist (:mod:`tp_launch.resilient.copies`):
   every rank goes back to them, :attr:`Kind.FROM_COPIES`.
6. Otherwise the highest committed step wins, :attr:`Kind.TRANSFER`: the ranks at it
   are the donors and every other rank receives from one (:func:`donor_plan`).
   Replicated (data-parallel) state may come from any donor; sharded state only from a
   donor of the receiver's **copy class**, the ranks that hold the same pieces (HSDP's
   replica peers: :func:`tp_launch.resilient.sharding.copy_classes`). Receivers are
   spread over their class's donors round-robin, so several newcomers are served in
   parallel by different donors; the other donors of its class send it a share of the
   large tensors at the same time (:func:`senders`). A receiver whose pieces no donor holds (plain FSDP
   keeps one copy of each shard; under HSDP every replica of it died) sends every rank
   back to the buddy copies when they exist (:attr:`Kind.FROM_COPIES`), else it is
   :class:`StateLost`. When every rank is at the highest step the plan is empty:
   nothing moves.

The step a recovery from buddy copies goes back to is not decided here: it needs a
second gather, of every rank's snapshots (:func:`tp_launch.resilient.copies.copy_plan`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from tp_launch.resilient import rng, sharding
from tp_launch.resilient.wire import Holding


class StateLost(RuntimeError):
    """No rank can provide the committed state exactly: the job must not go on."""


class Kind(enum.Enum):
    """What the ranks do with the state they hold."""

    FRESH = "fresh"  # the job's first generation: every rank's own state is the state
    TRANSFER = "transfer"  # the ranks at the highest step send it to the others
    FROM_COPIES = "from_copies"  # every rank goes back to the buddy copies


@dataclass(frozen=True)
class Agreement:
    """What every rank decided alike from the gathered rows (see the module's docstring).

    ``step``: the step every rank is at after a fresh start, the highest committed step
    otherwise (-1: no rank holds one; a recovery from buddy copies picks its own step
    later). ``donors``, ``plan`` (receiver -> donor; empty when no rank is behind) and
    ``senders`` (receiver -> its donor and the donors that share the sending,
    :func:`senders`) are a transfer's; ``per_rank_generators`` a fresh start's.
    """

    kind: Kind
    step: int
    donors: tuple[int, ...] = ()
    plan: dict[int, int] = field(default_factory=dict, hash=False)
    per_rank_generators: frozenset[str] = frozenset()
    senders: dict[int, tuple[int, ...]] = field(default_factory=dict, hash=False)


def decide(rows: Sequence[Holding], *, fresh: bool, copies: bool, built: bool,
           classes: Sequence[Any] | None, example: str | None = None,
           generators: Sequence[str] = rng.GENERATORS, most_donors: int = 0) -> Agreement:
    """The agreement of the ranks whose gathered rows are ``rows`` (rank order).

    Args:
        rows: every rank's :class:`Holding`, the same on every rank.
        fresh: the job's first generation.
        copies: buddy copies exist (``--shard-copy-every``); the same on every rank.
        built: the state is built with ``State(build=...)``.
        classes: each rank's copy class of the sharded modules' pieces
            (:func:`tp_launch.resilient.sharding.copy_classes`); None: no sharded state.
            Read only when ``built`` and some row holds sharded tensors.
        example: one path of this rank's sharded tensors, named in the message of a
            sharded state without ``build`` (the only thing here that may differ
            between ranks: the decision does not).
        generators: the names of the generator digests in a row's ``generators``.
        most_donors: the most ranks sending to one receiver (0: all that can).

    Raises:
        StateLost: no rank can provide the committed state exactly (the rule's cases).
    """
    steps = [r.step for r in rows]
    top = max(steps)
    if fresh:
        if len(set(steps)) > 1:
            raise StateLost("the ranks start at different steps "
                            f"({dict(enumerate(steps))}): load the same checkpoint everywhere")
        return Agreement(Kind.FRESH, top,
                         per_rank_generators=per_rank_generators(rows, generators))
    if any(r.sharded for r in rows) and not built:
        # Every rank decides alike (a newcomer's model is not sharded yet): none waits.
        raise StateLost(sharding.not_recovered(max(r.sharded for r in rows), example))
    if top < 0 and not copies:
        raise StateLost("no rank holds the training state any more (every rank that "
                        "held it failed, or was cut off after its optimizer step)")
    counts = {r.sharded for r in rows}
    if len(counts) > 1:
        raise StateLost(f"the ranks' built states differ: {sorted(counts)} sharded tensors "
                        "(State(build=...) must build the same objects on every rank)")
    if top < 0:
        return Agreement(Kind.FROM_COPIES, top)
    classes = classes if counts != {0} else None
    try:
        plan = donor_plan(steps, classes)
    except StateLost:
        if not copies:
            raise
        return Agreement(Kind.FROM_COPIES, top)
    donors = tuple(r for r, s in enumerate(steps) if s == top)
    return Agreement(Kind.TRANSFER, top, donors, plan,
                     senders=senders(plan, donors, classes, most_donors))


def per_rank_generators(rows: Sequence[Holding],
                        generators: Sequence[str] = rng.GENERATORS) -> frozenset[str]:
    """The generators the ranks seeded differently: their digests differ between the
    rows (read at a fresh start, when every rank is present with what it seeded)."""
    return frozenset(g for i, g in enumerate(generators)
                     if len({row.generators[i] for row in rows}) > 1)


def donor_plan(steps: Sequence[int], classes: Sequence[Any] | None = None) -> dict[int, int]:
    """Receiver -> donor. The ranks at the highest step are the donors; a receiver is
    served by a donor of its copy class (``classes[r]``: the ranks holding the same
    pieces of sharded state; None: all state replicated), round-robin within the class,
    so that several newcomers are served in parallel by different donors.

    Raises:
        StateLost: a receiver's pieces are held by no donor (plain FSDP keeps one copy;
            under HSDP every replica of that shard was lost).
    """
    top = max(steps)
    donors = [r for r, s in enumerate(steps) if s == top]
    plan: dict[int, int] = {}
    served: dict[Any, int] = {}
    orphans = []
    for r, s in enumerate(steps):
        if s == top:
            continue
        key = None if classes is None else classes[r]
        mine = [d for d in donors if classes is None or classes[d] == key]
        if not mine:
            orphans.append(r)
            continue
        plan[r] = mine[served.get(key, 0) % len(mine)]
        served[key] = served.get(key, 0) + 1
    if orphans:
        raise StateLost(f"the sharded state of rank(s) {orphans} is held by no surviving "
                        "rank (plain FSDP keeps one copy of each shard; HSDP lost every "
                        "replica of it)")
    return plan


def senders(plan: dict[int, int], donors: Sequence[int],
            classes: Sequence[Any] | None = None, most: int = 0) -> dict[int, tuple[int, ...]]:
    """Receiver -> the ranks that send it the state: its donor in ``plan`` first (it
    sends the document), then the other donors of its copy class, in rank order from the
    one after it, so that several receivers' second senders differ too; at most ``most``
    in all (0: every donor of its class). The large tensors are shared among them
    (:func:`tp_launch.resilient.transfer.shares`): the newcomer receives from all at once."""
    out: dict[int, tuple[int, ...]] = {}
    for receiver, first in plan.items():
        key = None if classes is None else classes[receiver]
        mine = [d for d in donors if classes is None or classes[d] == key]
        i = mine.index(first) if first in mine else 0
        order = [first] + [d for d in mine[i + 1:] + mine[:i] if d != first]
        out[receiver] = tuple(order[:most] if most > 0 else order)
    return out


__all__ = ["Agreement", "Kind", "StateLost", "decide", "donor_plan", "per_rank_generators",
           "senders"]
