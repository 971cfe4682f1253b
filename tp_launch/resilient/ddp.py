"""DDP's gradient buckets, laid out after a recovery as in the run without it.

A ``DistributedDataParallel`` sums gradients bucket by bucket, and gloo's ring
all-reduce adds up an element's contributions in an order that depends on the
element's offset in its bucket. DDP's first iteration uses one layout (torch 2.13: all
parameters in one bucket, in parameter order); after its first synchronised backward
(the second with ``static_graph=True``) it rebuilds the buckets once, in the order the
gradients became ready, and keeps that layout. A DDP built anew after a recovery would
run its first iteration with the first layout again, and that iteration's sums would
differ in their last bits from the run without the failure (measured: a 30-step job
whose DDP is rebuilt at step 10, no failure at all, ends with other parameters).

So while :func:`tp_launch.resilient.run` runs under an agent, DDP's bucket assignment
goes through :class:`Layouts`:

* the first DDP built over a registered module records the order in which its
  parameters' gradients are ready in its first synchronised backward (a
  post-accumulate-grad hook per parameter, removed after that backward: nothing is
  left on the steady-state path), and computes from it, with torch's own
  ``_compute_bucket_assignment_by_size`` and DDP's own size limits, the layout DDP's
  rebuild produces (it is the same computation);
* a DDP built at a committed step at or past the one from which the job uses the
  rebuilt layout gets that layout from its construction on (it then rebuilds once
  more, to the same layout);
* the layouts travel to newcomers with the state;
* a DDP built after a recovery keeps each rank's own buffers: DDP's construction
  broadcasts rank 0's, which the run without the failure (no construction there) did
  not do until the next forward pass.

The native all-reduce stays: exactness costs nothing per step. A layout is known by its
*fingerprint*: the parameter names in DDP's order and the bucket settings.

Known limit: ``static_graph=True`` rebuilds after its second iteration; a recovery at
the step right after the job's first one is then not bit-exact in that step's sums.

:func:`ordered_allreduce_hook` (summing every bucket in rank order) is kept for the
scripts that registered it; it is no longer needed for exact results.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import contextvars
import inspect
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from tp_launch.resilient.group import all_gather_flat


@dataclass
class Layout:
    """The rebuilt bucket layout of a DDP, and the first step that uses it."""

    buckets: list  # list[list[int]]: indices into DDP's parameter list, reducer order
    limits: list  # list[int]: each bucket's size limit
    from_step: int

    def to_tree(self) -> dict:
        return {"buckets": self.buckets, "limits": self.limits, "from_step": self.from_step}

    @staticmethod
    def from_tree(d: Any) -> "Layout":
        ok = (isinstance(d, dict) and isinstance(d.get("buckets"), list)
              and all(isinstance(b, list) and all(type(i) is int for i in b)
                      for b in d["buckets"])
              and isinstance(d.get("limits"), list) and type(d.get("from_step")) is int)
        if not ok:
            raise ValueError("bad DDP layout")
        return Layout(d["buckets"], list(d["limits"]), d["from_step"])


@dataclass
class _Construction:
    """A DDP being built: what the patched bucket assignment needs to know."""

    names: dict  # id(param) -> name
    step: int
    settings: dict
    forced: Optional[Layout] = None
    fingerprint: str = ""
    params: Optional[list] = None
    sparse: Optional[list] = None


_constructing: contextvars.ContextVar = contextvars.ContextVar("tp_run_ddp_construction",
                                                                default=None)
_install_lock = threading.Lock()
_installed: list = []  # the active Layouts (at most one per process)


class Layouts:
    """The DDP layouts of this process's job.

    Args:
        step: returns the committed step (when a DDP is built).
    """

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self.known: dict = {}  # fingerprint -> Layout
        # After a recovery, a DDP built anew must not replace each rank's own buffers
        # (BatchNorm statistics) by rank 0's: the run without the failure built none.
        self.keep_buffers = False
        self._tracking: set = set()
        self._recorders: list = []

    def abandon(self) -> None:
        """A recovery drops this generation's DDPs: unhook the recorders that still wait
        for a first backward (their hooks would keep the DDP and its group alive)."""
        for r in self._recorders:
            r.close()
        self._recorders = []
        self._tracking.clear()

    def install(self) -> None:
        """Route DDP construction through this object (once per process)."""
        with _install_lock:
            if not _installed:
                _patch()
            _installed[:] = [self]

    # ------------------------------------------------------------------ wire form

    def to_tree(self) -> dict:
        return {fp: layout.to_tree() for fp, layout in self.known.items()}

    def adopt(self, tree: Any) -> None:
        if not isinstance(tree, dict):
            raise ValueError("bad DDP layouts")
        for fp, d in tree.items():
            self.known.setdefault(str(fp), Layout.from_tree(d))

    # ------------------------------------------------------------------ construction

    def _begin(self, ddp_module: torch.nn.Module, settings: dict) -> _Construction:
        names: dict[int, str] = {}
        for name, p in ddp_module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        return _Construction(names, self._step(), settings)

    def _assign(self, c: _Construction, tensors: list, sparse: list) -> Optional[tuple]:
        """DDP asks for its initial buckets: the known layout, or None (DDP's own)."""
        c.params, c.sparse = list(tensors), list(sparse or [False] * len(tensors))
        c.fingerprint = json.dumps([[c.names.get(id(t), "?") for t in tensors],
                                    c.settings], separators=(",", ":"))
        layout = self.known.get(c.fingerprint)
        if layout is None or c.step < layout.from_step:
            return None
        if sorted(i for b in layout.buckets for i in b) != list(range(len(tensors))):
            raise RuntimeError("a DDP layout does not match its parameters")
        c.forced = layout
        return list(reversed(layout.buckets)), list(reversed(layout.limits))

    def _built(self, ddp: Any, c: _Construction) -> None:
        if c.params is None or c.fingerprint in self.known or c.fingerprint in self._tracking:
            return
        static, find_unused = c.settings["static_graph"], c.settings["find_unused"]
        if find_unused and not static:
            return  # DDP never rebuilds its buckets: its own first layout is the layout
        self._tracking.add(c.fingerprint)
        self._recorders.append(_Recorder(self, ddp, c, rebuild_after=2 if static else 1))

    def _learned(self, c: _Construction, order: list, limits: list, rebuild_after: int) -> None:
        params, sparse = c.params or [], c.sparse or []
        buckets, per_bucket = _ORIGINAL[0]([params[i] for i in order], limits,
                                           [sparse[i] for i in order], order)
        self.known[c.fingerprint] = Layout([list(map(int, b)) for b in buckets],
                                           [int(x) for x in per_bucket],
                                           c.step + rebuild_after)
        self._tracking.discard(c.fingerprint)


class _Recorder:
    """Records the gradient-ready order of a DDP's first synchronised backward."""

    def __init__(self, layouts: Layouts, ddp: Any, c: _Construction, rebuild_after: int) -> None:
        self.layouts, self.c, self.rebuild_after = layouts, c, rebuild_after
        self.synced = False
        self.order: list = []
        cfg = getattr(ddp, "_bucket_config", None)
        if cfg is not None:
            limits = cfg.compute_bucket_size_limits(static_graph=c.settings["static_graph"],
                                                    find_unused_parameters=c.settings["find_unused"])[1]
            self.limits = list(limits) or [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap]
        else:
            self.limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap]
        self.ddp = ddp
        self.handles = [ddp.register_forward_pre_hook(self._forward)]
        self.handles += [p.register_post_accumulate_grad_hook(self._ready(i))
                         for i, p in enumerate(c.params or [])]

    def _forward(self, module: Any, args: Any) -> None:
        self.synced = torch.is_grad_enabled() and bool(
            getattr(self.ddp, "require_backward_grad_sync", True))
        self.order = []

    def _ready(self, index: int) -> Callable:
        def hook(_p: Any) -> None:
            if not self.synced:
                return
            self.order.append(index)
            if len(self.order) == len(self.c.params or []):
                self.close()
                if self in self.layouts._recorders:
                    self.layouts._recorders.remove(self)
                self.layouts._learned(self.c, self.order, self.limits, self.rebuild_after)
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


_ORIGINAL: list = []


def _patch() -> None:
    from torch.nn.parallel import DistributedDataParallel

    original_assign = dist._compute_bucket_assignment_by_size
    original_init = DistributedDataParallel.__init__
    signature = inspect.signature(original_init)
    _ORIGINAL[:] = [original_assign]

    def assign(tensors: Any, limits: Any, expect_sparse: Any = None, tensor_indices: Any = None):
        c = _constructing.get()
        if c is not None and _installed and tensor_indices is None:
            _constructing.set(None)  # one DDP, one initial assignment
            forced = _installed[0]._assign(c, tensors, expect_sparse)
            if forced is not None:
                return forced
        if tensor_indices is None:
            return original_assign(tensors, limits, expect_sparse)
        return original_assign(tensors, limits, expect_sparse, tensor_indices)

    def init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        if not _installed or os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":
            original_init(self, module, *args, **kwargs)
            return
        bound = signature.bind(self, module, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        settings = {"bucket_cap_mb": a.get("bucket_cap_mb"),
                    "static_graph": bool(a.get("static_graph")),
                    "find_unused": bool(a.get("find_unused_parameters")),
                    "ignored": sorted(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))}
        layouts = _installed[0]
        c = layouts._begin(module, settings)
        kept = [(b, b.detach().clone()) for b in module.buffers()] if layouts.keep_buffers else []
        token = _constructing.set(c)
        try:
            original_init(self, module, *args, **kwargs)
        finally:
            _constructing.reset(token)
        with torch.no_grad():
            for b, value in kept:
                b.copy_(value)
        layouts._built(self, c)

    # Replacing torch's own functions is the point here (see the module's docstring).
    dist._compute_bucket_assignment_by_size = assign  # type: ignore[assignment]
    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]


def ordered_allreduce_hook(process_group: Optional[dist.ProcessGroup],
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the ranks, summing in rank order (world x the bucket's
    traffic; exact whatever the layout, and no longer needed for exactness)."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    gathered = torch.empty(world * buf.numel(), dtype=buf.dtype, device=buf.device)
    work = all_gather_flat(gathered, buf, group, async_op=True)
    assert work is not None  # async_op: the collective's handle
    fut = work.get_future()

    def reduce(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        f.value()  # re-raises the collective's error (a dead peer): never sum garbage
        rows = gathered.view(world, -1)
        out = rows[0].clone()
        for r in range(1, world):
            out.add_(rows[r])
        return out.div_(world)

    return fut.then(reduce)
