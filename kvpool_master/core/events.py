"""Side effects of the master core, drained by the server with ``MasterCore.take_events()``.

Rules of this file:
- Every event is a frozen, slotted dataclass (those made per key built with ``fast_init``);
  the core appends them in the order the changes happened, so replaying them in order
  (``kvpool_master/persist.py``) rebuilds the same index.
- Events describe durable facts only (clients, segments, committed objects, removals). Reads,
  leases and PENDING objects are not events: they are either too hot or not worth keeping
  across a restart.
- ``SegmentUnmounted`` implies that every replica on that segment is gone (reads no longer see
  them); the objects that lost their only replica are announced with
  ``ObjectRemoved(reason="segment_lost")`` as the sweep of the segment reaches them, after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpool_wire.records import fast_init
from kvpool_wire.types import ClientId, Extent, ObjectKey, Pin, SegmentId, SegmentInfo

RemoveReason = Literal["remove", "evict", "segment_lost", "revoke", "reclaim"]


@dataclass(frozen=True, slots=True)
class ClientRegistered:
    """A client registered (or re-registered after a restore) with this capability key."""

    client_id: ClientId
    host_id: str
    capability_key: bytes


@dataclass(frozen=True, slots=True)
class ClientExpired:
    """A client was silent for longer than ``client_ttl_s`` (or never came back after a restore)."""

    client_id: ClientId


@dataclass(frozen=True, slots=True)
class ClientUnregistered:
    """A client closed gracefully."""

    client_id: ClientId


@dataclass(frozen=True, slots=True)
class SegmentMounted:
    """A segment became usable (a fresh mount, or the remount of a restored one)."""

    segment: SegmentInfo


@dataclass(frozen=True, slots=True)
class SegmentUnmounted:
    """A segment and every replica on it are gone."""

    segment_id: SegmentId
    client_id: ClientId


@fast_init
@dataclass(frozen=True, slots=True)
class ObjectCommitted:
    """An object became READY (``put_end``)."""

    key: ObjectKey
    size_bytes: int
    placements: tuple[Extent, ...]
    checksum: int
    pin: Pin
    parent_key: ObjectKey | None


@dataclass(frozen=True, slots=True)
class ObjectsCommitted:
    """Objects of one replica each became READY together (a writer's batch, ``put_end``), as
    columns: the facts of one ``ObjectCommitted`` per object (``each``), in order, with no
    object made per key. The lists are never changed once made."""

    keys: list[ObjectKey]
    sizes_bytes: list[int]
    segment_ids: list[SegmentId]
    offsets: list[int]
    checksums: list[int]
    pins: list[Pin]
    parent_keys: list[ObjectKey | None]

    def each(self) -> list[ObjectCommitted]:
        """One ``ObjectCommitted`` per object, in order."""
        return [ObjectCommitted(key, size, (Extent(segment_id, offset, size),), checksum, pin,
                                parent)
                for key, size, segment_id, offset, checksum, pin, parent in zip(
                    self.keys, self.sizes_bytes, self.segment_ids, self.offsets,
                    self.checksums, self.pins, self.parent_keys, strict=True)]


@fast_init
@dataclass(frozen=True, slots=True)
class ReplicasChanged(ObjectCommitted):
    """A READY object gained a replica on another tier (a copy committed) or lost the ones on
    one tier (evicted from it while a copy elsewhere stays); ``placements`` is what it has now.
    Logged like a commit (the row is the object's new state)."""


@fast_init
@dataclass(frozen=True, slots=True)
class ObjectRemoved:
    """A READY or PENDING object left the index; ``reason`` says why."""

    key: ObjectKey
    size_bytes: int
    reason: RemoveReason


@dataclass(frozen=True, slots=True)
class EvictionPass:
    """One eviction pass finished (synchronous inside ``put_start`` or from ``tick``).

    Carries no duration: the core has no clock; the server times the call that ran it.
    """

    num_objects: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class PendingReclaimed:
    """A PENDING object was dropped: its writer vanished or did not commit in time."""

    key: ObjectKey


@dataclass(frozen=True, slots=True)
class SyncRequired:
    """The call that emitted it (always its last event) handed out a placement that may reuse
    bytes freed by a change not yet durable: its answer must wait until everything logged so
    far is synced (then ``MasterCore.mark_durable``), and must not go out if that fails.

    Only emitted once ``MasterCore.track_durability`` was called (a master with ``--state-dir``).
    """

    free_seq: int


Event = (ClientRegistered | ClientExpired | ClientUnregistered | SegmentMounted
         | SegmentUnmounted | ObjectCommitted | ObjectsCommitted | ReplicasChanged | ObjectRemoved
         | EvictionPass | PendingReclaimed | SyncRequired)
