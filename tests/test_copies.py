"""Buddy copies' decisions (tp_launch/resilient/copies.py), without processes: who holds
whose copy, which step a recovery goes back to, what is kept. The copies travelling
between real FSDP ranks are in test_sharded.py."""

from __future__ import annotations

import pytest
import torch

from tp_launch.resilient.copies import (
    CopiesLost,
    _keep,
    copy_plan,
    entry_exchange,
    holder_of,
    ward_of,
)
from tp_launch.resilient.wire import CopyRow, WireError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("world, local_world", [(2, 2), (4, 4), (4, 2), (8, 4), (6, 4), (3, 1)])
def test_every_rank_has_one_holder_and_one_ward(world, local_world):
    holders = [holder_of(r, world, local_world) for r in range(world)]
    assert sorted(holders) == list(range(world))  # a permutation: each holds one copy
    assert all(h != r for r, h in enumerate(holders))
    assert all(ward_of(h, world, local_world) == r for r, h in enumerate(holders))


def test_the_holder_is_on_another_node_when_there_is_one():
    # 2 nodes x 4 ranks: rank r's copy is on the other node, losing a node loses none.
    for r in range(8):
        assert holder_of(r, 8, 4) // 4 != r // 4
    assert holder_of(1, 4, 4) == 2  # one node: the next rank


def rows(*spec: tuple[tuple[int, ...], tuple[int, ...]]) -> list[CopyRow]:
    return [CopyRow(own, ward) for own, ward in spec]


HOLDERS_4 = [1, 2, 3, 0]  # holder_of(r, 4, 4)


def test_the_latest_step_every_rank_can_reach():
    # Rank 1 died (a newcomer holds nothing); rank 2 holds its copies of 8 and 4.
    plan = copy_plan(rows(((8, 4), (8, 4)), ((), ()), ((8, 4), (8, 4)), ((8, 4), (8, 4))),
                     HOLDERS_4)
    assert plan == (8, {1: 2})


def test_a_torn_latest_copy_goes_back_one_snapshot():
    # Rank 1 died while its copy of 8 was on the way: rank 2 has only 4 complete.
    plan = copy_plan(rows(((8, 4), (8, 4)), ((), ()), ((8, 4), (4,)), ((8, 4), (8, 4))),
                     HOLDERS_4)
    assert plan == (4, {1: 2})


def test_a_survivor_behind_is_served_by_its_holder_or_all_go_back():
    # Rank 3 had not taken its snapshot of 8 when rank 1 died: it has to go back too
    # unless rank 0 holds a copy of 8 of it, which it cannot without rank 3 sending it.
    plan = copy_plan(rows(((8, 4), (4,)), ((), ()), ((8, 4), (8, 4)), ((4,), (8, 4))),
                     HOLDERS_4)
    assert plan == (4, {1: 2})


def test_two_newcomers_served_by_their_own_holders():
    plan = copy_plan(rows(((5,), (5,)), ((), ()), ((5,), (5,)), ((), ())), HOLDERS_4)
    assert plan == (5, {1: 2, 3: 0})


def test_a_rank_lost_with_its_holder_is_lost():
    with pytest.raises(CopiesLost, match=r"at step 8: rank\(s\) \[1\]"):
        copy_plan(rows(((8, 4), (8, 4)), ((), ()), ((), ()), ((8, 4), (8, 4))), HOLDERS_4)
    with pytest.raises(CopiesLost, match="no buddy copy"):
        copy_plan(rows(((), ()), ((), ())), [1, 0])


def test_copy_rows_travel_as_int64_words():
    sent = [CopyRow((8, 4), (8,)), CopyRow((), ())]
    gathered = torch.cat([r.to_tensor() for r in sent])
    assert gathered.numel() == 2 * CopyRow.width()
    assert CopyRow.rows(gathered, 2) == sent
    with pytest.raises(WireError):
        CopyRow.rows(gathered[:-1], 2)


def test_kept_copies_are_the_latest_up_to_the_current_step():
    copies = {4: "a", 8: "b", 12: "c"}
    assert _keep(copies, 12, 2) == {12: "c", 8: "b"}
    # The job went back to 8: the copy of 12 belongs to a timeline that is gone.
    assert _keep(copies, 8, 2) == {8: "b", 4: "a"}
    assert _keep(copies, 7, 1) == {4: "a"}


def exchanges(spec: list[CopyRow], holders: list[int], step: int) -> list[tuple[bool, bool]]:
    return [entry_exchange(spec, holders, r, step) for r in range(len(holders))]


def test_a_fresh_generation_exchanges_everything():
    assert exchanges(rows(*[((), ())] * 4), HOLDERS_4, 0) == [(True, True)] * 4


def test_after_a_recovery_only_what_a_holder_lacks_moves():
    # Rank 1 came back at step 8 from rank 2's copy: rank 2 holds it still; rank 1 holds
    # no copy of its ward, rank 0, which sends it; nobody else moves anything.
    after = rows(((8, 4), (8, 4)), ((), ()), ((8, 4), (8, 4)), ((8, 4), (8, 4)))
    assert exchanges(after, HOLDERS_4, 8) == [(True, False), (False, True), (False, False),
                                              (False, False)]
    # Two newcomers, 1 and 2 (1 holds 0's copy, 2 holds 1's): 0 sends to 1, 1 to 2.
    two = rows(((8,), (8,)), ((), ()), ((), ()), ((8,), (8,)))
    assert exchanges(two, HOLDERS_4, 8) == [(True, False), (True, True), (False, True),
                                            (False, False)]


def test_both_ends_of_every_pair_agree():
    import itertools

    for world, local_world in [(2, 2), (4, 4), (4, 2), (6, 3)]:
        holders = [holder_of(r, world, local_world) for r in range(world)]
        for wards in itertools.product([(), (5,), (5, 3)], repeat=world):
            spec = [CopyRow((5,), w) for w in wards]
            got = exchanges(spec, holders, 5)
            for r in range(world):  # r sends to its holder iff the holder receives
                assert got[r][0] == got[holders[r]][1]
    # A world of one keeps its own snapshot only.
    assert entry_exchange([CopyRow((), ())], [0], 0, 3) == (False, False)
