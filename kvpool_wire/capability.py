"""Data-plane capabilities, client tokens and the master's capability clock.

A capability is a keyed BLAKE2b MAC (16 bytes) over (segment, offset, length, operation,
expiry, epoch, put id) with the key of the segment's owner. Each client gets its own random
key when it registers, so a client can forge capabilities only for its own segments.

Rules of this file:
- Expiries are on the *master's capability clock*: milliseconds since the master's epoch
  began (a random ``epoch`` number chosen at every master start). They are never compared with
  a wall clock: a client learns an upper bound of that clock from an answer of the master
  (``MasterClock``), so clock skew between hosts cannot make a capability live longer.
- ``epoch`` is signed, so a capability of a previous master incarnation never verifies against
  the current one. ``put_id`` names the put a WRITE capability belongs to (0 for READ).
- ``client_token`` derives the secret a client presents on every client-scoped call from its
  capability key; the master derives the same, so nothing more needs to be stored or persisted.
- ``ownership_proof`` is what a segment's owner writes into its shared memory and the master
  hands to mappers in GetSegments: only the holder of the owner's key can produce it, so a
  descriptor that names someone else's memory cannot be made to match it.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import itertools
import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from kvpool_wire.types import Extent, Op, SegmentId

CAPABILITY_BYTES = 16
KEY_BYTES = 32
TOKEN_BYTES = 16
# The signed fields after the segment id, in two parts: what differs between the capabilities
# of one answer (offset, length), and what they share (op, expiry, epoch, put id)
_EXTENT = struct.Struct("<QQ")
_TERMS = struct.Struct("<BQQQ")
_EXTENT_TERMS = struct.Struct(_EXTENT.format + _TERMS.format[1:])   # both at once
_TOKEN_PERSON = b"kvpool-client"
_PROOF_PERSON = b"kvpool-segment"
_COPY = hashlib.blake2b.copy
_UPDATE = hashlib.blake2b.update
_DIGEST = hashlib.blake2b.digest
PROOF_BYTES = 16


def keyed(key: bytes) -> hashlib.blake2b:
    """The MAC state keyed with ``key``, for ``sign_keyed`` (keying once per key, not per
    capability, halves the cost of signing a batch)."""
    return hashlib.blake2b(key=key, digest_size=CAPABILITY_BYTES)


def sign_keyed(state: hashlib.blake2b, segment_id: str, offset: int, length: int, op: Op,
               expiry_ms: int, epoch: int = 0, put_id: int = 0) -> bytes:
    """``sign`` with a state from ``keyed`` (which it leaves unchanged)."""
    mac = state.copy()
    mac.update(segment_id.encode())
    mac.update(_EXTENT.pack(offset, length) + _TERMS.pack(int(op), expiry_ms, epoch, put_id))
    return mac.digest()


def extent_signer(segment_key: Callable[[SegmentId], bytes | None], op: Op, expiry_ms: int,
                  epoch: int = 0, put_id: int = 0) -> Callable[[Extent], bytes]:
    """``capability_of(extent)``: ``sign_keyed`` of ``extent`` with these terms, under the key
    ``segment_key`` gives for its segment (``b""`` for a segment whose owner has no key). For
    the many capabilities of one answer: each segment's key is looked up and keyed once and
    its id absorbed once, so a capability costs one state copy, one update and the digest."""
    terms = _TERMS.pack(int(op), expiry_ms, epoch, put_id)
    pack = _EXTENT.pack
    state_of_segment = _SegmentStates(segment_key)

    def capability_of(extent: Extent) -> bytes:
        state = state_of_segment[extent.segment_id]
        if state is None:
            return b""
        mac = state.copy()
        mac.update(pack(extent.offset, extent.length) + terms)
        return mac.digest()
    return capability_of


#: ``capabilities_of_run(segment_id, offsets, length)``, see ``run_signer``.
RunSigner = Callable[[SegmentId, list[int], int], list[bytes]]


def run_signer(segment_key: Callable[[SegmentId], bytes | None], op: Op, expiry_ms: int,
               epoch: int = 0, put_id: int = 0) -> RunSigner:
    """``capabilities_of_run(segment_id, offsets, length)``: the capability of each extent
    (``segment_id``, offset, ``length``), the same bytes ``extent_signer`` gives each, made
    with C-level maps (a run of plain puts is signed without a Python step per extent)."""
    repeat = itertools.repeat
    state_of_segment = _SegmentStates(segment_key)

    def capabilities_of_run(segment_id: SegmentId, offsets: list[int],
                            length: int) -> list[bytes]:
        state = state_of_segment[segment_id]
        if state is None:
            return [b""] * len(offsets)
        macs = list(map(_COPY, repeat(state, len(offsets))))
        signed = map(_EXTENT_TERMS.pack, offsets, repeat(length), repeat(int(op)),
                     repeat(expiry_ms), repeat(epoch), repeat(put_id))
        collections.deque(map(_UPDATE, macs, signed), maxlen=0)
        return list(map(_DIGEST, macs))
    return capabilities_of_run


#: ``capabilities_of(segment_ids, offsets, lengths)``, see ``columns_signer``.
ColumnsSigner = Callable[[list[SegmentId], list[int], list[int]], list[bytes]]


def columns_signer(segment_key: Callable[[SegmentId], bytes | None], op: Op, expiry_ms: int,
                   epoch: int = 0, put_id: int = 0) -> ColumnsSigner:
    """``capabilities_of(segment_ids, offsets, lengths)``: the capability of each extent
    (``segment_ids[i]``, ``offsets[i]``, ``lengths[i]``), the same bytes ``extent_signer``
    gives it, ``b""`` where the segment id is ``""`` or its owner has no key; made with
    C-level maps (the replicas of a read answer's columns, signed without a Python step
    each)."""
    repeat = itertools.repeat
    state_of_segment = _SegmentStates(segment_key)

    def capabilities_of(segment_ids: list[SegmentId], offsets: list[int],
                        lengths: list[int]) -> list[bytes]:
        states = list(map(state_of_segment.__getitem__, segment_ids))
        signed = list(map(operator.is_not, states, repeat(None)))
        live = cast("list[hashlib.blake2b]", list(itertools.compress(states, signed)))
        macs = list(map(_COPY, live))
        terms = map(_EXTENT_TERMS.pack, itertools.compress(offsets, signed),
                    itertools.compress(lengths, signed), repeat(int(op)), repeat(expiry_ms),
                    repeat(epoch), repeat(put_id))
        collections.deque(map(_UPDATE, macs, terms), maxlen=0)
        if len(macs) == len(segment_ids):
            return list(map(_DIGEST, macs))
        capabilities = [b""] * len(segment_ids)
        collections.deque(map(capabilities.__setitem__,
                              itertools.compress(range(len(segment_ids)), signed),
                              map(_DIGEST, macs)), maxlen=0)
        return capabilities
    return capabilities_of


class _SegmentStates(dict[str, "hashlib.blake2b | None"]):
    """Segment id -> its MAC state (``_segment_state``), made when first asked for: each
    signer of an answer keys each segment once. None for ``""`` (no replica)."""

    def __init__(self, segment_key: Callable[[SegmentId], bytes | None]) -> None:
        super().__init__()
        self.segment_key = segment_key

    def __missing__(self, segment_id: str) -> hashlib.blake2b | None:
        state = _segment_state(self.segment_key, SegmentId(segment_id)) if segment_id else None
        self[segment_id] = state
        return state


def _segment_state(segment_key: Callable[[SegmentId], bytes | None],
                   segment_id: SegmentId) -> hashlib.blake2b | None:
    """The MAC state of ``segment_id``'s key with its id absorbed; None for a segment whose
    owner has no key."""
    key = segment_key(segment_id)
    if not key:
        return None
    state = keyed(key)
    state.update(segment_id.encode())
    return state


def sign(key: bytes, segment_id: str, offset: int, length: int, op: Op, expiry_ms: int,
         epoch: int = 0, put_id: int = 0) -> bytes:
    """Return the capability allowing ``op`` on ``[offset, offset+length)`` until ``expiry_ms``
    on the capability clock of master epoch ``epoch``, for put ``put_id`` (WRITE)."""
    return sign_keyed(keyed(key), segment_id, offset, length, op, expiry_ms, epoch, put_id)


def verify(key: bytes, capability: bytes, segment_id: str, offset: int, length: int, op: Op,
           expiry_ms: int, now_ms: int, epoch: int = 0, put_id: int = 0) -> bool:
    """True when ``capability`` is valid for exactly this request and has not expired
    (``now_ms`` is an upper bound of the master's capability clock)."""
    if now_ms > expiry_ms or len(capability) != CAPABILITY_BYTES:
        return False
    return hmac.compare_digest(
        capability, sign(key, segment_id, offset, length, op, expiry_ms, epoch, put_id))


def client_token(capability_key: bytes) -> bytes:
    """The secret a client presents on client-scoped calls, derived from its capability key."""
    return hashlib.blake2b(capability_key, digest_size=TOKEN_BYTES,
                           person=_TOKEN_PERSON).digest()


def ownership_proof(capability_key: bytes, segment_id: str, shm_name: str,
                    size_bytes: int) -> bytes:
    """The proof that the holder of ``capability_key`` owns this shared-memory segment."""
    mac = hashlib.blake2b(key=capability_key, digest_size=PROOF_BYTES, person=_PROOF_PERSON)
    mac.update(f"{segment_id}\0{shm_name}\0{size_bytes}".encode())
    return mac.digest()


@dataclass(frozen=True, slots=True)
class MasterClock:
    """An upper bound of the master's capability clock, learnt from one of its answers.

    The master read its clock (``master_ms``) after the request was sent at ``sent_s``
    (``time.monotonic()`` here), so ``master_ms + (now - sent_s)`` is never behind it.
    """

    epoch: int
    master_ms: int
    sent_s: float

    def now_ms(self, local_now_s: float) -> int:
        """An upper bound of the master's capability clock at ``local_now_s`` (this host's
        ``time.monotonic()``)."""
        return self.master_ms + int((local_now_s - self.sent_s) * 1000) + 1

    def local_deadline_s(self, expiry_ms: int) -> float:
        """The ``time.monotonic()`` by which the master's clock may have reached ``expiry_ms``."""
        return self.sent_s + (expiry_ms - self.master_ms - 1) / 1000

    def tighter(self, other: MasterClock) -> MasterClock:
        """The sample giving the lower (still safe) bound, preferring ``other``'s epoch when
        the epochs differ (a newer answer of a restarted master)."""
        if other.epoch != self.epoch:
            return other
        mine = self.master_ms - self.sent_s * 1000
        theirs = other.master_ms - other.sent_s * 1000
        return other if theirs <= mine else self
