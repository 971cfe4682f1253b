"""``run(train, state)``: the worker's side of resilient mode.

Under a tp-run agent with spares (``TP_RUN_CHANNEL`` set), every process of the script,
ranks and spares alike, runs the script up to :func:`run` (torch imported, model and
optimizer built) and connects to its agent there. Then, in a loop:

1. wait for a generation that gives this process a rank (a spare parks here, blocked on
   its socket: no CPU, once it has loaded what every rank loads at its first step:
   :func:`_warm_up`);
2. build the generation's group (:mod:`tp_launch.resilient.group`), agree on the step
   and receive or send the state (:mod:`tp_launch.resilient.transfer`); begin the
   replicas' check (:mod:`tp_launch.resilient.replicas`: digested beside the first
   iteration, compared at its optimizer step);
3. call ``train(state)``. Its loop (``state.steps()``, ``state.epochs()``/``batches()``)
   commits every iteration that ends (:mod:`tp_launch.resilient.state`), and at each
   commit this module records the restore point (:mod:`tp_launch.resilient.rollback`),
   writes the step to the progress board, and checks for a newer generation. ``train``
   returns: commit the end, report ``finished`` and wait for the agent's exit barrier
   (a failure elsewhere before every rank finished brings a new generation, and this
   rank, at the final step, becomes a donor). It raises because a newer generation
   exists (a collective failed when a peer died, or the commit saw the announcement):
   drop the iteration in flight and the group, and go to 2 with the new generation,
   where every rank first goes back to its last commit. Any other exception is the
   script's own: it propagates and the process fails as it would under torchrun (the
   agent then treats it as a dead rank).

A rank that finds the job cannot go on exactly (no rank holds the committed state any
more, the ranks' states differ after a recovery, or the script's loop does not mark its
iterations) tells the agent (``fatal``) and exits 1; the agent stops the job with that
one line (a lost state: ``--spare-policy``).

A planned migration's generation names a boundary step: the ranks stop right after
committing it; the retiring rank hands its state to its replacement over a two-process
group and exits 0.

Without an agent channel (plain torchrun, or tp-run without ``--spares``) :func:`run`
initialises the group from the environment and calls ``train(state)`` once; the loops
are plain counters.

The connection to the agent (announcements in, ``hello``/``resumed``/``stepped``/
``finished``/``fatal`` out) is :class:`tp_launch.resilient.link.AgentLink`. What the
agent tells the process (its channel, slot, board, ``--verify-every`` ...) is read once,
at :func:`run`, as a :class:`tp_launch.worker_settings.WorkerSettings`.

One module of this size (over 500 lines) on purpose: it is the one loop of a worker
process (park, enter a generation, train, recover, retire, hand off), whose steps share
the process's group, link and restore point; every decision inside it is another
module's (the agreement: :mod:`tp_launch.resilient.agreement`; what a commit records:
:mod:`tp_launch.resilient.rollback`; the group: :mod:`tp_launch.resilient.group`).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import sys
import time
from typing import Callable, Literal, NoReturn, TypeVar

import torch.distributed as dist

from tp_launch import channel, control_files
from tp_launch.progress import Stage
from tp_launch.resilient import group, per_rank, rng, sharding
from tp_launch.resilient.copies import BuddyCopies
from tp_launch.resilient.ddp import Layouts
from tp_launch.resilient.heartbeat import Heartbeat
from tp_launch.resilient.link import AgentLink
from tp_launch.resilient.rollback import Rollback
from tp_launch.resilient.state import (
    Generation,
    GenerationChanged,
    Hooks,
    ResilientUsageError,
    State,
)
from tp_launch.resilient.replicas import Diverged, ReplicaCheck
from tp_launch.resilient.transfer import (
    Carrier,
    StateLost,
    adopt,
    agree_and_transfer,
    copy_rows,
    recv_pieces,
    recv_state,
    send_pieces,
    send_state,
)
from tp_launch.resilient.wire import EncodeError, StateMessage, WireError, tensor_bytes
from tp_launch.worker_settings import RECOVERY_WAIT_S, WorkerSettings, from_env

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a rank that reported a fatal condition waits to be stopped by its agent.
_FATAL_WAIT_S = 30.0
# No generation within this long after the hello: this process is parked (a spare, or a
# rank whose nodes are still gathering), and warms up while it waits.
_WARM_AFTER_S = 0.5
# Module buffers up to this size go into the per-rank record at every commit.
_RECORD_BUFFERS_MAX = 16 << 20


def parked_spares() -> int:
    """How many spares this node's agent has parked right now (0 without an agent)."""
    settings = from_env()
    if settings is None:
        return 0
    status = control_files.read_status(settings.channel)
    return 0 if status is None else len(status.parked_spares)


def _warm_up() -> None:
    """Load what a training process loads at its first optimizer step (torch's
    optimizers import ``torch._dynamo`` then; FSDP2 at its first ``fully_shard``): about
    0.3 s of CPU and 25 MB, paid by a parked spare while it waits instead of by a
    newcomer during a recovery. In the main thread: an import racing the script's own
    in another thread can deadlock on the module locks."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # a build without it: the newcomer pays nothing either
        logger.debug("warm-up import failed: %s", e)


def run(train: Callable[[State], T], state: State, *, backend: str | None = None,
        timeout: datetime.timedelta | None = None) -> T:
    """Run ``train(state)`` on this rank, and again after every recovery.

    Args:
        train: the training function; it must resume from ``state.step`` and build
            anything that holds the process group (DDP) itself.
        state: what must survive (see :class:`State`).
        backend: ``init_process_group``'s backend (default: gloo; nccl for CUDA).
        timeout: the group's collective timeout (torch's default if None).

    Returns:
        What ``train`` returned on this rank.
    """
    backend = backend or group.default_backend()
    settings = from_env()
    if settings is None:
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout)
        # As under an agent: the groups go before the interpreter finalizes (an HSDP
        # mesh's subgroups left up made rank 0 of a plain torchrun job die of SIGABRT).
        atexit.register(group.let_go)
        if state.build is not None:
            state.rebuild(Generation(0, dist.get_rank(), dist.get_world_size(),
                                     _local_rank()))
        result = train(state)
        state.end()
        return result
    if dist.is_initialized():
        raise RuntimeError("tp_launch.resilient.run() builds the process group itself: "
                           "do not call dist.init_process_group() in a resilient script")
    return _Runner(AgentLink.connect(settings), settings, state, backend, timeout).loop(train)


class _ResilientHooks(Hooks):
    """The loop boundaries under an agent: restore point, progress board, generations."""

    def __init__(self, runner: _Runner) -> None:
        self.r = runner
        self.verify_every = runner.settings.verify_every
        self._verified = -1
        self.last_commit: float | None = None  # monotonic; None: none in this generation

    def entered(self, state: State) -> None:
        self.r.rollback.refresh_layout()
        self.r.rollback.capture()

    def committed(self, state: State) -> None:
        r, link = self.r, self.r.link
        r.compare_replicas()  # an iteration without an optimizer step: not compared yet
        r.rollback.capture()
        r._record(provisional=False)
        if link.board is not None:
            now = time.monotonic()
            took = 0.0 if self.last_commit is None else now - self.last_commit
            link.board.commit(link.slot, state.step, now, took)
            self.last_commit = now
        if link.report_first_step:
            link.report_first_step = False
            link.send(channel.Stepped(gen=link.current_gen, rank=r.rank, step=state.step,
                                      t=time.time(), check_s=r.check_s))
        if self.verify_every and state.step % self.verify_every == 0 \
                and state.step != self._verified and not state.cursor.ended:
            self._verified = state.step
            ReplicaCheck(state, r.carrier.per_rank_objects).compare()
        copies = r.copies
        if copies is not None and copies.due(state.step) and not state.cursor.ended:
            copies.snapshot(lambda: r.carrier.message().to_tree(),
                            state.stepped_only() if state.optimizers else None)

    def check(self, state: State) -> None:
        newer = self.r.link.newer()
        if newer is not None and (newer.boundary is None or state.step >= newer.boundary):
            raise GenerationChanged(f"generation {newer.gen} at step {state.step}")

    def long_phase(self, until: float) -> None:
        if self.r.link.board is not None:
            self.r.link.board.long_phase(self.r.link.slot, until)


class _Runner:
    def __init__(self, link: AgentLink, settings: WorkerSettings, state: State, backend: str,
                 timeout: datetime.timedelta | None) -> None:
        # What exists now (torch's modules, the script's model) lives as long as the
        # process: out of the collector's sight, a full collection (one per recovery, in
        # group.teardown) took ~12 ms instead of ~135 ms. Cycles among these objects are
        # never freed; a mesh made before run() is not found by teardown (build makes
        # the meshes that matter, after this).
        gc.freeze()
        self.link = link
        self.settings = settings
        self.state = state
        self.backend = backend
        self.timeout = timeout or datetime.timedelta(minutes=30)
        self.rollback = Rollback(state, on_step=self._at_optimizer_step)
        # The replicas' check begun at the last recovery, until the first optimizer step
        # (or commit) after it compares (:mod:`tp_launch.resilient.replicas`); what it
        # cost that step.
        self.check: ReplicaCheck | None = None
        self.check_s = 0.0
        self.layouts = Layouts(lambda: state.cursor.step)
        self.layouts.install()
        self.carrier = Carrier.of(state, self.rollback, self.layouts)
        self.rank = -1
        board = settings.progress
        self.record = _open_record(f"{board}.slot{link.slot}", create=True) if board else None
        # A rank process starts with the state it built (or loaded); a spare holds none.
        state.began(holding=not settings.spare)
        self.hooks = _ResilientHooks(self)
        state.hooks = self.hooks
        # State(build=...): whether this process built once; its committed state while
        # it holds no built objects (between two generations).
        self._built_once = False
        self._kept: StateMessage | None = None
        every = settings.shard_copy_every
        self.copies = BuddyCopies(every) if every > 0 and state.build is not None else None
        if link.board is not None and settings.heartbeat:
            Heartbeat(link.board, link.slot)

    def _stage(self, gen: int, stage: Stage) -> None:
        if self.link.board is not None:
            self.link.board.enter(self.link.slot, gen, stage)

    def loop(self, train: Callable[[State], T]) -> T:
        link = self.link
        announced = link.wait(_WARM_AFTER_S)
        if announced is None:
            _warm_up()
            announced = link.wait(None)
        while True:
            if not isinstance(announced, channel.NewGeneration):
                # Parked until the job ended (or the agent went away): nothing to do.
                sys.exit(0)
            gen = announced
            link.current_gen = gen.gen
            script_error: Exception | None = None
            cause = "the generation was announced"
            try:
                if gen.rank is None:
                    self._retire(gen)  # not a rank in this generation: exits
                self.rank = gen.rank
                self._enter(gen)
                self._stage(gen.gen, Stage.TRAINING)
                result = train(self.state)
                self.state.end()
                self._stage(gen.gen, Stage.FINISHED)
                link.send(channel.Finished(gen=gen.gen, rank=gen.rank, step=self.state.step))
                announced = link.wait(None)
                if isinstance(announced, channel.Exit):
                    if self.copies is not None:  # no gloo thread left at exit
                        self.copies.settle(timeout=_FATAL_WAIT_S)
                    # The groups stay up for the script's epilogue, and go before the
                    # interpreter finalizes: a gloo thread still dropping a collective
                    # then aborts the process (seen with an HSDP mesh's subgroups).
                    atexit.register(group.let_go)
                    return result
            except GenerationChanged:
                pass
            except (StateLost, Diverged, ResilientUsageError, WireError, EncodeError) as e:
                self._fatal(gen, e)
            except Exception as e:
                if not _is_communication_error(e) and not link.stale():
                    script_error = e
                else:
                    # Only its type and text: the exception would keep the old group's
                    # frames (and with them its sockets) alive.
                    cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    logger.info("rank %s: %s; moving to the next generation", gen.rank, cause)
            if script_error is not None:
                # The script's own error ends this process: with exit 1, never a
                # SIGABRT from gloo's threads at the interpreter's exit (a signal death
                # is a machine failure to the agent, not the script's bug).
                group.let_go()
                raise script_error
            # Out of the except block the traceback is gone, and with it the frames
            # that held DDP and the old group: teardown can now really drop the group,
            # which is what releases the peers still blocked in it (gloo).
            self._stage(gen.gen, Stage.WAITING)
            self.state.abandon()
            self.layouts.abandon()
            self.check = None  # its step's digest: the next generation takes its own
            self._release_built()
            group.teardown()
            wait_s = self.settings.recovery_wait_s
            announced = link.wait(wait_s)
            if announced is None:
                raise RuntimeError(f"no new generation came from the agent within "
                                   f"{wait_s:.0f} s after this rank's training "
                                   f"stopped ({cause})")

    def _enter(self, gen: channel.NewGeneration) -> None:
        """Join generation ``gen``: handoff (migration), group, agreement, transfer."""
        link, state = self.link, self.state
        assert gen.rank is not None
        t0 = time.monotonic()
        self.hooks.last_commit = None
        self._stage(gen.gen, Stage.JOINING)
        store = group.connect_store(gen.master_addr, gen.master_port)
        handoff_bytes = 0
        if gen.handoff is not None and gen.handoff.role == "receiver":
            handoff_bytes = self._handoff(store, gen.handoff, receiver=True)
        t1 = time.monotonic()
        group.build(store, gen.gen, gen.rank, gen.world_size, self.backend, self.timeout,
                    link.stale)
        t2 = time.monotonic()
        self._stage(gen.gen, Stage.AGREEING)
        os.environ.update({"RANK": str(gen.rank), "WORLD_SIZE": str(gen.world_size),
                           "ROLE_RANK": str(gen.rank), "ROLE_WORLD_SIZE": str(gen.world_size)})
        fresh = gen.reason == "start"
        if state.build is not None:
            self._rebuild(gen)
        if self.copies is not None:
            self.copies.open(gen.rank, gen.world_size, _local_world(gen.world_size))
        stats = agree_and_transfer(self.carrier, fresh=fresh, predecessor=self._predecessor(gen),
                                   copies=self.copies, most_donors=self.settings.donors)
        self.layouts.keep_buffers = not fresh
        self.rollback.refresh_layout()
        self.rollback.capture()
        copies, rank = self.copies, gen.rank
        if copies is not None:  # every rank holds the generation's first state
            copies.settle(stale=link.stale)
            copies.enter(state.step, lambda: self.carrier.message().to_tree(),
                         lambda: copy_rows(copies, rank, gen.world_size))
        self.check, self.check_s = None, 0.0
        if stats.compare:
            self.check = ReplicaCheck(state, self.carrier.per_rank_objects, background=True)
        link.send(channel.Resumed(
            gen=gen.gen, rank=gen.rank, step=stats.step, handoff_s=t1 - t0,
            group_s=t2 - t1, agree_s=stats.agree_s, transfer_s=stats.transfer_s,
            # Received only: a donor's sent bytes are some receiver's received ones.
            bytes=(stats.bytes if stats.donor is not None else 0) + handoff_bytes,
            donor=stats.donor, t=time.time(),
            verify_s=self.check.now_s if self.check is not None else 0.0,
            inexact=", ".join(stats.inexact)))
        if link.board is not None:
            link.board.write(link.slot, state.step)
        link.joined()

    def _release_built(self) -> None:
        """``State(build=...)``, training stopped: keep this rank's committed state as
        plain local pieces (:meth:`Carrier.message`) and let go of the objects build
        made. They hold the generation's subgroups (FSDP keeps its mesh's groups): a
        peer blocked in a collective of a subgroup without the dead rank (HSDP's
        replicas all-reducing) is released only when those groups are dropped here, as
        the default group's peers are by :func:`group.teardown`."""
        state, rollback = self.state, self.rollback
        if self.copies is not None:
            self.copies.close()
        if not state.built:
            return
        self._kept = None
        if state.holds_committed:
            if rollback.restore():
                self._kept = self.carrier.message()
            else:
                state.lost_commit()
        state.drop_built()
        rollback.rebind()

    def _rebuild(self, gen: channel.NewGeneration) -> None:
        """``State(build=...)``: build the objects bound to this generation's group. A
        survivor moves its committed state, kept as local pieces when training stopped,
        into the new ones; one that could not restore its commit, or a newcomer, starts
        from what build made and receives the state in the agreement."""
        state, rollback = self.state, self.rollback
        assert gen.rank is not None
        first = not self._built_once
        self._built_once = True
        state.rebuild(Generation(gen.gen, gen.rank, gen.world_size, _local_rank()))
        rollback.rebind()
        if first:
            self.carrier.first_built()
        kept, self._kept = self._kept, None
        if kept is not None:
            adopt(self.carrier, kept)
            del kept  # the last generation's pieces
        rollback.refresh_layout()
        rollback.capture()

    def _at_optimizer_step(self) -> None:
        """Just before the iteration's point of no return: the parameters change next."""
        self.compare_replicas()
        if self.copies is not None:
            self.copies.copied()
        self._record(provisional=True)

    def compare_replicas(self) -> None:
        """The first iteration after a recovery, at its optimizer step (or its commit,
        without one): the ranks compare the digests of the recovered state, before
        anything taken from it is committed; still restorable (a peer that dies during
        the comparison leaves this rank at its commit).

        Raises:
            Diverged: the replicas differ.
        """
        check, self.check = self.check, None
        if check is not None:
            t0 = time.monotonic()
            check.compare()
            self.check_s = check.waited_s + time.monotonic() - t0

    def _record(self, provisional: bool) -> None:
        """Write this rank's own state (generators, CPU buffers) to its record: at a
        commit, or provisionally (for the step being committed) at the optimizer step."""
        if self.record is None:
            return
        generators = rng.capture() if provisional else self.rollback.rng
        if generators is None:
            return
        buffers = self.rollback.buffers()
        data: list[bytes] | None = None
        if all(b.device.type == "cpu" for b in buffers) and \
                sum(b.numel() * b.element_size() for b in buffers) <= _RECORD_BUFFERS_MAX:
            data = [tensor_bytes(b) for b in buffers]
        step = self.state.step + (1 if provisional else 0)
        try:
            self.record.write(step, provisional, per_rank.encode(generators, data))
        except OSError as e:
            logger.warning("cannot write this rank's record (%s); recovery of its own "
                           "state is off", e)
            self.record = None

    def _predecessor(self, gen: channel.NewGeneration) -> Callable[[int], per_rank.Entry | None]:
        """What the previous process of this rank left on this node, by step."""
        slot = gen.from_slot
        board = self.settings.progress

        def at(step: int) -> per_rank.Entry | None:
            if not isinstance(slot, int) or not board:
                return None
            record = _open_record(f"{board}.slot{slot}", create=False)
            if record is None:
                return None
            try:
                return record.at(step)
            except ValueError as e:
                logger.warning("the record of slot %s is unreadable: %s", slot, e)
                return None
            finally:
                record.close()

        return at

    def _retire(self, gen: channel.NewGeneration) -> NoReturn:
        """This rank leaves (planned migration): hand the state over, then exit 0."""
        if gen.handoff is not None and gen.handoff.role == "donor":
            store = group.connect_store(gen.master_addr, gen.master_port)
            self._handoff(store, gen.handoff, receiver=False)
        logger.info("slot %s retired at step %s", self.link.slot, self.state.step)
        sys.exit(0)

    def _handoff(self, store: dist.Store, handoff: channel.Handoff, receiver: bool) -> int:
        """Move the state from the retiring rank (0) to its replacement (1).

        ``State(build=...)``: the state is bound to the generation's groups, and the
        replacement has built nothing yet. The retiring rank sends the local pieces it
        kept when training stopped (:meth:`_release_built`); the replacement keeps them
        until it has built its objects for the generation (:meth:`_rebuild`): its own
        shard, straight from the retiring rank, whatever other copy exists."""
        built = self.state.build is not None
        pstore = dist.PrefixStore(handoff.prefix, store)
        group.arrival_barrier(pstore, "arrived", 2, self.link.stale,
                              self.timeout.total_seconds())
        pg = dist.ProcessGroupGloo(pstore, 1 if receiver else 0, 2, self.timeout)
        try:
            if receiver and built:
                got, self._kept = recv_pieces(pg, 0)
                self.state.took_committed()
                return got
            if receiver:
                got = recv_state(self.carrier, pg, 0)
                self.state.took_committed()
                # The handed-over state is this process's restore point now: the
                # agreement restores it (a node migration has no other holder of it).
                self.rollback.refresh_layout()
                self.rollback.capture()
                return got
            if built:
                if self._kept is None:
                    raise StateLost("the retiring rank cannot restore its committed state")
                if self.copies is not None:
                    self.copies.settle(timeout=_FATAL_WAIT_S)  # its last copy, delivered
                return send_pieces(self._kept, pg, 1)
            if not self.rollback.restore():
                raise StateLost("the retiring rank cannot restore its committed state")
            held = sharding.dtensor_paths(self.state.objects)
            if held:
                raise StateLost(sharding.not_recovered(len(held), held[0]))
            return send_state(self.carrier, pg, 1)
        finally:
            del pg

    def _fatal(self, gen: channel.NewGeneration, e: Exception) -> None:
        """The job cannot go on exactly: tell the agent (it prints the one line and
        stops the job), wait to be stopped."""
        rank = gen.rank if gen.rank is not None else self.rank  # a retiring rank: its own
        logger.info("rank %s: %s", rank, e)
        try:
            self.link.send(channel.Fatal(kind=_fatal_kind(e), message=str(e).replace("\n", " "),
                                         rank=rank, gen=gen.gen))
        except OSError:
            pass
        self.link.wait_exit(_FATAL_WAIT_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "0")
    return int(value) if value.isdigit() else 0


def _local_world(world: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else world


def _fatal_kind(e: Exception) -> Literal["state_lost", "diverged", "usage"]:
    """The ``fatal`` message's kind for why the job cannot go on."""
    if type(e) is StateLost:
        return "state_lost"
    if type(e) is Diverged:
        return "diverged"
    return "usage"


def _open_record(path: str, create: bool) -> per_rank.Record | None:
    try:
        return per_rank.Record(path, create)
    except (OSError, ValueError) as e:
        if create:
            logger.warning("cannot keep this rank's record at %s: %s", path, e)
        return None


def _is_communication_error(e: BaseException) -> bool:
    """An error a dead peer causes (gloo's are RuntimeErrors from its transport)."""
    if isinstance(e, (dist.DistError, ConnectionError, TimeoutError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection", "connection", "Gloo", "gloo", "NCCL", "Socket",
                            "peer", "closed", "Timed out", "timed out"))
