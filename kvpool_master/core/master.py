"""MasterCore: the pure, synchronous state machine of kvpool-master.

Rules of this file:
- No I/O, no clock, no threads. Every method takes ``now`` (seconds, from a clock the server
  keeps monotonic and stall-corrected) and runs to completion, so each call is atomic.
- Batch-shaped: one Status per item. A batch longer than ``max_batch_keys`` or with mismatched
  list lengths answers INVALID_ARGUMENT for every item; a bad item changes nothing.
- Side effects leave as events (``take_events``); counters and gauges as ``stats()``.
- Ownership: a PENDING object belongs to its writer; only that client may commit or revoke it.
  A put_start on a key some other client is still writing answers ALREADY_EXISTS (first writer
  wins: keys name content, so the other copy is the same bytes, and the client treats
  ALREADY_EXISTS as success).
- Sizes: zero, negative or non-integer sizes are INVALID_ARGUMENT; a size larger than every
  mounted segment is NO_SPACE without evicting anything (no eviction can make it fit).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator, Sequence

from kvpool_master.core import leases
from kvpool_master.core.clients import ClientState, ClientTable, registration_error
from kvpool_master.core.config import CoreConfig
from kvpool_master.core.events import (
    ClientExpired,
    ClientRegistered,
    ClientUnregistered,
    Event,
    SegmentMounted,
)
from kvpool_master.core.objects import SHARD_MASK, ObjectTable
from kvpool_master.core.segments import SegmentTable, segment_info_error
from kvpool_master.core.snapshot import (
    Chunk,
    RestoreCounts,
    Snapshot,
    all_chunks,
    restore_into,
    snapshot_head,
    take_snapshot,
    walk_chunks,
)
from kvpool_master.core.stats import CoreStats, Counters, SegmentStats, build_stats, segment_stats
from kvpool_master.core.sweeps import RemoveJob, TableWalk
from kvpool_master.core.tiering import CopyTable, Tiering, build_dram_order
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    Extent,
    ObjectKey,
    ReadResult,
    SegmentId,
    SegmentInfo,
    Tier,
)

__all__ = ["CoreConfig", "MasterCore"]

class MasterCore(Tiering):
    """Where every object lives: clients, segments, objects, leases, eviction."""

    def __init__(self, config: CoreConfig) -> None:
        self._config = config
        self._clients = ClientTable()
        self._segments = SegmentTable()
        self._objects = ObjectTable(track_children=config.eviction_policy == "prefix-lru")
        self._deferred = leases.DeferredFrees()
        self._quarantine = leases.DeferredFrees()  # restored free space, see restore()
        self._lease_counters = leases.LeaseCounters()
        # the number of the latest lease a proven reader took: numbers go up by the count of
        # partitions from this one's index, so a lease's number names its partition
        self.last_lease_id = config.partition_index
        self._open_leases = leases.OpenLeases()
        self._counters = Counters()
        self._events: list[Event] = []
        self._watermark_retry_s: dict[Tier, float] = {}
        self.relief_due: set[Tier] = set()
        self._upkeep_turn = 0
        self._copies = CopyTable(config.part)
        self._jobs: list[RemoveJob] = []
        self._recent_puts = {}
        self._walk = TableWalk()

    @property
    def config(self) -> CoreConfig:
        """The configuration this core was built with."""
        return self._config

    # ---- clients -------------------------------------------------------------------------

    def register_client(self, client_id: ClientId, host_id: str, capability_key: bytes,
                        now: float, token: bytes = b"") -> tuple[Status, bytes]:
        """Register (or re-register) a client; return (status, the key it must use).

        A new id gets ``capability_key``. A known id (live, or restored from persisted state)
        keeps its key, and only a caller presenting its token (``capability.client_token``
        of that key) may re-register it: anyone else gets CLIENT_ALREADY_EXISTS (key empty;
        ``holder_expires_in_s`` says for how long at most).
        Fails with INVALID_ARGUMENT (malformed id or key; key returned empty).
        """
        if registration_error(client_id, host_id, capability_key):
            return Status.INVALID_ARGUMENT, b""
        client = self._clients.get(client_id)
        if client is not None and not hmac.compare_digest(
                client.token, token if type(token) is bytes else b""):
            self._counters.registrations_refused += 1
            return Status.CLIENT_ALREADY_EXISTS, b""
        if client is not None and not client.restored:
            client.last_heartbeat_s = now
            return Status.OK, client.capability_key
        if client is None:
            client = ClientState(client_id, host_id, capability_key, now)
            self._clients.add(client)
        client.restored = False
        client.host_id = host_id
        client.last_heartbeat_s = now
        self._counters.clients_registered += 1
        self._events.append(ClientRegistered(client_id, host_id, client.capability_key))
        return Status.OK, client.capability_key

    def join_client(self, client_id: ClientId, host_id: str, capability_key: bytes,
                    now: float, ticket_number: int) -> tuple[Status, bytes]:
        """Register a client partition 0 of a partitioned index registered with
        ``capability_key`` (the caller checked partition 0's ticket number ``ticket_number``
        for it): as ``register_client`` with the token of that key. A client this partition
        knows under another key by an older ticket is an earlier holder of the id, which
        partition 0 let go: it leaves as an expired client does first. A ticket older than
        the one the known client joined with is an earlier holder's: CLIENT_ALREADY_EXISTS,
        nothing changes."""
        if registration_error(client_id, host_id, capability_key):
            return Status.INVALID_ARGUMENT, b""
        client = self._clients.get(client_id)
        if client is not None and not hmac.compare_digest(client.capability_key,
                                                          capability_key):
            if ticket_number <= client.ticket_number:
                self._counters.registrations_refused += 1
                return Status.CLIENT_ALREADY_EXISTS, b""
            self._drop_client(client_id, now)
            self._counters.clients_expired += 1
            self._events.append(ClientExpired(client_id))
        status, key = self.register_client(client_id, host_id, capability_key, now,
                                           client_token(capability_key))
        joined = self._clients.get(client_id)
        if status == Status.OK and joined is not None:
            joined.ticket_number = max(joined.ticket_number, ticket_number)
        return status, key

    def holder_expires_in_s(self, client_id: ClientId, now: float) -> float:
        """Seconds until the holder of ``client_id`` expires unless it heartbeats (or, restored,
        re-registers) meanwhile; 0 when the id is free."""
        client = self._clients.get(client_id)
        if client is None:
            return 0.0
        until_s = (client.restore_deadline_s if client.restored
                   else client.last_heartbeat_s + self._config.client_ttl_s)
        return max(until_s - now, 0.0)

    def authenticate(self, client_id: ClientId, token: bytes) -> Status:
        """Whether a client-scoped call may act as ``client_id``: OK, or UNKNOWN_CLIENT when
        the caller is not that client as this master knows it (not registered in this master's
        lifetime, or a token that is not its current one). A client holding a stale token
        (it re-registered meanwhile) re-registers and retries, as after a master restart; an
        impostor learns nothing and is counted."""
        if self._clients.proven(client_id, token) is not None:
            return Status.OK
        if self._clients.live(client_id) is not None:
            self._counters.calls_unauthenticated += 1
        return Status.UNKNOWN_CLIENT

    def heartbeat(self, client_id: ClientId, now: float) -> Status:
        """Mark the client alive. Returns OK, or UNKNOWN_CLIENT (re-register and remount)."""
        client = self._clients.live(client_id)
        if client is None:
            return Status.UNKNOWN_CLIENT
        client.last_heartbeat_s = now
        return Status.OK

    def unregister_client(self, client_id: ClientId, now: float) -> Status:
        """Close a client gracefully: its segments, their objects and its PENDING puts go.

        Returns OK or UNKNOWN_CLIENT.
        """
        if self._clients.get(client_id) is None:
            return Status.UNKNOWN_CLIENT
        self._drop_client(client_id, now)
        self._events.append(ClientUnregistered(client_id))
        return Status.OK

    # ---- segments ------------------------------------------------------------------------

    def mount_segment(self, segment: SegmentInfo, now: float) -> Status:
        """Make ``segment`` usable for placements. Idempotent for an identical remount.

        Remounting a restored segment with the same descriptor keeps its objects; with a
        different descriptor they are dropped first (the memory behind it is new).
        Fails with INVALID_ARGUMENT (malformed, or larger than 2**46 bytes), UNKNOWN_CLIENT
        (owner not registered), SEGMENT_ALREADY_EXISTS (a mounted segment with this id and
        another descriptor, or a restored one of another owner), RESOURCE_EXHAUSTED (the
        owner already has ``max_segments_per_client`` segments), PERMISSION_DENIED (an
        engine endpoint where ``engine_transport`` is "refuse", none where it is "require")
        or, with ``defer_upkeep``, UNAVAILABLE: a segment lost under this id is still being
        swept (``sweeps.py``), try again once it is (the server answers the call then). Without
        ``defer_upkeep`` that sweep is finished here, at once.
        """
        if not isinstance(segment, SegmentInfo) or segment_info_error(segment):
            return Status.INVALID_ARGUMENT
        policy = self._config.engine_transport
        if policy != "allow" and bool(segment.engine_endpoint) != (policy == "require"):
            return Status.PERMISSION_DENIED
        if self._clients.live(segment.client_id) is None:
            return Status.UNKNOWN_CLIENT
        existing = self._segments.get(segment.segment_id)
        if existing is not None:
            if existing.mounted:
                return Status.OK if existing.info == segment else Status.SEGMENT_ALREADY_EXISTS
            if existing.info.client_id != segment.client_id:
                return Status.SEGMENT_ALREADY_EXISTS   # restored for another owner
            if existing.info == segment:
                self._segments.mark_mounted(existing)
                self._events.append(SegmentMounted(segment))
                return Status.OK
            self._lose_segment(existing, now)
        elif (self._segments.client_to_num_segments.get(segment.client_id, 0)
              >= self._config.max_segments_per_client):
            return Status.RESOURCE_EXHAUSTED
        if self.defer_upkeep and segment.segment_id in self._segments.dying:
            return Status.UNAVAILABLE
        self._mount_fresh(segment, now)
        if segment.tier == Tier.SSD:
            build_dram_order(self._objects, self._segments)
        return Status.OK

    def unmount_segment(self, client_id: ClientId, segment_id: SegmentId, now: float) -> Status:
        """Withdraw a segment: at once no read or placement sees it; objects whose every
        replica sat on it are dropped as ``sweep`` reaches them (``sweeps.py``).

        Fails with UNKNOWN_CLIENT, SEGMENT_NOT_FOUND or PERMISSION_DENIED (not the owner).
        """
        if self._clients.live(client_id) is None:
            return Status.UNKNOWN_CLIENT
        state = self._segments.get(segment_id) if isinstance(segment_id, str) else None
        if state is None:
            return Status.SEGMENT_NOT_FOUND
        if state.info.client_id != client_id:
            return Status.PERMISSION_DENIED
        self._lose_segment(state, now)
        return Status.OK

    def get_segments(self, segment_ids: Sequence[str]) -> list[SegmentInfo | None]:
        """Return the descriptor of each mounted segment, None for unknown or not mounted."""
        if len(segment_ids) > self._config.max_batch_keys:
            return [None] * len(segment_ids)
        get = self._segments.id_to_segment.get
        result: list[SegmentInfo | None] = []
        for segment_id in segment_ids:
            state = get(SegmentId(segment_id)) if isinstance(segment_id, str) else None
            result.append(state.info if state is not None and state.mounted else None)
        return result

    def segment_key(self, segment_id: SegmentId) -> bytes | None:
        """Return the capability key of the segment's owner, or None when either is unknown."""
        state = self._segments.get(segment_id) if isinstance(segment_id, str) else None
        if state is None:
            return None
        client = self._clients.get(state.info.client_id)
        return client.capability_key if client is not None else None

    # ---- reads (each OK item grants or extends a read lease) -------------------------------

    def get_replicas(self, keys: Sequence[ObjectKey], now: float,
                     reader: ClientId | None = None,
                     lease_id: int = 0) -> Sequence[ReadResult[Extent]]:
        """Return one ReadResult per key (``ReadColumns``, or for a refused call a list): OK
        with placements, NOT_FOUND (absent or PENDING),
        INVALID_KEY, or INVALID_ARGUMENT for an oversized batch. With ``reader`` (a proven
        client) the leases are its lease ``self.last_lease_id``, which it may end early
        (``end_leases``); a call served in steps passes the lease its first step got as
        ``lease_id``, and each later step's keys join that lease."""
        if len(keys) > self._config.max_batch_keys:
            return [ReadResult(int(Status.INVALID_ARGUMENT))] * len(keys)
        counters = self._lease_counters
        before = counters.leases_granted
        ttl_s = self._config.default_lease_ttl_s
        covered: list[ObjectKey] | None = None
        if reader is not None:
            if not 0 < lease_id <= self.last_lease_id:
                self.last_lease_id += self._config.partition_count
                lease_id = self.last_lease_id
            covered = []
        results = leases.get_replicas(self._objects, self._segments, keys, now, ttl_s,
                                      self._config.max_key_bytes, counters, reader,
                                      lease_id, covered)
        if covered:
            self._open_leases.add(lease_id, reader,  # type: ignore[arg-type]
                                  covered, now + ttl_s)
        if self._objects.dram_order is not None and \
                self._segments.tier_to_capacity_bytes[Tier.SSD]:
            hit = [(key, r.placements[0]) for key, r in zip(keys, results, strict=True)
                   if r.status == 0]
            self._note_ssd_hits([key for key, _ in hit], [p for _, p in hit])
        self._counters.read_keys += len(keys)
        self._counters.read_hit_keys += counters.leases_granted - before
        return results

    def end_lease(self, reader: ClientId, lease_id: int, now: float) -> None:
        """``reader`` (a proven client) finished reading under its lease ``lease_id``: take
        that lease's share off its hold on each object the lease covered (once; nothing for a
        lease that is not the reader's, ended already or ran out). Objects no one else holds
        lose their protection (evictable, removable); force-removed ones free their bytes
        now."""
        keys = self._open_leases.take(lease_id, reader)
        if keys:
            leases.end_leases(self._objects, self._deferred, self._segments, reader, lease_id,
                              keys, now, self._lease_counters)

    def exist(self, keys: Sequence[ObjectKey], now: float) -> tuple[list[Status], list[int]]:
        """Return (statuses, sizes_bytes): OK | NOT_FOUND | INVALID_KEY per key (INVALID_ARGUMENT
        for an oversized batch); size is 0 unless OK."""
        if len(keys) > self._config.max_batch_keys:
            return [Status.INVALID_ARGUMENT] * len(keys), [0] * len(keys)
        counters = self._lease_counters
        before = counters.leases_granted
        result = leases.exist(self._objects, self._segments, keys, now,
                              self._config.default_lease_ttl_s, self._config.max_key_bytes,
                              counters)
        self._counters.read_keys += len(keys)
        self._counters.read_hit_keys += counters.leases_granted - before
        return result

    def query_prefix(self, keys: Sequence[ObjectKey], now: float) -> int:
        """Return how many leading keys are READY, leasing those. An oversized batch answers 0
        and changes nothing."""
        if len(keys) > self._config.max_batch_keys:
            return 0
        count = leases.query_prefix(self._objects, self._segments, keys, now,
                                    self._config.default_lease_ttl_s, self._lease_counters)
        counters = self._counters
        counters.lookup_queries += 1
        counters.lookup_keys += len(keys)
        counters.lookup_hit_keys += count
        return count

    def tiers_of(self, keys: Sequence[ObjectKey]) -> list[Tier] | None:
        """The tier of each key's fastest replica (DRAM for a key not READY), or None when no
        SSD segment was ever mounted (everything is in DRAM). Changes nothing."""
        if self._objects.dram_order is None:
            return None
        get = self._objects.get
        segment_of = self._segments.id_to_segment.get
        tiers: list[Tier] = []
        for key in keys:
            entry = get(key) if type(key) is bytes else None
            state = segment_of(entry.segment_id) \
                if entry is not None and entry.writer_id is None else None
            tiers.append(state.info.tier if state is not None else Tier.DRAM)
        return tiers

    # ---- housekeeping --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Expire silent clients, drop restored state past its grace period, reclaim stale
        PENDING objects, free extents whose lease ended, and run a background eviction pass
        on every tier above its high watermark (with ``defer_upkeep``: note it for
        ``relieve``)."""
        self._deferred.release_due(self._segments, now)
        self._quarantine.release_due(self._segments, now)
        self._open_leases.expire(now)
        for client_id in self._clients.find_expired(now, self._config.client_ttl_s):
            self._drop_client(client_id, now)
            self._counters.clients_expired += 1
            self._events.append(ClientExpired(client_id))
        for state in [s for s in self._segments.id_to_segment.values()
                      if not s.mounted and now > s.restore_deadline_s]:
            self._lose_segment(state, now)
        self._reclaim_stale(now)
        if self.sweeping:
            self.sweep(now)
        for tier in Tier:
            self._relieve_watermark(tier, now)   # deferred (the server): noted in relief_due
        if self._copies.id_to_task and now - self._copies.expired_s >= 1.0:
            self._copies.expired_s = now  # a walk over every task: once a second is enough
            self._expire_copies(now)
        self._plan_copies(now)

    def upkeep(self, now: float) -> bool:
        """One step of the work a server runs between requests: a sweep step (``sweep``) or a
        deferred watermark pass (``relieve``), taking turns while both have work; True while
        either has."""
        for _ in range(2):
            turn = self._upkeep_turn
            self._upkeep_turn = 1 - turn
            if turn == 0 and self.sweeping:
                self.sweep(now)
                break
            if turn == 1 and self.relief_due:
                self.relieve(now)
                break
        return self.upkeep_due

    @property
    def upkeep_due(self) -> bool:
        """Whether ``upkeep`` has work."""
        return self.sweeping or bool(self.relief_due)

    def take_events(self) -> list[Event]:
        """Return and forget the events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self, with_segments: bool = True) -> CoreStats:
        """Return a copy of every counter and gauge (see ``core/stats.py``); its ``segments``
        only ``with_segments`` (a row per segment: ``segment_stats_steps`` hands them out a
        few at a time)."""
        return build_stats(self._clients, self._segments, self._objects, self._deferred,
                           self._quarantine, self._counters, self._lease_counters,
                           len(self._copies.id_to_task), self.sweep_backlog_keys(),
                           self.held_extents(), with_segments)

    def segment_stats_steps(self, max_segments: int) -> Iterator[list[SegmentStats]]:
        """The rows of ``stats().segments``, ``max_segments`` at a time, each list made when it
        is asked for: a caller may take them between other calls (the segments known at the
        first; one lost since shows as it was when lost)."""
        states = list(self._segments.id_to_segment.values())
        for start in range(0, len(states), max_segments):
            yield list(map(segment_stats, states[start:start + max_segments]))

    def mounted_segment_ids(self) -> list[SegmentId]:
        """The ids of the segments mounted now."""
        return [state.info.segment_id for state in self._segments.mounted]

    # ---- persistence (see core/snapshot.py and kvpool_master/persist.py) -------------------

    def snapshot(self) -> Snapshot:
        """Return the durable state (clients, segments, READY objects in LRU order).

        Its ``objects`` is an iterator over the live table: consume it before the next call
        into the core.
        """
        return take_snapshot(self._clients, self._segments, self._objects)

    def start_snapshot(self) -> Snapshot:
        """Start a snapshot taken a step at a time between calls: return the clients and
        segments as they are now (its ``objects`` is empty); ``snapshot_step`` then hands out
        the rows of every object READY now that is still there when its step comes, in LRU
        order as of now. It is fuzzy: what changes meanwhile may show either way, so it is
        only whole with every change logged since this call applied on top (what a state log
        does: a commit row is a whole state, a removal idempotent). Reads meanwhile move
        objects in the LRU order only afterwards (``settle``)."""
        self._objects.recency.start_walk()
        return snapshot_head(self._clients, self._segments)

    def snapshot_step(self, max_objects: int) -> list[Chunk] | None:
        """The next objects (up to ``max_objects`` looked at) of the snapshot started by
        ``start_snapshot``, as chunks (``core/snapshot.py``); None once it is complete (or
        was ended)."""
        return walk_chunks(self._objects, max_objects, self._segments.dying)

    def snapshot_chunks(self, max_objects: int) -> Iterator[Chunk]:
        """Every READY object in LRU order, as chunks of ``max_objects`` at most: the objects
        of ``snapshot``, as a snapshot file holds them. Consume it before the next call into
        the core."""
        return all_chunks(self._objects, max_objects, self._segments.dying)

    def end_snapshot(self) -> None:
        """Abandon the snapshot started by ``start_snapshot`` (``settle`` still has to run)."""
        self._objects.recency.end_walk()

    @property
    def settling(self) -> bool:
        """A stepped snapshot runs, or the reads it held back still have to move (``settle``)."""
        return self._objects.recency.walking

    def settle(self, max_objects: int | None) -> bool:
        """After a stepped snapshot, move up to ``max_objects`` (all with None) of the objects
        read meanwhile to the recent end, in the order they were read; True while more are
        left."""
        return self._objects.recency.settle(max_objects)

    def restore(self, snapshot: Snapshot, now: float, grace_s: float) -> RestoreCounts:
        """Load ``snapshot`` into this fresh core; return what was restored and dropped.

        Restored clients must register again and remount their segments (identical
        descriptors) before ``now + grace_s``; objects on a segment are readable once it is
        remounted and dropped if it is not remounted in time. Objects claiming overlapping
        extents are all dropped (counted). The free space of every restored segment is
        quarantined until ``now + write_capability_ttl_s``: a writer of the previous master may
        still hold a write capability for it (PENDING puts are not persisted), and none lives
        longer than that.
        Emits no events (the state came from the log). Raises ``ValueError`` when the core is
        not fresh.
        """
        counts = restore_into(self._clients, self._segments, self._objects, snapshot, now,
                              grace_s, self._config.max_key_bytes, self._config.part)
        if any(s.info.tier == Tier.SSD for s in self._segments.id_to_segment.values()):
            build_dram_order(self._objects, self._segments)
        until_s = now + self._config.write_capability_ttl_s
        for state in self._segments.id_to_segment.values():
            for offset, size_bytes in state.allocator.reserve_free():
                self._quarantine.add(until_s, state, offset, size_bytes, 0)
        return counts

    # ---- durability of frees (persist.py drives it) ------------------------------------

    def skip_object_events(self) -> None:
        """From now on commits and removals make no event (``ObjectCommitted``,
        ``ObjectRemoved``): nothing reads them without a state directory, and making them is
        about a third of a put's cost in the core. Every other event stays."""
        self.object_events = False

    def track_durability(self) -> None:
        """From now on a placement may reuse freed bytes only once the free is durable:
        ``put_start`` emits ``SyncRequired`` when one does, and ``mark_durable`` says what is.
        Without it (no state directory) every free counts as durable at once."""
        self._segments.track_durability()

    @property
    def free_seq(self) -> int:
        """Number of the latest free (covered by the events taken so far)."""
        return self._segments.free_seq

    def mark_durable(self, free_seq: int) -> None:
        """Every free up to number ``free_seq`` is durable (its record is synced)."""
        self._segments.mark_durable(free_seq)

    # ---- helpers shared with mutations.py ------------------------------------------------

    def _drop_client(self, client_id: ClientId, now: float) -> None:
        objects = self._objects
        for key in [k for k in objects.pending_key_to_started_s
                    if objects.shards[hash(k) & SHARD_MASK][k].writer_id == client_id]:
            self._reclaim(key, now)
        for state in self._segments.owned_by(client_id):
            self._lose_segment(state, now)
        self._drop_copies_of(client_id)
        self._clients.discard(client_id)

    def _reclaim_stale(self, now: float) -> None:
        timeout_s = self._config.put_start_discard_timeout_s
        stale: list[ObjectKey] = []
        for key, started_s in self._objects.pending_key_to_started_s.items():
            if now - started_s <= timeout_s:
                break  # started in order: everything after is younger
            stale.append(key)
        for key in stale:
            self._reclaim(key, now)
