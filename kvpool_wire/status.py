"""The one Status vocabulary of kvpool, mirrored from ``proto/kvpool.proto``.

Numbers reuse Mooncake's ``ErrorCode`` where the meaning matches (so connectors written against
Mooncake read them correctly); kvpool-only codes sit below -1000. ``tests/unit/test_status.py``
keeps this enum equal to the proto enum.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Per-item outcome of every master call and data-plane transfer."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    NO_SPACE = -200
    INVALID_KEY = -400
    INVALID_ARGUMENT = -600
    NOT_READY = -703
    NOT_FOUND = -704
    ALREADY_EXISTS = -705
    HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAILED = -800
    RPC_FAILED = -900
    UNAVAILABLE = -1010
    UNKNOWN_CLIENT = -1100
    CLIENT_ALREADY_EXISTS = -1101
    PERMISSION_DENIED = -1200
    CHECKSUM_MISMATCH = -1300
    RESOURCE_EXHAUSTED = -1400
    TIMEOUT = -1500


#: Statuses worth retrying after a short back-off: the same call may succeed later.
RETRYABLE: frozenset[Status] = frozenset(
    {
        Status.RPC_FAILED,
        Status.UNAVAILABLE,
        Status.UNKNOWN_CLIENT,
        Status.LEASE_EXPIRED,
        Status.TRANSFER_FAILED,
        Status.RESOURCE_EXHAUSTED,
        Status.TIMEOUT,
    }
)


class KVPoolError(Exception):
    """The one exception kvpool raises for an expected failure; carries a :class:`Status`."""

    def __init__(self, status: Status, message: str = "") -> None:
        self.status = Status(status)
        self.message = message
        super().__init__(f"{self.status.name} ({int(self.status)}): {message}" if message
                         else f"{self.status.name} ({int(self.status)})")

    @property
    def retryable(self) -> bool:
        """True when the same call may succeed if tried again."""
        return self.status in RETRYABLE
