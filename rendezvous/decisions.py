"""The membership's decisions, as pure functions: what to do next, given what was seen.

No I/O and no clock here: the caller (:class:`rendezvous.membership.Membership`) reads the
state, asks, performs the answer, and asks again (as torch's dynamic rendezvous splits
``_RendezvousJoinOp`` from ``_RendezvousOpExecutor``). So every rule is unit-tested with
a fake clock (``tests/test_membership_decisions.py``).

Joining (:func:`decide_join`): one look (:class:`JoinLook`: the state document and the
time) and what the loop remembers across looks (:class:`JoinProgress`) give one
:class:`JoinAction`:

- a read the decision needs first, made only when needed, so that a member's requests
  do not grow with the number of members: :class:`ReadAlive` (every liveness key),
  :class:`CheckOpener` (the opener's liveness key, at most every ``safety_poll``),
  :class:`CountJoins`, :class:`ReadJoiners` (the opener only);
- :class:`PutJoinKey` ("I want to be in this round", again on a new lease), and
  :class:`Pause` (the opener coalesces a burst of joins into one read): the same look
  is decided again afterwards;
- a compare-and-swap of the state (:class:`WriteState`: open a round, take the opener's
  role over, close the round, be listed as waiting or spare), :class:`Wait` for a watch
  or a timeout, :class:`LookAgain` at once: the state is read again afterwards;
- the end: :class:`Formed` (the world) or :class:`Fail` (one error line).

The running world (:func:`state_change`, :func:`lost_participant`): what in the state
or in the liveness keys is a :class:`WorldChange`, and of which kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Union

from rendezvous.state import JoinRecord, Member, RoundState, World

# Kinds of world change (what the agent does about them).
CHANGE_FAILURE = "failure"        # a member's workers failed: restart, counted
CHANGE_LOST = "lost"              # a participant's lease expired: restart, counted
CHANGE_WAITING = "waiting"        # a new member waits to be admitted: restart, not counted
CHANGE_ROUND = "round"            # a newer round was opened for another reason
CHANGE_COMPLETE = "complete"      # the job finished (the exit barrier passed)

# Minimum seconds between two reads of a round's join keys by its opener.
JOIN_READ_INTERVAL = 0.05


@dataclass
class WorldChange:
    kind: str
    detail: str

    @property
    def counts_as_failure(self) -> bool:
        return self.kind in (CHANGE_FAILURE, CHANGE_LOST)


# -------------------------------------------------------------------- the running world

def state_change(world: World, state: RoundState | None) -> WorldChange | None:
    """What the state says changed since ``world`` formed, or None."""
    if state is None:
        return WorldChange(CHANGE_LOST, "the rendezvous state disappeared")
    if state.round != world.round:
        kind = CHANGE_FAILURE if state.failures > world.failures else CHANGE_ROUND
        return WorldChange(kind, state.reason)
    if state.phase == "complete":
        return WorldChange(CHANGE_COMPLETE, "the job finished")
    if state.failed:
        return WorldChange(CHANGE_FAILURE, state.failed)
    if state.waiting:
        return WorldChange(CHANGE_WAITING, f"node {state.waiting[0].id} is waiting to join")
    return None


def lost_participant(ids: set[str], alive: set[str]) -> WorldChange | None:
    """A participant among ``ids`` whose liveness key is gone, or None."""
    dead = sorted(ids - alive)
    return WorldChange(CHANGE_LOST, f"node {dead[0]} left (its lease expired)") if dead else None


# -------------------------------------------------------------------- joining

@dataclass(frozen=True)
class JoinRules:
    """The settings a join decides by."""

    run_id: str
    me: Member
    min_nodes: int
    max_nodes: int
    accept_spare: bool  # resilient mode: a member beyond the world is a spare node
    last_round: int  # the round this member leaves (-1: none)
    deadline: float  # monotonic: join_timeout from the start of the join
    join_timeout: float
    last_call_timeout: float
    safety_poll: float


@dataclass(frozen=True)
class JoinLook:
    """One look at the job: the state and the time, plus the reads decided on so far."""

    state: RoundState | None
    now: float  # monotonic
    wall: float  # wall clock (a join time orders members only)
    lease_epoch: int
    alive: frozenset[str] | None = None
    opener_alive: bool | None = None
    join_count: int | None = None
    joiners: tuple[Member, ...] | None = None  # in join order


@dataclass(frozen=True)
class JoinProgress:
    """What the join loop remembers from one look to the next."""

    joined: tuple[int, int] = (-1, -1)  # (round, lease epoch) of our join key
    join_time: float = 0.0
    spare: bool = False  # listed as a spare of the closed round
    min_seen_at: float | None = None  # opener: when MIN members had joined
    next_opener_check: float = 0.0
    last_join_read: float = 0.0


@dataclass(frozen=True)
class ReadAlive:
    pass


@dataclass(frozen=True)
class CheckOpener:
    opener: str


@dataclass(frozen=True)
class CountJoins:
    round: int


@dataclass(frozen=True)
class ReadJoiners:
    round: int


@dataclass(frozen=True)
class PutJoinKey:
    round: int
    record: JoinRecord


@dataclass(frozen=True)
class Pause:
    seconds: float


WriteKind = Literal["open", "take over", "close", "wait", "spare"]


@dataclass(frozen=True)
class WriteState:
    """Compare-and-swap ``state`` over the document looked at. ``kind``: ``open`` a
    round, ``take over`` the opener's role, ``close`` the round, be listed as ``wait``-ing
    or as a ``spare``."""

    kind: WriteKind
    state: RoundState


@dataclass(frozen=True)
class Wait:
    seconds: float


@dataclass(frozen=True)
class LookAgain:
    pass


@dataclass(frozen=True)
class Formed:
    world: World


@dataclass(frozen=True)
class Fail:
    message: str


JoinAction = Union[ReadAlive, CheckOpener, CountJoins, ReadJoiners, PutJoinKey, Pause,
                   WriteState, Wait, LookAgain, Formed, Fail]


def decide_join(rules: JoinRules, look: JoinLook,
                progress: JoinProgress) -> tuple[JoinAction, JoinProgress]:
    """The next step of a join, and what to remember."""
    state, me = look.state, rules.me.id
    if state is None:
        return WriteState("open", RoundState.next_round(None, me, "first round", False)), progress
    if state.phase == "complete":
        return Fail(f"rendezvous {rules.run_id!r} is closed: the job already finished "
                    "(use a new --rdzv-id for a new job)"), progress
    if state.phase == "closed":
        return _decide_closed(rules, look, state, progress)
    return _decide_joining(rules, look, state, progress)


def _decide_closed(rules: JoinRules, look: JoinLook, state: RoundState,
                   progress: JoinProgress) -> tuple[JoinAction, JoinProgress]:
    me, ids = rules.me.id, state.participant_ids
    if me in ids:
        if state.round > rules.last_round:
            return Formed(state.world_for(me)), progress
        # Our own old round: we are here to restart it. (A failed round's reason carries
        # on: the others may read the new round before they saw the failure.)
        why = state.failed or f"restart requested by {me}"
        return WriteState("open", RoundState.next_round(state, me, why, False)), progress
    if look.alive is None:
        return ReadAlive(), progress
    dead = [i for i in ids if i not in look.alive]
    if dead:
        why = f"node {dead[0]} left (its lease expired)"
        return WriteState("open", RoundState.next_round(state, me, why, True)), progress
    # A healthy world we are not in: wait (and ask to be admitted).
    if not state.lists(me):
        # Resilient mode never restarts a running world to admit a node: a late node is
        # a spare whatever the world's size.
        as_spare = not (len(ids) < rules.max_nodes and not rules.accept_spare)
        return WriteState("spare" if as_spare else "wait",
                          state.with_listed(rules.me, as_spare)), progress
    progress = replace(progress, spare=progress.spare or me in state.spare_ids)
    if progress.spare and rules.accept_spare and state.round > rules.last_round:
        return Formed(state.world_for(me)), progress  # a spare node of this world
    return _wait(rules, look, state, progress, spare=progress.spare)


def _decide_joining(rules: JoinRules, look: JoinLook, state: RoundState,
                    progress: JoinProgress) -> tuple[JoinAction, JoinProgress]:
    me, rnd, now = rules.me.id, state.round, look.now
    if progress.joined != (rnd, look.lease_epoch):
        # (Again on a renewed lease: the old one took the key with it.)
        if progress.joined[0] != rnd:
            progress = replace(progress, join_time=look.wall, spare=False, min_seen_at=None,
                               next_opener_check=0.0)
        progress = replace(progress, joined=(rnd, look.lease_epoch))
        return PutJoinKey(rnd, JoinRecord(rules.me, progress.join_time)), progress
    if state.opener != me:
        if look.opener_alive is False:
            # Its lease is gone: take the round over.
            return WriteState("take over", state.taken_over(me)), progress
        if look.opener_alive is None and now >= progress.next_opener_check:
            # Rate-limited: every member looking at every wake-up would make a member's
            # requests grow with the number of members.
            return CheckOpener(state.opener), replace(progress,
                                                      next_opener_check=now + rules.safety_poll)
        return _wait(rules, look, state, progress, spare=False)
    if look.join_count is None:
        # Coalesce a burst of joins into one read: the opener is the only member that
        # reads the join keys, and N joins must not cost it N reads.
        if now < progress.last_join_read + JOIN_READ_INTERVAL:
            return Pause(progress.last_join_read + JOIN_READ_INTERVAL - now), progress
        # Only the count until the round can close: reading every join record at every
        # wake-up would cost the opener O(members^2).
        return CountJoins(rnd), replace(progress, last_join_read=now)
    count = look.join_count
    if count >= rules.min_nodes and progress.min_seen_at is None:
        progress = replace(progress, min_seen_at=now)
    min_seen_at = progress.min_seen_at
    full = count >= rules.max_nodes
    last_call_over = min_seen_at is not None and now - min_seen_at >= rules.last_call_timeout
    if full or last_call_over:
        if look.joiners is None:
            return ReadJoiners(rnd), progress
        if len(look.joiners) >= rules.min_nodes:  # a joiner may have left since
            return WriteState("close", state.closed(list(look.joiners), rules.max_nodes)), \
                progress
        return LookAgain(), progress
    timeout = rules.last_call_timeout if min_seen_at is None else \
        max(0.0, min_seen_at + rules.last_call_timeout - now)
    return _wait(rules, look, state, progress, spare=False, timeout=timeout, count=count)


def _wait(rules: JoinRules, look: JoinLook, state: RoundState, progress: JoinProgress,
          spare: bool, timeout: float | None = None,
          count: int | None = None) -> tuple[JoinAction, JoinProgress]:
    """Wait for a watch, ``timeout``, or the join deadline (a spare waits for ever)."""
    now = look.now
    if not spare and now >= rules.deadline:
        joined = f"{count} of " if count is not None else ""
        return Fail(f"rendezvous {rules.run_id!r} timed out after {rules.join_timeout:g}s "
                    f"(join_timeout): {joined}the {rules.min_nodes} node(s) needed have "
                    f"joined round {state.round}"), progress
    limit = rules.safety_poll if timeout is None else min(timeout, rules.safety_poll)
    if not spare:
        limit = min(limit, max(0.0, rules.deadline - now))
    return Wait(max(limit, 0.01)), progress
