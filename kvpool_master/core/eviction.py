"""Choosing eviction victims: LRU over READY, un-leased objects, soft pins last.

Rules of this file:
- Candidates are walked in the order of ``ObjectTable.recency`` (least recently used
  first). A candidate is READY, has no live lease (``lease_expiry_s <= now``) and is not
  hard-pinned; it must hold bytes on a mounted segment of the tier being relieved.
- First pass: unpinned objects only. Only if that frees too little does a second pass also take
  soft-pinned objects (in the same LRU order). Hard-pinned objects are never victims.
- ``prefix-lru``: an object that still has a cached chain successor (a READY object whose
  ``parent_key`` is this key) waits until that successor is chosen. A waiting object that
  becomes a leaf during the pass is older than every object not yet scanned, so it goes next
  (oldest first). A chain is therefore evicted tail first.
- A DRAM pass walks ``ObjectTable.dram_order`` once SSD segments exist (objects on SSD only
  are not in it); an SSD pass walks the main order and counts SSD bytes only.
- A pass takes at most ``MAX_VICTIMS`` objects and, once it has one, looks at no more than
  ``MAX_SCANNED``; the tier's next pass (the next put above the watermark, the tick, or the
  same put when it still has no room) goes on from the new least recently used.
- Selection does not mutate the table (the walk must see it whole); the
  caller removes the victims in the returned order. Hard-pinned, PENDING and leased objects
  met on the way are moved to the recent end afterwards, so later passes do not rescan them:
  a pass walks its victims and what it moves, never the same unevictable objects again and
  again. A leased object at the least recently used end was read within its lease, less
  than ``default_lease_ttl_s`` ago, so moving it costs it at most that much of its LRU age;
  it only happens when the pool turns over within a lease's time.
"""

from __future__ import annotations

import heapq

from kvpool_master.core.allocator import ALIGN_BYTES, aligned
from kvpool_master.core.objects import SHARD_MASK, ObjectEntry, ObjectTable, Recency
from kvpool_master.core.segments import SegmentTable
from kvpool_wire.types import ObjectKey, Pin, Tier

POLICIES = ("lru", "prefix-lru")
#: Most objects one pass evicts (a few ms of work, freeing scattered extents of a table of
#: millions included): a watermark pass over small objects would otherwise hold the master for
#: as long as it takes to evict a few percent of the table.
MAX_VICTIMS = 1024
#: Objects one pass looks at, victims or not, after which it is cut like one that took
#: ``MAX_VICTIMS``, once it has a victim (the unevictable ones it met are moved out of the way
#: first). A pass without a victim goes on: every cut pass frees something, so the passes a
#: put runs until it has room always end.
MAX_SCANNED = 4 * MAX_VICTIMS


class _Pass:
    """State of one selection: the victims so far and (prefix-lru) the objects waiting."""

    __slots__ = ("victims", "freed_bytes", "need_bytes", "evicted_children", "waiting", "ready",
                 "scan_index", "skipped", "max_victims", "left_to_scan")

    def __init__(self, need_bytes: int, max_victims: int) -> None:
        self.victims: dict[ObjectKey, ObjectEntry] = {}
        self.freed_bytes = 0
        self.need_bytes = need_bytes
        self.evicted_children: dict[ObjectKey, int] = {}
        self.waiting: dict[ObjectKey, tuple[int, ObjectEntry, int]] = {}
        self.ready: list[tuple[int, ObjectKey]] = []  # heap of waiting objects that became leaves
        self.scan_index = 0
        self.skipped: list[ObjectEntry] = []
        self.max_victims = max_victims
        self.left_to_scan = MAX_SCANNED

    @property
    def cut(self) -> bool:
        """Stopped after ``MAX_SCANNED`` objects, with victims."""
        return self.left_to_scan < 0 and bool(self.victims)

    @property
    def enough(self) -> bool:
        return self.freed_bytes >= self.need_bytes or len(self.victims) >= self.max_victims


def select_victims(table: ObjectTable, segments: SegmentTable, tier: Tier, need_bytes: int,
                   now: float, prefix_lru: bool,
                   max_victims: int = MAX_VICTIMS,
                   ) -> tuple[dict[ObjectKey, ObjectEntry], bool]:
    """Return the objects to evict (key -> entry), in eviction order, freeing at least
    ``need_bytes`` of ``tier``, and whether the pass was cut (``max_victims`` taken, or
    ``MAX_SCANNED`` looked at).

    Returns fewer when not enough is evictable (possibly none), and at most ``max_victims``:
    a pass never holds the master for long; the next one goes on where it stopped.
    """
    state = _Pass(need_bytes, max_victims)
    # Fast path: every mounted segment is on this tier and none is restored, so an object's
    # bytes on the tier are simply its aligned size times its number of replicas.
    simple = not segments.filtering and all(s.info.tier == tier for s in segments.mounted)
    order = table.dram_order if tier == Tier.DRAM and table.dram_order is not None \
        else table.recency
    # With SSD segments a DRAM pass is plain LRU: a child on SSD only would keep its parent
    # waiting forever.
    prefix_lru = prefix_lru and order is table.recency and not table.dram_order
    for allowed in ((Pin.NONE,), (Pin.NONE, Pin.SOFT)):
        # Each pass rescans from the oldest object, so waiting objects are found again in order.
        state.waiting.clear()
        state.ready.clear()
        _scan(table, order, segments, tier, now, prefix_lru, simple, allowed, state)
        if state.enough or state.cut:
            break
    victims = state.victims
    skipped = [entry for entry in state.skipped if entry.key not in victims]
    order.touch_all(skipped if order is table.recency
                    else [entry.dram for entry in skipped if entry.dram is not None])
    return victims, len(victims) >= max_victims or state.cut


def _scan(table: ObjectTable, order: Recency, segments: SegmentTable,
          tier: Tier, now: float, prefix_lru: bool, simple: bool, allowed: tuple[Pin, ...],
          state: _Pass) -> None:
    victims = state.victims
    counts = table.child_counts or []  # kept whenever prefix_lru is
    evicted_children = state.evicted_children
    waiting = state.waiting
    hard = Pin.HARD
    align_mask = ALIGN_BYTES - 1
    for entry in order.entries():
        state.left_to_scan -= 1
        if state.left_to_scan < 0 and victims:
            return  # cut: the next pass goes on (what was skipped moves out of its way)
        key = entry.key
        if entry.writer_id is not None or entry.pin is hard or entry.lease_expiry_s > now:
            state.skipped.append(entry)
            continue
        if entry.pin not in allowed or key in victims:
            continue
        if simple:
            num_bytes = ((entry.size_bytes + align_mask) & ~align_mask) * (1 + len(entry.more))
        else:
            num_bytes = _bytes_on_tier(segments, entry, tier)
            if not num_bytes:
                continue
        if prefix_lru:
            if counts[hash(key) & SHARD_MASK].get(key, 0) - evicted_children.get(key, 0) > 0:
                if key not in waiting:
                    waiting[key] = (state.scan_index, entry, num_bytes)
                    state.scan_index += 1
                continue
            _take(state, key, entry, num_bytes, table)
            _drain_ready(state, table)
        else:
            victims[key] = entry
            state.freed_bytes += num_bytes
        if state.enough:
            return
    _drain_ready(state, table)


def _take(state: _Pass, key: ObjectKey, entry: ObjectEntry, num_bytes: int,
          table: ObjectTable) -> None:
    state.victims[key] = entry
    state.freed_bytes += num_bytes
    parent = entry.parent_key
    if parent is None:
        return
    evicted = state.evicted_children.get(parent, 0) + 1
    state.evicted_children[parent] = evicted
    waiting = state.waiting.get(parent)
    if waiting is not None and table.num_children(parent) - evicted <= 0:
        heapq.heappush(state.ready, (waiting[0], parent))


def _drain_ready(state: _Pass, table: ObjectTable) -> None:
    while state.ready and not state.enough:
        _, key = heapq.heappop(state.ready)
        _, entry, num_bytes = state.waiting.pop(key)
        _take(state, key, entry, num_bytes, table)


def _bytes_on_tier(segments: SegmentTable, entry: ObjectEntry, tier: Tier) -> int:
    id_to_segment = segments.id_to_segment
    num_bytes = 0
    for placement in entry.extents():
        state = id_to_segment.get(placement.segment_id)
        if state is not None and state.mounted and state.info.tier == tier:
            num_bytes += aligned(placement.length)
    return num_bytes
