"""The worker <-> local agent channel of resilient mode: JSON lines over a Unix socket.

One module on purpose: it is the socket's whole contract between a worker and its agent,
which both sides import alone. The environment variables that tell a process where the
socket is (and the rest of what its agent hands it) are
:mod:`tp_launch.worker_settings`.

Workers talk only to their own node's agent. The agent listens on a Unix socket in its
private control directory (:mod:`tp_launch.control_files`) and puts the socket's path
in each process's environment (``TP_RUN_CHANNEL``, with the process's slot number in
``TP_RUN_SLOT``). A script that opts in (``tp_launch.resilient.run``) connects; a script
that does not never does, and the agent then treats it exactly as torchrun would.
``tp-run migrate`` talks to the agent over the same socket. This module holds the
messages, typed once, for both sides; it does not import torch (the agent imports it
before torch).

Messages, one JSON object per line (at most :data:`MAX_LINE` bytes), ``op`` naming the
kind; each kind is a frozen dataclass whose fields are checked, type and range (a bound
is part of the field's type: :data:`Count` >= 0, :data:`Positive` >= 1, :data:`Seconds`
>= 0), when it is built and when it is decoded (:func:`decode`), so a peer's bad line is
a :class:`ChannelError` (one line saying why), never a crash. A line longer than
:data:`MAX_LINE` (:class:`LineReader`), not JSON, not an object, of an ``op`` the
receiver does not accept, or with a field missing or out of type or range is refused;
fields a decoder does not know are ignored. A list field is typed ``tuple[X, ...]`` (a JSON
array of X). Both sides send only these types
(:func:`send`).

to the agent (:data:`TO_AGENT`)
    :class:`Hello` ``hello`` {slot, pid}: the process reached the wait point (model and
        optimizer built); a spare is parked from now on.
    :class:`Resumed` ``resumed`` {gen, rank, step, handoff_s, group_s, agree_s,
        transfer_s, bytes, donor (rank or None), t, verify_s, inexact}: the process
        joined generation ``gen`` and holds the agreed state (``inexact``: what of the
        rank's own state, its random generators or buffers, could not be had).
    :class:`Stepped` ``stepped`` {gen, rank, step, t, check_s}: first committed step
        after ``resumed`` (``check_s``: what the replicas' check took of it).
    :class:`Finished` ``finished`` {gen, rank, step}: the training function returned;
        waiting for the exit barrier (a failure before every rank finished is still
        recovered).
    :class:`Fatal` ``fatal`` {kind, message, rank, gen}: the job cannot go on exactly
        (``state_lost``: no rank holds the committed state; ``diverged``: the ranks'
        states differ; ``usage``: the script's loop does not mark its iterations). The
        agent stops the job with that line (``state_lost``: ``--spare-policy``).
    :class:`Migrate` ``migrate`` {rank}: ``tp-run migrate`` asks for a planned migration
        (rank None: every rank of the agent's node, ``--node``).
    :class:`Status` ``status`` {}: ``tp-run status`` asks what the agent's job does.
to a worker (:data:`TO_WORKER`)
    :class:`NewGeneration` ``generation`` {gen, rank (None: not a rank), world_size,
        master_addr, master_port, reason, boundary (step at which to stop, planned
        migration only), handoff (planned migration: :class:`Handoff` {role:
        "donor"|"receiver", prefix}), from_slot (a newcomer: the slot of its rank's last
        holder on this node, whose per-rank record it reads), lost_addrs (the addresses
        of the nodes this generation replaced as lost: the worker shuts its TCP
        connections to them)}.
    :class:`Exit` ``exit`` {}: every rank finished (ranks return from ``run``), or the
        job is over (spares exit 0).
    :class:`Recovering` ``recovering`` {}: the agent waits for a spare
        (``--spare-policy wait``): wait for the next generation without a limit.
    :class:`Reply` ``reply`` {message}: the answer to ``migrate`` ("ok: ..." or
        "error: ...").
    :class:`StatusReply` ``status_reply``: the answer to ``status`` (to ``tp-run status``,
        not a worker): {run_id, node, agent_pid, gen, world_size, state, ranks (this
        node's: :class:`RankStatus` {rank, pid, slot, step, step_s, gen, stage,
        commit_age_s, beat_age_s}), ranks_total, parked (:class:`SpareStatus` {slot,
        pid}), parked_total, recoveries (the last few, oldest first:
        :class:`RecoveryStatus` {gen, reason, failed_ranks, promoted_pids, step,
        detected_at, total_s}), log_dir}. Lists are capped (:data:`STATUS_MAX_RANKS`,
        :data:`STATUS_MAX_SPARES`, :data:`STATUS_MAX_RECOVERIES`), so the line stays well
        under :data:`MAX_LINE`; the ``*_total`` counts say what was left out.

The agent also shares a progress board with its processes (``TP_RUN_PROGRESS``,
:mod:`tp_launch.progress`): each process's committed step, heartbeat and position in
the collectives, as stores to shared memory, so the agent knows what every rank does
without a message per step. Beside it, each worker keeps its per-rank record
(``<board>.slot<N>``, :mod:`tp_launch.resilient.per_rank`).
"""

from __future__ import annotations

import json
import math
import socket
import struct
import types
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Annotated, Any, ClassVar, Iterable, Literal, TypeVar

# The longest line either side accepts: every message is well under a kilobyte, and a
# peer that never sends a newline must not make the reader grow without end.
MAX_LINE = 64 * 1024
_INT_LIMIT = 2**63  # integers travel as int64 at most (the progress board's steps)

_CREDS = struct.Struct("3i")  # struct ucred


class ChannelError(ValueError):
    """A line that is not a valid message, or a message the receiver rejects: the
    reason, in one line."""


@dataclass(frozen=True)
class AtLeast:
    """A field's lower bound: ``Annotated[int, AtLeast(0)]``."""

    low: int


# The field types of the messages: the bound travels in the type, so a field's default
# (or its absence) stays what the dataclass and the type checker see.
Count = Annotated[int, AtLeast(0)]
Positive = Annotated[int, AtLeast(1)]
Seconds = Annotated[float, AtLeast(0)]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A record type's field types, bounds included (``Annotated``), resolved once."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls, include_extras=True)
    return hints


def _split(hint: Any) -> tuple[Any, int | None]:
    """A field's type without its bound, and the bound (None: unbounded)."""
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        lows = [e.low for e in extras if isinstance(e, AtLeast)]
        return base, (lows[0] if lows else None)
    return hint, None


def _check(hint: Any, value: Any, name: str) -> None:
    """``value`` has the type ``hint`` names (int, float, str, a Literal of strings, a
    nested record, or any of them | None; a bound as :class:`AtLeast`); else
    ChannelError "<name> must be ...". bool is not an int here, NaN and infinities are
    not floats."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return
        (hint,) = [a for a in args if a is not type(None)]
    hint, low = _split(hint)
    if typing.get_origin(hint) is tuple:
        item, rest = typing.get_args(hint)
        assert rest is Ellipsis, f"channel field {name}: only tuple[X, ...] is supported"
        if type(value) is not tuple:
            raise ChannelError(f"{name} must be a list, not {_show(value)}")
        for i, v in enumerate(value):
            _check(item, v, f"{name}[{i}]")
        return
    if typing.get_origin(hint) is Literal:
        if type(value) is not str or value not in typing.get_args(hint):
            raise ChannelError(f"{name} must be one of {list(typing.get_args(hint))}, "
                               f"not {_show(value)}")
    elif hint is int:
        if type(value) is not int or not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ChannelError(f"{name} must be an integer, not {_show(value)}")
    elif hint is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ChannelError(f"{name} must be a number, not {_show(value)}")
    elif hint is str:
        if type(value) is not str:
            raise ChannelError(f"{name} must be a string, not {_show(value)}")
    elif isinstance(hint, type) and issubclass(hint, _Record):
        if not isinstance(value, hint):
            raise ChannelError(f"{name} must be an object, not {_show(value)}")
    else:
        raise TypeError(f"channel field {name}: unsupported type {hint}")
    if low is not None and value < low:
        raise ChannelError(f"{name} must be at least {low}, not {_show(value)}")


_R = TypeVar("_R", bound="_Record")


def _record_type(hint: Any) -> type[_Record] | None:
    """The record type a field holds (alone or | None), if any."""
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and issubclass(t, _Record):
            return t
    return None


def _tuple_item(hint: Any) -> Any:
    """The item type of a ``tuple[X, ...]`` field (alone, bounded or | None); None if
    the field is not a list."""
    for t in (hint, *typing.get_args(hint)):
        t = _split(t)[0]
        if typing.get_origin(t) is tuple:
            return typing.get_args(t)[0]
    return None


def _from_doc(hint: Any, value: Any, name: str) -> Any:
    """A decoded JSON value as the field's Python value: a nested record built, a list
    made a tuple (its items likewise); the field's own check comes after."""
    item = _tuple_item(hint)
    if item is not None:
        if not isinstance(value, list):
            return value  # refused by the field's check
        return tuple(_from_doc(item, v, f"{name}[{i}]") for i, v in enumerate(value))
    nested = _record_type(hint)
    if nested is not None and value is not None:
        try:
            return nested._from_json(value)
        except ChannelError as e:
            raise ChannelError(f"{name}: {e}") from None
    return value


@dataclass(frozen=True)
class _Record:
    """A record whose fields are checked (type and lower bound) when it is built."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in fields(self):
            _check(hints[f.name], getattr(self, f.name), f.name)

    @classmethod
    def from_json(cls: type[_R], doc: Any) -> _R:
        """The record a JSON object describes, checked as a message's fields are
        (ChannelError: why not)."""
        return cls._from_json(doc)

    @classmethod
    def _from_json(cls: type[_R], doc: Any) -> _R:
        if not isinstance(doc, dict):
            raise ChannelError(f"must be an object, not {_show(doc)}")
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in doc:
                if f.default is MISSING:
                    raise ChannelError(f"{f.name} is missing")
                continue
            values[f.name] = _from_doc(hints[f.name], doc[f.name], f.name)
        return cls(**values)


@dataclass(frozen=True)
class Message(_Record):
    """One channel message; ``op`` names its kind on the wire."""

    op: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, **asdict(self)}


# ---------------------------------------------------------------- to the agent


@dataclass(frozen=True)
class Hello(Message):
    op: ClassVar[str] = "hello"
    slot: Count
    pid: Positive


@dataclass(frozen=True)
class Resumed(Message):
    op: ClassVar[str] = "resumed"
    gen: Count
    rank: Count
    step: int
    handoff_s: Seconds
    group_s: Seconds
    agree_s: Seconds
    transfer_s: Seconds
    bytes: Count
    donor: int | None
    t: float
    verify_s: Seconds = 0.0
    inexact: str = ""  # what of the rank's own state could not be had, ", "-separated


@dataclass(frozen=True)
class Stepped(Message):
    op: ClassVar[str] = "stepped"
    gen: Count
    rank: Count
    step: int
    t: float
    check_s: Seconds = 0.0  # the replicas' check in that step: waiting and comparing


@dataclass(frozen=True)
class Finished(Message):
    op: ClassVar[str] = "finished"
    gen: Count
    rank: Count
    step: int


@dataclass(frozen=True)
class Fatal(Message):
    op: ClassVar[str] = "fatal"
    kind: Literal["state_lost", "diverged", "usage"]
    message: str
    rank: int | None
    gen: Count


@dataclass(frozen=True)
class Migrate(Message):
    op: ClassVar[str] = "migrate"
    rank: Count | None = None


@dataclass(frozen=True)
class Status(Message):
    op: ClassVar[str] = "status"


# ---------------------------------------------------------------- to a worker


@dataclass(frozen=True)
class Handoff(_Record):
    """A planned migration's direct state handoff, under store prefix ``prefix``."""

    role: Literal["donor", "receiver"]
    prefix: str


@dataclass(frozen=True)
class NewGeneration(Message):
    op: ClassVar[str] = "generation"
    gen: Count
    rank: Count | None
    world_size: Count
    master_addr: str
    master_port: Positive
    reason: str
    boundary: int | None = None
    handoff: Handoff | None = None
    from_slot: int | None = None
    # The addresses of the nodes this generation replaced as lost (vanished hosts): the
    # worker shuts its TCP connections to them (tp_launch.resilient.peers), since a
    # vanished peer closes nothing and gloo would wait for its own timeout.
    lost_addrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Exit(Message):
    op: ClassVar[str] = "exit"


@dataclass(frozen=True)
class Recovering(Message):
    op: ClassVar[str] = "recovering"


@dataclass(frozen=True)
class Reply(Message):
    op: ClassVar[str] = "reply"
    message: str


# ---------------------------------------------------------------- to tp-run status

STATUS_MAX_RANKS = 128
STATUS_MAX_SPARES = 64
STATUS_MAX_RECOVERIES = 5
STATUS_MAX_LISTED = 16  # ranks or pids named by one recovery


@dataclass(frozen=True)
class RankStatus(_Record):
    """One rank of this node, from the progress board (ages: seconds, None: never)."""

    rank: Count
    pid: int
    slot: Count
    step: int  # the last committed step, -1: none yet
    step_s: Seconds  # the last committed iteration's duration (0: first of its generation)
    gen: int  # the generation the process is in (-1: not yet)
    stage: str  # progress.Stage, lower case
    commit_age_s: Seconds | None = None
    beat_age_s: Seconds | None = None
    node: str = ""  # multi-node: the node that holds it ("": the node that answers)
    seq: Count = 0  # collectives issued in its generation (hang detection across nodes)


@dataclass(frozen=True)
class SpareStatus(_Record):
    slot: Count
    pid: int
    node: str = ""


@dataclass(frozen=True)
class NodeStatus(_Record):
    """What one node's ranks and parked spares do, as it publishes it for the other
    nodes (``P/status/<node>``, every 2 s): their ``tp-run status`` and their hang
    detection across nodes read it. ``t``: ``time.time()`` at publication."""

    t: float
    gen: int
    ranks: tuple[RankStatus, ...]
    parked: tuple[SpareStatus, ...]


@dataclass(frozen=True)
class RecoveryStatus(_Record):
    """One recovery of ``recovery.jsonl`` (``total_s`` None: not reported yet)."""

    gen: int
    reason: str
    failed_ranks: tuple[int, ...]
    promoted_pids: tuple[int, ...]
    step: int | None = None
    detected_at: float | None = None
    total_s: float | None = None


@dataclass(frozen=True)
class StatusReply(Message):
    op: ClassVar[str] = "status_reply"
    run_id: str
    node: str
    agent_pid: Positive
    gen: int
    world_size: Count
    state: str  # training, recovering, waiting for a spare, exiting
    ranks: tuple[RankStatus, ...]
    ranks_total: Count
    parked: tuple[SpareStatus, ...]
    parked_total: Count
    recoveries: tuple[RecoveryStatus, ...] = ()
    log_dir: str = ""


TO_AGENT: tuple[type[Message], ...] = (Hello, Resumed, Stepped, Finished, Fatal, Migrate,
                                       Status)
TO_WORKER: tuple[type[Message], ...] = (NewGeneration, Exit, Recovering, Reply, StatusReply)


# ---------------------------------------------------------------- framing


def encode(msg: Message) -> bytes:
    """One message as its line."""
    return json.dumps(msg.to_json(), allow_nan=False, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes | str, accept: Iterable[type[Message]]) -> Message:
    """The message on ``line``, which must be one of the kinds in ``accept``.

    Raises:
        ChannelError: not JSON, not an object, an op not in ``accept``, a field missing
            or of the wrong type or range (the message says which, in one line).
    """
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ChannelError(f"not a JSON line ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(doc, dict):
        raise ChannelError(f"not a JSON object: {_show(doc)}")
    kinds = {kind.op: kind for kind in accept}
    op = doc.get("op")
    kind = kinds.get(op) if isinstance(op, str) else None
    if kind is None:
        raise ChannelError(f"op {_show(op)} is not one of {sorted(kinds)}")
    try:
        return kind._from_json(doc)
    except ChannelError as e:
        raise ChannelError(f"{op}: {e}") from None


def send(sock: socket.socket, msg: Message) -> None:
    """Write one message (the whole line; the socket must be blocking or have a
    timeout)."""
    sock.sendall(encode(msg))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as
    the kernel saw it when the connection was made (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
    pid, uid, gid = _CREDS.unpack(creds)
    return pid, uid, gid


class LineReader:
    """Splits a byte stream into lines of at most :data:`MAX_LINE` bytes."""

    def __init__(self) -> None:
        self._buf = b""

    def lines(self, data: bytes) -> list[bytes]:
        """The complete non-blank lines ``data`` ends; ChannelError if a line (complete
        or not) is longer than :data:`MAX_LINE`."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > MAX_LINE or any(len(line) > MAX_LINE for line in lines):
            raise ChannelError(f"a line longer than {MAX_LINE} bytes")
        return [line for line in lines if line.strip()]
