"""Agent events for ``--event-log-handler``, in torchrun's shape.

torchrun serialises ``torch.distributed.elastic.events.Event`` objects as JSON and hands
them to a named logging handler: ``console`` (stderr), ``null`` and
``dynamic_rendezvous`` (both discard). tp-run keeps the names and the JSON fields.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tp_launch.config import ConfigError

HANDLERS = ("console", "dynamic_rendezvous", "null")


class EventLog:
    """Writes agent events to the destination named by ``--event-log-handler``.

    Args:
        destination: one of :data:`HANDLERS`.
    """

    def __init__(self, destination: str) -> None:
        if destination not in HANDLERS:
            raise ConfigError(
                f"--event-log-handler={destination!r} is not one of {', '.join(HANDLERS)}")
        self._enabled = destination == "console"

    def record(self, name: str, **metadata: Any) -> None:
        if not self._enabled:
            return
        event = {"name": name, "source": "AGENT",
                 "timestamp": int(time.time() * 1000), "metadata": metadata}
        print(json.dumps(event), file=sys.stderr, flush=True)
