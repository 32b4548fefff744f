"""Read leases: the reads that grant them, and frees that wait for them to run out.

Rules of this file:
- Every successful read (``get_replicas``, ``exist``, the leading READY keys of
  ``query_prefix``) sets the object's lease expiry to ``max(existing, now + ttl)`` and makes it
  most recently used. A miss changes nothing.
- The bytes of an object are never freed while its lease is live: eviction skips leased
  objects, and a forced remove of a leased object hides it at once but parks its extents in
  ``DeferredFrees`` until the lease has run out (``release_due`` runs in ``put_start`` and
  ``tick``).
- The read loops are the hottest code of the master: locals are bound once, per-key work is a
  dict lookup, two comparisons and appends; results for misses are shared constants.
- A lease "lapsed" when it ran out without renewal; it is counted when next observed (the next
  grant on that object, or its removal), which costs nothing extra on the hot path.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpool_master.core.allocator import OFFSET_BITS, aligned
from kvpool_master.core.objects import ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_wire.status import Status
from kvpool_wire.types import ObjectKey, Placement, ReadResult

OK = Status.OK
NOT_FOUND = Status.NOT_FOUND
INVALID_KEY = Status.INVALID_KEY
_NOT_FOUND_RESULT = ReadResult(int(Status.NOT_FOUND))
_INVALID_KEY_RESULT = ReadResult(int(Status.INVALID_KEY))


class LeaseCounters:
    """Counters the read loops bump (read by ``stats``)."""

    __slots__ = ("leases_granted", "leases_lapsed")

    def __init__(self) -> None:
        self.leases_granted = 0
        self.leases_lapsed = 0


def _well_formed(key: object, max_key_bytes: int) -> bool:
    """True when ``key`` is a well-formed key (so a miss is NOT_FOUND, not INVALID_KEY)."""
    return type(key) is bytes and 0 < len(key) <= max_key_bytes


def get_replicas(table: ObjectTable, segments: SegmentTable, keys: Sequence[ObjectKey],
                 now: float, ttl_s: float, max_key_bytes: int,
                 counters: LeaseCounters) -> list[ReadResult]:
    """Return one ReadResult per key: OK with placements (leased), NOT_FOUND or INVALID_KEY."""
    get = table.key_to_object.get
    touch = table.key_to_object.move_to_end
    expiry_s = now + ttl_s
    restoring = segments.num_restored > 0
    results: list[ReadResult] = []
    append = results.append
    granted = lapsed = 0
    for key in keys:
        entry = get(key)
        if entry is None or entry.writer_id is not None:
            append(_NOT_FOUND_RESULT if _well_formed(key, max_key_bytes) else _INVALID_KEY_RESULT)
            continue
        placements = entry.placements
        if restoring:
            placements = mounted_placements(segments, placements)
            if not placements:
                append(_NOT_FOUND_RESULT)
                continue
        lease = entry.lease_expiry_s
        if lease < expiry_s:
            if 0.0 < lease <= now:
                lapsed += 1
            entry.lease_expiry_s = expiry_s
        touch(key)
        granted += 1
        append(ReadResult(0, entry.size_bytes, placements, entry.checksum))
    counters.leases_granted += granted
    counters.leases_lapsed += lapsed
    return results


def exist(table: ObjectTable, segments: SegmentTable, keys: Sequence[ObjectKey], now: float,
          ttl_s: float, max_key_bytes: int,
          counters: LeaseCounters) -> tuple[list[Status], list[int]]:
    """Return (statuses, sizes_bytes): OK (leased) | NOT_FOUND | INVALID_KEY, size 0 unless OK."""
    get = table.key_to_object.get
    touch = table.key_to_object.move_to_end
    expiry_s = now + ttl_s
    restoring = segments.num_restored > 0
    statuses: list[Status] = []
    sizes: list[int] = []
    status_append = statuses.append
    size_append = sizes.append
    granted = lapsed = 0
    for key in keys:
        entry = get(key)
        if (entry is None or entry.writer_id is not None
                or (restoring and not mounted_placements(segments, entry.placements))):
            status_append(NOT_FOUND if _well_formed(key, max_key_bytes) else INVALID_KEY)
            size_append(0)
            continue
        lease = entry.lease_expiry_s
        if lease < expiry_s:
            if 0.0 < lease <= now:
                lapsed += 1
            entry.lease_expiry_s = expiry_s
        touch(key)
        granted += 1
        status_append(OK)
        size_append(entry.size_bytes)
    counters.leases_granted += granted
    counters.leases_lapsed += lapsed
    return statuses, sizes


def query_prefix(table: ObjectTable, segments: SegmentTable, keys: Sequence[ObjectKey],
                 now: float, ttl_s: float, counters: LeaseCounters) -> int:
    """Return the number of leading READY keys, leasing and touching each of them."""
    get = table.key_to_object.get
    touch = table.key_to_object.move_to_end
    expiry_s = now + ttl_s
    restoring = segments.num_restored > 0
    count = lapsed = 0
    for key in keys:
        entry = get(key)
        if (entry is None or entry.writer_id is not None
                or (restoring and not mounted_placements(segments, entry.placements))):
            break
        lease = entry.lease_expiry_s
        if lease < expiry_s:
            if 0.0 < lease <= now:
                lapsed += 1
            entry.lease_expiry_s = expiry_s
        touch(key)
        count += 1
    counters.leases_granted += count
    counters.leases_lapsed += lapsed
    return count


def mounted_placements(segments: SegmentTable,
                       placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Return the placements whose segment is mounted (restored ones are not readable yet)."""
    id_to_segment = segments.id_to_segment
    return tuple(p for p in placements
                 if (state := id_to_segment.get(p.segment_id)) is not None and state.mounted)


class DeferredFrees:
    """Extents freed only once a time has passed: those of force-removed objects whose read
    lease was still live (until the lease ends), and after a restore the free space of restored
    segments (until write capabilities of the previous master have run out).

    An extent stays held across an unmount and a later mount under the same segment id (the
    memory may be the same): ``adopt`` moves it onto the new segment, which must reserve it.
    """

    def __init__(self) -> None:
        # (until_s, tie-breaker, segment, offset, size_bytes, number of the free that parked it)
        self._heap: list[tuple[float, int, SegmentState, int, int, int]] = []
        self._tie = 0  # SegmentState does not order
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, until_s: float, state: SegmentState, offset: int, size_bytes: int,
            seq: int) -> None:
        """Free ``(offset, size_bytes)`` of ``state`` once ``until_s`` has passed."""
        self._tie += 1
        heapq.heappush(self._heap, (until_s, self._tie, state, offset, size_bytes, seq))
        self.num_bytes += size_bytes

    def release_due(self, segments: SegmentTable, now: float) -> int:
        """Free every parked extent whose time ended at or before ``now``; return how many."""
        heap = self._heap
        released = 0
        while heap and heap[0][0] <= now:
            _, _, state, offset, size_bytes, seq = heapq.heappop(heap)
            self.num_bytes -= size_bytes
            segments.free_on(state, offset, size_bytes, seq)
            released += 1
        return released

    def adopt(self, state: SegmentState) -> list[int]:
        """Move the extents still held on earlier segments with the id of ``state`` (a fresh
        mount) onto it; return them as ``offset << OFFSET_BITS | aligned size`` for its
        allocator to reserve. Extents beyond its size are dropped (they are not in it)."""
        segment_id = state.info.segment_id
        limit = state.allocator.size_bytes
        if not any(item[2] is not state and item[2].info.segment_id == segment_id
                   for item in self._heap):
            return []
        packed: list[int] = []
        kept: list[tuple[float, int, SegmentState, int, int, int]] = []
        for item in self._heap:
            until_s, tie, old, offset, size_bytes, seq = item
            if old is state or old.info.segment_id != segment_id:
                kept.append(item)
                continue
            self.num_bytes -= size_bytes
            if offset >= limit:
                continue
            size_bytes = min(size_bytes, limit - offset)
            self.num_bytes += size_bytes
            packed.append(offset << OFFSET_BITS | aligned(size_bytes))
            kept.append((until_s, tie, state, offset, size_bytes, seq))
        heapq.heapify(kept)
        self._heap = kept
        return packed

    def extents(self) -> list[tuple[str, int, int]]:
        """Return (segment id, offset, size_bytes) of every held extent (for checks)."""
        return [(item[2].info.segment_id, item[3], item[4]) for item in self._heap]
