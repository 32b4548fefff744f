"""A partitioned master: which partition a key belongs to, where partitions serve, and the
ticket with which partition 0 lets a client join the others (README, "Partitions").

Rules of this file:
- A key belongs to partition ``crc32(key) % count``: the same on every host and in every
  language (zlib's CRC-32, the one of gzip and PNG), computed in C a batch at a time.
- Lease and copy-task numbers name their partition: ``number % count``. A partition refuses
  a PutStart carrying a key of another partition (``stray``): an object lives only where
  every reader looks for it.
- Partition 0 registers clients; a partition after it registers a client only with a
  ticket of partition 0 for the client's id and capability key (a keyed BLAKE2b MAC under
  the secret the partitions share), so every partition verifies the same key and token and
  no caller joins as another client. A ticket carries its number (partition 0 counts them)
  and when it was issued on the capability clock every partition shares, both signed: it
  joins for ``TICKET_TTL_MS`` only, and an earlier holder of an id, whose ticket is older than
  the one a partition knows the id by, cannot push the later holder out.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import operator
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

#: Most partitions of one index (README, "Partitions").
MAX_PARTITIONS = 64
_TICKET_HEAD = struct.Struct("<QQ")   # the ticket's number, when it was issued (ms)
_TICKET_MAC_BYTES = 16
TICKET_BYTES = _TICKET_HEAD.size + _TICKET_MAC_BYTES
#: How long after partition 0 issued it a ticket joins the other partitions (a client joins
#: them at once; one that needs to later registers with partition 0 again).
TICKET_TTL_MS = 60_000
SECRET_BYTES = 32
_TICKET_PERSON = b"kvpool-partition"


@dataclass(frozen=True, slots=True)
class PartitionEndpoint:
    """Where one partition serves, on the host of partition 0: its gRPC port and lean
    endpoints, as a registration answer gives them."""

    port: int
    fast_port: int = 0
    fast_socket: str = ""
    master_pid: int = 0


def partition_of(key: bytes, count: int) -> int:
    """The partition of ``key`` among ``count``."""
    return zlib.crc32(key) % count


def partitions_of(keys: Sequence[bytes], count: int) -> list[int]:
    """The partition of each of ``keys`` among ``count`` (C-level maps)."""
    return list(map(operator.mod, map(zlib.crc32, keys), itertools.repeat(count)))


def stray(keys: Sequence[bytes], index: int, count: int) -> int | None:
    """The position of the first of ``keys`` that is not partition ``index``'s among
    ``count``, or None when all are (one C-level pass for a batch that is all its own)."""
    owners = partitions_of(keys, count)
    if owners.count(index) == len(owners):
        return None
    return next(i for i, owner in enumerate(owners) if owner != index)


def ticket(secret: bytes, client_id: str, capability_key: bytes, number: int,
           issued_ms: int) -> bytes:
    """Partition 0's ticket number ``number`` for ``client_id`` holding ``capability_key``,
    issued at ``issued_ms`` of the capability clock."""
    head = _TICKET_HEAD.pack(number, issued_ms)
    return head + _ticket_mac(secret, client_id, capability_key, head)


def _ticket_mac(secret: bytes, client_id: str, capability_key: bytes, head: bytes) -> bytes:
    mac = hashlib.blake2b(key=secret, digest_size=_TICKET_MAC_BYTES, person=_TICKET_PERSON)
    encoded = client_id.encode()
    mac.update(len(encoded).to_bytes(4, "little") + encoded + head + capability_key)
    return mac.digest()


def ticket_number(secret: bytes, client_id: str, capability_key: bytes, presented: object,
                  now_ms: int) -> int | None:
    """The number of ``presented`` when it is partition 0's ticket for ``client_id`` and
    ``capability_key`` (compared in constant time), issued at most ``TICKET_TTL_MS`` before
    ``now_ms``; None otherwise."""
    if (type(presented) is not bytes or len(presented) != TICKET_BYTES
            or type(capability_key) is not bytes):
        return None
    head = presented[:_TICKET_HEAD.size]
    if not hmac.compare_digest(_ticket_mac(secret, client_id, capability_key, head),
                               presented[_TICKET_HEAD.size:]):
        return None
    number, issued_ms = _TICKET_HEAD.unpack(head)
    return number if issued_ms <= now_ms <= issued_ms + TICKET_TTL_MS else None
