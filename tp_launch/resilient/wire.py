"""The state transfer's wire format: typed JSON plus raw tensors, never a pickle.

One module on purpose: it is the whole format, its values, its framing and the typed
metadata that travel in it, which change together under one :data:`VERSION`.

A state travels between two ranks of a job over a gloo (or NCCL) group, that is over
TCP ports anyone who can reach the node can connect to. So nothing received is ever
unpickled: the structure of a state (each object's ``state_dict()`` with its tensors
cut out, the step, the RNG states, ...) is a JSON document with a small, closed set of
tagged types, and the tensors follow as raw bytes whose shapes and dtypes the document
declares. A malformed or hostile message is a :class:`WireError` on the receiver.

Values (``encode``/``decode``):

==========================  ===================================================
Python                      JSON
==========================  ===================================================
None, bool, int, str        themselves
float                       a number; ``{"$f": "nan" | "inf" | "-inf"}``
list                        an array
tuple                       ``{"$tuple": [...]}``
dict with str keys          an object (keys starting with ``$`` are escaped:
                            such a dict is sent as ``{"$map": [[k, v], ...]}``)
dict with other keys        ``{"$map": [[k, v], ...]}`` (int keys: optimizer state)
bytes                       ``{"$bytes": "<base64>"}``
torch.dtype                 ``{"$dtype": "float32"}``
torch.Tensor                ``{"$t": i}``: the i-th tensor of the message
==========================  ===================================================

Anything else (a custom class in ``State.extra``, a lambda in a scheduler's state) is
refused on the *sender* with the path of the offending value.

A message on the wire, in order: a header (one int64 tensor: :data:`MAGIC`,
:data:`VERSION`, the document's length), the document (a uint8 tensor of UTF-8 JSON:
``{"tree": <value>, "tensors": [[shape, dtype], ...]}``, each declaration a
:class:`TensorSpec`), then the tensors as the sender's and the receiver's identical
:func:`plan_sends` groups them. A receiver refuses another :data:`VERSION`.

What travels, typed here and parsed strictly (a :class:`WireError` names what is wrong):

* :class:`StateMessage`, the tree of a state transfer (:mod:`tp_launch.resilient.transfer`):
  exactly the keys ``cursor`` (the committed position:
  ``tp_launch.resilient.state.Cursor.to_tree()``), ``extra`` (an object), ``objects``
  (registered name -> ``state_dict()``), ``rng`` (generator name -> state:
  :mod:`tp_launch.resilient.rng`), ``grads`` and ``modes`` (module name -> one bool per
  parameter: had a gradient; per submodule: ``training``), ``layouts`` (fingerprint ->
  a DDP bucket layout: ``tp_launch.resilient.ddp.Layout.to_tree()``) and
  ``per_rank_generators`` and ``per_rank_objects`` (names of the generators and the
  registered objects whose state is each rank's own). The nested position and layouts are
  checked by their own types when adopted.
* :class:`Holding`, one rank's row of the agreement before a transfer, all-gathered as
  int64 words in this order: ``step`` (the committed step it can provide, -1: none),
  ``own_step`` (its last commit, restorable or not, -1: none), ``used`` (bit i: the
  i-th generator of :data:`tp_launch.resilient.rng.GENERATORS` was drawn from since
  ``run()`` began; the next bit: the modules' buffers changed), ``buffers`` (a digest
  of its committed module buffers), then one digest word per generator.
* :class:`CopyRow`, one rank's row of a recovery from buddy copies
  (:mod:`tp_launch.resilient.copies`): the steps of its own snapshots, then of the
  complete copies it holds of its ward's (:data:`CopyRow.KEPT` words each, -1: none).
"""

from __future__ import annotations

import base64
import ctypes
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Collection, Optional, Sequence

import torch

from tp_launch.resilient.sharding import local_piece

MAGIC = 0x5450_5253_5441_5445  # "TPRSTATE"
VERSION = 2
MAX_DOCUMENT = 256 << 20  # a state's structure, not its tensors: generous
MAX_DIMS = 32

# Every dtype a state may hold (by the name torch prints without "torch.").
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                 "int64", "int32", "int16", "int8", "uint8", "bool",
                 "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
    if isinstance(getattr(torch, name, None), torch.dtype)
}

_SMALL_BYTES = 1 << 20  # a tensor under this is packed with its neighbours
_PACK_BYTES = 16 << 20  # at most this much in one packed send


class WireError(RuntimeError):
    """A message that is not a well-formed state (corrupt, hostile, or another version)."""


class EncodeError(TypeError):
    """A value that has no wire form (say which, and where)."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape and dtype, as the document declares it."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), dtype_name(t.dtype))

    def to_json(self) -> list[Any]:
        return [list(self.shape), self.dtype]

    @staticmethod
    def from_json(d: Any) -> TensorSpec:
        if not (isinstance(d, list) and len(d) == 2 and isinstance(d[0], list)
                and isinstance(d[1], str) and d[1] in DTYPES and len(d[0]) <= MAX_DIMS
                and all(type(n) is int and 0 <= n < 1 << 48 for n in d[0])):
            raise WireError(f"bad tensor declaration {str(d)[:80]!r}")
        return TensorSpec(tuple(d[0]), d[1])


@dataclass(frozen=True)
class StateMessage:
    """The tree a donor sends: a rank's committed state (see the module's docstring).
    Tensors are wherever the values hold them (placeholders before they arrive)."""

    cursor: dict[str, Any]
    extra: dict[Any, Any]
    objects: dict[str, Any]
    rng: dict[str, Any]
    grads: dict[str, list[bool]]
    modes: dict[str, list[bool]]
    layouts: dict[str, Any]
    per_rank_generators: list[str]
    per_rank_objects: list[str]

    def to_tree(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_tree(tree: Any) -> StateMessage:
        """Raises WireError: not a dict of exactly these keys, or a part of another type."""
        names = [f.name for f in fields(StateMessage)]
        if not isinstance(tree, dict) or set(tree) != set(names):
            keys = sorted(map(str, tree)) if isinstance(tree, dict) else type(tree).__name__
            raise WireError(f"the message is not a training state (it has {keys})")
        for name in ("cursor", "extra", "objects", "rng", "grads", "modes", "layouts"):
            if not isinstance(tree[name], dict):
                raise WireError(f"the state's {name} is not an object")
        for name in ("objects", "rng", "grads", "modes", "layouts"):
            if not all(isinstance(k, str) for k in tree[name]):
                raise WireError(f"the state's {name} has a key that is not a string")
        for name in ("grads", "modes"):
            if not all(isinstance(v, list) and all(type(b) is bool for b in v)
                       for v in tree[name].values()):
                raise WireError(f"the state's {name} are not lists of booleans")
        for name in ("per_rank_generators", "per_rank_objects"):
            listed = tree[name]
            if not (isinstance(listed, list) and all(isinstance(g, str) for g in listed)):
                raise WireError(f"the state's {name} are not a list of names")
        return StateMessage(**{name: tree[name] for name in names})


@dataclass(frozen=True)
class Holding:
    """One rank's row of the agreement (see the module's docstring)."""

    step: int
    own_step: int
    used: int
    buffers: int
    sharded: int  # how many DTensors the rank's state holds (tp_launch.resilient.sharding)
    generators: tuple[int, ...]

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.step, self.own_step, self.used, self.buffers,
                             self.sharded, *self.generators], dtype=torch.int64)

    @staticmethod
    def width(generators: int) -> int:
        """The words of a row with ``generators`` generator digests."""
        return 5 + generators

    @staticmethod
    def rows(gathered: torch.Tensor, world: int) -> list[Holding]:
        """The rows of an all-gather of :meth:`to_tensor` over ``world`` ranks."""
        if gathered.dtype != torch.int64 or gathered.numel() % world \
                or gathered.numel() // world < Holding.width(0):
            raise WireError(f"bad agreement of {gathered.numel()} words for {world} ranks")
        return [Holding(r[0], r[1], r[2], r[3], r[4], tuple(r[5:]))
                for r in gathered.view(world, -1).tolist()]


@dataclass(frozen=True)
class CopyRow:
    """One rank's row of a recovery from buddy copies (see the module's docstring)."""

    KEPT = 2  # snapshots kept of each kind: the latest may be torn when its sender died

    own: tuple[int, ...]
    ward: tuple[int, ...]

    @staticmethod
    def width() -> int:
        return 2 * CopyRow.KEPT

    def to_tensor(self) -> torch.Tensor:
        pad = [-1] * self.KEPT
        return torch.tensor([*(list(self.own) + pad)[:self.KEPT],
                             *(list(self.ward) + pad)[:self.KEPT]], dtype=torch.int64)

    @staticmethod
    def rows(gathered: torch.Tensor, world: int) -> list[CopyRow]:
        """The rows of an all-gather of :meth:`to_tensor` over ``world`` ranks."""
        k = CopyRow.KEPT
        if gathered.dtype != torch.int64 or gathered.numel() != world * CopyRow.width():
            raise WireError(f"bad copy agreement of {gathered.numel()} words for {world} ranks")
        return [CopyRow(tuple(s for s in r[:k] if s >= 0), tuple(s for s in r[k:] if s >= 0))
                for r in gathered.view(world, -1).tolist()]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise EncodeError(f"tensors of dtype {name} cannot be transferred")
    return name


class Leaf:
    """Where the i-th tensor of a message sits in a decoded tree (before it arrives)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"Leaf({self.index})"


def encode(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """A JSON-able form of ``tree`` and its tensors, in the order the form numbers them."""
    tensors: list[torch.Tensor] = []

    def enc(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return v if math.isfinite(v) else {"$f": repr(v)}
        if isinstance(v, torch.Tensor):
            dtype_name(v.dtype)
            if v.layout != torch.strided:
                raise EncodeError(f"{path or 'value'}: {v.layout} tensors cannot be transferred")
            tensors.append(v)
            return {"$t": len(tensors) - 1}
        if isinstance(v, torch.dtype):
            return {"$dtype": dtype_name(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode()}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"$tuple": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: enc(x, f"{path}.{k}") for k, x in v.items()}
            return {"$map": [[enc(k, f"{path}<key>"), enc(x, f"{path}[{k!r}]")]
                             for k, x in v.items()]}
        raise EncodeError(f"{path or 'value'}: a {type(v).__name__} cannot be transferred "
                          "(only None, bool, int, float, str, bytes, lists, tuples, dicts, "
                          "dtypes and tensors)")

    return enc(tree, ""), tensors


def decode(doc: Any, n_tensors: int) -> Any:
    """The tree of an :func:`encode`'d document, tensors as :class:`Leaf` placeholders."""

    def dec(v: Any, depth: int) -> Any:
        if depth > 64:
            raise WireError("the document nests too deep")
        if v is None or isinstance(v, (bool, str, int, float)):
            return v
        if isinstance(v, list):
            return [dec(x, depth + 1) for x in v]
        if not isinstance(v, dict):
            raise WireError(f"unexpected JSON value {str(v)[:40]!r}")
        if len(v) == 1:
            (tag, arg), = v.items()
            if tag == "$t":
                if type(arg) is not int or not 0 <= arg < n_tensors:
                    raise WireError(f"bad tensor reference {arg!r}")
                return Leaf(arg)
            if tag == "$f":
                if arg not in ("nan", "inf", "-inf"):
                    raise WireError(f"bad float {arg!r}")
                return float(arg)
            if tag == "$tuple":
                if not isinstance(arg, list):
                    raise WireError("bad tuple")
                return tuple(dec(x, depth + 1) for x in arg)
            if tag == "$map":
                if not (isinstance(arg, list)
                        and all(isinstance(kv, list) and len(kv) == 2 for kv in arg)):
                    raise WireError("bad map")
                out = {}
                for k, x in arg:
                    key = dec(k, depth + 1)
                    try:
                        out[key] = dec(x, depth + 1)
                    except TypeError:
                        raise WireError(f"unhashable map key {str(k)[:40]!r}") from None
                return out
            if tag == "$bytes":
                try:
                    return base64.b64decode(arg, validate=True)
                except (TypeError, ValueError):
                    raise WireError("bad bytes") from None
            if tag == "$dtype":
                if arg not in DTYPES:
                    raise WireError(f"unknown dtype {arg!r}")
                return DTYPES[arg]
        if any(k.startswith("$") for k in v):
            raise WireError(f"unknown tag in {sorted(v)[:3]!r}")
        return {k: dec(x, depth + 1) for k, x in v.items()}

    return dec(doc, 0)


def leaves(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Leaf]]:
    """Every :class:`Leaf` of a decoded tree with its path, in tree order."""
    if isinstance(tree, Leaf):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in leaves(v, (*path, k))]
    if isinstance(tree, (list, tuple)):
        return [x for i, v in enumerate(tree) for x in leaves(v, (*path, i))]
    return []


def fill(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Replace the :class:`Leaf` placeholders of a decoded tree by the received tensors."""
    if isinstance(tree, Leaf):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {k: fill(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [fill(v, tensors) for v in tree]
    if isinstance(tree, tuple):
        return tuple(fill(v, tensors) for v in tree)
    return tree


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes, through a host copy (no numpy: torch's CPU wheel does not
    bring it); a DTensor's: its local piece's (no collective)."""
    t = host_contiguous(t)
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a contiguous host tensor: itself where it is one, else a copy;
    a DTensor's local piece (no collective)."""
    t = local_piece(t).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


# ---------------------------------------------------------------- on a process group


# Post one tensor's send or receive. It may complete at once (returns None) or return
# the wait for its completion: a sender posts every tensor of a message before waiting for
# any, a receiver posts every receive, so that the transport is never idle between two
# tensors (gloo matches the sends and receives of one pair in the order they are posted).
Wait = Callable[[], None]
Send = Callable[[torch.Tensor], Optional[Wait]]
Recv = Callable[[torch.Tensor], Optional[Wait]]


def _done(pending: Optional[Wait]) -> None:
    if pending is not None:
        pending()


def plan_sends(specs: Sequence[TensorSpec], skip: Collection[int] = ()) -> list[list[int]]:
    """Group tensor indices into sends: a large tensor alone; consecutive small tensors
    of one dtype together, up to 16 MiB (a gloo send has a fixed cost of about a
    millisecond, which dominates for biases and norms). Sender and receiver compute the
    same plan from the same document. ``skip``: indices another sender sends."""
    sends: list[list[int]] = []
    pack: list[int] = []
    pack_bytes, pack_dtype = 0, ""
    for i, spec in enumerate(specs):
        if i in skip:
            continue
        nbytes = spec.nbytes
        if alone(spec):
            sends.append([i])
            continue
        if pack and (spec.dtype != pack_dtype or pack_bytes + nbytes > _PACK_BYTES):
            sends.append(pack)
            pack, pack_bytes = [], 0
        pack.append(i)
        pack_bytes += nbytes
        pack_dtype = spec.dtype
    if pack:
        sends.append(pack)
    return sends


def alone(spec: TensorSpec) -> bool:
    """Whether :func:`plan_sends` sends a tensor of ``spec`` on its own (it may then come
    from another sender than the document's)."""
    return spec.nbytes >= _SMALL_BYTES


def tensor_paths(tree: Any) -> tuple[list[torch.Tensor], list[tuple[Any, ...]]]:
    """``tree``'s tensors and each tensor's path in the tree (as a receiver finds them
    with :func:`leaves`)."""
    doc, tensors = encode(tree)
    paths: list[tuple[Any, ...]] = [()] * len(tensors)
    for path, leaf in leaves(decode(doc, len(tensors))):
        paths[leaf.index] = path
    return tensors, paths


def send_message(tree: Any, send: Send, skip: Collection[int] = (),
                 pending: Optional[list[Optional[Wait]]] = None) -> int:
    """Send ``tree`` (its document, then its tensors but those in ``skip``, which other
    senders send); returns the tensor bytes sent. ``pending``: leave the sends' waits
    there instead of waiting (the caller posts more first)."""
    doc, tensors = encode(tree)
    specs = [TensorSpec.of(t) for t in tensors]
    body = json.dumps({"tree": doc, "tensors": [s.to_json() for s in specs]},
                      allow_nan=False, separators=(",", ":")).encode()
    waits = [send(torch.tensor([MAGIC, VERSION, len(body)], dtype=torch.int64)),
             send(torch.frombuffer(bytearray(body), dtype=torch.uint8))]
    sent = 0
    for group in plan_sends(specs, skip):
        if len(group) == 1:
            t = _sendable(tensors[group[0]])
        else:
            device = tensors[group[0]].device
            t = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in group])
        waits.append(send(t))
        sent += t.numel() * t.element_size()
    _settle(waits, pending)
    return sent


def send_tensors(tensors: Sequence[torch.Tensor], send: Send,
                 pending: Optional[list[Optional[Wait]]] = None) -> int:
    """Send ``tensors``, each alone (a share of a message another sender declared);
    returns the bytes sent. ``pending``: as :func:`send_message`'s."""
    _settle([send(_sendable(t)) for t in tensors], pending)
    return sum(t.numel() * t.element_size() for t in tensors)


def _sendable(t: torch.Tensor) -> torch.Tensor:
    """A tensor sent alone, where it lies: itself, or a contiguous copy."""
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _settle(waits: list[Optional[Wait]], pending: Optional[list[Optional[Wait]]]) -> None:
    if pending is not None:
        pending.extend(waits)
    else:
        wait_all(waits)


def wait_all(waits: Sequence[Optional[Wait]]) -> None:
    """Wait for every posted send or receive (None: it completed when posted)."""
    for w in waits:
        _done(w)


def receive_document(recv: Recv) -> tuple[Any, list[TensorSpec]]:
    """The next message's tree (tensors as :class:`Leaf`) and tensor declarations."""
    header = torch.zeros(3, dtype=torch.int64)
    _done(recv(header))
    magic, version, length = (int(x) for x in header.tolist())
    if magic != MAGIC:
        raise WireError("not a tp-run state message (bad magic)")
    if version != VERSION:
        raise WireError(f"state message version {version}, this tp-run reads {VERSION}")
    if not 0 < length <= MAX_DOCUMENT:
        raise WireError(f"bad document length {length}")
    body = torch.empty(length, dtype=torch.uint8)
    _done(recv(body))
    try:
        doc = json.loads(tensor_bytes(body).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"the document is not JSON: {e}") from None
    except RecursionError:  # (decode() bounds the depth of what parses)
        raise WireError("the document nests too deep") from None
    if not (isinstance(doc, dict) and set(doc) == {"tree", "tensors"}
            and isinstance(doc["tensors"], list)):
        raise WireError("the document lacks its tree or tensor list")
    specs = [TensorSpec.from_json(s) for s in doc["tensors"]]
    return decode(doc["tree"], len(specs)), specs


def receive_message(recv: Recv, spare: Sequence[torch.Tensor] = ()) -> tuple[int, Any]:
    """The next message whole, its tensors in host memory: the i-th into ``spare[i]``
    where that fits its declaration, else a new tensor; returns (bytes, tree)."""
    tree, specs = receive_document(recv)
    buffers = [spare[i] if i < len(spare) and tuple(spare[i].shape) == s.shape
               and spare[i].dtype == DTYPES[s.dtype] and spare[i].is_contiguous()
               and spare[i].device.type == "cpu"
               else _allocate(s) for i, s in enumerate(specs)]
    got = receive_tensors(specs, buffers, recv)
    return got, fill(tree, buffers)


def _allocate(spec: TensorSpec) -> torch.Tensor:
    """A host tensor for a declared one; WireError where it cannot be had (a declaration
    of more memory than the machine has is the sender's error, not this process's)."""
    try:
        return torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
    except (RuntimeError, MemoryError) as e:
        raise WireError(f"cannot allocate a declared tensor of {spec.nbytes} bytes: "
                        f"{str(e).splitlines()[0][:80]}") from None


def receive_tensors(specs: Sequence[TensorSpec], buffers: Sequence[torch.Tensor],
                    recv: Recv, shares: Sequence[tuple[Recv, Sequence[int]]] = ()) -> int:
    """Receive a message's tensors into ``buffers`` (one per spec, matching it): from
    ``recv``, but those of ``shares`` (another sender's receive and the indices it
    sends, in its order, each alone). Every receive is posted before any is waited for."""
    skip = {i for _, indices in shares for i in indices}
    got = 0
    pending: list[Optional[Wait]] = []
    packs: list[tuple[torch.Tensor, list[int]]] = []
    with torch.no_grad():
        for group in plan_sends(specs, skip):
            if len(group) == 1:
                t = buffers[group[0]]
            else:
                first = buffers[group[0]]
                t = torch.empty(sum(specs[i].nbytes // DTYPES[specs[i].dtype].itemsize
                                    for i in group), dtype=first.dtype, device=first.device)
                packs.append((t, group))
            pending.append(recv(t))
            got += t.numel() * t.element_size()
        for other, indices in shares:
            for i in indices:
                pending.append(other(buffers[i]))
                got += buffers[i].numel() * buffers[i].element_size()
        wait_all(pending)
        for t, group in packs:
            offset = 0
            for i in group:
                n = buffers[i].numel()
                buffers[i].copy_(t[offset:offset + n].view(buffers[i].shape))
                offset += n
    return got
