"""The process group of one generation: build it, tear it down, abort it.

Generation ``g`` builds the default process group on ``PrefixStore("tp-run/g<g>")``
over the agent-hosted TCPStore: the store's host (the agent) outlives every worker, and
a fresh prefix per generation means no key of a dead process is ever read again.

Before ``init_process_group`` the ranks meet at an *arrival barrier* (a counter in the
store, polled every few milliseconds): ``init_process_group`` cannot be interrupted, so
a rank enters it only once every rank of the generation is alive and there; while it
polls, a newer generation (the agent found another death) aborts the wait at once.

Teardown drops every reference to the old group. For gloo that is what releases the
peers still blocked in one of its collectives (their sockets close; gloo's ``abort`` is
a no-op). NCCL does not notice dead peers this way: :func:`abort_nccl` aborts its
communicators from the channel's thread as soon as a new generation is announced, and
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (set by the agent) keeps NCCL's watchdog from
killing the survivor.
"""

from __future__ import annotations

import datetime
import gc
import logging
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from tp_launch.resilient.state import GenerationChanged

logger = logging.getLogger(__name__)

# A store wait that outlives this is a generation that cannot form: give up, look for
# a newer one (the agent publishes it as soon as it sees why).
STORE_TIMEOUT = datetime.timedelta(seconds=60)
_POLL_S = 0.002


def default_backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def connect_store(addr: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(addr, port, is_master=False, timeout=STORE_TIMEOUT)


def build(store: dist.Store, gen: int, rank: int, world_size: int, backend: str,
          timeout: datetime.timedelta, stale: Callable[[], bool]) -> None:
    """Make the default group of generation ``gen``.

    Args:
        store: the agent-hosted store (client).
        gen, rank, world_size: this process's place in the generation.
        backend: ``init_process_group``'s backend string.
        timeout: the group's collective timeout.
        stale: True once a newer generation has been announced.

    Raises:
        GenerationChanged: a newer generation was announced during the barrier.
    """
    pstore = dist.PrefixStore(f"tp-run/g{gen}", store)
    arrival_barrier(pstore, "arrived", world_size, stale, timeout.total_seconds())
    dist.init_process_group(backend, store=pstore, rank=rank, world_size=world_size,
                            timeout=timeout)


def arrival_barrier(store: dist.Store, key: str, count: int, stale: Callable[[], bool],
                    timeout: float) -> None:
    """Wait until ``count`` processes added themselves to ``key``, or the generation is
    stale (GenerationChanged), or ``timeout`` seconds passed (TimeoutError: the rank
    then waits for the next generation like one whose collective failed). The agent's
    hang detection normally decides long before: a rank that does not arrive is behind
    the ones that did."""
    arrived = store.add(key, 1)
    delay = _POLL_S
    deadline = time.monotonic() + timeout
    while arrived < count:
        if stale():
            raise GenerationChanged("a newer generation was announced")
        if time.monotonic() > deadline:
            raise TimeoutError(f"arrival barrier: {arrived} of {count} ranks arrived "
                               f"within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.02)
        arrived = store.add(key, 0)


def teardown() -> None:
    """Destroy every group (the default one and its subgroups) and collect the objects
    that held them: a peer blocked in a collective is released only when the groups it
    talks through are gone here."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # a broken group may complain; it is dropped either way
            logger.debug("destroy_process_group: %s", e)
    _clear_dtensor_caches()
    # One full collection (~100 ms in a process with torch and a model): DDP and the old
    # group's work objects sit in reference cycles, and so may meshes.
    gc.collect()
    _release_meshes()


def _clear_dtensor_caches() -> None:
    """DTensor's sharding caches keep meshes alive after every DTensor of theirs is
    gone."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        clear_redistribute_planner_cache()
    except (ImportError, AttributeError) as e:  # another torch: the scan below suffices
        logger.debug("DTensor caches: %s", e)


def _release_meshes() -> None:
    """A ``DeviceMesh`` keeps its groups in a registry of its own: the gloo connections
    of an HSDP replica group stayed open, and the replica peer blocked in its
    all-reduce with this rank waited for good. Any mesh still alive lets go of its
    groups (it belongs to a generation that is over); dropping the registry's references
    frees them at once (no cycle through a process group)."""
    if "torch.distributed.device_mesh" not in sys.modules:
        return
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # type(), not isinstance(): the latter warns on torch's deprecated objects.
        if type(obj) is DeviceMesh and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def all_gather_flat(output: torch.Tensor, input: torch.Tensor,
                    group: dist.ProcessGroup | None = None,
                    async_op: bool = False) -> dist.Work | None:
    """Every rank's ``input``, concatenated into ``output``: ``dist.all_gather_single``
    where torch has it (2.13 deprecates ``all_gather_into_tensor`` for it), else
    ``all_gather_into_tensor`` (torch 2.4 to 2.12, which tp-run supports)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def sequence_number() -> int:
    """The default group's collective count: how many collectives this process issued
    in it (-1 when there is no group). Safe from any thread."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        # A method of the C++ class that torch's stubs leave out (torch 2.4 to 2.13).
        return pg._get_sequence_number_for_group()  # type: ignore[attr-defined]
    except Exception:
        return -1


def let_go() -> None:
    """Before this process exits with the script's error: destroy the group, and give
    gloo's worker threads the moment they need to drop the collectives they finished.
    Dropping one takes the GIL (its thread-local state holds Python objects); a thread
    still waiting for the GIL when the interpreter finalizes is ended there, inside a
    destructor, and the process dies of SIGABRT ("terminate called without an active
    exception") instead of exiting 1; the agent then takes the script's bug for a
    machine failure (a crash loop goes unnoticed)."""
    teardown()
    time.sleep(0.2)  # the GIL released: waiting threads take it in turn


def abort_nccl() -> None:
    """Abort every NCCL communicator of the current group, from any thread."""
    if not dist.is_initialized():
        return
    try:
        if "nccl" in str(dist.get_backend()):
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
    except Exception as e:
        logger.warning("aborting the NCCL group failed: %s", e)
