"""The replicas' check: do the ranks that should hold the same state hold it?

After every recovery (and every ``--verify-every`` steps) the ranks compare a digest of
their replicated state: the position, ``extra`` and every registered object except the
ones each rank keeps its own (``State(per_rank=...)``, the generators), the modules
without their buffers (DDP ranks' BatchNorm statistics are their own between two
forward passes) and without DTensors; under HSDP a second digest of each rank's local
pieces is compared among the ranks holding the same pieces. A difference is
:class:`Diverged`, naming the ranks that do not match the lowest one: the job stops
(never goes on, or exits 0, with replicas that differ).

A check has two halves: each rank digests its state (:class:`ReplicaCheck`), then the
ranks all-gather their digests and compare (:meth:`ReplicaCheck.compare`: a collective,
every rank at the same point).

**After a recovery the check is off the critical path.** Training resumes as soon as the
state is in place. At once, on the training thread, each rank digests what the next
iteration changes before its optimizer step (the position, ``extra``, the objects that
are neither modules nor optimizers: a data loader's position; small) and the structure
of the rest. The tensors of the modules and optimizers, which nothing changes before the
optimizer step (the iteration's point of no return, :mod:`tp_launch.resilient.rollback`),
are digested on a thread of their own while the first iteration's forward and backward
run. The digests are compared at the **first optimizer step after the recovery, just
before it** (from its step pre-hook; at the iteration's commit if it has no optimizer
step): a divergence stops the job before the recovered state is changed or any step
taken from it committed (no restore point, buddy copy or progress of it exists). Not at
the commit: the comparison is a collective, and a rank blocked in a collective after its
optimizer step cannot go back to its commit when a peer dies there (CI caught exactly
that: a rank killed at its first optimizer step after a recovery left the newcomer, the
only other holder, past its own step and the state lost).
Without a registered optimizer nothing marks when the parameters change: the whole
digest is taken at once, as ``--verify-every``'s checks at a commit are.

**The digest.** blake2b over the structure (the wire's JSON form,
:func:`tp_launch.resilient.wire.encode`) and, per tensor, its shape, dtype and the
CRC-32 of its bytes, read in place (no copy; zlib releases the GIL). Not a cryptographic
hash on purpose: the check finds replicas that a bug or a non-deterministic operation
made differ, not forged state (a peer able to forge state could send any state at all;
the transfer's defence against that is the wire's strict parser, and the bytes crossed
a checksummed TCP stream). CRC-32 detects every difference confined to 32 consecutive
bits and every odd number of flipped bits, and any other difference in a tensor with
probability 1 - 2^-32 (a divergence touches many tensors, each such a chance); it runs
at ~4 GB/s on one core of the development machine where blake2b runs at ~0.9 GB/s.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
import time
import zlib
from typing import Any, Collection

import torch
import torch.distributed as dist

from tp_launch.resilient import sharding
from tp_launch.resilient.group import all_gather_flat
from tp_launch.resilient.state import State, digest_tree
from tp_launch.resilient.wire import EncodeError, encode, host_contiguous


class Diverged(RuntimeError):
    """Ranks that should hold identical state do not."""


def tensor_crc(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (a DTensor's: its local piece's), read in place where
    the tensor is a contiguous host one (else through a copy)."""
    t = host_contiguous(t)
    n = t.numel() * t.element_size()
    if n == 0:
        return 0
    # ``t`` stays referenced for the call: the memory read is its own.
    return zlib.crc32((ctypes.c_char * n).from_address(t.data_ptr()))


class _Digest:
    """A running digest of trees: structure, then tensors (shape, dtype, CRC-32)."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)

    def structure(self, tree: Any) -> list[torch.Tensor]:
        """Hash ``tree``'s structure; returns its tensors, to be hashed in this order."""
        doc, tensors = encode(tree)
        self._h.update(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
        return tensors

    def tensors(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._h.update(f"{tuple(t.shape)}{t.dtype}{tensor_crc(t)};".encode())

    def words(self) -> list[int]:
        d = self._h.digest()
        return [int.from_bytes(d[i:i + 8], "little", signed=True) for i in (0, 8)]


def _split(tree: dict[str, Any], later: Collection[str]) -> tuple[Any, Any]:
    """``tree`` (a :meth:`State.compared_tree`) as the part to digest now and the objects
    named in ``later``."""
    objects = tree.get("objects", {})
    now = {**tree, "objects": {n: v for n, v in objects.items() if n not in later}}
    return now, {n: v for n, v in objects.items() if n in later}


class ReplicaCheck:
    """This rank's digest of its replicated state at one step, and its comparison.

    Args:
        state: the rank's state, at a commit (or just recovered).
        own: the objects that are each rank's own (left out).
        background: digest the modules' and optimizers' tensors on a thread (see the
            module's docstring); False, or no registered optimizer: all at once.
    """

    def __init__(self, state: State, own: Collection[str] = (),
                 background: bool = False) -> None:
        t0 = time.monotonic()
        world = dist.get_world_size()
        classes = sharding.copy_classes(state.modules, world)
        if classes is not None and len(set(classes)) == world:
            classes = None  # plain FSDP: no two ranks hold the same pieces, none to compare
        self.step = state.step
        self._state, self._own, self._classes = state, own, classes
        later = set(state.modules) | set(state.optimizers) \
            if background and state.optimizers else set()
        trees = [state.compared_tree(buffers=False, sharded=False, skip=own)]
        if classes is not None:
            trees.append({"objects": sharding.local_tree(
                {n: sharding.object_state(o) for n, o in state.objects.items()
                 if n not in own})})
        self._digests: list[_Digest] = []
        deferred: list[list[torch.Tensor]] = []
        for tree in trees:
            d = _Digest()
            now, rest = _split(tree, later)
            d.tensors(d.structure(now))
            deferred.append(d.structure(rest))
            self._digests.append(d)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if any(deferred):
            self._thread = threading.Thread(target=self._digest, args=(deferred,),
                                            name="tp-replica-check", daemon=True)
            self._thread.start()
        self.now_s = time.monotonic() - t0  # on the training thread
        self.waited_s = 0.0  # the training thread's wait for the digest thread

    def _digest(self, deferred: list[list[torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                for d, tensors in zip(self._digests, deferred):
                    d.tensors(tensors)
        except BaseException as e:  # the training thread raises it (ready())
            self._error = e

    def ready(self) -> None:
        """Wait until this rank's digest is complete."""
        if self._thread is not None:
            t0 = time.monotonic()
            self._thread.join()
            self._thread = None
            self.waited_s += time.monotonic() - t0
        if self._error is not None:
            raise self._error

    def compare(self) -> None:
        """All ranks compare their digests. Collective.

        Raises:
            Diverged: naming the ranks that differ from the lowest rank's state (or, under
                HSDP, from the other holders of their pieces).
        """
        self.ready()
        world = dist.get_world_size()
        words = self._digests[0].words() + \
            (self._digests[1].words() if len(self._digests) > 1 else [0, 0])
        gathered = torch.zeros(world * 4, dtype=torch.int64)
        all_gather_flat(gathered, torch.tensor(words, dtype=torch.int64))
        rows = [tuple(r) for r in gathered.view(world, 4).tolist()]
        differ = [r for r, row in enumerate(rows) if row[:2] != rows[0][:2]]
        if differ:
            # Every rank is here alike (the same rows): name the objects, one more gather.
            others = sorted(differing_objects(self._state, world) - set(self._own))
            hint = (f" in {others} (an object each rank keeps its own, its data loader, is "
                    f"declared with State(per_rank={others}))") if others else ""
            raise Diverged(f"the ranks' states differ{hint}: rank(s) {differ} do not match "
                           f"rank 0 at step {self.step}")
        classes = self._classes
        if classes is not None:
            first: dict[Any, int] = {}
            for r in range(world):
                first.setdefault(classes[r], r)
            differ = [r for r in range(world) if rows[r][2:] != rows[first[classes[r]]][2:]]
            if differ:
                raise Diverged(f"the ranks' shards differ: rank(s) {differ} do not match the "
                               f"other holders of their pieces at step {self.step}")


def differing_objects(state: State, world: int) -> set[str]:
    """The registered objects, neither modules nor optimizers, whose state differs
    between the ranks: each rank's own (a data stream seeded by rank). Collective."""
    names = sorted(state.others)
    words = [_object_word(state.objects[n]) for n in names]
    gathered = torch.zeros(world * len(names), dtype=torch.int64)
    if names:
        all_gather_flat(gathered, torch.tensor(words, dtype=torch.int64))
    rows = gathered.view(world, len(names)).tolist() if names else []
    return {n for i, n in enumerate(names) if len({row[i] for row in rows}) > 1}


def _object_word(obj: Any) -> int:
    """64 bits of a digest of ``obj.state_dict()``; 0 for one the wire cannot carry (it
    fails if it ever has to travel, not here)."""
    try:
        return int.from_bytes(bytes.fromhex(digest_tree(obj.state_dict()))[:8], "little",
                              signed=True)
    except EncodeError:
        return 0


__all__ = ["Diverged", "ReplicaCheck", "differing_objects", "tensor_crc"]
