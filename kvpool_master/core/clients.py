"""Clients: registration, heartbeats and liveness.

Rules of this file:
- A client is *live* (registered in this master's lifetime) or *restored* (known from a
  persisted index). A restored client keeps its capability key; its heartbeat answers
  UNKNOWN_CLIENT so it re-registers (getting the same key back) and remounts its segments.
- Identity is the token derived from the capability key (``capability.client_token``), not the
  id: every client-scoped call presents it, and re-registering a known id (live or restored)
  needs it too. An id whose holder cannot prove it is refused until that holder expires.
- Expiry is purely ``now - last_heartbeat_s > client_ttl_s``. The core has no clock: the
  server passes a clock that does not advance while the master itself was stalled, so a
  master pause never expires anyone.
"""

from __future__ import annotations

import hmac

from kvpool_wire.capability import client_token
from kvpool_wire.types import ClientId

#: Longest client id and host id accepted.
MAX_ID_CHARS = 256
#: Accepted capability key lengths (the client library uses 32 random bytes).
MIN_CAPABILITY_KEY_BYTES = 16
MAX_CAPABILITY_KEY_BYTES = 64


class ClientState:
    """One client: identity, capability key, liveness."""

    __slots__ = ("client_id", "host_id", "capability_key", "token", "last_heartbeat_s",
                 "restored", "restore_deadline_s", "ticket_number")

    def __init__(self, client_id: ClientId, host_id: str, capability_key: bytes,
                 last_heartbeat_s: float, restored: bool = False,
                 restore_deadline_s: float = 0.0) -> None:
        self.client_id = client_id
        self.host_id = host_id
        self.capability_key = capability_key
        self.token = client_token(capability_key)
        self.last_heartbeat_s = last_heartbeat_s
        self.restored = restored
        self.restore_deadline_s = restore_deadline_s
        #: a later partition: the newest of partition 0's tickets it joined with (0: none)
        self.ticket_number = 0


def registration_error(client_id: object, host_id: object, capability_key: object) -> str:
    """Return why a registration is malformed, or "" when it is well formed."""
    if not isinstance(client_id, str) or not 0 < len(client_id) <= MAX_ID_CHARS:
        return "client_id must be a non-empty string of at most 256 characters"
    if not isinstance(host_id, str) or len(host_id) > MAX_ID_CHARS:
        return "host_id must be a string of at most 256 characters"
    if (not isinstance(capability_key, bytes)
            or not MIN_CAPABILITY_KEY_BYTES <= len(capability_key) <= MAX_CAPABILITY_KEY_BYTES):
        return "capability_key must be 16 to 64 bytes"
    return ""


class ClientTable:
    """Every known client by id."""

    def __init__(self) -> None:
        self.id_to_client: dict[ClientId, ClientState] = {}

    def __len__(self) -> int:
        return len(self.id_to_client)

    def get(self, client_id: ClientId) -> ClientState | None:
        """Return the client (live or restored), or None."""
        return self.id_to_client.get(client_id)

    def live(self, client_id: ClientId) -> ClientState | None:
        """Return the client if it registered in this master's lifetime, else None."""
        client = self.id_to_client.get(client_id)
        return client if client is not None and not client.restored else None

    def proven(self, client_id: ClientId, token: bytes) -> ClientState | None:
        """Return the live client ``client_id`` when ``token`` is its token, else None."""
        client = self.id_to_client.get(client_id)
        if (client is None or client.restored or type(token) is not bytes
                or not hmac.compare_digest(client.token, token)):
            return None
        return client

    def add(self, client: ClientState) -> None:
        """Track ``client`` (replacing nothing: its id must be new)."""
        self.id_to_client[client.client_id] = client

    def discard(self, client_id: ClientId) -> None:
        """Forget ``client_id`` (no-op when unknown)."""
        self.id_to_client.pop(client_id, None)

    def find_expired(self, now: float, client_ttl_s: float) -> list[ClientId]:
        """Return the live clients silent for more than ``client_ttl_s`` and the restored ones
        past their deadline; the caller drops them."""
        expired: list[ClientId] = []
        for client in self.id_to_client.values():
            if client.restored:
                if now > client.restore_deadline_s:
                    expired.append(client.client_id)
            elif now - client.last_heartbeat_s > client_ttl_s:
                expired.append(client.client_id)
        return expired
