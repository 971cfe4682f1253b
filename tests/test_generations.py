"""One node's generations (tp_launch.agent.generations.LocalGenerations), without processes:
the single-node side of the recovery path that multi-node jobs share."""

from __future__ import annotations

import pytest

from rendezvous import RendezvousInfo
from rendezvous.static import StaticRendezvous
from tp_launch.agent.control import Generation
from tp_launch.agent.generations import (
    LOCAL_NODE,
    LocalGenerations,
    open_generations,
    shared_membership,
)

pytestmark = pytest.mark.unit


def _info(world_size: int = 3) -> RendezvousInfo:
    return RendezvousInfo(round=0, node_rank=0, nnodes=1, rank_offset=0,
                          world_size=world_size, master_addr="127.0.0.1", master_port=29500,
                          use_agent_store=True)


def test_the_first_generation_puts_every_rank_on_this_node():
    gens = LocalGenerations(_info())
    g = gens.initial()
    assert (g.gen, g.ranks, g.store) == (0, {0: LOCAL_NODE, 1: LOCAL_NODE, 2: LOCAL_NODE},
                                         ("127.0.0.1", 29500))
    assert gens.store == ("127.0.0.1", 29500) and gens.fd is None


def test_a_publish_always_wins_and_the_view_follows_it():
    gens = LocalGenerations(_info())
    new = Generation(1, gens.initial().ranks, gens.store, [2], "failure")
    assert gens.publish(new)
    view = gens.view()
    assert view.generation is new
    assert (view.alive, view.spare_nodes, view.failed, view.broken) == ({LOCAL_NODE}, [],
                                                                        None, None)
    assert not view.complete


def test_finishing_the_current_generation_finishes_the_job():
    gens = LocalGenerations(_info())
    assert not gens.view().all_finished()
    gens.mark_finished(0)
    assert gens.view().all_finished()
    gens.publish(Generation(1, gens.initial().ranks, gens.store, [0], "failure"))
    assert not gens.view().all_finished()  # finished in an older generation


def test_one_node_never_waits_for_a_backend():
    gens = LocalGenerations(_info())
    assert gens.outage_s() == 0.0 < gens.outage_timeout
    assert not gens.finish_pending
    assert gens.parked() == {}
    gens.set_parked(2)  # nobody else to tell
    gens.report_failure("rank 0 failed", final=True)
    gens.flush()
    gens.mark_complete()
    gens.close()


def test_the_first_generation_stays_the_first():
    gens = LocalGenerations(_info())
    first = gens.initial()
    gens.publish(Generation(1, first.ranks, gens.store, [1], "failure"))
    assert gens.initial() is first and gens.view().generation.gen == 1


def test_a_fixed_world_has_no_multi_node_hooks_and_its_own_generations():
    rdzv = StaticRendezvous("job", nnodes=1, node_rank=0, master_addr="127.0.0.1",
                            master_port=0)
    assert rdzv.fd is None and rdzv.world_change() is None and rdzv.exit_barrier() is None
    rdzv.report_failure("rank 0 exited with 1")  # nobody else to tell
    rdzv.accept_spare_nodes()
    assert shared_membership(rdzv) is None
    assert isinstance(open_generations(rdzv, _info()), LocalGenerations)
