"""What every transport promises, and the checks every transport makes before moving a byte.

A transfer moves one object between the caller's regions and one placement (segment, offset,
length). The object is the concatenation of its regions, in order, so their total size must be
exactly the placement's length. Single-item forms raise KVPoolError; batch forms return one
Status per item and never raise for a bad item.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentInfo

Regions = Sequence[memoryview]  # an object is the concatenation of its regions, in order
Item = tuple[SegmentInfo, Placement, Regions]


@runtime_checkable
class Transport(Protocol):
    """A one-sided way of reaching a peer's segment."""

    async def write(self, segment: SegmentInfo, placement: Placement, src: Regions) -> None:
        """Copy ``src`` into the placement. Raises KVPoolError."""
        ...

    async def read(self, segment: SegmentInfo, placement: Placement, dst: Regions) -> None:
        """Copy the placement into ``dst``. Raises KVPoolError."""
        ...

    async def write_batch(self, items: Sequence[Item]) -> list[Status]:
        """Write every item; one Status per item."""
        ...

    async def read_batch(self, items: Sequence[Item]) -> list[Status]:
        """Read every item; one Status per item."""
        ...

    async def close(self) -> None:
        """Release connections, mappings and threads (idempotent)."""
        ...


def byte_views(regions: Regions, *, writable: bool) -> list[memoryview]:
    """Return ``regions`` as flat unsigned-byte views (no copy).

    Raises KVPoolError INVALID_ARGUMENT when a region is not a C-contiguous buffer, or is
    read-only where it will be written into.
    """
    views: list[memoryview] = []
    for region in regions:
        if type(region) is memoryview and region.format == "B" and region.ndim == 1 \
                and region.c_contiguous and not (writable and region.readonly):
            views.append(region)  # the common case, checked in one go
            continue
        try:
            view = region if isinstance(region, memoryview) else memoryview(region)
        except TypeError:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"region of type {type(region).__name__} is not a buffer") from None
        if not view.c_contiguous:
            raise KVPoolError(Status.INVALID_ARGUMENT, "regions must be C-contiguous")
        if writable and view.readonly:
            raise KVPoolError(Status.INVALID_ARGUMENT, "a read needs writable regions")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        views.append(view)
    return views


def check_item(segment: SegmentInfo, placement: Placement, views: Sequence[memoryview]) -> None:
    """Check one transfer before any byte moves.

    Raises KVPoolError INVALID_ARGUMENT when the placement names another segment, does not lie
    inside the segment, or its length differs from the regions' total size.
    """
    if placement.segment_id != segment.segment_id:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"placement on {placement.segment_id!r} given with segment "
                          f"{segment.segment_id!r}")
    check_range(placement.offset, placement.length, segment.size_bytes)
    total_bytes = views[0].nbytes if len(views) == 1 else sum(view.nbytes for view in views)
    if total_bytes != placement.length:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"regions hold {total_bytes} bytes, placement {placement.length}")


def check_range(offset: int, length: int, size_bytes: int) -> None:
    """Raise KVPoolError INVALID_ARGUMENT unless ``[offset, offset+length)`` is a non-empty
    range inside ``[0, size_bytes)``."""
    if offset < 0 or length <= 0 or offset + length > size_bytes:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"range [{offset}, {offset + length}) is outside a segment of "
                          f"{size_bytes} bytes")


def status_of(outcome: BaseException | None) -> Status:
    """Map one batch item's outcome to its Status (unexpected exceptions become
    TRANSFER_FAILED; cancellation propagates)."""
    if outcome is None:
        return Status.OK
    if isinstance(outcome, KVPoolError):
        return outcome.status
    if isinstance(outcome, Exception):
        return Status.TRANSFER_FAILED
    raise outcome
