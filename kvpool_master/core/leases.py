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
- Two things a lease does: the object answers HAS_LEASE to a plain remove and is not evicted
  until ``lease_expiry_s`` (Mooncake's lease, which runs its time), and its bytes are not
  reused while a reader may still copy them. The second is what readers can end early. A reader
  that proved its identity (``reader``) gets numbered leases (``lease_id``, one per
  ``get_replicas`` call; ``OpenLeases`` remembers the keys each covered until it ends or runs
  out), recorded per object as that reader's hold in ``entry.holds``: (the first lease of the
  hold, its expiry, how many of the reader's leases on it are still open). ``end_lease``
  takes one lease's share off each object it covered, once, whatever order the reader's
  leases end in: two threads of one client reading one object each keep it held until both
  ended. A hold that ran out starts afresh at the reader's next lease; an end of a lease from
  before that is ignored. A force-removed object whose holds all ended frees its bytes at
  once instead of after ``lease_expiry_s``. Leases nobody
  can end (``exist``, ``query_prefix``, reads of anonymous callers) protect the bytes for their
  time: on an object with holds they are the hold of ``""``, which no reader can name. Holds
  are None while only such leases were taken; ``NO_HOLDS`` (shared, never mutated) once every
  hold ended.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpool_master.core.allocator import OFFSET_BITS, aligned
from kvpool_master.core.objects import SHARD_MASK, ObjectEntry, ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_wire.readcolumns import ReadColumns
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, Extent, ObjectKey

OK = Status.OK
NOT_FOUND = Status.NOT_FOUND
INVALID_KEY = Status.INVALID_KEY
#: ``entry.holds`` once every hold on it ended: its bytes are protected by nothing (shared).
NO_HOLDS: dict[str, tuple[int, float, int]] = {}
_OK, _NOT_FOUND, _INVALID_KEY = int(Status.OK), int(Status.NOT_FOUND), int(Status.INVALID_KEY)


class LeaseCounters:
    """Counters the read loops bump (read by ``stats``)."""

    __slots__ = ("leases_granted", "leases_lapsed", "leases_ended")

    def __init__(self) -> None:
        self.leases_granted = 0
        self.leases_lapsed = 0
        self.leases_ended = 0


def _well_formed(key: object, max_key_bytes: int) -> bool:
    """True when ``key`` is a well-formed key (so a miss is NOT_FOUND, not INVALID_KEY)."""
    return type(key) is bytes and 0 < len(key) <= max_key_bytes


class OpenLeases:
    """The numbered leases of proven readers not ended yet: by lease id, the reader, the keys
    it covered and its expiry. Ids grow and every lease runs the same time, so the oldest is
    first: ``expire`` (at every tick) drops those that ran out from the front. Readers end
    theirs as they finish, so what is left between ticks is the leases of crashed readers."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[ClientId, list[ObjectKey], float]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, lease_id: int, reader: ClientId, keys: list[ObjectKey],
            expiry_s: float) -> None:
        """Open ``reader``'s lease ``lease_id`` over ``keys``, or add them to it when it is
        open (a later step of the same call: it keeps its place, its expiry moves on)."""
        lease = self._by_id.get(lease_id)
        if lease is not None and lease[0] == reader:
            lease[1].extend(keys)
            keys = lease[1]
        self._by_id[lease_id] = (reader, keys, expiry_s)

    def take(self, lease_id: int, reader: ClientId) -> list[ObjectKey] | None:
        """The keys of ``reader``'s open lease ``lease_id``, which ends now (None: not open, or
        another reader's)."""
        lease = self._by_id.get(lease_id)
        if lease is None or lease[0] != reader:
            return None
        del self._by_id[lease_id]
        return lease[1]

    def expire(self, now: float) -> None:
        """Forget the leases that ran out (their holds ran out with them)."""
        by_id = self._by_id
        while by_id:
            lease_id = next(iter(by_id))
            if by_id[lease_id][2] > now:
                return
            del by_id[lease_id]


def get_replicas(table: ObjectTable, segments: SegmentTable, keys: Sequence[ObjectKey],
                 now: float, ttl_s: float, max_key_bytes: int, counters: LeaseCounters,
                 reader: ClientId | None = None, lease_id: int = 0,
                 covered: list[ObjectKey] | None = None) -> ReadColumns:
    """Return one ReadResult per key, as ``ReadColumns``: OK with placements (leased),
    NOT_FOUND or INVALID_KEY. With ``reader``, each lease is a share of that reader's hold
    under ``lease_id``, which it may end; the keys granted are appended to ``covered``."""
    shards = table.shards
    mask = SHARD_MASK
    touched: list[ObjectEntry] = []
    touch = touched.append
    expiry_s = now + ttl_s
    hold = (lease_id, expiry_s, 1)
    restoring = segments.filtering
    results = ReadColumns()
    refuse = results.refuse
    statuses, sizes, checksums = results.statuses, results.sizes_bytes, results.checksums
    segment_ids, offsets, more = results.segment_ids, results.offsets, results.more
    lapsed = 0
    for key in keys:
        entry = shards[hash(key) & mask].get(key)
        if entry is None or entry.writer_id is not None:
            refuse(_NOT_FOUND if _well_formed(key, max_key_bytes) else _INVALID_KEY)
            continue
        if restoring or entry.more:
            placements = mounted_placements(segments, entry.extents()) if restoring \
                else entry.extents()
            if not placements:
                refuse(_NOT_FOUND)
                continue
            more[len(statuses)] = placements
            segment_ids.append(placements[0].segment_id)
            offsets.append(placements[0].offset)
        else:
            segment_ids.append(entry.segment_id)
            offsets.append(entry.offset)
        lease = entry.lease_expiry_s
        if lease < expiry_s:
            if 0.0 < lease <= now:
                lapsed += 1
            entry.lease_expiry_s = expiry_s
        holds = entry.holds
        if reader is not None:
            if lease <= now or holds is NO_HOLDS:  # nothing else protects the bytes
                entry.holds = {reader: hold}
            elif holds is None:  # the live lease so far is one nobody can end
                entry.holds = {"": (0, lease, 0), reader: hold}
            else:
                mine = holds.get(reader)
                holds[reader] = hold if mine is None or mine[1] <= now else \
                    (mine[0], expiry_s, mine[2] + 1)
            covered.append(key)  # type: ignore[union-attr]
        elif holds is not None:
            add_timed(entry, holds, hold)
        touch(entry)
        statuses.append(_OK)
        sizes.append(entry.size_bytes)
        checksums.append(entry.checksum)
    table.touch_all(touched)
    counters.leases_granted += len(touched)
    counters.leases_lapsed += lapsed
    return results


def exist(table: ObjectTable, segments: SegmentTable, keys: Sequence[ObjectKey], now: float,
          ttl_s: float, max_key_bytes: int,
          counters: LeaseCounters) -> tuple[list[Status], list[int]]:
    """Return (statuses, sizes_bytes): OK (leased) | NOT_FOUND | INVALID_KEY, size 0 unless OK."""
    shards = table.shards
    mask = SHARD_MASK
    touched: list[ObjectEntry] = []
    touch = touched.append
    expiry_s = now + ttl_s
    timed = (0, expiry_s, 0)
    restoring = segments.filtering
    statuses: list[Status] = []
    sizes: list[int] = []
    status_append = statuses.append
    size_append = sizes.append
    lapsed = 0
    for key in keys:
        entry = shards[hash(key) & mask].get(key)
        if (entry is None or entry.writer_id is not None
                or (restoring and not mounted_placements(segments, entry.extents()))):
            status_append(NOT_FOUND if _well_formed(key, max_key_bytes) else INVALID_KEY)
            size_append(0)
            continue
        lease = entry.lease_expiry_s
        if lease < expiry_s:
            if 0.0 < lease <= now:
                lapsed += 1
            entry.lease_expiry_s = expiry_s
        if entry.holds is not None:
            add_timed(entry, entry.holds, timed)
        touch(entry)
        status_append(OK)
        size_append(entry.size_bytes)
    table.touch_all(touched)
    counters.leases_granted += len(touched)
    counters.leases_lapsed += lapsed
    return statuses, sizes


def query_prefix(table: ObjectTable, segments: SegmentTable, keys: Sequence[ObjectKey],
                 now: float, ttl_s: float, counters: LeaseCounters) -> int:
    """Return the number of leading READY keys, leasing and touching each of them."""
    shards = table.shards
    mask = SHARD_MASK
    touched: list[ObjectEntry] = []
    touch = touched.append
    expiry_s = now + ttl_s
    timed = (0, expiry_s, 0)
    restoring = segments.filtering
    lapsed = 0
    for key in keys:
        entry = shards[hash(key) & mask].get(key)
        if (entry is None or entry.writer_id is not None
                or (restoring and not mounted_placements(segments, entry.extents()))):
            break
        lease = entry.lease_expiry_s
        if lease < expiry_s:
            if 0.0 < lease <= now:
                lapsed += 1
            entry.lease_expiry_s = expiry_s
        if entry.holds is not None:
            add_timed(entry, entry.holds, timed)
        touch(entry)
    table.touch_all(touched)
    counters.leases_granted += len(touched)
    counters.leases_lapsed += lapsed
    return len(touched)


def add_timed(entry: ObjectEntry, holds: dict[str, tuple[int, float, int]],
              timed: tuple[int, float, int]) -> None:
    """Record a lease nobody can end on an entry that has holds."""
    if holds is NO_HOLDS:
        entry.holds = {"": timed}
    else:
        holds[""] = timed


def end_hold(entry: ObjectEntry, reader: ClientId, lease_id: int) -> bool:
    """Take lease ``lease_id``'s share off ``reader``'s hold on ``entry`` (nothing when the
    hold started after that lease: it ran out and started afresh); drop the hold when no share
    is left. True when a share was taken off."""
    holds = entry.holds
    if not holds:
        return False
    hold = holds.get(reader)
    if hold is None or hold[0] > lease_id:
        return False
    if hold[2] > 1:
        holds[reader] = (hold[0], hold[1], hold[2] - 1)
        return True
    del holds[reader]
    if not holds:
        entry.holds = NO_HOLDS
    return True


def protected_until(entry: ObjectEntry) -> float:
    """Until when a reader may still copy the entry's bytes: its holds' latest expiry when it
    has holds, else its lease."""
    holds = entry.holds
    if holds is None:
        return entry.lease_expiry_s
    return max((hold[1] for hold in holds.values()), default=0.0)


def end_leases(table: ObjectTable, parked: DeferredFrees, segments: SegmentTable,
               reader: ClientId, lease_id: int, keys: Sequence[ObjectKey], now: float,
               counters: LeaseCounters) -> None:
    """Take lease ``lease_id``'s share off ``reader``'s holds on ``keys`` (what it covered):
    on live objects, and on force-removed ones still parked (freed now when no live hold is
    left)."""
    get = table.get
    ended = 0
    for key in keys:
        entry = get(key)
        if entry is not None and entry.holds is not None:
            ended += end_hold(entry, reader, lease_id)
        if parked.has_key(key):
            ended += parked.end_holds(key, reader, lease_id, segments, now)
    counters.leases_ended += ended


def mounted_placements(segments: SegmentTable,
                       placements: tuple[Extent, ...]) -> tuple[Extent, ...]:
    """Return the placements whose segment is mounted (restored ones are not readable yet,
    lost ones not any more)."""
    id_to_segment = segments.id_to_segment
    return tuple(p for p in placements
                 if (state := id_to_segment.get(p.segment_id)) is not None and state.mounted)


#: A parked extent: (until_s, tie-breaker, segment, offset, size_bytes, number of its free).
Parked = tuple[float, int, SegmentState, int, int, int]


class DeferredFrees:
    """Extents freed only once a time has passed: those of force-removed objects whose read
    lease was still live (until the lease ends), and after a restore the free space of restored
    segments (until write capabilities of the previous master have run out).

    An extent stays held across an unmount and a later mount under the same segment id (the
    memory may be the same): ``adopt`` moves it onto the new segment, which must reserve it.
    """

    def __init__(self) -> None:
        self._heap: list[Parked] = []
        self._tie = 0  # SegmentState does not order
        self.num_bytes = 0
        # Extents of objects whose readers can end their holds early: by key, the removed
        # entries (their ``holds``) and the ties of their extents; by tie, the extent and key.
        self._by_key: dict[ObjectKey, list[tuple[ObjectEntry, list[int]]]] = {}
        self._watched: dict[int, tuple[Parked, ObjectKey]] = {}
        self._freed_early: set[int] = set()  # still in the heap, already freed

    def __len__(self) -> int:
        return len(self._heap) - len(self._freed_early)

    def add(self, until_s: float, state: SegmentState, offset: int, size_bytes: int,
            seq: int) -> Parked:
        """Free ``(offset, size_bytes)`` of ``state`` once ``until_s`` has passed; returns the
        parked extent (for ``watch``)."""
        self._tie += 1
        item = (until_s, self._tie, state, offset, size_bytes, seq)
        heapq.heappush(self._heap, item)
        self.num_bytes += size_bytes
        return item

    def watch(self, key: ObjectKey, entry: ObjectEntry, items: list[Parked]) -> None:
        """Free the parked extents ``items`` of the removed ``entry`` early, once its readers
        ended every hold (``end_holds``)."""
        if not items:
            return
        for item in items:
            self._watched[item[1]] = (item, key)
        self._by_key.setdefault(key, []).append((entry, [item[1] for item in items]))

    def has_key(self, key: ObjectKey) -> bool:
        """True when extents of a removed object of ``key`` wait for holds to end."""
        return key in self._by_key

    def end_holds(self, key: ObjectKey, reader: ClientId, lease_id: int,
                  segments: SegmentTable, now: float) -> int:
        """End ``reader``'s holds (lease ``lease_id`` or earlier) on removed objects of
        ``key``; free the extents of each whose holds all ended. Returns holds ended."""
        ended = 0
        watched = self._by_key[key]
        for entry, ties in list(watched):
            if not end_hold(entry, reader, lease_id):
                continue
            ended += 1
            if protected_until(entry) > now:
                continue
            watched.remove((entry, ties))
            for tie in ties:
                watched_item = self._watched.pop(tie, None)
                if watched_item is None:
                    continue
                _, _, state, offset, size_bytes, seq = watched_item[0]
                self._freed_early.add(tie)
                self.num_bytes -= size_bytes
                segments.free_on(state, offset, size_bytes, seq)
        if not watched:
            del self._by_key[key]
        return ended

    def release_due(self, segments: SegmentTable, now: float) -> int:
        """Free every parked extent whose time ended at or before ``now``; return how many."""
        heap = self._heap
        released = 0
        while heap and heap[0][0] <= now:
            _, tie, state, offset, size_bytes, seq = heapq.heappop(heap)
            if self._freed_early and tie in self._freed_early:
                self._freed_early.discard(tie)
                continue
            if self._watched:
                self._forget(tie)
            self.num_bytes -= size_bytes
            segments.free_on(state, offset, size_bytes, seq)
            released += 1
        return released

    def _forget(self, tie: int) -> None:
        """Stop watching extent ``tie`` (freed by time)."""
        watched_item = self._watched.pop(tie, None)
        if watched_item is None:
            return
        key = watched_item[1]
        watched = self._by_key.get(key, [])
        for record in watched:
            if tie in record[1]:
                record[1].remove(tie)
                if not record[1]:
                    watched.remove(record)
                break
        if not watched:
            self._by_key.pop(key, None)

    def adopt(self, state: SegmentState) -> list[int]:
        """Move the extents still held on earlier segments with the id of ``state`` (a fresh
        mount) onto it; return them as ``offset << OFFSET_BITS | aligned size`` for its
        allocator to reserve. Extents beyond what its allocator covers are dropped (they are not
        in it)."""
        segment_id = state.info.segment_id
        first, limit = state.allocator.start_bytes, state.allocator.end_bytes
        if not any(item[2] is not state and item[2].info.segment_id == segment_id
                   for item in self._heap):
            return []
        packed: list[int] = []
        kept: list[Parked] = []
        for item in self._heap:
            until_s, tie, old, offset, size_bytes, seq = item
            if tie in self._freed_early:
                self._freed_early.discard(tie)
                continue
            if old is state or old.info.segment_id != segment_id:
                kept.append(item)
                continue
            self.num_bytes -= size_bytes
            if offset >= limit or offset + size_bytes <= first:
                self._forget(tie)
                continue
            if offset < first:  # (a partition's share of a segment mounted with a new size)
                size_bytes -= first - offset
                offset = first
            size_bytes = min(size_bytes, limit - offset)
            self.num_bytes += size_bytes
            packed.append(offset << OFFSET_BITS | aligned(size_bytes))
            moved = (until_s, tie, state, offset, size_bytes, seq)
            if tie in self._watched:
                self._watched[tie] = (moved, self._watched[tie][1])
            kept.append(moved)
        heapq.heapify(kept)
        self._heap = kept
        return packed

    def extents(self) -> list[tuple[str, int, int]]:
        """Return (segment id, offset, size_bytes) of every held extent (for checks)."""
        return [(item[2].info.segment_id, item[3], item[4]) for item in self._heap
                if item[1] not in self._freed_early]
