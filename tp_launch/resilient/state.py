"""What survives a failure: the registered training state and its committed step.

A :class:`State` holds the objects a script registers (a model, an optimizer, an LR
scheduler, a stateful data loader: anything with ``state_dict``/``load_state_dict``) and
the **committed step**: the number of optimizer steps taken. The step is committed by a
hook that runs when the first registered optimizer's ``step()`` returns, so a script
needs no extra call, and so the state is consistent whenever a collective can fail: a
data-parallel step has no collective between ``optimizer.step()`` and the next
iteration's forward pass. (Put the other per-step state updates, such as
``scheduler.step()``, right after ``optimizer.step()``.)

The same hook is the step boundary of resilient mode: when the agent has announced a
new generation (a failure elsewhere, or a planned migration whose boundary step has
been reached), it raises :class:`GenerationChanged` right after the commit, and
:func:`tp_launch.resilient.run` moves to the new generation.

For the transfer, each object's ``state_dict()`` is flattened into its tensors (in a
fixed order, each with its path) and a skeleton holding everything else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


class GenerationChanged(Exception):
    """Raised at a step boundary: the process group of this generation is obsolete."""


@dataclass(frozen=True)
class _Leaf:
    """A tensor's place in a skeleton."""

    index: int


Path = tuple[Any, ...]


def flatten(tree: Any) -> tuple[Any, list[tuple[Path, torch.Tensor]]]:
    """Split a state dict into a picklable skeleton and its tensors, with their paths."""
    leaves: list[tuple[Path, torch.Tensor]] = []

    def walk(node: Any, path: Path) -> Any:
        if isinstance(node, torch.Tensor):
            leaves.append((path, node))
            return _Leaf(len(leaves) - 1)
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(walk(v, (*path, i)) for i, v in enumerate(node))
        return node

    return walk(tree, ()), leaves


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Put tensors back into a skeleton made by :func:`flatten`."""
    if isinstance(skeleton, _Leaf):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)) and not hasattr(skeleton, "_fields"):
        return type(skeleton)(unflatten(v, tensors) for v in skeleton)
    return skeleton


class State:
    """The training state that resilient mode keeps alive across failures.

    Args:
        **objects: objects with ``state_dict()`` and ``load_state_dict()`` (a model
            without its DDP wrapper, optimizers, schedulers, data loaders...), by name;
            they are available as attributes (``state.model``).
        extra: plain picklable values that travel with the state (``state.extra``).

    ``state.step`` is the committed step: it starts at 0 and grows by one each time the
    first registered optimizer's ``step()`` returns. Call :meth:`commit` yourself when
    no optimizer is registered.
    """

    def __init__(self, extra: dict[str, Any] | None = None, **objects: Any) -> None:
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"State({name}=...): {type(obj).__name__} has no "
                                "state_dict()/load_state_dict()")
        self.objects: dict[str, Any] = dict(objects)
        self.extra: dict[str, Any] = dict(extra or {})
        self.step = 0
        # False until this process holds real training state: a parked spare's freshly
        # built model must never be taken for the job's state.
        self.valid = False
        self._on_commit: Callable[[int], None] | None = None
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        if optimizers:
            optimizers[0].register_step_post_hook(lambda *_: self.commit())

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(name)

    def commit(self) -> None:
        """Mark one more step as done (and let resilient mode stop here if it must)."""
        self.step += 1
        if self._on_commit is not None:
            self._on_commit(self.step)

    def snapshot(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The skeleton (step, extra, each object's non-tensor state) and the tensors."""
        skeletons: dict[str, Any] = {}
        tensors: list[torch.Tensor] = []
        for name, obj in self.objects.items():
            skeleton, leaves = flatten(obj.state_dict())
            skeletons[name] = (skeleton, [p for p, _ in leaves], len(tensors))
            tensors.extend(t for _, t in leaves)
        meta = {"step": self.step, "extra": self.extra, "objects": skeletons,
                "specs": [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]}
        return meta, tensors

    def receive_buffers(self, meta: dict[str, Any]) -> tuple[list[torch.Tensor], set[str]]:
        """Tensors to receive ``meta``'s state into: this process's own tensors where
        path, shape and dtype match (received in place), new ones elsewhere.

        Returns the buffers and the names of the objects that need ``load_state_dict``.
        """
        buffers: list[torch.Tensor] = []
        to_load: set[str] = set()
        for name, (_skeleton, paths, _start) in meta["objects"].items():
            obj = self.objects.get(name)
            if obj is None:
                raise RuntimeError(f"the donor's state has {name!r}, this process's does not")
            own = dict(flatten(obj.state_dict())[1]) if isinstance(obj, torch.nn.Module) else {}
            in_place = True
            for path in paths:
                shape, dtype = meta["specs"][len(buffers)]
                dtype = getattr(torch, dtype)
                mine = own.get(path)
                if (mine is not None and tuple(mine.shape) == tuple(shape)
                        and mine.dtype == dtype and mine.is_contiguous()):
                    buffers.append(mine)
                else:
                    device = mine.device if mine is not None else _default_device(obj)
                    buffers.append(torch.empty(shape, dtype=dtype, device=device))
                    in_place = False
            if not (in_place and isinstance(obj, torch.nn.Module)):
                to_load.add(name)
        return buffers, to_load

    def load(self, meta: dict[str, Any], buffers: list[torch.Tensor], to_load: set[str]) -> None:
        """Adopt received state: step, extra, and ``load_state_dict`` where needed."""
        for name in to_load:
            skeleton, _paths, start = meta["objects"][name]
            self.objects[name].load_state_dict(unflatten(skeleton, buffers[start:]))
        self.step = meta["step"]
        self.extra = meta["extra"]
        self.valid = True


def _default_device(obj: Any) -> torch.device:
    """Where an object keeps its tensors (an optimizer: its first parameter's device)."""
    if isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                return p.device
    return torch.device("cpu")
