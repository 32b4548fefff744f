"""The SSD tier in the master core: demotion, promotion and the copies that make them.

Rules of this file:
- The master never touches bytes. A copy between tiers is a ``CopyTask`` for the client that
  owns both ends: the source replica's segment and a target extent the master allocated on
  another segment of the same owner (DRAM -> SSD: a *demotion*; SSD -> DRAM: a *promotion*).
  The owner learns that tasks wait from its heartbeat answer, fetches them with ``CopyTasks``,
  copies locally and reports each result in its next ``CopyTasks`` call.
- A copy commits only if the object is still the very entry the task was made for and still
  has the source replica: then the target joins its placements (DRAM replicas first, SSD
  after) and a ``ReplicasChanged`` event records it. Otherwise, or when the copy failed, the
  target is freed at once (the copier is done writing it).
- A task handed out and not reported within ``copy_task_ttl_s`` is dropped; its target is
  reused only ``write_capability_ttl_s`` after that (the copier refuses to start a copy after
  half the ttl, so it never writes that late). A task never handed out is dropped at its
  ttl and its target freed at once. Tasks of a client that leaves go with its segments; the
  targets of those handed out stay parked as a late task's would (the client may come back
  and mount the same memory while its copier still writes).
- An owner's copier may wait at the master for tasks (``CopyTasks`` with a wait): the core
  names the owners that got new tasks (``take_fresh_copy_owners``) so their waiting calls are
  answered at once. Passes run on every commit too (bounded as below), so a burst of puts is
  met by demotions within a pass interval, not a poll interval.
- Demotion runs ahead of eviction: once DRAM is within ``2 x eviction_ratio`` of its high
  watermark, the least recently used DRAM objects worth ``3 x eviction_ratio`` of DRAM
  capacity get an SSD copy. Objects copied already that eviction passes by for now (leased,
  or soft-pinned) do not count in that window, so they never hold back the copies of the
  objects eviction will take instead. A DRAM eviction then drops only the DRAM replica of an
  object that has one on SSD (nothing is lost); the object lives on in SSD until the SSD
  watermark evicts it there. An object without an SSD copy is evicted as before.
- Promotion: a read answered from SSD only counts a hit; at ``ssd_promote_after_hits`` hits
  (0: never) the object gets a DRAM copy on its owner's DRAM segment, evicting from DRAM for
  room as a put would (least recently used first: mostly DRAM copies of objects that also
  live on SSD).
- Each pass is bounded (``SCAN_LIMIT`` objects looked at, ``MAX_TASKS_PER_OWNER`` in flight
  per owner), so no call grows with the table, and passes run at most every
  ``PLAN_INTERVAL_S`` however many copiers ask.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

from kvpool_master.core.allocator import aligned
from kvpool_master.core.events import ReplicasChanged
from kvpool_master.core.leases import protected_until
from kvpool_master.core.objects import ObjectEntry, ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_master.core.sweeps import Sweeps
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, Extent, ObjectKey, Pin, Tier

#: Objects a demotion pass looks at, from the least recently used.
SCAN_LIMIT = 8192
#: Copies one owner may have waiting or in flight.
MAX_TASKS_PER_OWNER = 64
#: Keys remembered as wanting promotion, and hit counts kept, at most.
MAX_WANTED = 4096
#: A pass runs at most this often (every CopyTasks call asks for one; copiers ask often).
PLAN_INTERVAL_S = 0.02


class CopyTask:
    """One copy the owner of ``source`` and ``target`` is asked to make."""

    __slots__ = ("task_id", "key", "entry", "source", "target", "target_state", "owner",
                 "promote", "created_s", "deadline_s")

    def __init__(self, task_id: int, key: ObjectKey, entry: ObjectEntry, source: Extent,
                 target: Extent, target_state: SegmentState, owner: ClientId,
                 promote: bool, now: float) -> None:
        self.task_id = task_id
        self.key = key
        self.entry = entry
        self.source = source
        self.target = target
        self.target_state = target_state
        self.owner = owner
        self.promote = promote
        self.created_s = now
        self.deadline_s = 0.0  # set when handed out


class CopyTable:
    """Copy tasks by id, by key and per owner (waiting ones in order)."""

    def __init__(self, part: tuple[int, int] = (0, 1)) -> None:
        self.id_to_task: dict[int, CopyTask] = {}
        self.key_to_task: dict[ObjectKey, CopyTask] = {}
        self.owner_to_waiting: dict[ClientId, deque[CopyTask]] = {}
        self.owner_to_count: dict[ClientId, int] = {}
        self.fresh_owners: set[ClientId] = set()  # got tasks since take_fresh_copy_owners
        self.hits: dict[ObjectKey, int] = {}       # reads answered from SSD only, per key
        self.wanted: dict[ObjectKey, None] = {}    # keys to promote, in order
        self.promote_retry_s = 0.0  # no promotion before this (DRAM had no room)
        self.planned_s = -1.0  # when the last pass ran
        self.expired_s = -1.0  # when late tasks were last looked for
        index, count = part  # task numbers name their partition, as lease numbers do
        self._ids = itertools.count(index + count, count)

    def add(self, key: ObjectKey, entry: ObjectEntry, source: Extent, target: Extent,
            target_state: SegmentState, owner: ClientId, promote: bool,
            now: float) -> CopyTask:
        task = CopyTask(next(self._ids), key, entry, source, target, target_state, owner,
                        promote, now)
        self.id_to_task[task.task_id] = task
        self.key_to_task[key] = task
        self.owner_to_waiting.setdefault(owner, deque()).append(task)
        self.owner_to_count[owner] = self.owner_to_count.get(owner, 0) + 1
        self.fresh_owners.add(owner)
        return task

    def forget(self, task: CopyTask) -> None:
        del self.id_to_task[task.task_id]
        if self.key_to_task.get(task.key) is task:
            del self.key_to_task[task.key]
        left = self.owner_to_count[task.owner] - 1
        if left:
            self.owner_to_count[task.owner] = left
        else:
            del self.owner_to_count[task.owner]

    def waiting(self, owner: ClientId) -> int:
        queue = self.owner_to_waiting.get(owner)
        return len(queue) if queue else 0


def build_dram_order(objects: ObjectTable, segments: SegmentTable) -> None:
    """Start keeping ``objects.dram_order`` (the first SSD segment was mounted or restored)."""
    if objects.dram_order is not None:
        return
    objects.start_dram_order(entry for entry in objects.entries()
                             if segments.has_tier(entry.extents(), Tier.DRAM))


class Tiering(Sweeps):
    """Demotion, promotion and copy tasks; the base of ``MasterCore`` (over ``Sweeps``)."""

    # Set by MasterCore.__init__.
    _copies: CopyTable

    # ---- the owner's side ----------------------------------------------------------------

    def copy_tasks_waiting(self, client_id: ClientId) -> int:
        """How many copy tasks wait for ``client_id`` to fetch them."""
        return self._copies.waiting(client_id)

    def copy_tasks(self, client_id: ClientId, done: Sequence[tuple[int, int]],
                   max_tasks: int, now: float) -> tuple[Status, list[CopyTask]]:
        """Apply the results ``done`` ((task id, Status value) each) the owner reports, then
        hand it up to ``max_tasks`` waiting tasks (their ttl starts now). Results for tasks
        that are not this client's, or gone, change nothing. UNKNOWN_CLIENT for a client the
        master does not know; INVALID_ARGUMENT for more results than one batch holds."""
        if len(done) > self._config.max_batch_keys:
            return Status.INVALID_ARGUMENT, []
        for task_id, status in done:
            task = self._copies.id_to_task.get(task_id) if type(task_id) is int else None
            if task is not None and task.owner == client_id and task.deadline_s:
                self._finish_copy(task, status == Status.OK, now)
        self._plan_copies(now)
        return Status.OK, self.hand_copy_tasks(client_id, max_tasks, now)

    def hand_copy_tasks(self, client_id: ClientId, max_tasks: int, now: float
                        ) -> list[CopyTask]:
        """Hand ``client_id`` up to ``max_tasks`` of its waiting tasks (their ttl starts now)."""
        queue = self._copies.owner_to_waiting.get(client_id)
        handed: list[CopyTask] = []
        deadline_s = now + self._config.copy_task_ttl_s
        while queue and len(handed) < max_tasks:
            task = queue.popleft()
            task.deadline_s = deadline_s
            handed.append(task)
        if queue is not None and not queue:
            del self._copies.owner_to_waiting[client_id]
        return handed

    def take_fresh_copy_owners(self) -> set[ClientId]:
        """The owners that got new tasks since the last call (their copiers may be waiting)."""
        fresh = self._copies.fresh_owners
        if fresh:
            self._copies.fresh_owners = set()
        return fresh

    def put_end(self, client_id: ClientId, keys: Sequence[ObjectKey], now: float,
                checksums: Sequence[int] | None = None) -> list[Status]:
        """``Mutations.put_end``, then a demotion pass when one is due (committed objects are
        what demotions copy: a burst of puts must not outrun them)."""
        statuses = super().put_end(client_id, keys, now, checksums)
        self._plan_copies(now)
        return statuses

    def _finish_copy(self, task: CopyTask, ok: bool, now: float) -> None:
        self._copies.forget(task)
        entry = self._objects.get(task.key)
        current = (ok and entry is task.entry and entry.writer_id is None
                   and task.source in entry.extents()  # by value: the same entry, still there
                   and self._segments.get(task.target.segment_id) is task.target_state
                   and task.target_state.mounted)
        counters = self._counters
        if not current:
            self._segments.free_on(task.target_state, task.target.offset, task.target.length,
                                   self._segments.next_free_seq())
            if task.promote:
                counters.promotions_failed += 1
            else:
                counters.demotions_failed += 1
            return
        assert entry is not None
        if task.promote:
            entry.set_extents((task.target, *entry.extents()))
            if self._objects.dram_order is not None:
                self._objects.dram_add(entry)
            counters.promotions_done += 1
        else:
            entry.set_extents((*entry.extents(), task.target))
            counters.demotions_done += 1
        self._events.append(ReplicasChanged(task.key, entry.size_bytes, entry.extents(),
                                            entry.checksum, entry.pin, entry.parent_key))

    # ---- reads ---------------------------------------------------------------------------

    def _note_ssd_hits(self, keys: Sequence[ObjectKey], placements: Sequence[Extent]) -> None:
        """Count reads answered from SSD only (``placements``: each key's first replica)."""
        get = self._segments.id_to_segment.get
        copies = self._copies
        after = self._config.ssd_promote_after_hits
        ssd_hits = 0
        for key, first in zip(keys, placements, strict=True):
            state = get(first.segment_id)
            if state is None or state.info.tier != Tier.SSD:
                continue
            ssd_hits += 1
            if not after or key in copies.key_to_task or key in copies.wanted:
                continue
            hits = copies.hits.get(key, 0) + 1
            if hits < after:
                if len(copies.hits) >= MAX_WANTED:
                    copies.hits.clear()
                copies.hits[key] = hits
            elif len(copies.wanted) < MAX_WANTED:
                copies.hits.pop(key, None)
                copies.wanted[key] = None
        self._counters.ssd_read_hit_keys += ssd_hits

    # ---- passes (tick, and every CopyTasks call) -------------------------------------------

    def _plan_copies(self, now: float) -> None:
        segments = self._segments
        if not segments.tier_to_capacity_bytes[Tier.SSD] or self._quarantine \
                or 0.0 <= now - self._copies.planned_s < PLAN_INTERVAL_S:
            return
        self._copies.planned_s = now
        owner_to_ssd: dict[ClientId, list[SegmentState]] = {}
        owner_to_dram: dict[ClientId, list[SegmentState]] = {}
        for state in segments.mounted:
            by_tier = owner_to_ssd if state.info.tier == Tier.SSD else owner_to_dram
            by_tier.setdefault(state.info.client_id, []).append(state)
        if self._copies.wanted:
            self._plan_promotions(owner_to_dram, now)
        self._plan_demotions(owner_to_ssd, now)

    def _plan_demotions(self, owner_to_ssd: dict[ClientId, list[SegmentState]],
                        now: float) -> None:
        segments = self._segments
        order = self._objects.dram_order
        capacity = segments.tier_to_capacity_bytes[Tier.DRAM]
        config = self._config
        if order is None or not capacity or segments.tier_to_used_bytes[Tier.DRAM] < (
                config.eviction_high_watermark_ratio - 2 * config.eviction_ratio) * capacity:
            return
        window_bytes = 3 * config.eviction_ratio * capacity
        get = segments.id_to_segment.get
        copies = self._copies
        full: set[ClientId] = set()
        wanted: list[tuple[ObjectKey, ObjectEntry, Extent, ClientId]] = []
        seen_bytes = 0
        for entry in itertools.islice(order.entries(), SCAN_LIMIT):
            key = entry.key
            if entry.writer_id is not None or entry.pin is Pin.HARD:
                continue
            extents = entry.extents()
            copied = segments.has_tier(extents, Tier.SSD)
            if copied and (entry.pin is Pin.SOFT or protected_until(entry) > now):
                continue  # copied, and kept in DRAM a while: eviction passes it by
            seen_bytes += aligned(entry.size_bytes)
            if seen_bytes > window_bytes:
                break
            if copied or key in copies.key_to_task:
                continue
            source, owner = None, ClientId("")
            for p in extents:
                state = get(p.segment_id)
                if state is not None and state.mounted:
                    source, owner = p, state.info.client_id
                    break
            if source is None:
                continue
            if owner in owner_to_ssd and owner not in full:
                if copies.owner_to_count.get(owner, 0) >= MAX_TASKS_PER_OWNER:
                    full.add(owner)
                    continue
                wanted.append((key, entry, source, owner))
        for key, entry, source, owner in wanted:
            if owner in full or copies.owner_to_count.get(owner, 0) >= MAX_TASKS_PER_OWNER:
                continue
            target = self._allocate_target(owner_to_ssd[owner], entry.size_bytes, Tier.SSD, now)
            if target is None:
                full.add(owner)
                continue
            copies.add(key, entry, source, target[0], target[1], owner, False, now)
            self._counters.demotions_started += 1

    def _plan_promotions(self, owner_to_dram: dict[ClientId, list[SegmentState]],
                         now: float) -> None:
        copies = self._copies
        if now < copies.promote_retry_s:
            return
        wanted, copies.wanted = list(copies.wanted), {}
        get = self._objects.get
        segment_of = self._segments.id_to_segment.get
        for index, key in enumerate(wanted):
            entry = get(key)
            if entry is None or entry.writer_id is not None or key in copies.key_to_task:
                continue
            first = entry.extents()[0]
            state = segment_of(first.segment_id)
            if state is None or not state.mounted or state.info.tier != Tier.SSD:
                continue  # gone, or in DRAM again
            owner = state.info.client_id
            if copies.owner_to_count.get(owner, 0) >= MAX_TASKS_PER_OWNER \
                    or owner not in owner_to_dram:
                continue
            target = self._allocate_target(owner_to_dram[owner], entry.size_bytes, Tier.DRAM,
                                           now)
            if target is None:  # DRAM is leased through: try the rest again a little later
                copies.wanted.update(dict.fromkeys(wanted[index:]))
                copies.promote_retry_s = now + self._config.default_lease_ttl_s / 10
                return
            copies.add(key, entry, first, target[0], target[1], owner, True, now)
            self._counters.promotions_started += 1

    def _allocate_target(self, states: list[SegmentState], size_bytes: int, tier: Tier,
                         now: float) -> tuple[Extent, SegmentState] | None:
        """An extent on one of ``states`` (one owner's segments of ``tier``), evicting from
        ``tier`` once to make room (a promoted object is hot: it displaces the least recently
        used, as a put would)."""
        target = self._allocate_on_any(states, size_bytes)
        if target is None:
            capacity = self._segments.tier_to_capacity_bytes[tier]
            wanted = max(aligned(size_bytes), math.ceil(self._config.eviction_ratio * capacity))
            if self._evict_pass(tier, wanted, now):
                target = self._allocate_on_any(states, size_bytes)
        return target

    def _allocate_on_any(self, states: list[SegmentState], size_bytes: int
                         ) -> tuple[Extent, SegmentState] | None:
        for state in states:
            placement = self._segments.allocate_on(state, size_bytes)
            if placement is not None:
                return placement, state
        return None

    def _expire_copies(self, now: float) -> None:
        copies = self._copies
        ttl_s = self._config.copy_task_ttl_s
        late = [t for t in copies.id_to_task.values()
                if (t.deadline_s and now > t.deadline_s)
                or (not t.deadline_s and now > t.created_s + ttl_s)]
        for task in late:
            copies.forget(task)
            if task.deadline_s:  # handed out: the copier may write until the ttl ended
                self._deferred.add(task.deadline_s + self._config.write_capability_ttl_s,
                                   task.target_state, task.target.offset, task.target.length,
                                   self._segments.next_free_seq())
            else:
                queue = copies.owner_to_waiting.get(task.owner)
                if queue is not None:
                    queue.remove(task)
                    if not queue:
                        del copies.owner_to_waiting[task.owner]
                self._segments.free_on(task.target_state, task.target.offset,
                                       task.target.length, self._segments.next_free_seq())
            self._counters.copies_expired += 1

    def _drop_copies_of(self, client_id: ClientId) -> None:
        """Forget the tasks of a client that left (its segments, and the targets, are gone).
        The target of a task handed out stays parked as a late one's would: the client may
        come back, mount the same memory again and still be copying into it."""
        copies = self._copies
        copies.owner_to_waiting.pop(client_id, None)
        for task in [t for t in copies.id_to_task.values() if t.owner == client_id]:
            copies.forget(task)
            if task.deadline_s:
                self._deferred.add(task.deadline_s + self._config.write_capability_ttl_s,
                                   task.target_state, task.target.offset, task.target.length,
                                   self._segments.next_free_seq())
