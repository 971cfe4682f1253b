"""Failures that do not exit: which rank holds the job up, and which one drags it.

Pure decisions over what the progress board shows (:mod:`tp_launch.progress`: every
rank's committed step, heartbeat, stage and position in the collectives); the agent
(:mod:`tp_launch.agent.resilient_agent`) reads the board, asks, and acts. No I/O here, no
clock of its own: tests drive these with made-up marks and times.

**Progress.** The job progresses while some rank commits a step, issues a collective
(its collective count moves), changes stage or ends a long phase: :class:`ProgressClock`
says for how long it has not. It
also keeps the recent step times (the ``step_s`` of the commits it saw).

**Hangs** (:func:`assess`). Once the job has not progressed for the hang limit,
``max(--hang-timeout, FACTOR x the median recent step time)`` (before the attempt's first
commit: the startup budget, :attr:`HangPolicy.startup`), the culprit is, in this order:

1. a rank that stopped beating (no heartbeat for :attr:`HangPolicy.stale_s`): it is not
   running at all (SIGSTOP, a debugger, a process holding the interpreter lock);
2. a rank that is *behind*: an older generation, an earlier stage of it, or fewer
   collectives issued than the others. Ranks of one group issue the same collectives in
   the same order, so the ones ahead wait in a collective the culprit has not reached
   (it is stuck in its forward pass, its data loader, a lock). A rank whose collective
   timed out (``WAITING``) or that finished counts as ahead of everyone: it is never
   the culprit while the board shows a peer behind it.

When every rank is at the same place and beating (a deadlock everywhere, or a long phase
that nobody marked and that issues no collective), there is no culprit: after twice the
limit it is reported as a hang everywhere and ``--spare-policy`` decides. A rank inside a
phase the script marked long (``state.long_phase()``) exempts the job until the mark's
end. Ranks on other nodes are not on this node's board: a node compares its own ranks
first, and when none of them is behind another, the agent compares them with the other
nodes' ranks as they published them (``tp-run status``'s documents, every few seconds)
and kills only its own culprits (a hang everywhere across nodes is reported, not acted
on).

**Regrouping.** Ranks whose collectives all failed (every one timed out, or one was
slower than the group's timeout and the others gave up) while no process died wait for a
new generation that no death will bring: :func:`all_waiting` says so, and the agent
announces the same placement again (single node; across nodes the ranks give up after
``RECOVERY_WAIT_S`` and are replaced as dead ones).

A rank whose collective timed out while a peer's did not (the script's group timeout
shorter than the hang limit) waits for the verdict on that peer: the agent tells it so
(:func:`waiting_on_a_peer`), so that its own give-up time never makes it the one that
fails.

**A plain script** (one that does not use ``tp_launch.resilient``: no board) has only its
output to show: :class:`OutputClock` says how long no worker of the node wrote anything
(``/proc/<pid>/io``); past ``--hang-timeout`` (given explicitly: a quiet script is not
a hung one by default; before the first output, the startup budget) the workers are
ended with their stacks and restarted, torchrun's way
(:mod:`tp_launch.agent.node_agent`). Under ``--spares`` a script that has not said hello
within the startup budget is taken for a plain one.

**Stragglers** (:class:`Stragglers`). In a synchronous job every rank's step takes as
long as the slowest rank's, so step times cannot name it; positions can: the straggler
is the rank that is behind the others' collective count whenever one looks. Sampled at
every agent tick over a window, a rank's *share* is the fraction of samples in which it
was behind. If a rank needs ``k`` times the others' time per step, it is behind for about
``1 - 1/k`` of each step while the others are behind for next to nothing; so a rank whose
share exceeds the others' median share by ``1 - 1/k`` (``k``: ``--straggler-factor``) for a
whole window, over enough steps, is a straggler. Flagged at most once per window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from tp_launch.progress import Mark, Stage

# The hang limit is at least this many median step times.
FACTOR = 20.0
# Step times kept for the median.
_STEP_TIMES = 64


@dataclass(frozen=True)
class HangPolicy:
    """``--hang-timeout`` and what follows from it.

    Args:
        timeout: the hang limit's floor in seconds (0: hang detection off).
    """

    timeout: float = 300.0

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    @property
    def startup(self) -> float:
        """The budget before the attempt's first commit (model build, compilation,
        data loading, the first step)."""
        return max(10 * self.timeout, 120.0)

    @property
    def stale_s(self) -> float:
        """A heartbeat older than this: the process is not running."""
        return min(5.0, self.timeout / 2)

    def limit(self, step_s: float, started: bool) -> float:
        """How long the job may go without progress (``started``: it committed)."""
        steady = max(self.timeout, FACTOR * step_s)
        return steady if started else max(steady, self.startup)


@dataclass
class ProgressClock:
    """When the job last progressed on this node, and its recent step times."""

    since: float = 0.0  # monotonic: the last progress (or reset)
    committed: bool = False  # some rank committed since the attempt began
    _last: dict[int, tuple[int, int, int, int, float]] = field(default_factory=dict)
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=_STEP_TIMES))

    def reset(self, now: float) -> None:
        """Start counting afresh (a generation applied, a wait that is not a hang)."""
        self.since = now

    def observe(self, now: float, marks: dict[int, Mark]) -> float:
        """Take the board's marks (rank -> mark) at ``now``; the seconds without
        progress."""
        for rank, m in marks.items():
            key = (m.gen, m.stage, m.step, m.seq, m.long_until)  # a long phase's end too
            before = self._last.get(rank)
            if key != before:
                if before is not None:  # a rank seen for the first time did not move
                    self.since = max(self.since, now)
                if before is not None and m.step != before[2] and m.step_s > 0:
                    self._step_times.append(m.step_s)
                if m.step >= 0 and m.commit_t > 0:
                    self.committed = True
                self._last[rank] = key
        for rank in list(self._last):
            if rank not in marks:
                del self._last[rank]
        return now - self.since

    @property
    def step_s(self) -> float:
        """The median recent step time (0: none seen)."""
        return statistics.median(self._step_times) if self._step_times else 0.0


def all_waiting(marks: dict[int, Mark], gen: int) -> bool:
    """Every rank's collective failed in generation ``gen`` (a timeout everywhere: one
    rank was too slow for the group's timeout) while none died: they wait for a
    generation nobody would announce. The agent regroups them (the same placement in
    a new generation)."""
    return bool(marks) and all(m.stage == Stage.WAITING and m.gen == gen
                               for m in marks.values())


def waiting_on_a_peer(marks: dict[int, Mark], gen: int) -> list[int]:
    """Ranks whose collective failed in generation ``gen`` while a peer's did not: a
    group timeout shorter than the hang limit. The hang verdict on that peer is to come
    (at the limit): they must wait for it, past their own give-up time
    (``TP_RUN_RECOVERY_WAIT_S``), or they would fail first and be blamed for the
    peer's hang (a healthy rank replaced, then its newcomer, then a "crash loop")."""
    waiting = sorted(r for r, m in marks.items() if m.stage == Stage.WAITING and m.gen == gen)
    others = [m for r, m in marks.items() if r not in waiting and m.stage != Stage.FINISHED]
    return waiting if others else []


@dataclass
class OutputClock:
    """How long a plain script's workers have written nothing."""

    since: float = 0.0
    spoke: bool = False  # some worker wrote something
    _last: int | None = None

    def observe(self, now: float, written: int) -> float:
        """``written``: the bytes the node's workers wrote so far, together."""
        if written != self._last:
            if self._last is not None:
                self.since = now
                self.spoke = True
            self._last = written
        return now - self.since


@dataclass(frozen=True)
class Verdict:
    """A hang: ``culprit`` (``ranks`` hold the others up) or ``everywhere`` (no rank does)."""

    kind: Literal["culprit", "everywhere"]
    ranks: list[int]
    why: dict[int, str]  # rank -> the evidence, one line each
    idle_s: float
    limit_s: float


def _position(m: Mark) -> tuple[int, int, int]:
    """How far a rank got, comparable across the ranks of one node."""
    if m.beat_t <= 0:
        return (m.gen, -1, 0)  # never beat: not yet at run()
    if m.stage in (Stage.WAITING, Stage.FINISHED):
        return (m.gen, 3, 0)  # waits for the others, or is done: never behind
    if m.stage in (Stage.AGREEING, Stage.TRAINING):
        return (m.gen, 2, m.seq)  # one group: its collective count orders them
    return (m.gen, 1 if m.stage == Stage.JOINING else 0, 0)


def _where(m: Mark) -> str:
    if m.stage in (Stage.AGREEING, Stage.TRAINING):
        what = "training" if m.stage == Stage.TRAINING else "joining (agreement/transfer)"
        return f"{what}, {m.seq} collectives issued in generation {m.gen}"
    try:
        stage = Stage(m.stage).name.lower()
    except ValueError:
        stage = f"stage {m.stage}"
    return f"{stage}, generation {m.gen}"


def assess(policy: HangPolicy, now: float, marks: dict[int, Mark], idle_s: float,
           step_s: float, started: bool) -> Verdict | None:
    """Whether this node's ranks (rank -> mark) are hung, and who holds them up."""
    if not policy.enabled:
        return None
    active = {r: m for r, m in marks.items() if m.stage != Stage.FINISHED}
    if not active or any(m.long_until > now for m in marks.values()):
        return None
    limit = policy.limit(step_s, started)
    if idle_s < limit:
        return None
    stale = {r: now - m.beat_t for r, m in active.items()
             if m.beat_t > 0 and now - m.beat_t > policy.stale_s}
    if stale and len(stale) < len(active):
        return Verdict("culprit", sorted(stale),
                       {r: f"no heartbeat for {age:.1f} s (stopped, or holding the "
                        f"interpreter lock) while its peers beat; last at step "
                        f"{active[r].step}, {_where(active[r])}"
                        for r, age in stale.items()}, idle_s, limit)
    positions = {r: _position(m) for r, m in active.items()}
    ahead = max(positions.values())
    behind = sorted(r for r, p in positions.items() if p < ahead)
    if behind:
        waiting = sorted(r for r, p in positions.items() if p == ahead)
        return Verdict("culprit", behind,
                       {r: f"behind its peers: {_where(active[r])}, while rank(s) "
                        f"{waiting} are at: {_where(active[waiting[0]])}"
                        for r in behind}, idle_s, limit)
    if idle_s < 2 * limit:
        return None
    return Verdict("everywhere", sorted(active),
                   {r: _where(m) for r, m in active.items()}, idle_s, 2 * limit)


@dataclass(frozen=True)
class Straggler:
    rank: int
    share: float  # fraction of samples it was behind
    others: float  # the other ranks' median share
    samples: int
    steps: int
    window_s: float

    @property
    def evidence(self) -> str:
        ratio = 1.0 / max(1e-3, 1.0 - (self.share - self.others))
        return (f"rank {self.rank} was the last to reach the collectives in "
                f"{self.share:.0%} of {self.samples} samples over {self.window_s:.0f} s "
                f"and {self.steps} steps (the others: {self.others:.0%}): about "
                f"{ratio:.1f}x their time per step")


@dataclass
class Stragglers:
    """Samples of who is behind, over a window; names a straggler once per window.

    Args:
        factor: ``--straggler-factor`` k (0: off).
        window_s: ``--straggler-window``: how long a rank must stay slow.
        min_steps: steps the window must span (a few slow steps are not a straggler).
        min_samples: samples the window must hold.
    """

    factor: float = 0.0
    window_s: float = 60.0
    min_steps: int = 10
    min_samples: int = 20
    _samples: deque[tuple[float, int, frozenset[int], frozenset[int]]] = \
        field(default_factory=deque)

    def reset(self) -> None:
        self._samples.clear()

    def observe(self, now: float, marks: dict[int, Mark],
                can_act: bool = True) -> Straggler | None:
        """One sample of this node's ranks (rank -> mark); a straggler, or None.
        ``can_act``: a verdict can be acted on now (a spare is parked); while not, the
        samples are kept and nobody is named, so that a straggler found before the
        first spare parked moves as soon as one does instead of a window later."""
        if self.factor <= 1.0:
            return None
        training = {r: m for r, m in marks.items() if m.stage == Stage.TRAINING}
        gens = {m.gen for m in training.values()}
        if len(training) < 2 or len(gens) != 1 or len(training) != len(marks):
            self.reset()  # a recovery, a finish, a single rank: nothing to compare
            return None
        top = max(m.seq for m in training.values())
        behind = frozenset(r for r, m in training.items() if m.seq < top)
        step = max(m.step for m in training.values())
        self._samples.append((now, step, behind, frozenset(training)))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        first_t, first_step, _, ranks = self._samples[0]
        if not can_act or now - first_t < 0.9 * self.window_s or len(self._samples) < self.min_samples \
                or step - first_step < self.min_steps \
                or any(s[3] != ranks for s in self._samples):
            return None
        n = len(self._samples)
        share = {r: sum(r in s[2] for s in self._samples) / n for r in ranks}
        worst = max(share, key=lambda r: share[r])
        others = statistics.median(share[r] for r in ranks if r != worst)
        if share[worst] - others < 1.0 - 1.0 / self.factor:
            return None
        self.reset()  # at most once per window
        return Straggler(worst, share[worst], others, n, step - first_step, now - first_t)
