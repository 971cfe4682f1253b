"""Importing a library whose native logging would flood stderr, with that logging off.

gRPC (etcd's client) prints TLS handshake failures and every retry; torch's C++ layer
prints a wall of stack frames for each retry of a TCPStore client whose server is gone
(a c10d host that died, or is not there yet). The agent reports such errors itself, in
one line. Both libraries read their log level from the environment once, at import, so
it is set for the import only: the workers' environment, built from ``os.environ``
later, keeps whatever the user set. A library already imported is left as it is.
"""

from __future__ import annotations

import importlib
import os
import sys


def import_quietly(module: str, env: str, value: str) -> None:
    """Import ``module`` with ``env=value`` in the environment, unless its top-level
    package is imported already (the level was read then)."""
    if module.partition(".")[0] in sys.modules:
        return
    old = os.environ.get(env)
    os.environ[env] = value
    try:
        importlib.import_module(module)
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old


def import_grpc_quietly() -> None:
    """Import gRPC with its own logging off."""
    import_quietly("grpc", "GRPC_VERBOSITY", "NONE")


def import_torch_quietly() -> None:
    """Import ``torch.distributed`` with torch's C++ log level at FATAL."""
    import_quietly("torch.distributed", "TORCH_CPP_LOG_LEVEL", "FATAL")
