"""The failure decisions of resilient mode, kept apart from the process plumbing.

A :class:`World` is this node's view of the current generation: which slot (process)
holds which rank, which slots are parked spares. The agent feeds it what it observes
(deaths, spares that parked) and it answers with decisions:

- :meth:`World.replace`: give every dead rank a parked spare (the longest-parked first)
  and open generation g+1, or say that there are not enough spares;
- :meth:`World.migrate`: a planned migration of one rank to a spare at a step boundary;
- :class:`CrashLoop`: a rank that fails with an error again at the step of the previous
  error failure is a script bug, not a machine failure: stop instead of draining the
  pool.

Generations only grow; a process is told the generation number with every
announcement and ignores anything older than what it holds (the fencing token on one
node; across nodes the rendezvous backend's compare-and-swap plays that part).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class World:
    """Ranks and spares of the current generation on this node.

    Args:
        world_size: ranks in the job.
        rank_offset: global rank of this node's first rank.
    """

    world_size: int
    rank_offset: int = 0
    gen: int = 0
    slot_of: dict[int, int] = field(default_factory=dict)  # rank -> slot
    parked: list[int] = field(default_factory=list)  # spare slots, longest parked first

    def rank_of(self, slot: int) -> int | None:
        for rank, s in self.slot_of.items():
            if s == slot:
                return rank
        return None

    def park(self, slot: int) -> None:
        if slot not in self.parked:
            self.parked.append(slot)

    def unpark(self, slot: int) -> None:
        if slot in self.parked:
            self.parked.remove(slot)

    def replace(self, dead_ranks: list[int]) -> dict[int, int] | None:
        """Promote one parked spare per dead rank; returns rank -> new slot, or None
        (nothing changed) when too few spares are parked."""
        if len(self.parked) < len(dead_ranks):
            return None
        promoted = {rank: self.parked.pop(0) for rank in sorted(dead_ranks)}
        self.slot_of.update(promoted)
        self.gen += 1
        return promoted

    def migrate(self, rank: int) -> tuple[int, int] | None:
        """Move ``rank`` to a parked spare; returns (old slot, new slot), or None."""
        if rank not in self.slot_of or not self.parked:
            return None
        old = self.slot_of[rank]
        self.slot_of[rank] = self.parked.pop(0)
        self.gen += 1
        return old, self.slot_of[rank]


@dataclass
class CrashLoop:
    """Detects a script that fails the same way at the same step, however often it is
    given a new process.

    Only error exits count (exit status > 0): a process killed by a signal (SIGKILL, the
    OOM killer, a lost GPU's driver) is a machine failure and always recovered.
    """

    last_error_step: int | None = None

    def is_loop(self, exitcode: int, step: int) -> bool:
        if exitcode <= 0:
            return False
        looping = self.last_error_step is not None and step <= self.last_error_step
        self.last_error_step = step
        return looping
