"""Counters and gauges of the master core, read by ``metrics.py`` and ``/status``.

Rules of this file:
- The core bumps plain integer counters (``Counters``) on its own paths; batch paths bump once
  per batch, never per key. ``MasterCore.stats()`` copies them, with gauges computed on demand,
  into one frozen ``CoreStats``. The core never reads metrics back.
- Counters only grow (Prometheus ``_total`` semantics) for the lifetime of one core.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpool_master.core.clients import ClientTable
from kvpool_master.core.leases import DeferredFrees, LeaseCounters
from kvpool_master.core.objects import ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_wire.types import ClientId, SegmentId, Tier


class Counters:
    """Monotonic counters of one core."""

    __slots__ = ("put_started", "put_committed", "put_revoked", "put_no_space", "evicted_objects",
                 "evicted_bytes", "eviction_passes", "removed_objects", "segment_lost_objects",
                 "pending_reclaimed", "clients_registered", "clients_expired",
                 "registrations_refused", "calls_unauthenticated",
                 "lookup_queries", "lookup_keys", "lookup_hit_keys", "read_keys", "read_hit_keys",
                 "evicted_replicas", "ssd_read_hit_keys", "demotions_started", "demotions_done",
                 "demotions_failed", "promotions_started", "promotions_done",
                 "promotions_failed", "copies_expired")

    def __init__(self) -> None:
        self.put_started = 0
        self.put_committed = 0
        self.put_revoked = 0
        self.put_no_space = 0
        self.evicted_objects = 0
        self.evicted_bytes = 0
        self.eviction_passes = 0
        self.removed_objects = 0
        self.segment_lost_objects = 0
        self.pending_reclaimed = 0
        self.clients_registered = 0
        self.clients_expired = 0
        self.registrations_refused = 0
        self.calls_unauthenticated = 0
        self.lookup_queries = 0
        self.lookup_keys = 0
        self.lookup_hit_keys = 0
        self.read_keys = 0
        self.read_hit_keys = 0
        self.evicted_replicas = 0  # evicted from one tier, kept on another
        self.ssd_read_hit_keys = 0  # reads answered from SSD only
        self.demotions_started = 0
        self.demotions_done = 0
        self.demotions_failed = 0
        self.promotions_started = 0
        self.promotions_done = 0
        self.promotions_failed = 0
        self.copies_expired = 0


@dataclass(frozen=True, slots=True)
class SegmentStats:
    """Capacity and usage of one segment."""

    segment_id: SegmentId
    client_id: ClientId
    tier: Tier
    mounted: bool  # False: restored from a persisted index, waiting for its owner
    capacity_bytes: int
    used_bytes: int
    num_free_extents: int
    largest_free_bytes: int


@dataclass(frozen=True, slots=True)
class CoreStats:
    """A consistent copy of every counter and gauge of the core at one moment."""

    num_clients: int
    num_segments: int                 # mounted
    num_restored_segments: int        # restored, waiting for a remount
    num_engine_endpoints: int         # distinct transfer-engine sessions of mounted segments
    num_objects: int                  # READY
    num_pending: int
    ready_bytes: int                  # logical bytes of READY objects, one copy each
    deferred_free_bytes: int          # bytes of force-removed objects still under a read lease
    quarantined_bytes: int            # restored free space held back after a restore
    tier_to_capacity_bytes: Mapping[Tier, int]
    tier_to_used_bytes: Mapping[Tier, int]
    segments: tuple[SegmentStats, ...]
    put_started_total: int            # keys answered OK by put_start (fresh placements)
    put_committed_total: int
    put_revoked_total: int
    put_no_space_total: int           # keys answered NO_SPACE
    evicted_objects_total: int
    evicted_bytes_total: int          # allocated bytes freed by eviction (all replicas)
    eviction_passes_total: int
    removed_objects_total: int        # by remove / remove_all / remove_by_regex
    segment_lost_objects_total: int
    pending_reclaimed_total: int
    clients_registered_total: int
    clients_expired_total: int
    registrations_refused_total: int  # a known id without its token
    calls_unauthenticated_total: int  # client-scoped calls with a wrong token
    leases_granted_total: int         # successful reads (each grants or extends a lease)
    leases_lapsed_total: int          # leases seen to have run out unrenewed
    leases_ended_total: int           # holds their readers ended once done reading
    lookup_queries_total: int         # query_prefix calls
    lookup_keys_total: int            # keys asked by query_prefix
    lookup_hit_keys_total: int        # leading READY keys answered by query_prefix
    read_keys_total: int              # keys asked by get_replicas and exist
    read_hit_keys_total: int          # of which OK
    ssd_read_hit_keys_total: int      # of which answered from SSD only
    evicted_replicas_total: int       # evicted from one tier, kept on another
    demotions_started_total: int      # DRAM -> SSD copies asked of owners
    demotions_done_total: int         # ... committed
    demotions_failed_total: int       # ... failed or too late to commit
    promotions_started_total: int     # SSD -> DRAM copies asked of owners
    promotions_done_total: int
    promotions_failed_total: int
    copies_expired_total: int         # tier copies not reported within copy_task_ttl
    copies_in_flight: int             # tier copies waiting or being made
    sweep_backlog_keys: int           # about the table entries the sweeps have still to walk
    held_extents: int                 # extents of removed objects removal jobs still hold


def segment_stats(state: SegmentState) -> SegmentStats:
    """Capacity and usage of the segment ``state``, as they are now."""
    allocator = state.allocator
    return SegmentStats(state.info.segment_id, state.info.client_id, state.info.tier,
                        state.mounted, allocator.size_bytes, allocator.used_bytes,
                        allocator.num_free_extents, allocator.largest_free_bytes)


def build_stats(clients: ClientTable, segments: SegmentTable, objects: ObjectTable,
                deferred: DeferredFrees, quarantine: DeferredFrees, counters: Counters,
                leases: LeaseCounters, copies_in_flight: int = 0,
                sweep_backlog_keys: int = 0, held_extents: int = 0,
                with_segments: bool = True) -> CoreStats:
    """Return a consistent copy of every counter and gauge (``segments`` empty unless
    ``with_segments``: a row per segment grows with the cluster)."""
    return CoreStats(
        num_clients=len(clients),
        num_segments=len(segments.mounted),
        num_restored_segments=segments.num_restored,
        num_engine_endpoints=len({s.info.engine_endpoint for s in segments.mounted
                                  if s.info.engine_endpoint}),
        num_objects=len(objects) - len(objects.pending_key_to_started_s),
        num_pending=len(objects.pending_key_to_started_s),
        ready_bytes=objects.ready_bytes,
        deferred_free_bytes=deferred.num_bytes,
        quarantined_bytes=quarantine.num_bytes,
        tier_to_capacity_bytes=dict(segments.tier_to_capacity_bytes),
        tier_to_used_bytes=dict(segments.tier_to_used_bytes),
        segments=tuple(map(segment_stats, segments.id_to_segment.values()))
        if with_segments else (),
        put_started_total=counters.put_started,
        put_committed_total=counters.put_committed,
        put_revoked_total=counters.put_revoked,
        put_no_space_total=counters.put_no_space,
        evicted_objects_total=counters.evicted_objects,
        evicted_bytes_total=counters.evicted_bytes,
        eviction_passes_total=counters.eviction_passes,
        removed_objects_total=counters.removed_objects,
        segment_lost_objects_total=counters.segment_lost_objects,
        pending_reclaimed_total=counters.pending_reclaimed,
        clients_registered_total=counters.clients_registered,
        clients_expired_total=counters.clients_expired,
        registrations_refused_total=counters.registrations_refused,
        calls_unauthenticated_total=counters.calls_unauthenticated,
        leases_granted_total=leases.leases_granted,
        leases_lapsed_total=leases.leases_lapsed,
        leases_ended_total=leases.leases_ended,
        lookup_queries_total=counters.lookup_queries,
        lookup_keys_total=counters.lookup_keys,
        lookup_hit_keys_total=counters.lookup_hit_keys,
        read_keys_total=counters.read_keys,
        read_hit_keys_total=counters.read_hit_keys,
        ssd_read_hit_keys_total=counters.ssd_read_hit_keys,
        evicted_replicas_total=counters.evicted_replicas,
        demotions_started_total=counters.demotions_started,
        demotions_done_total=counters.demotions_done,
        demotions_failed_total=counters.demotions_failed,
        promotions_started_total=counters.promotions_started,
        promotions_done_total=counters.promotions_done,
        promotions_failed_total=counters.promotions_failed,
        copies_expired_total=counters.copies_expired,
        copies_in_flight=copies_in_flight,
        sweep_backlog_keys=sweep_backlog_keys,
        held_extents=held_extents,
    )
