"""kvpool client library: segments, one-sided data plane, native and Mooncake-compatible APIs.

Importable without torch or a running master. ``KVPoolClient`` / ``AsyncKVPoolClient`` are
imported lazily so that ``import kvpool_client`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from kvpool_wire.status import KVPoolError, Status

__all__ = ["AsyncKVPoolClient", "KVPoolClient", "KVPoolError", "Status"]


def __getattr__(name: str) -> Any:
    if name in ("KVPoolClient", "AsyncKVPoolClient"):
        from kvpool_client import client

        return getattr(client, name)
    raise AttributeError(name)
