"""What ``GetReplicas`` answers, as the master core makes it: each key's status, size,
checksum and replicas, kept as columns.

Rules of this file:
- A key read from the table is mostly one READY object with one replica. The core appends
  its size, checksum, segment id and offset to the columns and makes no ``Extent``,
  ``ReadResult`` or tuple for it: the columns encoder writes them as they are and signs
  them with C-level maps (``kvpool_wire.capability.columns_signer``). A key whose replicas
  are anything else (several, or some filtered out) keeps its whole tuple in ``more``; a
  key that is not OK has the segment id ``""``.
- Read as a sequence, it is exactly the list of ``ReadResult`` a key-by-key answer would
  be, and compares equal to that list.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool_wire.aslist import AsList
from kvpool_wire.status import Status
from kvpool_wire.types import Extent, ReadResult, SegmentId

_OK = int(Status.OK)
_NO_SEGMENT = SegmentId("")


class ReadColumns(AsList[ReadResult[Extent]]):
    """Per key: ``statuses``, ``sizes_bytes``, ``checksums``, and the first replica
    (``segment_ids``, ``offsets``; its length is the size), the whole replica tuple in
    ``more`` where it is not that one replica."""

    __slots__ = ("statuses", "sizes_bytes", "checksums", "segment_ids", "offsets", "more")

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.sizes_bytes: list[int] = []
        self.checksums: list[int] = []
        self.segment_ids: list[SegmentId] = []
        self.offsets: list[int] = []
        self.more: dict[int, tuple[Extent, ...]] = {}

    def refuse(self, status: int) -> None:
        """Answer the next key with ``status`` (not OK)."""
        self.statuses.append(status)
        self.sizes_bytes.append(0)
        self.checksums.append(0)
        self.segment_ids.append(_NO_SEGMENT)
        self.offsets.append(0)

    def __len__(self) -> int:
        return len(self.statuses)

    def __iter__(self) -> Iterator[ReadResult[Extent]]:
        return map(self._at, range(len(self.statuses)))

    def _at(self, index: int) -> ReadResult[Extent]:
        status, size = self.statuses[index], self.sizes_bytes[index]
        if status != _OK:
            return ReadResult(status)
        placements = self.more.get(index)
        if placements is None:
            placements = (Extent(self.segment_ids[index], self.offsets[index], size),)
        return ReadResult(status, size, placements, self.checksums[index])
