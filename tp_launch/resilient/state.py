"""What survives a failure: the registered training state and the committed position.

A :class:`State` holds the objects a script registers (models, optimizers, LR
schedulers, a stateful data loader, a GradScaler: anything with ``state_dict`` and
``load_state_dict``), a few plain values (``extra``) and the **committed position**: how
many iterations of the training loop have completed (``step``), and for epoch loops
the epoch and the batch within it.

The loop itself marks what an iteration is::

    for step in state.steps(total):          # or: for epoch in state.epochs(n):
        ...                                  #         for batch in state.batches(loader):
                                             #             ...

An iteration is committed when its body has run to the end (the generator is resumed
for the next one). Whatever happens in the body, the forward and backward passes, the
optimizer step, the scheduler step, an EMA update, the loss log, is one unit: after a
failure every rank is at the end of the same committed iteration, never in the middle
of one. A ``break`` out of the loop commits the iteration it leaves and ends the loop for
good (a recovery later does not resume it); so does ``train`` returning.

Resilient mode (:func:`tp_launch.resilient.run` under a tp-run agent) hangs its
bookkeeping on these boundaries (:class:`Hooks`): what to restore if the next
iteration is abandoned (:mod:`tp_launch.resilient.rollback`), the progress board, and
the check for a new generation, which is raised as :class:`GenerationChanged` right
after a commit. Under plain torchrun the loops are plain counters.

Callbacks given to :meth:`State.on_commit` during an iteration run once it is
committed, and never if it is abandoned: side effects that must happen once per step
(a loss log, a metrics push) go there.

A phase that runs much longer than a step (an evaluation, a checkpoint save) is marked
``with state.long_phase(seconds):`` so that the agent's hang detection gives it that
budget instead of taking it for a hang (the agent reads the mark on the progress board;
without an agent it does nothing).

One module of this size (over 500 lines) on purpose: it is the whole of what a script
touches (the registration, the three loops, the commit and its callbacks, the position
that travels) and the loops share the commit's bookkeeping; split, a script's author
would read three modules to learn one contract. What happens at a commit under an agent
is not here (:class:`Hooks`, implemented by :mod:`tp_launch.resilient.runtime`).
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Collection, Iterable, Iterator

import torch

from tp_launch.resilient import rng, sharding
from tp_launch.resilient.wire import encode, tensor_bytes


class GenerationChanged(Exception):
    """Raised at a step boundary: the process group of this generation is obsolete."""


class ResilientUsageError(RuntimeError):
    """The script uses the resilient API in a way that cannot be recovered exactly."""


class Possession(enum.Enum):
    """Whether this process holds the job's committed state (resilient mode).

    To hold it is to be able to provide it to the other ranks: this process's objects,
    position and generators are the last commit the job went on from, or can be rolled
    back to it (:mod:`tp_launch.resilient.rollback`). In an agreement after a failure
    (:mod:`tp_launch.resilient.agreement`) a rank that holds, and rolls back, offers its
    committed step; any other offers none and receives.

    * ``HOLDS``: a rank process that built or loaded its state when ``run()`` began, or
      that received or adopted the state since (an agreement, buddy copies, a planned
      migration's handoff). A survivor of a failure keeps holding while its rollback to
      the commit can succeed.
    * ``NOTHING``: a spare, promoted or parked, that has received nothing yet; a rank
      whose commit could not be restored; a State outside ``run()``.
    """

    HOLDS = "holds"
    NOTHING = "nothing"


@dataclass
class Cursor:
    """The committed position of the training loop."""

    step: int = 0  # iterations committed (steps() and batches() alike)
    epoch: int = 0  # epochs committed (epochs())
    batch: int = 0  # batches committed in the current epoch (batches())
    pass_done: bool = False  # the current epoch's batches() has ended
    ended: bool = False  # the loop was left with break, or train returned
    # The generators' states when the current pass over the data began: resuming in
    # the middle of it replays the data loader's iter() (which draws a seed) from there.
    pass_rng: dict[str, Any] | None = None

    def to_tree(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_tree(d: Any) -> Cursor:
        if not isinstance(d, dict) or not all(
                type(d.get(k)) is int and d[k] >= 0 for k in ("step", "epoch", "batch")):
            raise ValueError(f"bad position {str(d)[:80]}")
        return Cursor(d["step"], d["epoch"], d["batch"], bool(d.get("pass_done")),
                      bool(d.get("ended")), d.get("pass_rng"))


@dataclass(frozen=True)
class Generation:
    """What a State's ``build`` function is given: this process's place in the
    generation it builds for (a promoted spare keeps its own ``local_rank``)."""

    number: int  # grows with every recovery (0 under plain torchrun)
    rank: int
    world_size: int
    local_rank: int


class Hooks:
    """What runs at the loop's boundaries. This one (plain torchrun, or no agent) does
    nothing; :class:`tp_launch.resilient.runtime` installs the resilient one."""

    def entered(self, state: State) -> None:
        """A loop starts or resumes: the state is a committed one."""

    def committed(self, state: State) -> None:
        """An iteration (or, ``break``, a loop) ended: the state is a committed one."""

    def check(self, state: State) -> None:
        """After the commit's callbacks: raise GenerationChanged if the job moves on."""

    def long_phase(self, until: float) -> None:
        """A phase marked long runs until monotonic time ``until`` (0: it ended)."""


class State:
    """The training state that resilient mode keeps alive across failures.

    Args:
        extra: plain values that travel with the state (``state.extra``): None, bools,
            numbers, strings, bytes, lists, tuples, dicts and tensors.
        build: for state bound to the process group (FSDP2's ``fully_shard``, a
            ``DeviceMesh``, optimizers over DTensors): called with the
            :class:`Generation` once the generation's group exists (before ``train``;
            again after every recovery, on survivors and newcomers alike), it builds
            and returns those objects by name; they join ``objects``. A survivor's
            committed state moves into what it built, a newcomer's comes from a rank
            that holds the same pieces. Seeding inside it is fine: after a recovery
            the committed generators replace what it drew (the first time, as under
            torchrun, what it draws stays drawn).
        snapshot: when the state at a commit is also copied at the optimizer step, so
            that an iteration can be rolled back after its optimizer step (a collective
            after the step failed on every rank): ``"auto"`` (once such a collective
            has been seen), ``"always"``, ``"never"``. Costs a copy of the parameters
            and optimizer state per step, in their own memory.
        per_rank: the names of registered objects (given here or returned by
            ``build``) that each rank keeps its own, whose state may differ from rank
            to rank later even where it is the same at the start (a data loader over
            this rank's part of the data, whose buffers fill as it reads). An object
            whose state already differs between the ranks at the start is found
            without it. Each rank's own are left out of the replicas' comparison and
            travel only to their own rank's newcomer (buddy copies, a planned
            migration's handoff); otherwise a newcomer goes on with a donor's and the
            recovery says so (``inexact``).
        **objects: objects with ``state_dict()`` and ``load_state_dict()`` (a model
            without its DDP wrapper, optimizers, schedulers, data loaders...), by name;
            they are available as attributes (``state.model``).
    """

    def __init__(self, extra: dict[str, Any] | None = None, *, snapshot: str = "auto",
                 build: Callable[[Generation], dict[str, Any]] | None = None,
                 per_rank: Collection[str] = (), **objects: Any) -> None:
        _check_objects(objects, "State")
        if snapshot not in ("auto", "always", "never"):
            raise ValueError(f"State(snapshot={snapshot!r}): auto, always or never")
        if build is not None and not callable(build):
            raise TypeError("State(build=...) takes a function of the Generation")
        self.objects: dict[str, Any] = dict(objects)
        self.build = build
        if isinstance(per_rank, str) or not all(isinstance(n, str) for n in per_rank):
            raise TypeError("State(per_rank=...) takes a collection of object names")
        self.per_rank: frozenset[str] = frozenset(per_rank)
        self.built: set[str] = set()  # the names build() returned (its last call)
        self.extra: dict[str, Any] = dict(extra or {})
        self.snapshot = snapshot
        self.cursor = Cursor()
        self.hooks: Hooks = Hooks()
        self._depth = 0  # how many of our loops' bodies are running
        self._long_depth = 0  # how many long_phase() marks are open
        self._callbacks: list[Callable[[], Any]] = []
        self._replaying = False  # epochs() restored the pass's generators: batches() need not
        self._resume_rng: dict[str, Any] | None = None  # the committed ones, meanwhile
        self._broken: tuple[list[Callable[[], Any]], bool] | None = None
        # Resilient mode: set by the runtime and the transfer through the methods below.
        self._possession = Possession.NOTHING

    def rebuild(self, gen: Generation) -> None:
        """Call ``build`` for generation ``gen``; what it returns replaces what it
        returned last time (the caller moves the state over)."""
        assert self.build is not None
        built = self.build(gen)
        if not isinstance(built, dict) or not all(isinstance(k, str) for k in built):
            raise ResilientUsageError("State(build=...) must return a dict of objects by name")
        _check_objects(built, "State(build=...) returned")
        clash = set(built) & (set(self.objects) - self.built)
        if clash:
            raise ResilientUsageError(f"State(build=...) returned {sorted(clash)}, which "
                                      "State() was given too")
        for name in self.built - set(built):
            del self.objects[name]
        self.objects.update(built)
        self.built = set(built)

    def drop_built(self) -> None:
        """Forget what ``build`` returned (the objects bound to a generation's groups)."""
        for name in self.built:
            del self.objects[name]
        self.built = set()

    # ------------------------------------------------------------------ possession

    @property
    def possession(self) -> Possession:
        """Whether this process holds the job's committed state (:class:`Possession`)."""
        return self._possession

    @property
    def holds_committed(self) -> bool:
        """``possession is Possession.HOLDS``."""
        return self._possession is Possession.HOLDS

    def began(self, holding: bool) -> None:
        """``run()`` begins in this process: a rank process holds the state it built or
        loaded (``holding``), a spare holds none."""
        self._possession = Possession.HOLDS if holding else Possession.NOTHING

    def took_committed(self) -> None:
        """This process now holds the committed state: it received or adopted it, or
        every rank agreed its own is the state (a fresh start)."""
        self._possession = Possession.HOLDS

    def lost_commit(self) -> None:
        """This process cannot provide the committed state any more: its rollback to the
        last commit failed."""
        self._possession = Possession.NOTHING

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(name)

    # ------------------------------------------------------------------ the position

    @property
    def step(self) -> int:
        """Iterations committed so far (settable, e.g. after loading a checkpoint)."""
        return self.cursor.step

    @step.setter
    def step(self, value: int) -> None:
        self.cursor.step = int(value)

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.cursor.epoch = int(value)

    @property
    def batch(self) -> int:
        """Batches of the current epoch committed so far."""
        return self.cursor.batch

    @batch.setter
    def batch(self, value: int) -> None:
        self.cursor.batch = int(value)

    @property
    def in_iteration(self) -> bool:
        return self._depth > 0

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        return {n: o for n, o in self.objects.items() if isinstance(o, torch.nn.Module)}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {n: o for n, o in self.objects.items() if isinstance(o, torch.optim.Optimizer)}

    def stepped_only(self) -> Callable[[tuple[Any, ...]], bool]:
        """Whether the tensor at a path of a state tree (``("objects", name, key,
        ...)``) is one that only an optimizer step changes: a registered module's
        parameter, an optimizer's state. The rest (buffers: a forward pass changes
        them; the position, other objects) may change anywhere in an iteration. For the
        objects registered now (take a new one after a rebuild)."""
        params = {n: {p for p, _ in m.named_parameters()} for n, m in self.modules.items()}
        optimizers = set(self.optimizers)

        def only(path: tuple[Any, ...]) -> bool:
            if len(path) < 3 or path[0] != "objects":
                return False
            if path[1] in optimizers:
                return path[2] == "state"
            return path[2] in params.get(path[1], ())
        return only

    @property
    def others(self) -> dict[str, Any]:
        """Registered objects that are neither modules nor optimizers (small state)."""
        return {n: o for n, o in self.objects.items()
                if not isinstance(o, (torch.nn.Module, torch.optim.Optimizer))}

    # ------------------------------------------------------------------ the loops

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Iterate from the committed step to ``total`` (None: until ``break``); each
        iteration is committed when its body ends."""
        c = self.cursor
        if c.ended:
            return
        self._entered()
        while total is None or c.step < total:
            with _Iteration(self) as it:
                yield c.step
            if it.closed:
                return
            self._settle_break()
            c.step += 1
            self._committed()

    def epochs(self, total: int) -> Iterator[int]:
        """Iterate from the committed epoch to ``total``; inside, iterate the epoch's
        data with :meth:`batches`. An epoch is committed when its body ends (after the
        per-epoch work that follows the batches: evaluation, a scheduler step...)."""
        c = self.cursor
        if c.ended:
            return
        self._entered()
        while c.epoch < total:
            if c.batch == 0 and not c.pass_done:
                c.pass_rng = rng.capture()
            elif not c.pass_done and c.pass_rng is not None:
                # Resuming inside the epoch: replay its start (the loader's iter() draws
                # a seed) up to the data already trained on; batches() then puts the
                # committed generators back.
                self._resume_rng = rng.capture()
                rng.restore(c.pass_rng)
                self._replaying = True
            with _Iteration(self) as it:
                yield c.epoch
            if it.closed:
                return
            self._settle_break()
            c.epoch += 1
            c.batch, c.pass_done, c.pass_rng = 0, False, None
            self._committed()

    def batches(self, data: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``data`` (a data loader), one committed iteration per item, from the
        batch after the last committed one. A data loader registered in this State
        resumes itself (``StatefulDataLoader``); any other is re-iterated from its
        start and the committed batches are skipped (read, not trained on)."""
        c = self.cursor
        replaying, self._replaying = self._replaying, False
        resume_rng, self._resume_rng = self._resume_rng, None
        if c.ended or c.pass_done:
            if resume_rng is not None:
                rng.restore(resume_rng)
            return
        if c.batch == 0:
            if c.pass_rng is None:
                c.pass_rng = rng.capture()
            self._entered()  # before iter(): its draws belong to the pass
            it = iter(data)
        else:
            committed = resume_rng if replaying else rng.capture()
            if not replaying and c.pass_rng is not None:
                rng.restore(c.pass_rng)
            it = iter(data)
            if not any(data is o for o in self.objects.values()):
                for _ in range(c.batch):
                    next(it, None)
            if committed is not None:
                rng.restore(committed)
            self._entered()
        while True:
            try:
                item = next(it)
            except StopIteration:
                c.pass_done = True
                self.hooks.committed(self)  # in place: a rollback need not re-read the data
                return
            with _Iteration(self, ends_pass=True) as body:
                yield item
            if body.closed:
                return
            self._settle_break()
            c.step += 1
            c.batch += 1
            self._committed()

    def on_commit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` once the current iteration is committed (never if it is
        abandoned after a failure). Outside an iteration: at once."""
        if self._depth == 0:
            fn()
        else:
            self._callbacks.append(fn)

    @contextlib.contextmanager
    def long_phase(self, seconds: float | None = None) -> Iterator[None]:
        """Mark a phase that takes much longer than a step (evaluation, a checkpoint
        save): while it runs, hang detection gives this rank ``seconds`` (None: no
        limit) instead of the hang timeout. Its peers waiting for it meanwhile are not
        hung either. Nests; the outermost mark counts."""
        if self._long_depth:
            self._long_depth += 1
            try:
                yield
            finally:
                self._long_depth -= 1
            return
        self._long_depth = 1
        until = float("inf") if seconds is None else time.monotonic() + seconds
        self.hooks.long_phase(until)
        try:
            yield
        finally:
            self._long_depth = 0
            self.hooks.long_phase(0.0)

    def _entered(self) -> None:
        self._settle_break()
        self.hooks.entered(self)

    def _committed(self) -> None:
        self.hooks.committed(self)
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()
        self.hooks.check(self)

    def _settle_break(self) -> None:
        """The script went on normally after a ``break`` out of one of the loops: the
        iteration it left counts (its callbacks run; a data pass is over)."""
        broken, self._broken = self._broken, None
        if broken is None:
            return
        callbacks, ends_pass = broken
        if ends_pass:
            self.cursor.pass_done = True
        for fn in callbacks:
            fn()

    def abandon(self) -> None:
        """The iteration in flight failed: forget what it would have committed."""
        self._depth = 0
        self._callbacks = []
        self._broken = None
        self._replaying = False
        self._resume_rng = None

    def end(self) -> None:
        """Training is over on this rank (``train`` returned): commit the end."""
        self._settle_break()
        self.cursor.ended = True
        self.hooks.committed(self)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything registered, the position and ``extra``: for the script's own
        checkpoints (``torch.save(state.state_dict(), path)``)."""
        # A loaded checkpoint resumes the loop: "train() returned" is this run's only.
        cursor = {**self.cursor.to_tree(), "ended": False}
        return {"cursor": cursor, "extra": self.extra,
                "objects": {n: o.state_dict() for n, o in self.objects.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cursor = Cursor.from_tree(sd["cursor"])
        self.extra = dict(sd["extra"])
        for name, obj in self.objects.items():
            obj.load_state_dict(sd["objects"][name])

    def digest(self, buffers: bool = True, sharded: bool = True,
               skip: Collection[str] = ()) -> str:
        """A hash of the whole state (position, extra, every registered object): equal
        on two ranks exactly when their states are bit-identical. ``buffers=False``
        leaves out the modules' buffers, which differ between DDP ranks between two
        forward passes (each rank's BatchNorm statistics are its own until DDP
        broadcasts rank 0's); ``sharded=False`` the DTensors, whose local pieces differ
        from rank to rank (with them: each one's local piece). The cursor's ``ended`` is
        left out: it says whether ``train`` returned on this rank, which ranks at the same
        last step may differ in (one was told of a failure at its last commit, another
        had already returned) with the same training state. ``skip``: objects left out
        (each rank's own: a data stream of its own)."""
        return digest_tree(self.compared_tree(buffers, sharded, skip))

    def compared_tree(self, buffers: bool = True, sharded: bool = True,
                      skip: Collection[str] = ()) -> dict[str, Any]:
        """What :meth:`digest` hashes, as a tree (the same arguments): the position
        without ``pass_rng`` and ``ended``, ``extra`` and the objects' states (their
        tensors the live ones, not copies)."""
        objects = {}
        for name, obj in self.objects.items():
            if name in skip:
                continue
            sd = sharding.object_state(obj)
            if not buffers and isinstance(obj, torch.nn.Module):
                own = {n for n, _ in obj.named_buffers()}
                sd = {k: v for k, v in sd.items() if k not in own}
            objects[name] = sd if sharded else sharding.without_dtensors(sd)
        return {"cursor": {k: v for k, v in self.cursor.to_tree().items()
                           if k not in ("pass_rng", "ended")},
                "extra": self.extra, "objects": objects}


def _check_objects(objects: dict[str, Any], where: str) -> None:
    for name, obj in objects.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"{where} {name}=...: {type(obj).__name__} has no "
                            "state_dict()/load_state_dict()")


def digest_tree(tree: Any) -> str:
    """blake2b of a tree's typed structure and its tensors' bytes."""
    doc, tensors = encode(tree)
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(tensor_bytes(t))
    return h.hexdigest()


class _Iteration:
    """The body of one iteration of State's loops. A ``GeneratorExit`` at the ``yield``
    is either a ``break`` or an exception unwinding through the loop: Python closes the
    generator in both cases before anyone can tell them apart, so the iteration is kept
    aside (``State._broken``): the next boundary settles it as a break, a failure
    (``State.abandon``) drops it."""

    def __init__(self, state: State, ends_pass: bool = False) -> None:
        self.state = state
        self.ends_pass = ends_pass
        self.closed = False

    def __enter__(self) -> _Iteration:
        self.state._depth += 1
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        state = self.state
        state._depth -= 1
        if exc_type is GeneratorExit:
            state._broken = (state._callbacks, self.ends_pass)
            state._callbacks = []
            self.closed = True
            return True
        return False
