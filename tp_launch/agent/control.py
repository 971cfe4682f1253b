"""The failure decisions of resilient mode, kept apart from the process plumbing.

A :class:`Generation` is what every node of the job agrees on: which node holds which
rank, where the generation's store is, which ranks get a new process. A :class:`World`
is one node's side of it: which of its slots (processes) holds which of its ranks, which
slots are parked spares. The agent feeds them what it observes and they answer with
decisions:

- :func:`place`: give every rank that lost its process a node with a parked spare:
  the rank's own node first for a dead process, a spare node first for a lost node,
  then the other nodes; None when there are not enough spares;
- :func:`evacuate`: homes for every rank of a node that will go away (a preemption
  notice, a failed health check, ``tp-run migrate --node``);
- :meth:`World.apply`: take a generation on this node: keep the processes whose rank
  stayed, promote parked spares into the new ranks, release the rest;
- :class:`CrashLoop`: a rank that fails with an error again at the step of the previous
  error failure is a script bug, not a machine failure: stop instead of draining the
  pool;
- :class:`SpareRestarts`: spares that keep dying young are started again ever later
  (exponential backoff), not in a loop.

Generations only grow; a process is told the generation number with every announcement
and ignores anything older than what it holds. On one node the agent is the only
writer; across nodes the rendezvous backend's compare-and-swap on the generation is the
fencing token (:mod:`tp_launch.agent.generations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rendezvous.state import StateError
from tp_launch.agent.recovery_report import FailedRank


@dataclass
class Generation:
    """One generation of the job, as every node sees it.

    Args:
        gen: the generation number (the fencing token).
        ranks: global rank -> id of the node that holds it.
        store: (address, port) of the store the generation's group forms on.
        replaced: ranks that get a new process in this generation.
        reason: why it was opened ("start", "failure", "node loss", "migration").
        boundary: a planned migration's step: ranks stop right after committing it.
    """

    gen: int
    ranks: dict[int, str]
    store: tuple[str, int]
    replaced: list[int] = field(default_factory=list)
    reason: str = "start"
    boundary: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def ranks_of(self, node: str) -> list[int]:
        return sorted(r for r, n in self.ranks.items() if n == node)

    @property
    def nodes(self) -> list[str]:
        """Nodes that hold a rank, in the order of their lowest rank."""
        seen: dict[str, None] = {}
        for rank in sorted(self.ranks):
            seen.setdefault(self.ranks[rank], None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        return {"ranks": {str(r): n for r, n in self.ranks.items()},
                "store": f"{self.store[0]}:{self.store[1]}", "replaced": self.replaced,
                "reason": self.reason, "boundary": self.boundary}

    @staticmethod
    def from_json(gen: int, d: dict[str, Any]) -> Generation:
        """The placement read back from the rendezvous state; StateError (a KVError: the
        readers' path for a backend that answers nonsense) if anything is off."""
        try:
            addr, _, port = d["store"].rpartition(":")
            ranks = {int(r): n for r, n in d["ranks"].items()}
            replaced = list(d.get("replaced", []))
            reason, boundary = d.get("reason", "?"), d.get("boundary")
            ok = all(type(n) is str for n in ranks.values()) and type(reason) is str \
                and all(type(r) is int for r in replaced) \
                and (boundary is None or type(boundary) is int)
            store = (addr, int(port))
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise StateError(f"malformed placement of generation {gen}: {str(d)[:200]!r}")
        return Generation(gen, ranks, store, replaced, reason, boundary)


def place(lost: dict[int, str], ranks: dict[int, str], parked: dict[str, int],
          order: list[str]) -> dict[int, str] | None:
    """New homes for ranks that lost their process.

    Args:
        lost: rank -> the node it was on.
        ranks: the current placement (rank -> node).
        parked: node -> parked spares it has.
        order: the nodes to try, best first.

    Returns:
        The new placement, or None (nothing changes) when too few spares are parked.
        The ranks of one node move together to the first node that can take them all;
        only when none can are they spread.
    """
    free = {n: parked.get(n, 0) for n in order}
    new = dict(ranks)
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(lost.items()):
        by_node.setdefault(node, []).append(rank)
    for group in by_node.values():
        home = next((n for n in order if free[n] >= len(group)), None)
        for rank in group:
            target = home or next((n for n in order if free[n] > 0), None)
            if target is None:
                return None
            free[target] -= 1
            new[rank] = target
    return new


def evacuate(node: str, ranks: dict[int, str], parked: dict[str, int],
             others: list[str]) -> dict[int, str] | None:
    """The placement that moves every rank of ``node`` to parked spares elsewhere.

    Args:
        node: the node whose ranks move.
        ranks: the current placement (rank -> node).
        parked: node -> parked spares it has.
        others: the other live nodes to try, best first (spare nodes, then the nodes
            that hold ranks).

    Returns:
        The new placement (all to one node if one can take them all, else spread), or
        None when too few spares are parked elsewhere. With no other node at all, the
        node's own parked spares, if there are enough (the placement stays: every rank
        gets a new process on the same node).
    """
    mine = {r: n for r, n in ranks.items() if n == node}
    if not mine:
        return None
    order = [n for n in others if n != node]
    if order:
        return place(mine, ranks, parked, order)
    return dict(ranks) if parked.get(node, 0) >= len(mine) else None


@dataclass
class Placed:
    """What :meth:`World.apply` did on this node (rank -> slot)."""

    promoted: dict[int, int] = field(default_factory=dict)  # a spare took the rank
    released: dict[int, int] = field(default_factory=dict)  # the slot's rank left it
    unplaced: list[int] = field(default_factory=list)       # no spare parked for it yet


def failures_served(replaced: list[int], dead_here: dict[int, FailedRank],
                    placed: Placed) -> list[FailedRank]:
    """The failures a generation decided by another node stands for on this node, by
    rank: the ranks it replaced (this node's record of each where it has one), and this
    node's dead ranks that it gives a home although the deciding node did not know of
    them (an outage): a spare at once, or the next spare to park (the deciding node
    may have taken this node's parked spare for one of its own ranks)."""
    served = [dead_here.get(r, FailedRank(r)) for r in replaced]
    served += [dead_here[r] for r in (*placed.promoted, *placed.unplaced)
               if r in dead_here and r not in replaced]
    return sorted(served, key=lambda f: f.rank)


@dataclass
class World:
    """This node's processes in the current generation.

    Args:
        node: this node's id.
    """

    node: str
    gen: int = -1
    slot_of: dict[int, int] = field(default_factory=dict)  # rank -> slot (this node's)
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

    def apply(self, g: Generation, failed: Callable[[int], bool]) -> Placed:
        """Take generation ``g``: a rank of this node keeps its slot unless it is
        replaced or ``failed`` (its process's failure was acted on: an outage kept it out
        of ``g``); the others get parked spares (the longest-parked first) or wait in
        ``unplaced``.

        A process that died since the agent last looked is not ``failed`` yet: its rank
        keeps the slot, and its exit, seen next, is a failure of that rank like any
        other (``--spare-policy`` and all). Taking a spare for it here would let it
        skip the policy, and its exit would then pass for a parked spare's death."""
        done = Placed()
        mine = set(g.ranks_of(self.node))
        for rank, slot in list(self.slot_of.items()):
            if rank not in mine or rank in g.replaced or failed(slot):
                done.released[rank] = self.slot_of.pop(rank)
        for rank in sorted(mine - set(self.slot_of)):
            if self.parked:
                self.slot_of[rank] = done.promoted[rank] = self.parked.pop(0)
            else:
                done.unplaced.append(rank)
        self.gen = g.gen
        return done

    def fill(self, rank: int) -> int | None:
        """Give an unplaced rank of the current generation a spare that parked since."""
        if not self.parked:
            return None
        self.slot_of[rank] = self.parked.pop(0)
        return self.slot_of[rank]


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


@dataclass
class SpareRestarts:
    """When to start a new spare after one died: at once after a spare that lived, then
    exponentially later while they keep dying young (a script that cannot run as a
    spare, a broken device, a spare killed as soon as it parks), up to ``cap_s``.

    A young death is one within ``stable_s`` of the spare's start. Only the first death
    of a streak is worth the user's attention (:meth:`died` says which).
    """

    base_s: float = 1.0
    cap_s: float = 120.0
    stable_s: float = 60.0
    streak: int = 0  # young deaths in a row
    not_before: float = 0.0  # monotonic time before which no spare starts

    def died(self, lifetime: float, now: float) -> float:
        """A spare died after ``lifetime`` seconds: the delay before the next start."""
        if lifetime >= self.stable_s:
            self.streak = 0
        self.streak += 1
        delay = 0.0 if self.streak == 1 else min(self.base_s * 2 ** (self.streak - 2),
                                                 self.cap_s)
        self.not_before = now + delay
        return delay

    @property
    def first_of_streak(self) -> bool:
        return self.streak == 1

    def ready(self, now: float) -> bool:
        return now >= self.not_before
