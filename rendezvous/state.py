"""The membership's wire format: its keys and the state document, each typed once.

All keys live under ``<prefix>/<run id>/`` (``P/`` below), so two jobs on one etcd never
see each other; :class:`Keys` is the only place that spells them.

Keys
----
``P/state``
    The state document (:class:`RoundState`, JSON), always written with compare-and-swap
    on its version (:class:`StateStore`).
``P/alive/<member>``
    A :class:`Member`, on the member's lease: the member is alive while this key exists.
``P/r<round>/join/<member>``
    A :class:`JoinRecord`, on the lease: "I want to be in round ``round``", with the join
    time (wall clock: it only orders members).
``P/r<round>/store``
    The port of the workers' store, on node rank 0's address (node rank 0's agent hosts a
    fresh store each round).
``P/r<round>/done/<member>``, ``P/r<round>/left/<member>``
    The exit barrier (``1``): this member's workers all succeeded; it left the barrier
    (the store's host lingers until every participant has).
``P/parked/<member>``
    Resilient mode: how many spares the member has parked (an integer), on its lease.
``P/status/<member>``
    Resilient mode: the member's ranks as ``tp-run status`` shows them (a JSON document
    the agent writes every few seconds, opaque to the rendezvous), on its lease.
``P/r<round>/finished/<member>``
    Resilient mode: the generation in which the member's ranks finished (an integer).

The state document
------------------
One JSON object (:class:`RoundState`); parsing is strict: a document that is not an
object with these keys and types is a :class:`StateError`.

``v`` (int)
    Write counter, +1 on every write: values never repeat, so a compare-and-swap on the
    value (c10d) is as safe as one on a revision (etcd).
``round`` (int)
    The rendezvous round, +1 per restart.
``phase``
    ``joining``, ``closed`` or ``complete`` (:data:`Phase`).
``participants``, ``spares``, ``waiting`` (lists of :class:`Member` objects)
    The world of a closed round in node rank order; members beyond MAX (torchrun's
    redundancy list; resilient mode's spare nodes); members that arrived after the
    world formed with fewer than MAX nodes (compatible mode restarts to admit them).
``generation`` (int)
    +1 every time a world is formed or placed again: the fencing token.
``opener`` (str)
    The member that closes a joining round.
``reason`` (str), ``failures`` (int)
    Why the round was opened; how many rounds were opened because something failed
    (plus failure reports).
``failed`` (str), ``final`` (bool), optional
    A member's failure report in this round: every member restarts (``final``: stops).
``resilient`` (object), optional
    Resilient mode's placement of the current generation (rank -> node, the store, the
    replaced ranks: :meth:`tp_launch.agent.control.Generation.to_json`); opaque here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from rendezvous import bounded_json
from rendezvous.kv import KV, KVError

Phase = Literal["joining", "closed", "complete"]


class StateError(KVError):
    """A malformed key or state document: the backend holds something this protocol
    did not write (a refusal, not an outage)."""


def _check(d: Any, what: str, required: dict[str, type | tuple[type, ...]],
           optional: dict[str, type | tuple[type, ...]] | None = None) -> dict[str, Any]:
    """``d`` as a JSON object with exactly these keys of these types (bools are not ints)."""
    optional = optional or {}
    if not isinstance(d, dict):
        raise StateError(f"malformed {what}: not a JSON object: {d!r:.200}")
    missing = sorted(set(required) - set(d))
    unknown = sorted(set(d) - set(required) - set(optional))
    if missing or unknown:
        raise StateError(f"malformed {what}: missing {missing}, unknown {unknown}")
    for key, value in d.items():
        kind = required.get(key) or optional[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int, float))):
            raise StateError(f"malformed {what}: {key}={value!r:.200}")
    return d


def _loads(text: str, what: str) -> Any:
    try:
        return bounded_json.loads(text)
    except bounded_json.BoundsError as e:
        raise StateError(f"malformed {what}: {e}") from None


@dataclass(frozen=True)
class Member:
    """A member as the others see it: its id, its address, its local world size."""

    id: str
    addr: str
    local_world_size: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "addr": self.addr, "lws": self.local_world_size}

    @staticmethod
    def from_json(d: Any) -> Member:
        d = _check(d, "member", {"id": str, "addr": str, "lws": int})
        return Member(d["id"], d["addr"], d["lws"])


def member_addr(member_id: str) -> str | None:
    """The address a member id names (``<addr>-<pid>-<hex8>``, as
    :func:`rendezvous.membership.new_member_id` makes it), None if it is not one."""
    addr, sep, rest = member_id.rpartition("-")
    addr, sep2, pid = addr.rpartition("-")
    if not (sep and sep2 and addr and pid.isdigit() and len(rest) == 8):
        return None
    return addr


@dataclass(frozen=True)
class JoinRecord:
    """A join key's value: the member and its join time (``t``, wall clock)."""

    member: Member
    t: float

    def dumps(self) -> str:
        return json.dumps({**self.member.to_json(), "t": self.t})

    @staticmethod
    def loads(text: str) -> JoinRecord:
        d = _check(_loads(text, "join key"), "join key",
                   {"id": str, "addr": str, "lws": int, "t": (int, float)})
        return JoinRecord(Member(d["id"], d["addr"], d["lws"]), float(d["t"]))


@dataclass
class World:
    """A closed round as one member sees it."""

    round: int
    generation: int
    participants: list[Member]
    spares: list[Member] = field(default_factory=list)
    me: str = ""
    failures: int = 0  # the state's failure count when this world formed

    @property
    def is_spare(self) -> bool:
        """This member is a spare node of the world (resilient mode), not a participant."""
        return self.node_rank < 0

    @property
    def node_rank(self) -> int:
        """This member's node rank; -1 for a spare node."""
        ids = [m.id for m in self.participants]
        return ids.index(self.me) if self.me in ids else -1

    @property
    def rank_offset(self) -> int:
        return sum(m.local_world_size for m in self.participants[: max(self.node_rank, 0)])

    @property
    def world_size(self) -> int:
        return sum(m.local_world_size for m in self.participants)


def _ids(members: tuple[Member, ...]) -> list[str]:
    return [m.id for m in members]


@dataclass(frozen=True)
class RoundState:
    """The state document (``P/state``; the module docstring lists its fields).

    Immutable: each transition below returns the document to write.
    """

    round: int
    phase: Phase
    opener: str
    reason: str
    generation: int = 0
    failures: int = 0
    participants: tuple[Member, ...] = ()
    spares: tuple[Member, ...] = ()
    waiting: tuple[Member, ...] = ()
    failed: str | None = None
    final: bool = False
    resilient: dict[str, Any] | None = None
    v: int = 0

    # ---------------------------------------------------------------- wire

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "v": self.v, "round": self.round, "phase": self.phase,
            "participants": [m.to_json() for m in self.participants],
            "spares": [m.to_json() for m in self.spares],
            "waiting": [m.to_json() for m in self.waiting],
            "opener": self.opener, "generation": self.generation, "reason": self.reason,
            "failures": self.failures,
        }
        if self.failed is not None:
            d.update(failed=self.failed, final=self.final)
        if self.resilient is not None:
            d["resilient"] = self.resilient
        return d

    @staticmethod
    def from_json(d: Any) -> RoundState:
        d = _check(d, "rendezvous state",
                   {"v": int, "round": int, "phase": str, "participants": list,
                    "spares": list, "waiting": list, "opener": str, "generation": int,
                    "reason": str, "failures": int},
                   {"failed": str, "final": bool, "resilient": dict})
        if d["phase"] not in get_args(Phase):
            raise StateError(f"malformed rendezvous state: phase={d['phase']!r:.200}")
        return RoundState(
            v=d["v"], round=d["round"], phase=d["phase"], opener=d["opener"],
            reason=d["reason"], generation=d["generation"], failures=d["failures"],
            participants=tuple(Member.from_json(m) for m in d["participants"]),
            spares=tuple(Member.from_json(m) for m in d["spares"]),
            waiting=tuple(Member.from_json(m) for m in d["waiting"]),
            failed=d.get("failed"), final=d.get("final", False), resilient=d.get("resilient"))

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @staticmethod
    def loads(text: str) -> RoundState:
        return RoundState.from_json(_loads(text, "rendezvous state"))

    # ---------------------------------------------------------------- views

    @property
    def participant_ids(self) -> list[str]:
        return _ids(self.participants)

    @property
    def spare_ids(self) -> list[str]:
        return _ids(self.spares)

    def lists(self, member: str) -> bool:
        """``member`` is in the waiting list or among the spares."""
        return member in _ids(self.waiting) + _ids(self.spares)

    def world_for(self, me: str) -> World:
        """This (closed) round as member ``me`` sees it."""
        return World(self.round, self.generation, list(self.participants), list(self.spares),
                     me, self.failures)

    # ---------------------------------------------------------------- transitions

    @staticmethod
    def next_round(prev: RoundState | None, opener: str, reason: str,
                   failure: bool) -> RoundState:
        """Round ``prev.round + 1`` (0 after no state), joining, opened by ``opener``;
        the generation and the failure count carry on, a failure report does not."""
        if prev is None:
            return RoundState(round=0, phase="joining", opener=opener, reason=reason,
                              failures=1 if failure else 0)
        return RoundState(round=prev.round + 1, phase="joining", opener=opener, reason=reason,
                          generation=prev.generation,
                          failures=prev.failures + (1 if failure else 0), v=prev.v)

    def taken_over(self, opener: str) -> RoundState:
        return replace(self, opener=opener)

    def closed(self, joiners: list[Member], max_nodes: int) -> RoundState:
        """The round closed: the first ``max_nodes`` joiners take part, the rest are
        spares; a new generation."""
        return replace(self, phase="closed", participants=tuple(joiners[:max_nodes]),
                       spares=tuple(joiners[max_nodes:]), waiting=(),
                       generation=self.generation + 1)

    def with_listed(self, member: Member, as_spare: bool) -> RoundState:
        """``member`` added to the spares (``as_spare``) or to the waiting list."""
        if as_spare:
            return replace(self, spares=self.spares + (member,))
        return replace(self, waiting=self.waiting + (member,))

    def with_failure(self, detail: str, final: bool) -> RoundState:
        return replace(self, failed=detail, final=final, failures=self.failures + 1)

    def completed(self) -> RoundState:
        return replace(self, phase="complete")

    def placed(self, nodes: list[str], placement: dict[str, Any]) -> RoundState:
        """The next generation places the ranks on ``nodes`` (member ids, in node rank
        order): they become the participants, a spare among them leaves the spares."""
        members = {m.id: m for m in self.participants + self.spares}
        return replace(self, participants=tuple(members[n] for n in nodes if n in members),
                       spares=tuple(m for m in self.spares if m.id not in nodes),
                       resilient=placement, generation=self.generation + 1)


@dataclass(frozen=True)
class Keys:
    """The key layout of one job (see the module docstring)."""

    root: str  # "<prefix>/<run id>/"

    @staticmethod
    def of(prefix: str, run_id: str) -> Keys:
        return Keys(f"{prefix.rstrip('/')}/{run_id}/")

    @property
    def state(self) -> str:
        return self.root + "state"

    @property
    def alive_prefix(self) -> str:
        return self.root + "alive/"

    def alive(self, member: str) -> str:
        return self.alive_prefix + member

    @property
    def parked_prefix(self) -> str:
        return self.root + "parked/"

    def parked(self, member: str) -> str:
        return self.parked_prefix + member

    @property
    def status_prefix(self) -> str:
        return self.root + "status/"

    @property
    def link_prefix(self) -> str:
        return self.root + "link/"

    def link(self, member: str) -> str:
        return self.link_prefix + member

    def status(self, member: str) -> str:
        return self.status_prefix + member

    def in_round(self, rnd: int, name: str) -> str:
        """A round-scoped key (or, ending in ``/``, prefix): ``store``, ``join/``,
        ``done/``, ``left/``, ``finished/``."""
        return f"{self.root}r{rnd}/{name}"


def by_member(prefix: str, items: dict[str, str]) -> dict[str, str]:
    """``get_prefix``'s answer keyed by what follows ``prefix`` (a member id)."""
    return {k[len(prefix):]: v for k, v in items.items()}


def int_value(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise StateError(f"malformed {key}: {value!r:.200}") from None


class StateStore:
    """``P/state``: read and parsed, written by compare-and-swap on the version read."""

    def __init__(self, kv: KV, keys: Keys) -> None:
        self.kv = kv
        self.key = keys.state

    def read(self) -> tuple[RoundState | None, Any]:
        """(the document, its version); (None, None) when there is none."""
        raw, version = self.kv.get(self.key)
        return (RoundState.loads(raw) if raw is not None else None), version

    def write(self, version: Any, state: RoundState) -> bool:
        """Write ``state`` (its ``v`` + 1) if the document is still at ``version``."""
        return self.kv.cas(self.key, version, replace(state, v=state.v + 1).dumps())


def alive_members(kv: KV, keys: Keys) -> set[str]:
    """The members whose liveness key exists."""
    return set(by_member(keys.alive_prefix, kv.get_prefix(keys.alive_prefix)))
