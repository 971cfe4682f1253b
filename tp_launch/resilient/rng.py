"""The random number generators a training step draws from, as part of its state.

A dropout mask, a random augmentation or a ``DataLoader``'s shuffle seed comes from a
process-wide generator: torch's CPU generator, each initialised CUDA device's, Python's
``random`` and (if the script imported it) numpy's legacy global ``RandomState``. An
abandoned step advanced them; a newcomer has its own. So their states are part of every
commit (:mod:`tp_launch.resilient.rollback`): restored on survivors, given to newcomers.

A generator is either *replicated* (every rank seeded it alike and draws the same
numbers: the usual ``torch.manual_seed(seed)``) or *per rank* (seeded with the rank, or
not seeded at all: Python's and numpy's are seeded from the OS at start). A newcomer
takes a replicated generator from its donor; a per-rank one only from the record its
rank's previous process left on this node (:mod:`tp_launch.resilient.per_rank`). A
per-rank generator that the script never draws from does not matter.

:func:`capture` returns the states as a tree that :mod:`tp_launch.resilient.wire` can
carry; :func:`restore` sets them (all, or the named generators); :func:`digests` gives
one 64-bit word per generator, to compare ranks.
"""

from __future__ import annotations

import hashlib
import random
import struct
import sys
from typing import Any

import torch

from tp_launch.resilient.wire import tensor_bytes

RngState = dict[str, Any]
GENERATORS = ("torch", "cuda", "python", "numpy")


def capture() -> RngState:
    state: RngState = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: RngState, only: set[str] | None = None) -> None:
    """Set the generators from ``state`` (``only``: just these ones)."""
    def wanted(name: str) -> bool:
        return name in state and (only is None or name in only)

    if wanted("torch"):
        torch.set_rng_state(state["torch"])
    if wanted("cuda"):
        for i, s in enumerate(state["cuda"]):
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(s, i)
    if wanted("python"):
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    np = sys.modules.get("numpy")
    if np is not None and wanted("numpy"):
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def digests(state: RngState) -> dict[str, int]:
    """One signed 64-bit word per generator (0: the generator is absent)."""
    out = {}
    for name in GENERATORS:
        part = _encode_one(state, name)
        out[name] = 0 if part is None else int.from_bytes(
            hashlib.blake2b(part, digest_size=8).digest(), "little", signed=True)
    return out


def _encode_one(state: RngState, name: str) -> bytes | None:
    if name not in state:
        return None
    v = state[name]
    if name == "torch":
        return tensor_bytes(v)
    if name == "cuda":
        return b"".join(struct.pack("<q", t.numel()) + tensor_bytes(t) for t in v)
    if name == "python":
        version, internal, gauss = v
        return struct.pack(f"<qq{len(internal)}Q", version, len(internal), *internal) + \
            (b"N" if gauss is None else b"G" + struct.pack("<d", gauss))
    kind, keys, pos, has_gauss, cached = v
    return kind.encode() + struct.pack(f"<q{len(keys)}Qqqd", len(keys), *keys, pos,
                                       has_gauss, cached)


def to_bytes(state: RngState) -> bytes:
    """A compact binary form (for the per-rank record)."""
    out = b""
    for i, name in enumerate(GENERATORS):
        part = _encode_one(state, name)
        if part is not None:
            out += struct.pack("<qq", i, len(part)) + part
    return out


def from_bytes(data: bytes) -> RngState:
    """The inverse of :func:`to_bytes` (raises ValueError on a malformed record)."""
    state: RngState = {}
    off = 0
    try:
        while off < len(data):
            i, n = struct.unpack_from("<qq", data, off)
            off += 16
            part, off = data[off:off + n], off + n
            name = GENERATORS[i]
            if name == "torch":
                state["torch"] = torch.frombuffer(bytearray(part), dtype=torch.uint8)
            elif name == "cuda":
                tensors, p = [], 0
                while p < len(part):
                    (k,) = struct.unpack_from("<q", part, p)
                    tensors.append(torch.frombuffer(bytearray(part[p + 8:p + 8 + k]),
                                                    dtype=torch.uint8))
                    p += 8 + k
                state["cuda"] = tensors
            elif name == "python":
                version, count = struct.unpack_from("<qq", part, 0)
                internal = list(struct.unpack_from(f"<{count}Q", part, 16))
                rest = part[16 + 8 * count:]
                gauss = None if rest[:1] == b"N" else struct.unpack("<d", rest[1:9])[0]
                state["python"] = [version, internal, gauss]
            else:
                kind = part[:7].decode()
                (count,) = struct.unpack_from("<q", part, 7)
                keys = list(struct.unpack_from(f"<{count}Q", part, 15))
                pos, has_gauss, cached = struct.unpack_from("<qqd", part, 15 + 8 * count)
                state["numpy"] = [kind, keys, pos, has_gauss, cached]
    except (struct.error, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"bad generator record: {e}") from None
    return state
