"""Segments: the memory clients contribute, one allocator each, and where replicas go.

Rules of this file:
- A segment is *mounted* (usable, counted in its tier's capacity) or *restored* (known from a
  persisted index, waiting for its owner to mount it again before a deadline). Restored
  segments hold their objects' extents but serve no reads and take no new allocations.
- All allocation and freeing goes through ``SegmentTable`` so per-tier used bytes stay exact
  without summing over segments on the hot path.
- Durability of frees (``track_durability``): every free is numbered (``free_seq``) and each
  segment remembers the number of its latest free (``freed_seq``; a segment mounted again under
  the id of one lost before inherits the number of that loss). An allocation on a segment whose
  latest free is newer than ``durable_seq`` sets ``needs_sync``: the placement may reuse bytes
  whose freeing record is not on disk yet, so the answer must wait for a sync.
- Placement: the preferred segment first, then (``prefer_same_host``) segments on the writer's
  host, then the rest; within each group most free bytes first, which spreads a stream of puts
  evenly. Replicas of one object always sit on distinct segments. Puts land in DRAM only: SSD
  space is handed out by the tiering code (``allocate_on``), for copies its owner makes.
- The order "DRAM first, most free bytes first" is an index (``_by_free``, a heap of
  ``(tier, -free bytes, mount number, push number, segment)``), so a put costs O(log segments)
  and not a scan of every segment. Each segment has one current entry (``index_no``, its push
  number); every free, mount and handing-out pushes a new current entry, and older ones are
  dropped when popped, unused. An allocation made off the index (a preferred or same-host put)
  leaves the current entry too high: found when popped, it is pushed again with the true value.
  Each entry is popped at most once, so a put costs O(log segments) amortised however many
  frees came before it. The heap is rebuilt when stale entries outnumber the segments.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Iterable

from kvpool_master.core.allocator import (
    ALIGN_BYTES,
    MAX_SEGMENT_BYTES,
    OFFSET_BITS,
    Allocator,
    aligned,
)
from kvpool_wire.types import ClientId, Extent, SegmentId, SegmentInfo, Tier

#: Longest segment id accepted (segment ids travel in every placement).
MAX_SEGMENT_ID_BYTES = 256


class SegmentState:
    """One segment: its descriptor, its allocator and whether it is mounted.

    The objects on a segment are not listed per segment: losing one finds them by walking the
    object table (``sweeps.py``), which costs no memory per object and nothing per put.
    ``sweep_shards_left`` counts the table shards that walk has still to visit for this segment
    once it is lost (0 while it is not).
    """

    __slots__ = ("info", "allocator", "mounted", "restore_deadline_s", "freed_seq",
                 "mount_no", "index_no", "sweep_shards_left")

    def __init__(self, info: SegmentInfo, allocator: Allocator, mounted: bool,
                 restore_deadline_s: float = 0.0) -> None:
        self.info = info
        self.allocator = allocator
        self.mounted = mounted
        self.restore_deadline_s = restore_deadline_s
        self.freed_seq = 0  # number of the latest free on this segment (SegmentTable.free_seq)
        self.mount_no = 0  # order of its latest mount (placement ties go to the earlier)
        self.index_no = 0  # push number of its current placement-index entry
        self.sweep_shards_left = 0


def segment_info_error(info: SegmentInfo) -> str:
    """Return why ``info`` cannot be mounted, or "" when it is well formed."""
    if not isinstance(info.segment_id, str) or not 0 < len(info.segment_id) <= MAX_SEGMENT_ID_BYTES:
        return "segment_id must be a non-empty string of at most 256 characters"
    if not isinstance(info.client_id, str) or not info.client_id:
        return "client_id must be a non-empty string"
    if (not isinstance(info.size_bytes, int) or isinstance(info.size_bytes, bool)
            or not 0 < info.size_bytes <= MAX_SEGMENT_BYTES):
        return f"size_bytes must be in (0, 2**46], got {info.size_bytes!r}"
    if not isinstance(info.tier, Tier):
        return f"unknown tier {info.tier!r}"
    return engine_error(info)


def engine_error(info: SegmentInfo) -> str:
    """Why the engine fields of ``info`` are malformed, or "": none at all, or a
    ``"host:port"`` session with a base address that leaves room for the whole segment."""
    base = info.engine_base_address
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        return f"engine_base_address must be an unsigned integer, got {base!r}"
    if not info.engine_endpoint:
        return "" if base == 0 else "engine_base_address given without engine_endpoint"
    host, _, port = info.engine_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"engine_endpoint must be 'host:port', got {info.engine_endpoint!r}"
    if base == 0 or base + info.size_bytes > 1 << 64:
        return f"engine_base_address 0x{base:x} cannot hold {info.size_bytes} bytes"
    return ""


class SegmentTable:
    """Every known segment, per-tier capacity and usage, and replica placement."""

    def __init__(self) -> None:
        self.id_to_segment: dict[SegmentId, SegmentState] = {}
        self.mounted: list[SegmentState] = []  # mount order: ties in placement go to the first
        self.tier_to_capacity_bytes: dict[Tier, int] = {tier: 0 for tier in Tier}
        self.tier_to_used_bytes: dict[Tier, int] = {tier: 0 for tier in Tier}
        self.num_restored = 0  # restored segments still waiting for their owner
        # Segments discarded whose objects are still being swept (see mutations.py, "Losing
        # a segment"); a segment id is never mounted again while it is here.
        self.dying: dict[SegmentId, SegmentState] = {}
        self.client_to_num_segments: dict[ClientId, int] = {}  # mounted or restored
        # Durability of frees (see the module rules). Untracked: nothing is ever newer.
        self.free_seq = 0
        self.durable_seq = _UNTRACKED
        self.needs_sync = False
        self.lost_seq: dict[SegmentId, int] = {}  # segments lost at a free not yet durable
        self._by_free: list[tuple[int, int, int, int, SegmentState]] = []  # see module rules
        self._num_mounts = 0
        self._num_pushes = 0
        self._largest_bytes = -1  # largest mounted segment, -1: not known (see its method)
        self._num_dram = -1  # mounted DRAM segments, -1: not known

    @property
    def filtering(self) -> bool:
        """Whether some placements in the object table name segments that serve no reads
        (restored and not mounted again, or lost and not swept yet): reads filter them."""
        return self.num_restored > 0 or bool(self.dying)

    def track_durability(self) -> None:
        """From now on, frees count as durable only once ``mark_durable`` says so."""
        self.durable_seq = self.free_seq

    def next_free_seq(self) -> int:
        """Number the next free (or parking of extents) and return its number."""
        self.free_seq += 1
        return self.free_seq

    def mark_durable(self, seq: int) -> None:
        """Every free numbered ``seq`` or lower is durable (its record is on disk)."""
        if self.durable_seq == _UNTRACKED or seq <= self.durable_seq:
            return
        self.durable_seq = seq
        if self.lost_seq:
            self.lost_seq = {s: n for s, n in self.lost_seq.items() if n > seq}

    def get(self, segment_id: SegmentId) -> SegmentState | None:
        """Return the segment (mounted or restored) with this id, or None."""
        return self.id_to_segment.get(segment_id)

    def owned_by(self, client_id: ClientId) -> list[SegmentState]:
        """Return the segments (mounted or restored) whose owner is ``client_id``."""
        return [s for s in self.id_to_segment.values() if s.info.client_id == client_id]

    def add(self, state: SegmentState) -> None:
        """Track ``state`` (its id must be new); count it in its tier when mounted.

        A segment whose id was lost by a free not yet durable inherits that free's number.
        """
        segment_id = state.info.segment_id
        self.id_to_segment[segment_id] = state
        owner = state.info.client_id
        self.client_to_num_segments[owner] = self.client_to_num_segments.get(owner, 0) + 1
        if self.lost_seq:
            state.freed_seq = max(state.freed_seq, self.lost_seq.get(segment_id, 0))
        if state.mounted:
            self._count(state, +1)
        else:
            self.num_restored += 1

    def mark_mounted(self, state: SegmentState) -> None:
        """Turn a restored segment into a mounted one, keeping its allocator."""
        if not state.mounted:
            state.mounted = True
            self.num_restored -= 1
            self._count(state, +1)

    def discard(self, state: SegmentState) -> None:
        """Forget ``state``; its allocator and every extent in it are gone."""
        del self.id_to_segment[state.info.segment_id]
        owner = state.info.client_id
        left = self.client_to_num_segments.pop(owner, 1) - 1
        if left:
            self.client_to_num_segments[owner] = left
        if self.durable_seq != _UNTRACKED:
            self.lost_seq[state.info.segment_id] = self.next_free_seq()
        if state.mounted:
            self._count(state, -1)
        else:
            self.num_restored -= 1
        state.mounted = False

    def allocate(self, size_bytes: int, replica_num: int, preferred_segment: str,
                 same_host_id: str) -> tuple[Extent, ...] | None:
        """Return ``replica_num`` placements on distinct mounted segments, or None if none fit.

        Nothing is allocated when None is returned.
        """
        if replica_num == 1 and preferred_segment:  # the common pinned put: no generator
            preferred = self.id_to_segment.get(SegmentId(preferred_segment))
            if preferred is not None and preferred.mounted and preferred.info.tier == Tier.DRAM:
                placement = self._allocate_on(preferred, size_bytes)
                if placement is not None:
                    return (placement,)
        if replica_num == 1 and not same_host_id:  # the common put: the emptiest segment
            placement = self._allocate_best(size_bytes)
            if placement is not None:
                return (placement,)
        placements: list[Extent] = []
        candidates = self._candidates(replica_num, preferred_segment, same_host_id)
        try:
            for state in candidates:
                placement = self._allocate_on(state, size_bytes)
                if placement is None:
                    continue
                placements.append(placement)
                if len(placements) == replica_num:
                    return tuple(placements)
        finally:
            candidates.close()  # the segments it handed out go back into the index now
        self.free(placements, seq=-1)  # never handed out: not a free anyone must wait for
        return None

    def _allocate_best(self, size_bytes: int) -> Extent | None:
        """One extent on the DRAM segment with the most free bytes, straight off the index
        (no generator: this is every plain put's path), or None when that one cannot hold it
        (the caller then tries every segment in order)."""
        state = self._best()
        if state is None:
            return None
        placement = self._allocate_on(state, size_bytes)
        if placement is not None:
            self._index(state)
        return placement

    def allocate_run(self, size_bytes: int, count: int) -> tuple[SegmentState, list[int]] | None:
        """Up to ``count`` extents of ``size_bytes`` on the DRAM segment with the most free
        bytes (``Allocator.allocate_run``): (segment, their offsets), or None when that
        segment cannot hold one."""
        state = self._best()
        if state is None:
            return None
        offsets = state.allocator.allocate_run(size_bytes, count)
        if not offsets:
            return None
        self._taken(state, aligned(size_bytes) * len(offsets))
        self._index(state)
        return state, offsets

    def _best(self) -> SegmentState | None:
        """The DRAM segment at the top of the index, its entry there current (superseded
        entries dropped, values changed off the index pushed again), or None when the index
        holds no DRAM segment (DRAM sorts first: what follows is SSD, which takes no puts)."""
        heap = self._by_free
        while heap:
            tier, negative_free, mount_no, push_no, state = heap[0]
            if tier != Tier.DRAM:
                return None
            if push_no != state.index_no or not state.mounted or mount_no != state.mount_no:
                heapq.heappop(heap)  # superseded, unmounted or remounted since
            elif state.allocator.free_bytes != -negative_free:
                self._index(state)  # allocated from off the index: its true value
                heap = self._by_free
            else:
                return state
        return None

    def has_tier(self, placements: tuple[Extent, ...], tier: Tier) -> bool:
        """True when one of ``placements`` is on a known segment of ``tier``."""
        get = self.id_to_segment.get
        return any((state := get(p.segment_id)) is not None and state.info.tier == tier
                   for p in placements)

    def allocate_on(self, state: SegmentState, size_bytes: int) -> Extent | None:
        """One extent of ``size_bytes`` on the mounted segment ``state``, or None."""
        return self._allocate_on(state, size_bytes) if state.mounted else None

    def _allocate_on(self, state: SegmentState, size_bytes: int) -> Extent | None:
        """One extent of ``size_bytes`` on ``state`` (counted as used), or None if none fits."""
        offset = state.allocator.allocate(size_bytes)
        if offset < 0:
            return None
        self._taken(state, aligned(size_bytes))
        return Extent(state.info.segment_id, offset, size_bytes)

    def _taken(self, state: SegmentState, num_bytes: int) -> None:
        """``num_bytes`` of ``state`` were just allocated: count them; a put that may reuse
        a free not yet durable must sync first (see the module rules)."""
        self.tier_to_used_bytes[state.info.tier] += num_bytes
        if state.freed_seq > self.durable_seq:
            self.needs_sync = True

    def free(self, placements: Iterable[Extent], seq: int = 0) -> None:
        """Free the extents of ``placements`` that sit on segments still known, as free number
        ``seq`` (a new number when 0; -1 to undo allocations of the same call).

        Extents are grouped per segment and freed in one ``Allocator.free_many`` call each.
        """
        if not seq:
            seq = self.next_free_seq()
        id_to_segment = self.id_to_segment
        mask = ALIGN_BYTES - 1
        # None for a segment that is gone: its extents went with it.
        segment_to_packed: dict[SegmentId, list[int] | None] = {}
        for placement in placements:
            segment_id = placement.segment_id
            packed = segment_to_packed.get(segment_id, _UNSEEN)
            if packed is _UNSEEN:
                packed = [] if segment_id in id_to_segment else None
                segment_to_packed[segment_id] = packed
            if packed is not None:
                packed.append(placement.offset << OFFSET_BITS | ((placement.length + mask) & ~mask))
        for segment_id, packed in segment_to_packed.items():
            if packed:
                self.free_packed_on(id_to_segment[segment_id], packed, seq)

    def free_packed_on(self, state: SegmentState, packed: list[int], seq: int) -> None:
        """Free extents of ``state`` (known) given as ``offset << OFFSET_BITS | aligned size``
        (``Allocator.free_packed``), as free number ``seq``."""
        allocator = state.allocator
        before = allocator.used_bytes
        allocator.free_packed(packed)
        if seq > state.freed_seq:
            state.freed_seq = seq
        if state.mounted:
            self.tier_to_used_bytes[state.info.tier] -= before - allocator.used_bytes
            self._index(state)

    def free_on(self, state: SegmentState, offset: int, size_bytes: int, seq: int) -> None:
        """Free one extent of ``state`` parked by free number ``seq`` (no-op when the segment
        has been discarded since)."""
        if self.id_to_segment.get(state.info.segment_id) is not state:
            return
        state.allocator.free(offset, size_bytes)
        if seq > state.freed_seq:
            state.freed_seq = seq
        if state.mounted:
            self.tier_to_used_bytes[state.info.tier] -= aligned(size_bytes)
            self._index(state)

    def largest_segment_bytes(self) -> int:
        """Return the size of the largest mounted segment (0 when none; kept since the last
        mount or unmount, so a put does not scan the segments)."""
        largest = self._largest_bytes
        if largest < 0:
            largest = self._largest_bytes = max((s.allocator.size_bytes for s in self.mounted
                                                 if s.info.tier == Tier.DRAM), default=0)
        return largest

    def num_dram_segments(self) -> int:
        """How many mounted segments take puts (kept like ``largest_segment_bytes``)."""
        count = self._num_dram
        if count < 0:
            count = self._num_dram = sum(1 for s in self.mounted if s.info.tier == Tier.DRAM)
        return count

    def _count(self, state: SegmentState, sign: int) -> None:
        tier = state.info.tier
        self.tier_to_capacity_bytes[tier] += sign * state.allocator.size_bytes
        self.tier_to_used_bytes[tier] += sign * state.allocator.used_bytes
        self._largest_bytes = self._num_dram = -1  # recomputed at the next put
        if sign > 0:
            self.mounted.append(state)
            self._num_mounts += 1
            state.mount_no = self._num_mounts
            self._index(state)
        else:
            self.mounted.remove(state)

    def _index(self, state: SegmentState) -> None:
        """Push ``state``'s current free bytes into the placement index as its current entry."""
        heap = self._by_free
        if len(heap) > 2 * len(self.mounted) + 64:
            self._by_free = heap = []
            for mounted in self.mounted:
                self._num_pushes += 1
                mounted.index_no = self._num_pushes
                heap.append((int(mounted.info.tier), -mounted.allocator.free_bytes,
                             mounted.mount_no, self._num_pushes, mounted))
            heapq.heapify(heap)
            if state.mounted:
                return  # the rebuild holds it
        self._num_pushes += 1
        state.index_no = self._num_pushes
        heapq.heappush(heap, (int(state.info.tier), -state.allocator.free_bytes, state.mount_no,
                              self._num_pushes, state))

    def _by_rank(self) -> Generator[SegmentState, None, None]:
        """Mounted DRAM segments, most free bytes first, each once (ties: the earlier
        mounted). Segments handed out are indexed again when the iteration ends."""
        handed: list[SegmentState] = []
        seen: set[int] = set()
        try:
            while (state := self._best()) is not None:
                heapq.heappop(self._by_free)  # its current entry: handed out
                if id(state) in seen:
                    continue  # indexed again since it was handed out
                seen.add(id(state))
                handed.append(state)
                yield state
        finally:
            for state in handed:
                if state.mounted:
                    self._index(state)

    def _candidates(self, replica_num: int, preferred_segment: str,
                    same_host_id: str) -> Generator[SegmentState, None, None]:
        seen: set[str] = set()
        preferred = self.id_to_segment.get(SegmentId(preferred_segment))
        if preferred is not None and preferred.mounted and preferred.info.tier == Tier.DRAM:
            seen.add(preferred_segment)
            yield preferred
        if same_host_id:
            by_rank = sorted((s for s in self.mounted if s.info.tier == Tier.DRAM),
                             key=_placement_rank, reverse=True)
            for state in by_rank:
                if state.info.host_id == same_host_id and state.info.segment_id not in seen:
                    seen.add(state.info.segment_id)
                    yield state
            for state in by_rank:
                if state.info.segment_id not in seen:
                    seen.add(state.info.segment_id)
                    yield state
            return
        ranked = self._by_rank()
        try:
            for state in ranked:
                if state.info.segment_id not in seen:
                    seen.add(state.info.segment_id)
                    yield state
        finally:
            ranked.close()


_UNSEEN: list[int] = []
_UNTRACKED = 1 << 62  # durable_seq while durability is not tracked: above every free number


def _placement_rank(state: SegmentState) -> tuple[int, int]:
    return (-int(state.info.tier), state.allocator.free_bytes)
