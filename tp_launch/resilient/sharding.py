"""Sharded state (DTensors): what resilient mode does with it today.

A ``DTensor`` (FSDP2's ``fully_shard`` parameters and the optimizer state built on them,
tensor-parallel weights) is one rank's piece of a tensor laid out over a ``DeviceMesh``.
Two things stop the replicated recovery (:mod:`tp_launch.resilient.transfer`) from
carrying it:

- **Its piece exists once.** Under FSDP a dead rank's shard of the parameters and of the
  optimizer state is held by no other rank: "the highest committed step wins, any holder
  is a donor" would hand a newcomer another rank's shard. (HSDP's replica groups hold a
  copy; a buddy copy would give plain FSDP one: not built yet.)
- **It is bound to its mesh's process groups.** Every operation on a DTensor that is not
  purely local (``torch.cat`` of two of them, ``.contiguous()``, a redistribution) runs a
  collective on the groups it was built with: after a new generation they are gone, and
  such a call blocks for good (seen: a donor's send of FSDP2 parameters hung the
  recovery). Survivors would have to rebuild FSDP, the mesh and the optimizers on the
  new generation's groups.

So until both are built, a state that holds DTensors trains exactly as under torchrun
and a failure is not recovered peer to peer: the agreement, where every rank (the
newcomer, whose model is not sharded yet, too) learns whether any rank's state holds
DTensors, ends in :class:`~tp_launch.resilient.transfer.StateLost`, and the agent
applies ``--spare-policy`` (``restart``: every worker restarts from the script's own
checkpoint, torchrun's way). A planned migration of such a rank stops the same way.
Digests (``--verify-every``, the check after a recovery) read a DTensor's local piece
and leave DTensors out of the comparison of replicated state: each rank's piece differs.
"""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor`` for a
    script that never did: a DTensor exists only once it was imported)."""
    if not isinstance(t, torch.Tensor) or type(t) is torch.Tensor \
            or type(t) is torch.nn.Parameter:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor of ``t`` (a DTensor's local piece; ``t`` otherwise): what
    can be read without a collective."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def dtensor_paths(objects: dict[str, Any]) -> list[str]:
    """The state-dict paths (``model.0.weight``, ``optimizer.state.0.exp_avg``) of the
    DTensors that the registered ``objects`` hold."""
    found: list[str] = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, torch.Tensor):
            if is_dtensor(v):
                found.append(path)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}")
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}")

    for name, obj in objects.items():
        walk(obj.state_dict(), name)
    return found


def without_dtensors(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by a marker: what ranks compare of a state
    whose DTensor pieces differ from rank to rank."""
    if isinstance(tree, torch.Tensor):
        return "<dtensor>" if is_dtensor(tree) else tree
    if isinstance(tree, dict):
        return {k: without_dtensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [without_dtensors(v) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(without_dtensors(v) for v in tree)
    return tree


def not_recovered(count: int, example: str | None = None) -> str:
    """The one line that says why a state of ``count`` DTensors is not recovered."""
    which = f", {example} among them" if example else ""
    return (f"the training state holds {count} sharded tensor(s) (DTensor{which}: FSDP2, "
            "tensor parallelism), which resilient mode does not recover peer to peer yet")
