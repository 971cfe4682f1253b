"""Sharded state (DTensors): which ranks hold the same pieces, and how pieces move.

A ``DTensor`` (FSDP2's ``fully_shard`` parameters and the optimizer state built on them,
tensor-parallel weights) is one rank's piece of a tensor laid out over a ``DeviceMesh``.
Two facts shape its recovery:

- **A piece exists where the placement says.** Under plain FSDP a rank's shard of the
  parameters and of the optimizer state is held by no other rank; under HSDP (a 2-D
  mesh, ``Replicate`` x ``Shard``) the ranks with the same shard coordinate in the other
  replica groups hold it identically. :func:`copy_classes` gives each rank the key of
  the ranks holding its pieces (its coordinates along the sharded mesh dimensions);
  :func:`tp_launch.resilient.agreement.donor_plan` serves a receiver only from a donor of
  its class, and a receiver with none is :class:`StateLost` (``--spare-policy``).
- **It is bound to its mesh's process groups.** Any DTensor operation that is not purely
  local (``torch.cat`` of two of them, ``.contiguous()``, a redistribution) runs a
  collective on the groups it was built with; after a new generation they are gone and
  such a call blocks for good (seen: a donor's send of FSDP2 parameters hung the
  recovery). So pieces travel and are compared as plain local tensors
  (:func:`local_tree`: no collective), and the objects bound to the groups are rebuilt
  for every generation by the script's ``State(build=...)``: a survivor's committed
  pieces move into its new objects (:func:`load_module_pieces`,
  :func:`optimizer_pieces_rehomed`), a newcomer's arrive from a donor into its own.

A state that holds DTensors without ``build`` (a script that sharded a registered model
itself) cannot be rebuilt: a failure or a planned migration ends in ``StateLost``, every
rank deciding alike from the agreement's count (a newcomer's model is not sharded yet),
and the agent applies ``--spare-policy`` (``restart``: the script's own checkpoint).
Plain FSDP keeps one copy of each shard: its failures go the same way until buddy copies
exist. After a recovery (and every ``--verify-every`` steps) the ranks compare the
replicated state all together and their pieces within each class.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

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


def object_state(obj: Any) -> dict[str, Any]:
    """What the runtime moves, compares, copies and restores of a registered object:
    ``obj.state_dict()``, except for a module: its parameters and persistent buffers by
    name, read directly (:func:`module_tensors`)."""
    return module_tensors(obj) if isinstance(obj, torch.nn.Module) else obj.state_dict()


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters (each once: tied weights under their first name) and
    persistent buffers, the tensors themselves. Not ``state_dict()``: it runs the module's
    hooks, and a framework's hook may run a collective on a group that is gone
    (TorchTitan's fused QKV linear redistributes its DTensor weight on save) or hand out
    new tensors instead of the module's own. An FSDP2 module caught between its forward
    and backward passes holds its unsharded parameters: they are put back to its shards
    first (a local step: what FSDP2's own state-dict pre-hook does, ``reshard()`` keeps
    a root module that does not reshard after forward unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            for param_group in m._get_fsdp_state()._fsdp_param_groups:
                param_group._to_sharded()
    return {**dict(module.named_parameters()), **dict(persistent_buffers(module))}


def extra_state_holders(objects: dict[str, Any]) -> list[str]:
    """The modules among ``objects`` (and their submodules), by dotted name, that keep
    state of their own in ``get_extra_state()``: a value outside their parameters and
    buffers that :func:`module_tensors` does not read (TransformerEngine's FP8 scaling
    history is one, serialised by pickle)."""
    base = torch.nn.Module.get_extra_state
    return [".".join(filter(None, (name, prefix)))
            for name, obj in objects.items() if isinstance(obj, torch.nn.Module)
            for prefix, m in obj.named_modules() if type(m).get_extra_state is not base]


def persistent_buffer_slots(module: torch.nn.Module
                            ) -> list[tuple[str, torch.nn.Module, str]]:
    """Where ``module``'s buffers that its state holds (not those registered
    ``persistent=False``) live: (dotted name, owning submodule, attribute), in
    ``named_buffers()`` order. A slot, not the tensor: a forward pass may assign a new
    tensor to it (``self.count = self.count + 1``)."""
    return [(f"{prefix}.{name}" if prefix else name, m, name)
            for prefix, m in module.named_modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set]


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s buffers that its state holds, by name (:func:`persistent_buffer_slots`)."""
    return [(name, m._buffers[attr])  # type: ignore[misc]  # the slots hold tensors
            for name, m, attr in persistent_buffer_slots(module)]


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor of ``t`` (a DTensor's local piece; ``t`` otherwise): what
    can be read without a collective."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _dtensors(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every DTensor in ``tree`` (dicts, lists, tuples) with its dotted path."""
    if isinstance(tree, torch.Tensor):
        if is_dtensor(tree):
            yield path, tree
    elif isinstance(tree, dict):
        for k, x in tree.items():
            yield from _dtensors(x, f"{path}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, x in enumerate(tree):
            yield from _dtensors(x, f"{path}.{i}")


def dtensor_paths(objects: dict[str, Any]) -> list[str]:
    """The state-dict paths (``model.0.weight``, ``optimizer.state.0.exp_avg``) of the
    DTensors that the registered ``objects`` hold."""
    return [path for name, obj in objects.items()
            for path, _ in _dtensors(object_state(obj), name)]


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` (dicts, lists, tuples; a named tuple is a leaf) with ``fn`` of each tensor."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(map_tensors(v, fn) for v in tree)
    return tree


def without_dtensors(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by a marker: what ranks compare of a state
    whose DTensor pieces differ from rank to rank."""
    return map_tensors(tree, lambda t: "<dtensor>" if is_dtensor(t) else t)


def local_tree(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local piece (the same storage): what a
    rank sends of its shards, and what another rank with the same shard coordinates
    holds identically."""
    return map_tensors(tree, local_piece)


def load_module_pieces(module: torch.nn.Module, sd: dict[str, Any]) -> None:
    """Copy a state dict of local pieces (:func:`local_tree`) into ``module``'s own
    tensors, in place: a sharded module's ``load_state_dict`` wants DTensors of its own
    mesh, and these pieces come from another mesh (the last generation's) or another
    rank (the same coordinates)."""
    own = module_tensors(module)
    if set(own) != set(sd):
        raise ValueError(f"keys differ: {sorted(set(own) ^ set(sd))[:4]}")
    with torch.no_grad():
        for k, t in own.items():
            mine, v = local_piece(t), sd[k]
            if not isinstance(v, torch.Tensor) or v.shape != mine.shape \
                    or v.dtype != mine.dtype:
                raise ValueError(f"{k}: {getattr(v, 'shape', type(v).__name__)} does not fit "
                                 f"this rank's piece {tuple(mine.shape)}")
            if v.data_ptr() != mine.data_ptr():
                mine.copy_(v)


def optimizer_pieces_rehomed(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict of local pieces made loadable by ``opt``: each state
    tensor of a DTensor parameter, of that parameter's local shape, becomes a DTensor
    on the parameter's mesh with its placements (no collective)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, entry in sd.get("state", {}).items():
        p = params[i] if isinstance(i, int) and 0 <= i < len(params) else None
        if p is None or not is_dtensor(p):
            state[i] = entry
            continue
        from torch.distributed.tensor import DTensor

        local = p.to_local()
        state[i] = {k: DTensor.from_local(v.to(local.device), p.device_mesh, p.placements,
                                          run_check=False, shape=p.shape, stride=p.stride())
                    if isinstance(v, torch.Tensor) and not is_dtensor(v)
                    and v.shape == local.shape and v.dim() > 0 else v
                    for k, v in entry.items()}
    return {**sd, "state": state}


def copy_classes(objects: dict[str, Any], world: int) -> list[tuple[Any, ...]] | None:
    """For each rank of ``world``, the key of the ranks that hold the same pieces of
    every DTensor the ``objects`` hold: their coordinates along the mesh dimensions a
    tensor is sharded on (a ``Replicate`` dimension, HSDP's replica groups, does not
    tell them apart). None when there is no DTensor. Every rank computes the same keys:
    they come from the meshes' rank layouts, which are the job's."""
    layouts: dict[tuple[Any, ...], None] = {}
    for name, obj in objects.items():
        for _, dt in _dtensors(object_state(obj), name):
            mesh = dt.device_mesh
            sharded = tuple(d for d, pl in enumerate(dt.placements) if not pl.is_replicate())
            layouts[(tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape),
                     sharded)] = None
    if not layouts:
        return None
    keys: list[list[Any]] = [[] for _ in range(world)]
    for ranks, shape, sharded in layouts:
        where = {r: _coordinate(i, shape) for i, r in enumerate(ranks)}
        for r in range(world):
            c = where.get(r)
            keys[r].append(None if c is None else tuple(c[d] for d in sharded))
    return [tuple(k) for k in keys]


def _coordinate(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinate of the ``index``-th element of a row-major array of ``shape``."""
    c = []
    for n in reversed(shape):
        c.append(index % n)
        index //= n
    return tuple(reversed(c))


def not_recovered(count: int, example: str | None = None) -> str:
    """The one line that says why a state of ``count`` DTensors is not recovered."""
    which = f", {example} among them" if example else ""
    return (f"the training state holds {count} sharded tensor(s) (DTensor{which}: FSDP2, "
            "tensor parallelism), which resilient mode does not recover peer to peer yet")
