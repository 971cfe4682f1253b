"""The resilient agent's recovery decisions, as pure functions of what it knows.

Each function takes a snapshot of the attempt's facts (plain values: the generation,
this node's ranks, the pending recovery, the view of the job) and an event (exits, a
view, a recovery to place) and returns a typed decision. Nothing here reads a clock, a
file, a socket or the rendezvous backend, and nothing here changes the attempt: the
executor (:class:`~tp_launch.agent.recovery.Recoverer`, driven by the loop of
:mod:`tp_launch.agent.resilient_agent`) gathers the facts, asks, and performs the
answer. The shape is torch elastic's dynamic rendezvous (operations that return an
action, one executor that performs it) and this project's own
:mod:`rendezvous.decisions` + :mod:`rendezvous.join`; ``tests/test_agent_decisions.py``
drives them over tables of events, with no process.

The decisions:

- :class:`Phase`: the attempt's lifecycle (running, exiting after every rank finished,
  ended after the exit barrier), with its transitions in one table;
- :class:`Pending`: a recovery decided but not yet published (no spare parked anywhere
  yet: ``--spare-policy wait``; the backend unreachable: deferred);
- :func:`judge_exits`: which of the processes that exited are failures of the job, and
  whether they are recovered, handed to torchrun's way, or a crash loop that stops it;
- :func:`plan_recovery`: the next generation for ranks that lost their process, or why
  there is none (the state is lost; no spare parked: the policy);
- :func:`judge_view`: what the job's state, read from the backend, asks of this node
  (stop, apply another node's generation, end the job, move a lost node's ranks, retry
  a pending recovery);
- :func:`lost_addresses`: whose TCP connections this node's workers shut when they
  take a generation (the nodes it replaced as lost);
- :func:`migration_refusal`, :func:`node_migration_refusal`: why a planned migration
  cannot happen now (``None``: it can);
- :func:`attempt_settled`: the attempt ends with success.

Placement itself (which node and slot a rank goes to) is :mod:`tp_launch.agent.control`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Sequence

from rendezvous.state import member_addr
from tp_launch.agent.control import CrashLoop, Generation
from tp_launch.worker_settings import RECOVERY_WAIT_S

# ---------------------------------------------------------------- the lifecycle


class Phase(enum.Enum):
    """Where an attempt is in its life.

    RUNNING: its ranks train (or a plain script runs); failures are recovered.
    EXITING: every rank of the job finished (or the job was marked complete): the
    processes are told to exit; a death now is torchrun's business, not a recovery.
    ENDED: every rank exited 0 after the exit barrier: parked spares may leave.
    """

    RUNNING = "running"
    EXITING = "exiting"
    ENDED = "ended"


_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RUNNING: frozenset({Phase.EXITING}),
    Phase.EXITING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}


class BadTransition(RuntimeError):
    """A phase change the lifecycle does not have (a bug in the agent)."""


def next_phase(now: Phase, to: Phase) -> Phase:
    """``to``, if the lifecycle goes from ``now`` to it (staying put is allowed)."""
    if to is not now and to not in _TRANSITIONS[now]:
        raise BadTransition(f"attempt phase {now.value} -> {to.value}")
    return to


# ---------------------------------------------------------------- a pending recovery


@dataclass
class Pending:
    """A recovery that has no generation yet, for either of two reasons (both may hold:
    a wait for a spare that then meets an outage).

    no_spare: rank -> node, no spare parked anywhere (``--spare-policy wait``), since
    ``no_spare_since`` (wall time of the first failure), given up at ``deadline``
    (monotonic).
    no_backend: rank -> node, decided while the rendezvous backend was unreachable
    (multi-node), since ``no_backend_since``: published when it answers.
    """

    no_spare: dict[int, str] = field(default_factory=dict)
    no_spare_since: float = 0.0
    deadline: float = 0.0
    no_backend: dict[int, str] = field(default_factory=dict)
    no_backend_since: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.no_spare or self.no_backend)

    @property
    def ranks(self) -> dict[int, str]:
        """Every rank the pending recovery stands for (rank -> node)."""
        return {**self.no_spare, **self.no_backend}

    @property
    def since(self) -> float:
        """When the failure it recovers was detected (wall time)."""
        return self.no_spare_since if self.no_spare else self.no_backend_since


# ---------------------------------------------------------------- exits


@dataclass(frozen=True)
class Exit:
    """A process of this node that exited, as the agent saw it.

    ``rank``: the rank it held (None: a spare, or a rank that migrated away);
    ``retired``: its rank left it (a migration): its exit is no failure;
    ``hello``: it reached ``tp_launch.resilient.run()``; ``step``: its last committed
    step on the progress board.
    """

    slot: int
    rank: int | None
    returncode: int
    hello: bool = True
    retired: bool = False
    step: int = -1


ExitOutcome = Literal["none", "torchrun", "recover", "crash_loop"]


@dataclass
class ExitVerdict:
    """What a batch of exits means (see :func:`judge_exits`)."""

    outcome: ExitOutcome = "none"
    failures: list[Exit] = field(default_factory=list)  # ranks that failed, in order
    spares_lost: list[Exit] = field(default_factory=list)  # spares that died
    plain: bool = False  # a rank ended without ever saying hello: spares are unused
    loop: Exit | None = None  # the failure that makes it a crash loop


def backend_to_blame(outage_s: float, since_outage_s: float,
                     wait_s: float = RECOVERY_WAIT_S) -> bool:
    """Ranks may have waited for a generation only the unreachable backend could bring,
    and given up (after ``wait_s``, the ranks' recovery wait): their errors say nothing
    about the script while the backend is, or lately was, unreachable."""
    return outage_s > 0 or since_outage_s < wait_s + 5


def judge_exits(exits: Sequence[Exit], resilient: bool, phase: Phase,
                blame_backend: bool, crash: CrashLoop) -> ExitVerdict:
    """Which exits fail the job, and how the job goes on.

    A spare's death (or a retired rank's exit) is not a failure of the job. A rank that
    exits 0 after the exit barrier, or a plain script's rank that exits 0, ended
    normally. Any other rank exit is a failure: torchrun's way (stop, restart every
    worker) when the script is not resilient or training is over; else recovered,
    unless an error exit (not a signal) comes at or before the step of the previous
    error exit while the backend is not to blame: a crash loop (``crash`` keeps that
    step, across calls).
    """
    verdict = ExitVerdict()
    for e in exits:
        if e.rank is None:
            if not e.retired:
                verdict.spares_lost.append(e)
            continue
        if not e.hello:
            verdict.plain = True
        if e.returncode == 0 and (phase is not Phase.RUNNING or not e.hello):
            continue
        verdict.failures.append(e)
    if not verdict.failures:
        return verdict
    if not resilient or phase is not Phase.RUNNING:
        verdict.outcome = "torchrun"
        return verdict
    verdict.outcome = "recover"
    for e in verdict.failures:
        if not blame_backend and crash.is_loop(e.returncode, e.step):
            verdict.outcome, verdict.loop = "crash_loop", e
            break
    return verdict


# ---------------------------------------------------------------- a recovery


@dataclass(frozen=True)
class StateLost:
    """No surviving rank holds the committed state: the job cannot go on exactly."""

    detail: str


@dataclass(frozen=True)
class NoSpare:
    """Not enough spares are parked anywhere for ``lost``: ``--spare-policy`` decides."""

    lost: dict[int, str]


@dataclass(frozen=True)
class Publish:
    """Publish ``generation``, which gives every lost rank a parked spare."""

    generation: Generation
    local: list[int]  # the lost ranks that were this node's


RecoveryPlan = StateLost | NoSpare | Publish


def plan_recovery(lost: Mapping[int, str], node: str, gen: Generation,
                  holders: Iterable[int], hung: Iterable[int], parked_here: int,
                  store: tuple[str, int],
                  place_elsewhere: Callable[[dict[int, str]], dict[int, str] | None]
                  ) -> RecoveryPlan:
    """The generation that replaces ``lost`` ranks (rank -> the node it was on: this
    node's own, or a lost node's), given the current generation ``gen``.

    The state is lost when no rank that keeps its process is on another node and none
    of this node's surviving ranks holds the committed state (``holders``). This node's
    parked spares take its own dead ranks when there are enough of them; otherwise
    ``place_elsewhere(lost)`` (the only look outside: the job's view of parked spares,
    through :func:`~tp_launch.agent.control.place`) finds homes, None: not enough. The
    reason is "hang" when every local rank was killed as hung, "failure" for any other
    local death, "node loss" when none was this node's.
    """
    lost = dict(lost)
    local = sorted(r for r, n in lost.items() if n == node)
    elsewhere = [r for r, n in gen.ranks.items() if r not in lost and n != node]
    if not elsewhere and not set(holders) - set(lost):
        return StateLost(f"rank(s) {sorted(lost)} failed and no other rank held the "
                         "training state")
    ranks: dict[int, str] | None = gen.ranks  # this node's spares take its dead ranks
    if len(local) < len(lost) or parked_here < len(lost):
        ranks = place_elsewhere(lost)
    if ranks is None:
        return NoSpare(lost)
    reason = "failure" if local else "node loss"
    if local and set(local) <= set(hung):
        reason = "hang"
    return Publish(Generation(gen.gen + 1, ranks, store, sorted(lost), reason), local)


def placement_order(node: str, lost: Mapping[int, str], spare_nodes: Sequence[str],
                    nodes: Sequence[str], alive: Iterable[str]) -> list[str]:
    """The nodes a lost rank may go to, best first: this node for its own dead ranks,
    then live spare nodes, then every other live node of the job (never a lost one)."""
    alive, gone = set(alive), set(lost.values())
    order = [node] if node in gone else []
    order += [n for n in [*spare_nodes, *nodes] if n in alive and n not in order
              and n not in gone]
    return order


# ---------------------------------------------------------------- the job's view


@dataclass(frozen=True)
class ViewFacts:
    """What a read of the job's state says (a :class:`~tp_launch.agent.generations.View`,
    reduced to what the decision reads)."""

    generation: Generation
    alive: frozenset[str]
    failed: str | None = None
    final: bool = False
    complete: bool = False
    all_finished: bool = False
    broken: str | None = None


ViewStop = Literal["broken", "failed"]


@dataclass
class ViewDecision:
    """What :func:`judge_view` asks of this node, performed in this order."""

    stop: ViewStop | None = None  # stop every process here; the reason is the view's
    apply: Generation | None = None  # another node's newer generation
    end: bool = False  # every rank finished: tell every process to exit
    move: dict[int, str] = field(default_factory=dict)  # a lost node's ranks to move
    lost_nodes: list[str] = field(default_factory=list)
    retry: bool = False  # retry the pending recovery


def lost_addresses(previous: Generation, g: Generation, node: str) -> tuple[str, ...]:
    """The addresses this node's workers shut their TCP connections to when they take
    ``g`` (:attr:`tp_launch.channel.NewGeneration.lost_addrs`): those of the nodes that
    held ranks in ``previous`` and hold none in ``g``, lost (a planned migration's
    ``boundary`` means the leaving node hands its state over: never cut). An address
    that is also a node of ``g``'s, or this node's own (nodes sharing one address, on
    one machine), is never cut: that would cut live peers too."""
    if g.boundary is not None:
        return ()
    kept = {member_addr(n) for n in (*g.nodes, node)}
    gone = {member_addr(n) for n in previous.nodes if n not in g.ranks.values()}
    return tuple(sorted(a for a in gone - kept if a))


# After this node was cut off from the backend, how long nodes missing from it are not
# taken for lost. If the backend's own host was cut off, every lease expired there, and
# each node comes back when its own TCP retransmission does (backoff: up to several
# seconds after a 10 s cut); the first back saw everyone else missing. A node that was
# not cut off decides at once (a vanished host: its lease TTL, seconds).
LOST_GRACE_S = 15.0


def judge_view(view: ViewFacts, node: str, applied_gen: int, phase: Phase,
               pending: Pending, cut_off_s: float = float("inf")) -> ViewDecision:
    """What this node does about the job's state.

    The backend refusing this node, or a node asking for a stop or a restart (before
    the end), stops it. A newer generation is applied. A complete job, or one whose
    ranks all finished, ends. Nodes of the generation whose lease expired lose their
    ranks: the lowest live node decides where they go (a race between deciders is
    settled by the compare-and-swap anyway); any other node with a pending recovery
    tries it again (a spare may have parked elsewhere, the backend may answer now). A
    recovery deferred for the backend is void once a newer generation is applied (it
    gave this node's dead ranks this node's spares); one waiting for a spare is not.
    ``cut_off_s``: seconds since this node was last cut off from the backend; within
    :data:`LOST_GRACE_S` of that, no node is taken for lost (the others may be on their
    way back, as this one was).
    """
    if view.broken:
        return ViewDecision(stop="broken")
    exiting = phase is not Phase.RUNNING
    if view.failed and not exiting:
        return ViewDecision(stop="failed")
    g = view.generation
    decision = ViewDecision(apply=g if g.gen > applied_gen else None)
    if view.complete or (g.nodes and view.all_finished):
        decision.end = not exiting
        return decision
    if exiting:
        return decision
    lost = [n for n in g.nodes if n not in view.alive]
    survivors = sorted(n for n in g.nodes if n in view.alive)
    if lost and survivors and survivors[0] == node and cut_off_s >= LOST_GRACE_S:
        decision.lost_nodes = lost
        decision.move = {r: n for r, n in g.ranks.items() if n in lost}
    elif pending.no_spare or (pending.no_backend and decision.apply is None):
        decision.retry = True
    return decision


# ---------------------------------------------------------------- planned migrations


def migration_refusal(rank: int, ranks_here: Iterable[int], recovering: bool,
                      parked: int) -> str | None:
    """Why rank ``rank`` cannot move to a parked spare of this node now (the reply to
    ``tp-run migrate --rank``), or None."""
    here = sorted(ranks_here)
    if rank not in here:
        return f"error: no rank {rank} on this node (ranks {here})"
    if recovering:
        return "error: a recovery is in progress; try again in a moment"
    if not parked:
        return "error: no spare is parked; try again when one is"
    return None


NodeMigration = Literal["ok", "retry", "impossible"]


def node_migration_refusal(draining: bool, ranks_here: int, unplaced: int,
                           resilient: bool, phase: Phase, pending: bool, recovering: bool
                           ) -> tuple[NodeMigration, str] | None:
    """Why this node's ranks cannot (or need not) move elsewhere now, with the outcome
    (see :meth:`~tp_launch.agent.recovery.Recoverer.migrate_node`), or None: look for
    homes."""
    if draining:
        return "ok", "ok: this node's ranks have moved already"
    if not ranks_here and not unplaced:
        return "ok", "ok: this node holds no rank; its spares take none from now on"
    if not resilient:
        return "impossible", ("error: the script does not use tp_launch.resilient: its "
                              "ranks cannot move")
    if phase is not Phase.RUNNING:
        return "impossible", "error: the job is ending"
    if pending or unplaced or recovering:
        return "retry", "error: a recovery is in progress; try again in a moment"
    return None


# ---------------------------------------------------------------- spares to start


# The longest a promoted spare's replacement waits for the recovered ranks' first step.
REPLACEMENT_WAIT_S = 10.0


def replacement_wait(step_s: float) -> float:
    """How long after a recovery's generation a promoted spare's replacement waits for
    the recovered ranks' first step (``step_s``: the job's recent step time, 0 unknown):
    three steps (the transfer, the first step and its comparison), at least 2 s, at most
    :data:`REPLACEMENT_WAIT_S`. Past it the replacement starts anyway: a first step that
    is slow for another reason, or a script that waits for a parked spare inside it,
    must not keep the pool short for long."""
    return min(REPLACEMENT_WAIT_S, max(2.0, 3 * step_s))


def spares_to_start(pool: int, unplaced: int, waiting: int, starting: int,
                    recovering: bool = False) -> int:
    """How many spare processes to start now on this node. ``pool``: the spares the node
    keeps (``--spares``); ``unplaced``: ranks of this generation with no process here;
    ``waiting``: ranks of this node that lost their process and wait for a spare
    (``--spare-policy wait``); ``starting``: spare processes started here, not dead,
    not holding a rank (starting or parked); ``recovering``: a recovery on this node
    whose ranks have not all committed their first step after it (for at most
    :func:`replacement_wait`).

    Ranks that wait for a spare get one started each, beside the pool: two ranks lost
    with ``--spares 1`` would otherwise wait for a second spare that never starts. The
    pool's replacement for a promoted spare waits until the recovered ranks have taken
    their first step: a process starting beside them takes CPU from that step (measured:
    the first step after a recovery took 1.5x a normal one with the replacement starting
    at once); a rank that needs a process now gets it at once."""
    return max(0, (0 if recovering else pool) + unplaced + waiting - starting)


# ---------------------------------------------------------------- the attempt's end


def attempt_settled(returncodes: Iterable[int | None], pending: bool, unplaced: bool,
                    phase: Phase, resilient: bool, has_ranks: bool) -> bool:
    """The attempt ends with success: every rank of this node exited 0, nothing is
    pending, and either the exit barrier was passed or a plain script's ranks ended.
    (A resilient rank gone before the barrier is a failure being recovered, never a
    success: its generation may still be on its way.)"""
    if any(rc != 0 for rc in returncodes) or pending or unplaced:
        return False
    return phase is Phase.EXITING or (has_ranks and not resilient)
