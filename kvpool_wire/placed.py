"""What ``PutStart`` answers, as the master core makes it: a status and the placements of each
key, with runs of plain puts kept as columns.

Rules of this file:
- A stretch of plain puts (one replica, one size, absent keys) is placed in runs of extents
  carved from one segment. The core keeps those keys as runs, pairs of (segment id,
  offsets), all OK with one replica of ``run_size_bytes`` each, and makes no ``Extent`` or
  tuple per key: the columns encoder reads the offsets as they are and signs them a run at a
  time (``kvpool_wire.capability.run_signer``). The other keys' results (a key that exists,
  one the key-by-key loop placed) are lists between the runs: ``pieces`` holds both, in key
  order (a run is a tuple, a list of results is a list).
- Read as a sequence, it is exactly the list of (status, placements) a key-by-key answer would
  be, and compares equal to that list.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool_wire.aslist import AsList
from kvpool_wire.status import Status
from kvpool_wire.types import Extent, SegmentId

PutResult = tuple[Status, tuple[Extent, ...]]
#: Keys placed by one run: (segment id, the offset of each key's extent).
Run = tuple[SegmentId, list[int]]
#: A piece of a ``PlacedBatch``: a run, or the results of the keys between runs.
Piece = Run | list[PutResult]


class PlacedBatch(AsList[PutResult]):
    """Per key (status, placements), piece after piece (see the module rules)."""

    __slots__ = ("pieces", "run_size_bytes", "num_keys")

    def __init__(self, pieces: list[Piece], run_size_bytes: int) -> None:
        self.pieces = pieces
        self.run_size_bytes = run_size_bytes
        self.num_keys = sum(len(piece[1]) if isinstance(piece, tuple) else len(piece)
                            for piece in pieces)

    @property
    def runs(self) -> list[Run]:
        """The runs, in key order."""
        return [piece for piece in self.pieces if isinstance(piece, tuple)]

    def __len__(self) -> int:
        return self.num_keys

    def __iter__(self) -> Iterator[PutResult]:
        size = self.run_size_bytes
        for piece in self.pieces:
            if isinstance(piece, tuple):
                segment_id, offsets = piece
                for offset in offsets:
                    yield Status.OK, (Extent(segment_id, offset, size),)
            else:
                yield from piece

    def _at(self, index: int) -> PutResult:
        for piece in self.pieces:
            if isinstance(piece, tuple):
                segment_id, offsets = piece
                if index < len(offsets):
                    return Status.OK, (Extent(segment_id, offsets[index],
                                              self.run_size_bytes),)
                index -= len(offsets)
            elif index < len(piece):
                return piece[index]
            else:
                index -= len(piece)
        raise AssertionError("unreachable")

    def statuses(self) -> list[Status]:
        """Each key's status."""
        statuses: list[Status] = []
        for piece in self.pieces:
            if isinstance(piece, tuple):
                statuses += [Status.OK] * len(piece[1])
            else:
                statuses += [status for status, _ in piece]
        return statuses
