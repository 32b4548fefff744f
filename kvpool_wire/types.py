"""Domain vocabulary shared by the master and the client (no protobuf here).

Only ``kvpool_wire/convert.py`` translates between these
types and protobuf messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, NewType, TypeVar

from kvpool_wire.records import fast_init

ObjectKey = NewType("ObjectKey", bytes)
ClientId = NewType("ClientId", str)
SegmentId = NewType("SegmentId", str)

#: Largest key accepted anywhere, in bytes of its UTF-8 / raw form.
MAX_KEY_BYTES = 1024


class Tier(enum.IntEnum):
    """Storage tier of a segment."""

    DRAM = 0
    SSD = 1


class Pin(enum.IntEnum):
    """Eviction protection of an object."""

    NONE = 0
    SOFT = 1  # evicted only when nothing unpinned is left
    HARD = 2  # never evicted; removed only explicitly


class Op(enum.IntEnum):
    """Data-plane operation a capability allows."""

    READ = 1
    WRITE = 2


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A contiguous range of memory contributed by a client and how peers reach it."""

    segment_id: SegmentId
    client_id: ClientId
    size_bytes: int
    tier: Tier = Tier.DRAM
    host_id: str = ""
    shm_name: str = ""
    tcp_endpoint: str = ""
    engine_endpoint: str = ""        # transfer-engine session id ("host:port"), "" when none
    engine_base_address: int = 0     # the segment's first byte for that engine (0: none)
    file_path: str = ""              # tier SSD: the file on the owner's host ("" when none)
    # Set by the master in GetSegments answers (capability.ownership_proof): not part of what
    # a segment is, so it takes no part in comparisons.
    ownership_proof: bytes = field(default=b"", compare=False)


@fast_init
@dataclass(frozen=True, slots=True)
class Placement:
    """One replica of an object as a client gets it: ``length`` bytes at ``offset`` of
    ``segment_id``, and the capability that lets it read or write them (the master keeps an
    ``Extent`` and signs it into one of these on the way out)."""

    segment_id: SegmentId
    offset: int
    length: int
    capability_expiry_ms: int = 0   # on the master's capability clock
    capability: bytes = b""
    put_id: int = 0                 # WRITE: the put the capability belongs to


class Extent:
    """Where one replica's bytes are: ``length`` bytes at ``offset`` of ``segment_id``, with
    no capability. The master keeps every replica as one of these and signs it into a
    ``Placement`` on the way out: a third of the memory of a ``Placement`` and of the time to
    make one, for each of millions of objects. Never changed once made (entries, events and
    answers share them); compares by value."""

    __slots__ = ("segment_id", "offset", "length")

    def __init__(self, segment_id: SegmentId, offset: int, length: int) -> None:
        self.segment_id = segment_id
        self.offset = offset
        self.length = length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Extent):
            return NotImplemented
        return (self.segment_id, self.offset, self.length) == \
            (other.segment_id, other.offset, other.length)

    def __hash__(self) -> int:
        return hash((self.segment_id, self.offset, self.length))

    def __repr__(self) -> str:
        return f"Extent({self.segment_id!r}, {self.offset}, {self.length})"


#: Where a replica is, signed (``Placement``, what clients get) or not (``Extent``, what the
#: master keeps).
Located = TypeVar("Located", Placement, Extent)


@dataclass(frozen=True, slots=True)
class PutOptions:
    """How a put places its object."""

    replica_num: int = 1
    preferred_segment: str = ""
    prefer_same_host: bool = False
    pin: Pin = Pin.NONE


def parse_size_bytes(value: int | str) -> int:
    """Parse ``4294967296``, ``"4gb"``, ``"512 MiB"``, ``"1.5GB"`` into a byte count.

    Units are binary (``gb`` == ``gib`` == 2**30), as Mooncake's config reads them.
    Raises ``ValueError`` naming the value when it is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    text = value.strip().lower().replace(" ", "")
    units = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
             "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40,
             "tib": 2**40}
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    if unit not in units or not number:
        raise ValueError(f"not a size: {value!r} (use bytes or e.g. '4gb', '512mb')")
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"not a size: {value!r}") from None
    if amount < 0 or amount != amount:
        raise ValueError(f"size must be >= 0, got {value!r}")
    return int(amount * units[unit])


@fast_init
@dataclass(frozen=True, slots=True)
class ReadResult(Generic[Located]):
    """The master's answer for one key of a read: where its bytes are, or why not
    (``ReadResult[Extent]`` in the master, ``ReadResult[Placement]`` once signed and sent)."""

    status: int  # a kvpool_wire.status.Status value
    size_bytes: int = 0
    placements: tuple[Located, ...] = ()
    checksum: int = 0  # xxh3_64 of the bytes as committed, 0 when none was given
