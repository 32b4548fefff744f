"""What ``PutStart`` answers, as the master core makes it: a status and the placements of each
key, whose leading keys may be runs of plain puts kept as columns.

Rules of this file:
- A batch of plain puts (one replica, one size) is placed in runs of extents carved back to
  back from one segment. The core keeps those keys as ``runs``, pairs of (segment id, offsets),
  all OK with one replica of ``run_size_bytes`` each, and makes no ``Extent`` or tuple per key:
  the columns encoder reads the offsets as they are and signs them a run at a time
  (``kvpool_wire.capability.run_signer``). ``rest`` holds the other keys' results, after them.
- Read as a sequence, it is exactly the list of (status, placements) a key-by-key answer would
  be, and compares equal to that list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from kvpool_wire.status import Status
from kvpool_wire.types import Extent, SegmentId

PutResult = tuple[Status, tuple[Extent, ...]]


class PlacedBatch(Sequence[PutResult]):
    """Per key (status, placements): first the keys of ``runs``, then ``rest``."""

    __slots__ = ("runs", "run_size_bytes", "num_run_keys", "rest")

    def __init__(self, runs: list[tuple[SegmentId, list[int]]], run_size_bytes: int,
                 rest: list[PutResult]) -> None:
        self.runs = runs
        self.run_size_bytes = run_size_bytes
        self.num_run_keys = sum(len(offsets) for _, offsets in runs)
        self.rest = rest

    def __len__(self) -> int:
        return self.num_run_keys + len(self.rest)

    def __iter__(self) -> Iterator[PutResult]:
        size = self.run_size_bytes
        for segment_id, offsets in self.runs:
            for offset in offsets:
                yield Status.OK, (Extent(segment_id, offset, size),)
        yield from self.rest

    @overload
    def __getitem__(self, index: int) -> PutResult: ...

    @overload
    def __getitem__(self, index: slice) -> list[PutResult]: ...

    def __getitem__(self, index: int | slice) -> PutResult | list[PutResult]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("PlacedBatch index out of range")
        if index >= self.num_run_keys:
            return self.rest[index - self.num_run_keys]
        for segment_id, offsets in self.runs:
            if index < len(offsets):
                return Status.OK, (Extent(segment_id, offsets[index], self.run_size_bytes),)
            index -= len(offsets)
        raise AssertionError("unreachable")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PlacedBatch({list(self)!r})"

    def statuses(self) -> list[Status]:
        """Each key's status."""
        return [Status.OK] * self.num_run_keys + [status for status, _ in self.rest]
