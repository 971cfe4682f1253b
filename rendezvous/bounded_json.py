"""JSON read from a shared place (an etcd key, a store, a socket): bounded before use.

Anyone who can write under a job's etcd prefix (an etcd without auth: see the README's
"Trust model") or connect to its store can put any text there. A document
nested ten thousand deep makes ``json.loads`` raise RecursionError, and one merely a few
hundred deep passes it, then breaks whatever walks it recursively later (``json.dumps``
for ``tp-run status``, a ``repr``); a document of gigabytes takes the reader's memory.
:func:`loads` refuses both with a :class:`BoundsError`, a ValueError, so every reader's
existing "malformed document" path takes it: one line, the document ignored or the job
stopped loudly, never an agent's traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

# Deeper than any document tp-run writes (its deepest, a node's status, is 4 levels).
MAX_DEPTH = 16
# Larger than any document tp-run writes (a rendezvous state of thousands of members).
MAX_BYTES = 4 << 20


class BoundsError(ValueError):
    """A document over the size or depth bound (or not JSON at all)."""


def loads(text: str | bytes, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, or BoundsError: over ``max_bytes``, nested deeper than
    ``max_depth``, or not JSON (the message says which, in one line)."""
    if len(text) > max_bytes:
        raise BoundsError(f"{len(text)} bytes, more than {max_bytes}")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise BoundsError(f"nested deeper than {max_depth}") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise BoundsError(f"not JSON ({str(e).splitlines()[0][:80]})") from None
    if depth_exceeds(doc, max_depth):
        raise BoundsError(f"nested deeper than {max_depth}")
    return doc


def depth_exceeds(doc: Any, max_depth: int) -> bool:
    """Whether ``doc`` (parsed JSON) nests deeper than ``max_depth``; no recursion."""
    stack = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Iterable[Any] = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth >= max_depth:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
