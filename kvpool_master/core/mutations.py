"""Writes of the master core: two-phase puts, removes, eviction passes, losing segments.

Rules of this file:
- ``Mutations`` is the half of ``MasterCore`` that changes objects (``tiering.py`` builds the
  copies between tiers on it); ``master.py`` holds the other half (clients, segments, reads,
  housekeeping). They share state through the attributes declared below, which
  ``MasterCore.__init__`` sets.
- Every object leaves through ``_drop`` (one ``ObjectRemoved`` event each, extents freed, or
  parked in ``DeferredFrees`` while a read lease on them is live), or through ``_reclaim``
  for a PENDING object whose writer vanished or ran out of time.
- A PENDING object's extents (revoked, reclaimed, or lost with their segment) stay parked for
  ``write_capability_ttl_s``: its writer may still hold WRITE capabilities for them, and a
  late write must land on space that belongs to nobody, never on the next object's (a lost
  segment may be mounted again over the same memory).
- Losing a segment (``sweeps.py``: at once, its objects swept in steps) parks the extents of
  its leased objects on it like a forced remove does, and a segment mounted again under that
  id reserves whatever is still parked (a reader inside its lease may still be copying those
  bytes of the same memory).
- Durability: a ``put_start`` that handed out a placement on a segment with a free not yet
  durable ends with a ``SyncRequired`` event (see ``segments.py`` and ``events.py``).
- While restored free space is quarantined (``_quarantine``: the first
  ``write_capability_ttl_s`` after a restore) nothing is evicted: a put that does not fit
  answers NO_SPACE and the watermark passes are off. That space frees itself, and evicting
  for it would only throw restored objects away.
- Eviction inside ``put_start``: when an allocation fails, passes run (DRAM first) until it
  fits or nothing evictable is left; after a successful allocation that pushes a tier above
  its high watermark, one pass brings it down by ``eviction_ratio x capacity``. A tier found
  with nothing (more) to evict is not rescanned for the rest of the call: within one call
  nothing can become evictable.
- With ``defer_upkeep`` (the server's mode) that watermark pass is not run inside the put:
  the tier is noted in ``relief_due`` and ``relieve`` runs the pass as a step of its own
  between requests, so one step never holds a batch's puts and a pass together. Passes for an
  allocation that does not fit still run at once.
- Batch paths (``batches.py``): a plain batch of puts, a writer's commits and a pass's drops
  go the C-level way when they are the common case, with the effects the loops below
  would have; the loops answer the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvpool_master.core.allocator import Allocator, aligned
from kvpool_master.core.batches import (
    BATCH_MIN_KEYS,
    MAX_CHECKSUM,
    RUN_MAX_KEYS,
    BatchPaths,
    CarvedRun,
    Stretches,
    commit_event,
)
from kvpool_master.core.clients import ClientTable
from kvpool_master.core.config import CoreConfig
from kvpool_master.core.events import (
    Event,
    EvictionPass,
    ObjectRemoved,
    PendingReclaimed,
    RemoveReason,
    ReplicasChanged,
    SegmentMounted,
    SyncRequired,
)
from kvpool_master.core.eviction import select_victims
from kvpool_master.core.leases import DeferredFrees, LeaseCounters, protected_until
from kvpool_master.core.objects import SHARD_MASK, ObjectEntry, ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_master.core.stats import Counters
from kvpool_wire.placed import Piece, PlacedBatch, PutResult
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    Extent,
    ObjectKey,
    Pin,
    PutOptions,
    SegmentInfo,
    Tier,
)

#: Most replicas one object may ask for.
MAX_REPLICAS = 16


class Mutations(BatchPaths):
    """Puts, removes and eviction; mixed into ``MasterCore``."""

    # Set by MasterCore.__init__.
    _config: CoreConfig
    _clients: ClientTable
    _segments: SegmentTable
    _objects: ObjectTable
    _deferred: DeferredFrees
    _quarantine: DeferredFrees
    _lease_counters: LeaseCounters
    _counters: Counters
    _events: list[Event]
    _watermark_retry_s: dict[Tier, float]
    _jobs: list[Any]  # removal jobs in progress (sweeps.py)
    _pass_capped = False  # the last eviction pass was cut (MAX_VICTIMS or MAX_SCANNED)
    defer_upkeep = False  # see the module rules and ``MasterCore.upkeep``
    relief_due: set[Tier]  # tiers a deferred watermark pass is due on
    object_events = True  # commits and removals are events (see MasterCore.skip_object_events)

    def spare(self, jobs: list[Any], entry: ObjectEntry, shard: int) -> None:
        """Tell the removal ``jobs`` still walking of ``entry``, just put into ``shard``: they
        leave it (``sweeps.py``)."""
        raise NotImplementedError

    # ---- two-phase put -------------------------------------------------------------------

    def put_start(self, client_id: ClientId, keys: Sequence[ObjectKey],
                  sizes_bytes: Sequence[int], options: PutOptions, now: float,
                  parent_keys: Sequence[ObjectKey] | None = None) -> Sequence[PutResult]:
        """Allocate space for new objects; return (status, placements) per key (a
        ``PlacedBatch``, or for a refused call a list).

        OK with placements (the writer now writes the bytes, then calls put_end); the same
        answer again for a key this client already has PENDING with the same size.
        Fails per key with ALREADY_EXISTS (READY, or PENDING by another writer), NO_SPACE
        (nothing evictable left, or larger than any segment), INVALID_KEY, INVALID_ARGUMENT;
        for the whole call with UNKNOWN_CLIENT or INVALID_ARGUMENT (bad batch or options).
        """
        n = len(keys)
        config = self._config
        if (n > config.max_batch_keys or len(sizes_bytes) != n
                or (parent_keys is not None and len(parent_keys) != n)):
            return [(Status.INVALID_ARGUMENT, ())] * n
        client = self._clients.live(client_id)
        if client is None:
            return [(Status.UNKNOWN_CLIENT, ())] * n
        pin, replica_num = _options(options)
        if pin is None:
            return [(Status.INVALID_ARGUMENT, ())] * n
        segments = self._segments
        self._deferred.release_due(segments, now)
        if self._quarantine:
            self._quarantine.release_due(segments, now)
        same_host_id = client.host_id if options.prefer_same_host else ""
        # No eviction can place an object larger than every segment, or more replicas than
        # there are segments: those answer NO_SPACE at once.
        largest_bytes = self._segments.largest_segment_bytes()
        num_segments = self._segments.num_dram_segments()
        max_key_bytes = config.max_key_bytes
        shards = self._objects.shards
        mask = SHARD_MASK
        id_to_segment = self._segments.id_to_segment
        dying = self._segments.dying
        size_to_int = self._objects.size_to_int
        exhausted: set[Tier] = set()
        results: list[PutResult] = []
        started = no_space = 0
        # plain puts of one size in a row take their extents from one run (see _carve_run)
        plain = replica_num == 1 and not options.preferred_segment and not same_host_id \
            and not self._quarantine
        run: CarvedRun | None = None
        walking = [job for job in self._jobs if job.shards_left]   # they leave what is put now
        spare = self.spare
        # stretches of absent keys go the batch way (_put_runs); the loop answers the rest
        pieces: list[Piece] = []
        placed = 0
        stretches = Stretches(self._batchable(keys, sizes_bytes, parent_keys)
                               if plain and not walking and self.batch_paths
                               and n >= BATCH_MIN_KEYS else None, n)
        batch_at = stretches.next_from(0)
        after = 0  # the next key to answer
        while after < n:
            i = after
            if i == batch_at:
                assert stretches.key_shards is not None
                end = stretches.end()
                got, runs, run = self._put_runs(client_id, keys, sizes_bytes[0], pin,
                                                parent_keys, stretches.key_shards, i, end, run,
                                                now, exhausted)
                # a stretch cut short (no room to carve) leaves its next key to the loop
                batch_at = stretches.next_from(end if i + got == end else i + got + 1)
                if got:
                    if results:
                        pieces.append(results)
                        results = []
                    pieces += runs
                    placed += got
                    after = i + got
                    continue
            after = i + 1
            key = keys[i]
            size = sizes_bytes[i]
            parent = parent_keys[i] if parent_keys is not None else None
            if not (type(key) is bytes and 0 < len(key) <= max_key_bytes):
                results.append((Status.INVALID_KEY, ()))
                continue
            if type(size) is not int or size <= 0:
                results.append((Status.INVALID_ARGUMENT, ()))
                continue
            if parent is not None and len(parent) == 0:
                parent = None
            if parent is not None and not (type(parent) is bytes and len(parent) <= max_key_bytes):
                results.append((Status.INVALID_KEY, ()))
                continue
            # One int object per distinct size (KV blocks share a few sizes): saves 32 bytes
            # per object, as entry and placements both hold it.
            size = size_to_int.setdefault(size, size) if len(size_to_int) < 4096 else size
            entry = shards[hash(key) & mask].get(key)
            if entry is not None and dying and not any(
                    p.segment_id in id_to_segment for p in entry.extents()):
                # on lost segments only: sweep it now (a PENDING one's extents wait for its
                # writer's capability, as the sweep's would)
                self._drop((key,), "segment_lost", now, 0.0 if entry.writer_id is None
                           else now + self._config.write_capability_ttl_s)
                self._counters.segment_lost_objects += 1
                entry = None
            if entry is not None:
                if entry.writer_id != client_id:
                    results.append((Status.ALREADY_EXISTS, ()))
                elif entry.size_bytes == size:
                    results.append((Status.OK, entry.extents()))  # the writer retrying
                else:
                    results.append((Status.INVALID_ARGUMENT, ()))
                continue
            placements: tuple[Extent, ...] | None = None
            on_run = run is not None and run.size_bytes == size and run.left > 0
            if not on_run and aligned(size) <= largest_bytes and replica_num <= num_segments:
                if run is not None:
                    self._end_run(run)
                    run = None
                if plain:
                    run = self._carve_run(size, _same_size_after(sizes_bytes, i))
                    on_run = run is not None
                if not on_run:
                    placements = self._allocate(size, replica_num, options.preferred_segment,
                                                same_host_id, now, exhausted)
            if on_run:
                assert run is not None
                placements = (self._take(run, now, exhausted),)
            elif placements is None:
                no_space += 1
                results.append((Status.NO_SPACE, ()))
                continue
            if parent is not None:
                parent = self._objects.shared_key(parent)
            entry = ObjectEntry.of_extents(key, size, placements, client_id, pin, parent)
            self._objects.add_pending(key, entry, now)
            if walking:
                spare(walking, entry, hash(key) & mask)
            started += 1
            results.append((Status.OK, placements))
        if run is not None:
            self._end_run(run)
        self._counters.put_started += started + placed
        self._counters.put_no_space += no_space
        if segments.needs_sync:
            segments.needs_sync = False
            self._events.append(SyncRequired(segments.free_seq))
        if not placed:
            return results
        if results:
            pieces.append(results)
        return PlacedBatch(pieces, sizes_bytes[0])

    def put_end(self, client_id: ClientId, keys: Sequence[ObjectKey], now: float,
                checksums: Sequence[int] | None = None) -> list[Status]:
        """Commit PENDING objects: they become READY and visible. OK per key (also for a key
        already READY: a retried commit). Fails per key with NOT_FOUND (reclaimed, revoked or
        never started), PERMISSION_DENIED (another client's put), INVALID_KEY, INVALID_ARGUMENT
        (checksum not a u64); for the call with UNKNOWN_CLIENT or INVALID_ARGUMENT."""
        n = len(keys)
        if n > self._config.max_batch_keys or (checksums is not None and len(checksums) != n):
            return [Status.INVALID_ARGUMENT] * n
        if self._clients.live(client_id) is None:
            return [Status.UNKNOWN_CLIENT] * n
        objects = self._objects
        events = self._events if self.object_events else None
        own = self._own_pending(client_id, keys, checksums) \
            if self.batch_paths and n >= BATCH_MIN_KEYS else None
        if own is not None:  # a writer committing its own batch: at once, C-level
            objects.commit_all(keys, own, checksums)
            if events is not None:
                events += self._commit_events(keys, own, checksums)
            objects.touch_all(own)
            self._counters.put_committed += n
            return [Status.OK] * n
        shards = objects.shards
        mask = SHARD_MASK
        statuses: list[Status] = []
        committed: list[ObjectEntry] = []
        for i, key in enumerate(keys):
            checksum = checksums[i] if checksums is not None else 0
            if type(checksum) is not int or not 0 <= checksum <= MAX_CHECKSUM:
                statuses.append(Status.INVALID_ARGUMENT)
                continue
            entry = shards[hash(key) & mask].get(key)
            if entry is None:
                statuses.append(self._missing(key))
            elif entry.writer_id is None:
                statuses.append(Status.OK)
            elif entry.writer_id != client_id:
                statuses.append(Status.PERMISSION_DENIED)
            else:
                objects.commit(key, entry, checksum)
                if events is not None:
                    events.append(commit_event(key, entry, checksum))
                committed.append(entry)
                statuses.append(Status.OK)
        objects.touch_all(committed)
        self._counters.put_committed += len(committed)
        return statuses

    def put_revoke(self, client_id: ClientId, keys: Sequence[ObjectKey],
                   now: float) -> list[Status]:
        """Abandon PENDING objects of this client; their space is reused once the put's WRITE
        capabilities have expired (``write_capability_ttl_s``). OK per key.
        Fails per key with NOT_FOUND, INVALID_ARGUMENT (already READY: too late to revoke),
        PERMISSION_DENIED (another client's put), INVALID_KEY; for the call with UNKNOWN_CLIENT
        or INVALID_ARGUMENT."""
        n = len(keys)
        if n > self._config.max_batch_keys:
            return [Status.INVALID_ARGUMENT] * n
        if self._clients.live(client_id) is None:
            return [Status.UNKNOWN_CLIENT] * n
        get = self._objects.get
        statuses: list[Status] = []
        for key in keys:
            entry = get(key)
            if entry is None:
                statuses.append(self._missing(key))
            elif entry.writer_id is None:
                statuses.append(Status.INVALID_ARGUMENT)
            elif entry.writer_id != client_id:
                statuses.append(Status.PERMISSION_DENIED)
            else:
                self._drop((key,), "revoke", now, now + self._config.write_capability_ttl_s)
                self._counters.put_revoked += 1
                statuses.append(Status.OK)
        return statuses

    # ---- removal -------------------------------------------------------------------------

    def remove(self, keys: Sequence[ObjectKey], force: bool, now: float) -> list[Status]:
        """Remove READY objects. OK per key; NOT_FOUND, NOT_READY (PENDING), HAS_LEASE (a read
        lease is live and not ``force``), INVALID_KEY; INVALID_ARGUMENT for an oversized batch.
        A forced remove hides the object at once; its bytes are reused only after the lease."""
        if len(keys) > self._config.max_batch_keys:
            return [Status.INVALID_ARGUMENT] * len(keys)
        get = self._objects.get
        statuses: list[Status] = []
        for key in keys:
            entry = get(key)
            if entry is None:
                statuses.append(self._missing(key))
            elif entry.writer_id is not None:
                statuses.append(Status.NOT_READY)
            elif entry.lease_expiry_s > now and not force:
                statuses.append(Status.HAS_LEASE)
            else:
                self._drop((key,), "remove", now)
                self._counters.removed_objects += 1
                statuses.append(Status.OK)
        return statuses

    # ---- shared machinery ----------------------------------------------------------------

    def _missing(self, key: object) -> Status:
        ok = type(key) is bytes and 0 < len(key) <= self._config.max_key_bytes
        return Status.NOT_FOUND if ok else Status.INVALID_KEY

    def _drop(self, keys: Sequence[ObjectKey], reason: RemoveReason, now: float,
              hold_until_s: float = 0.0, freed: list[Extent] | None = None,
              entries: list[ObjectEntry] | None = None) -> None:
        """Remove objects (READY or PENDING, all present) and free or park their extents
        (until their read lease ends, and at least until ``hold_until_s``; extents on a
        segment being lost are parked too, in case it is mounted again). With ``freed``, the
        extents that would be freed now are appended to it instead, still allocated (a
        removal job frees them later, in offset order). ``entries``: the entries of
        ``keys`` (distinct), when the caller has them."""
        events = self._events if self.object_events else None
        if (self.batch_paths and len(keys) >= BATCH_MIN_KEYS and freed is None
                and hold_until_s <= now and self._objects.dram_order is None):
            entries = self._unprotected(keys, now, entries)
            if entries is not None:
                self._drop_all(keys, entries, reason, events)
                return
        pop = self._objects.pop
        to_free: list[Extent] = []
        lapsed = 0
        seq = self._segments.next_free_seq()
        for key in keys:
            entry = pop(key)
            lease_s = max(protected_until(entry), hold_until_s)
            if lease_s > now:
                # A reader may still be copying these bytes: reuse them only after its lease.
                get = self._segments.id_to_segment.get
                dying = self._segments.dying
                parked = []
                for p in entry.extents():
                    state = get(p.segment_id)
                    if state is None:  # a segment being lost: held in case it comes back
                        state = dying.get(p.segment_id)
                    if state is not None:
                        parked.append(self._deferred.add(lease_s, state, p.offset, p.length, seq))
                if entry.holds and hold_until_s <= now:
                    # ... or once its readers ended their leases, when that comes first.
                    self._deferred.watch(key, entry, parked)
            else:
                if entry.lease_expiry_s > 0.0:
                    lapsed += 1
                to_free += entry.extents()
            if events is not None:
                events.append(ObjectRemoved(key, entry.size_bytes, reason))
        if freed is None:
            self._segments.free(to_free, seq)
        else:
            freed += to_free
        self._lease_counters.leases_lapsed += lapsed

    def _reclaim(self, key: ObjectKey, now: float) -> None:
        self._drop((key,), "reclaim", now, now + self._config.write_capability_ttl_s)
        self._counters.pending_reclaimed += 1
        self._events.append(PendingReclaimed(key))

    def _mount_fresh(self, segment: SegmentInfo, now: float) -> None:
        part = self._config.part
        state = SegmentState(segment, Allocator(segment.size_bytes, part), mounted=True)
        # Extents still held on an earlier segment of this id stay held on this one.
        held = self._deferred.adopt(state) + self._quarantine.adopt(state)
        if held:
            state.allocator = Allocator.from_packed(segment.size_bytes, held, part)
        self._segments.add(state)
        self._events.append(SegmentMounted(segment))

    def _end_run(self, run: CarvedRun) -> None:
        """Free the extents of ``run`` never handed out (nobody saw them: no free to wait
        for)."""
        if run.left:
            self._segments.tier_to_used_bytes[Tier.DRAM] += run.left * run.step_bytes
            segment_id = run.state.info.segment_id
            self._segments.free([Extent(segment_id, offset, run.size_bytes)
                                 for offset in run.offsets[-run.left:]], seq=-1)
            run.left = 0

    def _carve_run(self, size_bytes: int, count: int) -> CarvedRun | None:
        """Extents for the next ``count`` plain puts of ``size_bytes`` in a batch, carved at
        once from the emptiest DRAM segment (back to back where it can: one allocator and one
        index update instead of one per key); None when a run is not worth it (``count`` 1) or
        that segment has no room (the caller then allocates one key the usual way, evicting
        if it must). Its tier counts an extent as used once ``_take`` hands it out."""
        if count < 2:
            return None
        carved = self._segments.allocate_run(size_bytes, count)
        if carved is None:
            return None
        state, offsets = carved
        run = CarvedRun(state, offsets, size_bytes)
        # the tier counts each extent as it is handed out, so watermark passes run exactly
        # where they would for puts placed one at a time
        self._segments.tier_to_used_bytes[Tier.DRAM] -= len(offsets) * run.step_bytes
        return run

    def _take(self, run: CarvedRun, now: float, exhausted: set[Tier]) -> Extent:
        """The next extent of ``run``; a watermark pass follows, as after any
        allocation (checked only once the tier may be above its high watermark: ``quiet``
        counts the extents that cannot take it there; none at all while a deferred pass on
        the tier is due: until ``relieve`` runs it, a check changes nothing)."""
        step = run.step_bytes
        used = self._segments.tier_to_used_bytes
        used[Tier.DRAM] += step
        placement = Extent(run.state.info.segment_id, run.offsets[-run.left], run.size_bytes)
        run.left -= 1
        if run.quiet:
            run.quiet -= 1
        else:
            if Tier.DRAM not in exhausted and not self._relieve_watermark(Tier.DRAM, now):
                exhausted.add(Tier.DRAM)
            if self.defer_upkeep and Tier.DRAM in self.relief_due:
                run.quiet = run.left
                return placement
            # one check to spare: float rounding never lets a crossing go unchecked
            room = (self._config.eviction_high_watermark_ratio
                    * self._segments.tier_to_capacity_bytes[Tier.DRAM] - used[Tier.DRAM])
            run.quiet = max(0, int(room // step) - 1)
        return placement

    def _allocate(self, size_bytes: int, replica_num: int, preferred_segment: str,
                  same_host_id: str, now: float,
                  exhausted: set[Tier]) -> tuple[Extent, ...] | None:
        segments = self._segments
        placements = segments.allocate(size_bytes, replica_num, preferred_segment, same_host_id)
        if placements is None and self._quarantine:
            return None   # no eviction during the restart quarantine (see the module rules)
        while placements is None:
            need_bytes = aligned(size_bytes) * replica_num
            for tier in (Tier.DRAM,):  # puts land in DRAM only
                capacity = segments.tier_to_capacity_bytes[tier]
                if tier in exhausted or not capacity:
                    continue
                wanted = max(need_bytes, math.ceil(self._config.eviction_ratio * capacity))
                if self._evict_pass(tier, wanted, now) < wanted and not self._pass_capped:
                    exhausted.add(tier)
                break
            else:
                return None
            placements = segments.allocate(size_bytes, replica_num, preferred_segment,
                                           same_host_id)
        id_to_segment = segments.id_to_segment
        tiers = {id_to_segment[placements[0].segment_id].info.tier} if len(placements) == 1 \
            else {id_to_segment[p.segment_id].info.tier for p in placements}
        for tier in tiers:
            if tier not in exhausted and not self._relieve_watermark(tier, now):
                exhausted.add(tier)
        return placements

    def _above_watermark(self, tier: Tier) -> bool:
        capacity = self._segments.tier_to_capacity_bytes[tier]
        return bool(capacity) and (self._segments.tier_to_used_bytes[tier]
                                   > self._config.eviction_high_watermark_ratio * capacity)

    def _relieve_watermark(self, tier: Tier, now: float) -> bool:
        """Run a watermark pass on ``tier`` if it is above its high watermark; return False
        when the pass found too little to evict.

        After a short pass the tier is not rescanned for a tenth of a lease: above the high
        watermark is allowed (allocation failures still evict at once), and rescanning a
        table of leased or pinned objects on every put would cost O(objects) each time.
        """
        if self.defer_upkeep:
            if tier not in self.relief_due and self._pass_due(tier, now):
                self.relief_due.add(tier)
            return True
        return not self._pass_due(tier, now) or self._watermark_pass(tier, now)

    def relieve(self, now: float) -> bool:
        """Run one deferred watermark pass (see ``defer_upkeep``); True while a
        pass is still due."""
        due = self.relief_due
        while due:
            tier = min(due)
            if not self._pass_due(tier, now):
                due.discard(tier)
                continue
            if not self._watermark_pass(tier, now) or not self._above_watermark(tier):
                due.discard(tier)
            break
        return bool(due)

    def _pass_due(self, tier: Tier, now: float) -> bool:
        """Whether ``tier`` is above its high watermark, out of its back-off and out of the
        restart quarantine: a watermark pass on it would run."""
        return (self._above_watermark(tier) and now >= self._watermark_retry_s.get(tier, 0.0)
                and not self._quarantine)

    def _watermark_pass(self, tier: Tier, now: float) -> bool:
        """One pass bringing ``tier`` down by ``eviction_ratio`` of its capacity; False
        (and no pass on it for a tenth of a lease) when it found too little to evict."""
        wanted = math.ceil(self._config.eviction_ratio
                           * self._segments.tier_to_capacity_bytes[tier])
        if self._evict_pass(tier, wanted, now) >= wanted or self._pass_capped:
            return True  # (a pass cut at MAX_VICTIMS: the next one goes on, no backoff)
        self._watermark_retry_s[tier] = now + self._config.default_lease_ttl_s / 10
        return False

    def _evict_pass(self, tier: Tier, need_bytes: int, now: float) -> int:
        """Evict victims freeing at least ``need_bytes`` of ``tier`` if possible; return the
        bytes of that tier actually freed."""
        chosen, self._pass_capped = select_victims(self._objects, self._segments, tier,
                                                   need_bytes, now,
                                                   self._objects.track_children)
        if not chosen:
            return 0
        victims = list(chosen)
        used = self._segments.tier_to_used_bytes
        before = used[tier]
        total_before = sum(used.values())
        # once an SSD segment exists, a victim may live on another tier too
        if self._objects.dram_order is not None:
            kept = self._strip_tier(victims, tier)
            self._drop(victims, "evict", now)
        else:
            kept = 0
            self._drop(victims, "evict", now, entries=list(chosen.values()))
        counters = self._counters
        counters.eviction_passes += 1
        counters.evicted_objects += len(victims)
        counters.evicted_replicas += kept
        counters.evicted_bytes += total_before - sum(used.values())
        self._events.append(EvictionPass(len(victims), total_before - sum(used.values())))
        return before - used[tier]

    def _strip_tier(self, victims: list[ObjectKey], tier: Tier) -> int:
        """Take the victims that also live on another tier out of ``victims``: they only lose
        their replicas on ``tier`` (freed now: victims hold no lease). Returns how many."""
        get = self._segments.id_to_segment.get
        objects = self._objects
        dropped: list[ObjectKey] = []
        to_free: list[Extent] = []
        for key in victims:
            entry = objects.shards[hash(key) & SHARD_MASK][key]
            extents = entry.extents()
            here = [p for p in extents
                    if (s := get(p.segment_id)) is not None and s.info.tier == tier]
            if len(here) == len(extents):
                dropped.append(key)
                continue
            remaining = tuple(p for p in extents if p not in here)
            entry.set_extents(remaining)
            to_free += here
            if tier == Tier.DRAM:
                objects.dram_remove(entry)
            self._events.append(ReplicasChanged(key, entry.size_bytes, remaining,
                                                entry.checksum, entry.pin, entry.parent_key))
        kept = len(victims) - len(dropped)
        victims[:] = dropped
        self._segments.free(to_free)
        return kept


def _options(options: PutOptions) -> tuple[Pin | None, int]:
    """Return (pin, replica_num) of well-formed options, or (None, 0)."""
    if not isinstance(options, PutOptions) or not isinstance(options.preferred_segment, str):
        return None, 0
    replica_num = options.replica_num or 1
    if type(replica_num) is not int or not 1 <= replica_num <= MAX_REPLICAS:
        return None, 0
    try:
        return Pin(options.pin), replica_num
    except ValueError:
        return None, 0


def _same_size_after(sizes_bytes: Sequence[int], i: int) -> int:
    """How many sizes from ``i`` on equal ``sizes_bytes[i]`` (at most RUN_MAX_KEYS)."""
    size = sizes_bytes[i]
    end = min(len(sizes_bytes), i + RUN_MAX_KEYS)
    j = i + 1
    while j < end and sizes_bytes[j] == size:
        j += 1
    return j - i

