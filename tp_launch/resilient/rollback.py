"""The committed state on one rank, and how to get back to it.

After a failure every rank must be at the end of the same committed iteration
(:mod:`tp_launch.resilient.state`). A survivor whose iteration was cut short has
changed things since: gradients, the BatchNorm statistics of the forward pass, the
random generators, the data loader's position, maybe the parameters. At every commit
this module records what an abandoned iteration can change cheaply, and restores it:

* the position and ``extra`` (copied);
* every registered object that is neither a module nor an optimizer (schedulers, data
  loaders, a GradScaler...): a deep copy of its ``state_dict()``, loaded back;
* each registered module's persistent buffers (copied into buffers kept for this),
  its submodules' ``training`` flags and which parameters had a gradient (a
  gradient that existed is zeroed, one that did not is removed again);
* each optimizer's hyperparameters (``param_groups`` without the parameters: a
  scheduler stepped before the optimizer changed the learning rate);
* the random generators (:mod:`tp_launch.resilient.rng`).

Parameters and optimizer state are not copied at the commit: nothing changes them
before the **optimizer step**, the iteration's point of no return. A registered
optimizer's step pre-hook marks the iteration *dirty* there. A rank that fails before
its optimizer step is restored exactly; one that fails after it (a collective after the
step, say a loss all-reduce for the log, lost a peer) cannot be, unless a **snapshot**
of the parameters and optimizer state was taken at the step (``State(snapshot=...)``):
``always``; ``auto``, from the first iteration in which a collective ran after the
optimizer step (the default group's sequence number moved between the step and the
commit); ``never``. A dirty rank without a snapshot is no donor: it receives the state
from a rank that has it, and if no rank does, the job says so and stops (its
``--spare-policy`` applies) instead of going on from a state that is not a commit.

Without a registered optimizer the parameters' version counters tell whether the
iteration changed them in place.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Callable, Sequence

import torch

from tp_launch.resilient import group, rng, sharding
from tp_launch.resilient.state import Cursor, ResilientUsageError, State

logger = logging.getLogger(__name__)


class _ModuleRecord:
    """A module's parts that a forward/backward pass changes, captured at a commit."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.submodules = list(module.modules())
        self.params = [p for p in module.parameters()]
        self.buffer_slots = [(sub, attr) for _, sub, attr
                             in sharding.persistent_buffer_slots(module)]
        self.saved_buffers: list[torch.Tensor | None] = [None] * len(self.buffer_slots)
        self.modes: tuple[bool, ...] = ()
        self.no_grad: tuple[bool, ...] = ()
        self.versions: tuple[int, ...] = ()

    def capture(self, versions: bool) -> None:
        with torch.no_grad():
            for i, (sub, name) in enumerate(self.buffer_slots):
                t = sub._buffers[name]
                saved = self.saved_buffers[i]
                if t is None:
                    self.saved_buffers[i] = None
                elif saved is None or saved.shape != t.shape or saved.dtype != t.dtype \
                        or saved.device != t.device:
                    self.saved_buffers[i] = t.detach().clone()
                else:
                    saved.copy_(t)
        self.modes = tuple(m.training for m in self.submodules)
        self.no_grad = tuple(p.grad is None for p in self.params)
        if versions:
            self.versions = tuple(p._version for p in self.params)

    def changed_params(self) -> bool:
        return bool(self.versions) and self.versions != tuple(p._version for p in self.params)

    def restore(self) -> None:
        with torch.no_grad():
            for (sub, name), saved in zip(self.buffer_slots, self.saved_buffers):
                if saved is None:
                    continue
                t = sub._buffers.get(name)
                if t is not None and t.shape == saved.shape and t.dtype == saved.dtype:
                    t.copy_(saved)
                else:
                    sub._buffers[name] = saved.clone()
        for m, training in zip(self.submodules, self.modes):
            m.training = training
        for p, none in zip(self.params, self.no_grad):
            if none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class _Snapshot:
    """Parameters and optimizer state, copied at the optimizer step (kept allocated
    from step to step)."""

    def __init__(self) -> None:
        self.params: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.optim: list[tuple[torch.optim.Optimizer, dict[torch.Tensor, dict[str, Any]]]] = []
        self.valid = False

    def take(self, params: list[torch.Tensor], optimizers: list[torch.optim.Optimizer]) -> None:
        with torch.no_grad():
            for p in params:
                kept = self.params.get(id(p))
                if kept is None or kept[0] is not p or kept[1].shape != p.shape:
                    self.params[id(p)] = (p, p.detach().clone())
                else:
                    kept[1].copy_(p)
            previous = {id(o): saved for o, saved in self.optim}
            self.optim = []
            for opt in optimizers:
                old = previous.get(id(opt), {})
                saved: dict[torch.Tensor, dict[str, Any]] = {}
                for p, entry in opt.state.items():
                    before = old.get(p, {})
                    copy_of: dict[str, Any] = {}
                    for k, v in entry.items():
                        if isinstance(v, torch.Tensor):
                            b = before.get(k)
                            if isinstance(b, torch.Tensor) and b.shape == v.shape \
                                    and b.dtype == v.dtype and b.device == v.device:
                                b.copy_(v)
                                copy_of[k] = b
                            else:
                                copy_of[k] = v.detach().clone()
                        else:
                            copy_of[k] = copy.deepcopy(v)
                    saved[p] = copy_of
                self.optim.append((opt, saved))
        self.valid = True

    def restore(self) -> None:
        with torch.no_grad():
            for p, kept in self.params.values():
                p.copy_(kept)
            for opt, saved in self.optim:
                for p in list(opt.state):
                    if p not in saved:
                        del opt.state[p]
                for p, entry in saved.items():
                    live = opt.state[p]
                    for k in list(live):
                        if k not in entry:
                            del live[k]
                    for k, v in entry.items():
                        cur = live.get(k)
                        if isinstance(v, torch.Tensor):
                            if isinstance(cur, torch.Tensor) and cur.shape == v.shape \
                                    and cur.dtype == v.dtype:
                                cur.copy_(v)
                            else:
                                live[k] = v.clone()
                        else:
                            live[k] = copy.deepcopy(v)


class Rollback:
    """The restore point of one rank: captured at every commit, restored after a failure.

    Args:
        state: the registered state. Its optimizers get a step pre-hook: the point of
            no return (and, outside one of the State's loops, a usage error).
        on_step: called at the point of no return, just before it (once per iteration).
    """

    def __init__(self, state: State, on_step: Callable[[], None] | None = None) -> None:
        self.state = state
        self._on_step = on_step
        self.snapshot_on = state.snapshot == "always"
        self._snapshot = _Snapshot()
        self._modules: dict[str, _ModuleRecord] = {}
        self._cursor = Cursor()
        self._extra: dict[str, Any] = {}
        self._others: dict[str, Any] = {}
        self._hyper: dict[str, list[dict[str, Any]]] = {}
        self.rng: rng.RngState | None = None
        self.dirty = False
        self._seq_at_step = -1
        self._hooks: list[Any] = []
        self.rebind()

    def rebind(self) -> None:
        """Follow the state's objects after ``State.rebuild``: the new optimizers get the
        step pre-hook, the new modules are read, nothing of the old ones is kept."""
        self.close()
        self._hooks = [opt.register_step_pre_hook(self._at_optimizer_step)
                       for opt in self.state.optimizers.values()]
        self._snapshot = _Snapshot()
        self._modules = {}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ capture

    def refresh_layout(self) -> None:
        """Re-read each module's parameters, buffers and submodules (a loop starts)."""
        self._modules = {n: _ModuleRecord(m) for n, m in self.state.modules.items()}

    def capture(self) -> None:
        """The state is a committed one: remember what the next iteration may change."""
        s = self.state
        if self.dirty and not self.snapshot_on and s.snapshot == "auto" \
                and self._seq_at_step >= 0 and group.sequence_number() != self._seq_at_step:
            logger.info("a collective runs after the optimizer step: snapshots on "
                        "(State(snapshot='auto'))")
            self.snapshot_on = True
        if not self._modules:
            self.refresh_layout()
        versions = not s.optimizers
        for rec in self._modules.values():
            rec.capture(versions)
        self._cursor = dataclasses.replace(s.cursor)
        self._extra = copy.deepcopy(s.extra)
        self._others = {n: copy.deepcopy(o.state_dict()) for n, o in s.others.items()}
        self._hyper = {n: [_hyperparameters(g) for g in o.param_groups]
                       for n, o in s.optimizers.items()}
        self.rng = rng.capture()
        self.dirty = False
        self._snapshot.valid = False

    def _at_optimizer_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.state.in_iteration:
            raise ResilientUsageError(
                "optimizer.step() outside `for step in state.steps(...)` (or state.epochs()"
                "/state.batches()): resilient mode commits whole iterations; see the README")
        if self.dirty:
            return
        if self._on_step is not None:
            # Before the point of no return: what it does may fail with a dead peer (the
            # replicas' comparison after a recovery is a collective), and a rank that
            # fails there can still go back to its commit.
            self._on_step()
        self.dirty = True
        self._seq_at_step = group.sequence_number()
        if self.snapshot_on:
            optimizers = list(self.state.optimizers.values())
            params = {id(p): p for rec in self._modules.values() for p in rec.params}
            params.update({id(p): p for o in optimizers for g in o.param_groups
                           for p in g["params"]})
            self._snapshot.take(list(params.values()), optimizers)

    # ------------------------------------------------------------------ restore

    def restorable(self) -> bool:
        """Whether :meth:`restore` can bring this rank back to its last commit."""
        dirty = self.dirty or any(r.changed_params() for r in self._modules.values())
        return not dirty or self._snapshot.valid

    def restore(self) -> bool:
        """Back to the last commit; False (nothing done) when that cannot be had."""
        if not self.restorable():
            return False
        s = self.state
        if self.dirty:
            self._snapshot.restore()
        for rec in self._modules.values():
            rec.restore()
        s.cursor = dataclasses.replace(self._cursor)
        s.extra = copy.deepcopy(self._extra)
        for name, sd in self._others.items():
            s.objects[name].load_state_dict(copy.deepcopy(sd))
        for name, groups in self._hyper.items():
            for live, saved in zip(s.optimizers[name].param_groups, groups):
                live.update(_hyperparameters(saved))
        if self.rng is not None:
            rng.restore(self.rng)
        self.dirty = False
        self._snapshot.valid = False
        return True

    # ------------------------------------------------------------------ per rank

    def buffers(self) -> list[torch.Tensor]:
        """Every registered module's persistent buffers, live, in a fixed order."""
        return [t for rec in self._modules.values() for sub, name in rec.buffer_slots
                if (t := sub._buffers.get(name)) is not None]

    def committed_buffers(self) -> list[torch.Tensor | None]:
        """The same buffers as they were at the last commit."""
        return [b for rec in self._modules.values() for b in rec.saved_buffers]

    def set_buffers(self, values: Sequence[torch.Tensor | bytes | None]) -> bool:
        """Overwrite the live buffers (tensors, or raw bytes of the same layout);
        False (nothing changed) when the layout does not match or a value is missing."""
        live = self.buffers()
        if len(values) != len(live):
            return False
        pairs = []
        for t, v in zip(live, values):
            if v is None:
                return False
            if isinstance(v, torch.Tensor):
                if v.shape != t.shape or v.dtype != t.dtype:
                    return False
                pairs.append((t, v))
            else:
                if len(v) != t.numel() * t.element_size():
                    return False
                src = torch.frombuffer(bytearray(v), dtype=t.dtype) if v else \
                    torch.empty(0, dtype=t.dtype)
                pairs.append((t, src.view(t.shape)))
        with torch.no_grad():
            for t, v in pairs:
                t.copy_(v)
        return True

    # ------------------------------------------------------------------ what travels

    def gradients(self) -> dict[str, list[bool]]:
        """Per module: which parameters had a gradient at the commit."""
        return {n: [not none for none in r.no_grad] for n, r in self._modules.items()}

    def modes(self) -> dict[str, list[bool]]:
        return {n: list(r.modes) for n, r in self._modules.items()}

    def adopt(self, gradients: dict[str, list[bool]], modes: dict[str, list[bool]]) -> None:
        """A newcomer takes the donor's gradient presence and training flags."""
        if not self._modules:
            self.refresh_layout()
        for name, rec in self._modules.items():
            for p, has in zip(rec.params, gradients.get(name, [])):
                p.grad = torch.zeros_like(p) if has else None
            for m, training in zip(rec.submodules, modes.get(name, [])):
                m.training = training


def _hyperparameters(param_group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v))
            for k, v in param_group.items() if k != "params"}

