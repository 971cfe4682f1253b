"""The agreement's rule (tp_launch/resilient/agreement.py), without processes: from the
gathered rows, a fresh start, a transfer (donors, receiver -> donor), a return to buddy
copies, or StateLost. The collectives that carry it out are in test_transfer.py,
test_resilient.py and test_sharded.py."""

from __future__ import annotations

from typing import Any, Sequence

import pytest

from tp_launch.resilient.agreement import (
    Agreement,
    Kind,
    StateLost,
    decide,
    donor_plan,
    per_rank_generators,
)
from tp_launch.resilient.rng import GENERATORS
from tp_launch.resilient.state import Possession, State
from tp_launch.resilient.wire import Holding

pytestmark = pytest.mark.unit

SAME = (11, 22, 33, 44)  # one digest per generator of rng.GENERATORS


def row(step: int, sharded: int = 0, generators: Sequence[int] = SAME) -> Holding:
    """One rank's row as Holding.rows makes it (own_step, used, buffers: not read by
    the decision)."""
    return Holding(step=step, own_step=step, used=0, buffers=0, sharded=sharded,
                   generators=tuple(generators))


def rows(*steps: int, sharded: int = 0) -> list[Holding]:
    return [row(s, sharded) for s in steps]


HSDP_2x2 = [(0,), (1,), (0,), (1,)]  # two replicas of two shards: ranks 0/2, 1/3 alike
FSDP_4 = [(0,), (1,), (2,), (3,)]  # one copy of each shard


@pytest.mark.parametrize("rows_, kwargs, expected", [
    # The job's first generation: every rank's own state is the state.
    (rows(0, 0, 0), {"fresh": True}, Agreement(Kind.FRESH, 0)),
    (rows(7, 7), {"fresh": True}, Agreement(Kind.FRESH, 7)),  # a checkpoint, loaded by all
    # Survivors at the top step, newcomers at -1: donors round-robin.
    (rows(5, -1), {}, Agreement(Kind.TRANSFER, 5, (0,), {1: 0}, senders={1: (0,)})),
    (rows(5, 5, 5), {}, Agreement(Kind.TRANSFER, 5, (0, 1, 2), {})),  # nothing moves
    # Every other donor sends a share too, the second senders spread alike.
    (rows(5, -1, 5, -1), {}, Agreement(Kind.TRANSFER, 5, (0, 2), {1: 0, 3: 2},
                                       senders={1: (0, 2), 3: (2, 0)})),
    (rows(-1, 5, 5, -1, -1), {}, Agreement(Kind.TRANSFER, 5, (1, 2), {0: 1, 3: 2, 4: 1},
                                           senders={0: (1, 2), 3: (2, 1), 4: (1, 2)})),
    (rows(5, -1, 5, 5), {"most_donors": 2},
     Agreement(Kind.TRANSFER, 5, (0, 2, 3), {1: 0}, senders={1: (0, 2)})),
    # A survivor behind (its rollback failed) receives like a newcomer.
    (rows(5, 4, -1), {}, Agreement(Kind.TRANSFER, 5, (0,), {1: 0, 2: 0},
                                   senders={1: (0,), 2: (0,)})),
    # HSDP: a receiver is served by a replica peer of its own shard.
    (rows(5, -1, -1, 5, sharded=3), {"built": True, "classes": HSDP_2x2},
     Agreement(Kind.TRANSFER, 5, (0, 3), {1: 3, 2: 0}, senders={1: (3,), 2: (0,)})),
    # Three replicas of two shards: a receiver's other senders hold its own shard.
    (rows(5, 5, -1, 5, 5, -1, sharded=3),
     {"built": True, "classes": [(0,), (1,), (0,), (1,), (0,), (1,)]},
     Agreement(Kind.TRANSFER, 5, (0, 1, 3, 4), {2: 0, 5: 1}, senders={2: (0, 4), 5: (1, 3)})),
    # Plain FSDP lost a shard, buddy copies exist: every rank goes back to them.
    (rows(5, -1, 5, 5, sharded=2), {"built": True, "classes": FSDP_4, "copies": True},
     Agreement(Kind.FROM_COPIES, 5)),
    # Nobody holds the state, buddy copies exist.
    (rows(-1, -1), {"copies": True}, Agreement(Kind.FROM_COPIES, -1)),
    (rows(-1, -1, sharded=2), {"built": True, "classes": HSDP_2x2[:2], "copies": True},
     Agreement(Kind.FROM_COPIES, -1)),
])
def test_the_decision(rows_: list[Holding], kwargs: dict[str, Any], expected: Agreement):
    args: dict[str, Any] = {"fresh": False, "copies": False, "built": False, "classes": None}
    assert decide(rows_, **{**args, **kwargs}) == expected


@pytest.mark.parametrize("rows_, kwargs, message", [
    (rows(0, 3), {"fresh": True},
     r"^the ranks start at different steps \(\{0: 0, 1: 3\}\): load the same checkpoint "
     r"everywhere$"),
    (rows(-1, -1), {},
     r"^no rank holds the training state any more \(every rank that held it failed, or "
     r"was cut off after its optimizer step\)$"),
    # Sharded without State(build=...): whatever else holds (copies too).
    (rows(5, -1, sharded=2), {"copies": True, "example": "model.0.weight"},
     r"^the training state holds 2 sharded tensor\(s\) \(DTensor, model.0.weight among "
     r"them: FSDP2, tensor parallelism\), which resilient mode does not recover peer to "
     r"peer yet$"),
    ([row(5, 4), row(-1, 0)], {},
     r"^the training state holds 4 sharded tensor\(s\) \(DTensor: FSDP2"),
    # The ranks built different objects: copies do not help either.
    ([row(5, 2), row(-1, 3)], {"built": True, "classes": FSDP_4[:2], "copies": True},
     r"^the ranks' built states differ: \[2, 3\] sharded tensors \(State\(build=\.\.\.\) "
     r"must build the same objects on every rank\)$"),
    # Plain FSDP lost a shard and there are no copies; HSDP lost both replicas of one.
    (rows(5, -1, 5, 5, sharded=2), {"built": True, "classes": FSDP_4},
     r"^the sharded state of rank\(s\) \[1\] is held by no surviving rank \(plain FSDP keeps "
     r"one copy of each shard; HSDP lost every replica of it\)$"),
    (rows(5, -1, 5, -1, sharded=2), {"built": True, "classes": HSDP_2x2},
     r"rank\(s\) \[1, 3\] is held by no surviving rank"),
])
def test_the_state_is_lost(rows_: list[Holding], kwargs: dict[str, Any], message: str):
    args: dict[str, Any] = {"fresh": False, "copies": False, "built": False, "classes": None}
    with pytest.raises(StateLost, match=message):
        decide(rows_, **{**args, **kwargs})


def test_a_fresh_start_reads_neither_the_sharded_counts_nor_the_copies():
    # The first generation gathers no sharded counts (0 everywhere) and no rank is behind.
    got = decide(rows(0, 0), fresh=True, copies=True, built=True, classes=FSDP_4[:2])
    assert got.kind is Kind.FRESH and got.plan == {} and got.donors == ()


@pytest.mark.parametrize("digests, expected", [
    ([SAME, SAME, SAME], set()),
    ([SAME, (11, 22, 99, 44), SAME], {"python"}),  # python's random seeded by rank
    ([(1, 22, 33, 5), (2, 22, 33, 6)], {"torch", "numpy"}),
    ([(1, 2, 3, 4)], set()),  # one rank: nothing to tell apart
])
def test_the_generators_seeded_per_rank(digests: list[tuple[int, ...]], expected: set[str]):
    assert GENERATORS == ("torch", "cuda", "python", "numpy")
    gathered = [row(0, generators=d) for d in digests]
    assert per_rank_generators(gathered) == expected
    assert decide(gathered, fresh=True, copies=False, built=False,
                  classes=None).per_rank_generators == expected


def test_only_a_fresh_start_tells_the_per_rank_generators():
    gathered = [row(5, generators=(1, 2, 3, 4)), row(-1, generators=(5, 6, 7, 8))]
    assert decide(gathered, fresh=False, copies=False, built=False,
                  classes=None).per_rank_generators == frozenset()


@pytest.mark.parametrize("steps, classes, expected", [
    ([5, -1, -1, -1], None, {1: 0, 2: 0, 3: 0}),  # one donor serves every newcomer
    ([5, 5, -1, -1, -1, -1], None, {2: 0, 3: 1, 4: 0, 5: 1}),  # spread over the donors
    # Round-robin within each class: class (0,) has donors 0 and 1, class (1,) has 4.
    ([5, 5, -1, -1, 5, -1], [(0,), (0,), (0,), (0,), (1,), (1,)], {2: 0, 3: 1, 5: 4}),
])
def test_the_donor_plan(steps: list[int], classes: list[Any] | None,
                        expected: dict[int, int]):
    assert donor_plan(steps, classes) == expected


def test_the_old_imports_still_work():
    from tp_launch.resilient import transfer

    assert transfer.StateLost is StateLost and transfer.donor_plan is donor_plan


def test_possession_changes_only_through_the_state():
    state = State()
    assert state.possession is Possession.NOTHING and not state.holds_committed
    state.began(holding=True)
    assert state.possession is Possession.HOLDS and state.holds_committed
    state.lost_commit()
    assert state.possession is Possession.NOTHING
    state.took_committed()
    assert state.holds_committed
    state.began(holding=False)  # a spare
    assert state.possession is Possession.NOTHING
