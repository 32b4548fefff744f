"""Mooncake's integer return codes, derived from kvpool's :class:`Status`.

Rules of this file:
- Mooncake callers compare results with ``== 0``, ``== 1``, ``== sum(sizes)`` or ``< 0``, so every
  failure they can see must be one of Mooncake's own ``ErrorCode`` numbers.
- :class:`Status` already reuses Mooncake's number wherever the meaning is the same; those pass
  through unchanged. The kvpool-only statuses (below -1000) map to the Mooncake code a Mooncake
  caller would have seen for the same situation, listed in ``KVPOOL_ONLY_TO_MOONCAKE``.
- Anything that is not a :class:`Status` (an unexpected exception) is ``INTERNAL_ERROR`` (-1).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool_wire.status import KVPoolError, Status

OK = 0
INTERNAL_ERROR = int(Status.INTERNAL_ERROR)  # -1
NO_SPACE = int(Status.NO_SPACE)  # -200
INVALID_PARAMS = int(Status.INVALID_ARGUMENT)  # -600, also "buffer too small"
NOT_FOUND = int(Status.NOT_FOUND)  # -704
HAS_LEASE = int(Status.HAS_LEASE)  # -706
TRANSFER_FAILED = int(Status.TRANSFER_FAILED)  # -800
RPC_FAILED = int(Status.RPC_FAILED)  # -900
#: ``health_check``'s own answers (Mooncake's: not 0 means unhealthy, and why)
HEALTH_NOT_SET_UP = 1  # before setup, or after close
HEALTH_MASTER_UNREACHABLE = 2

#: kvpool-only statuses and the Mooncake code that names the same situation for its callers.
KVPOOL_ONLY_TO_MOONCAKE: dict[Status, int] = {
    Status.UNAVAILABLE: RPC_FAILED,  # master unreachable
    Status.UNKNOWN_CLIENT: RPC_FAILED,  # the master forgot us (restart); the client re-registers
    Status.CLIENT_ALREADY_EXISTS: RPC_FAILED,  # the id is held by a live client (registration)
    Status.PERMISSION_DENIED: TRANSFER_FAILED,  # a data server refused a capability
    Status.CHECKSUM_MISMATCH: TRANSFER_FAILED,  # the bytes read are not the bytes written
    Status.RESOURCE_EXHAUSTED: NO_SPACE,  # async-write queue or data-server limits full
    Status.TIMEOUT: TRANSFER_FAILED,  # a transfer or call ran past its deadline
}


def mooncake_code(status: int) -> int:
    """Return the Mooncake return code for a kvpool status value (0 for ``OK``)."""
    try:
        known = Status(status)
    except ValueError:
        return INTERNAL_ERROR
    return KVPOOL_ONLY_TO_MOONCAKE.get(known, int(known))


def code_of_error(exc: BaseException) -> int:
    """Return the Mooncake return code for an exception raised by a kvpool call."""
    if isinstance(exc, KVPoolError):
        return mooncake_code(exc.status)
    return INTERNAL_ERROR


def per_key_codes(statuses: Sequence[int]) -> list[int]:
    """Mooncake's code per key of a batch; ``ALREADY_EXISTS`` (a put of an existing key) is 0,
    as Mooncake answers it."""
    return [OK if s == Status.ALREADY_EXISTS else mooncake_code(s) for s in statuses]
