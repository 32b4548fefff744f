"""Data-plane capabilities: the master signs every placement it hands out, data servers check.

A capability is a keyed BLAKE2b MAC (16 bytes) over (segment, offset, length, operation,
expiry) with the key of the segment's owner. Each client gets its own random key when it
registers, so a client can forge capabilities only for its own segments.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from kvpool_client.types import Op

CAPABILITY_BYTES = 16
KEY_BYTES = 32
_FIELDS = struct.Struct("<QQBQ")


def keyed(key: bytes) -> hashlib.blake2b:
    """The MAC state keyed with ``key``, for ``sign_keyed`` (keying once per key, not per
    capability, halves the cost of signing a batch)."""
    return hashlib.blake2b(key=key, digest_size=CAPABILITY_BYTES)


def sign_keyed(state: hashlib.blake2b, segment_id: str, offset: int, length: int, op: Op,
               expiry_ms: int) -> bytes:
    """``sign`` with a state from ``keyed`` (which it leaves unchanged)."""
    mac = state.copy()
    mac.update(segment_id.encode())
    mac.update(_FIELDS.pack(offset, length, int(op), expiry_ms))
    return mac.digest()


def sign(key: bytes, segment_id: str, offset: int, length: int, op: Op, expiry_ms: int) -> bytes:
    """Return the capability allowing ``op`` on ``[offset, offset+length)`` until ``expiry_ms``."""
    return sign_keyed(keyed(key), segment_id, offset, length, op, expiry_ms)


def verify(key: bytes, capability: bytes, segment_id: str, offset: int, length: int, op: Op,
           expiry_ms: int, now_ms: int) -> bool:
    """True when ``capability`` is valid for exactly this request and has not expired."""
    if now_ms > expiry_ms or len(capability) != CAPABILITY_BYTES:
        return False
    return hmac.compare_digest(capability, sign(key, segment_id, offset, length, op, expiry_ms))
