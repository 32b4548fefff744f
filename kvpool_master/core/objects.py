"""The object table: every PENDING and READY object, kept in recency order.

Rules of this file:
- ``key_to_object`` is an ``OrderedDict`` whose order IS the LRU order: a put appends, a commit
  or a successful read moves the key to the end, so eviction walks it from the front. One
  structure serves lookups and recency, which keeps a million objects small (see
  ``benchmarks/master_core.py``).
- An object is PENDING while ``writer_id`` is set (only its writer may commit or revoke it;
  readers never see it) and READY once ``writer_id`` is None. Objects are write-once.
- Per-object state is one slotted ``ObjectEntry`` holding the placements tuple that reads hand
  out as is (no per-read allocation of placements).
- ``parent_to_num_children`` counts READY children per parent key; only the prefix-lru policy
  needs it, so it is kept only then.
- ``dram_order`` (None until an SSD segment is first mounted, see ``core/tiering.py``) holds the
  objects with a replica in DRAM in their own recency order, so a DRAM eviction or demotion
  pass never walks past the objects that live on SSD only. Puts always land in DRAM; the
  tiering code moves keys in and out of it when replicas change tier.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool_wire.types import ClientId, ObjectKey, Pin, Placement


class ObjectEntry:
    """One object. ``lease_expiry_s`` is 0.0 until its first read: the time until which its
    bytes are protected, the latest of every live lease on it. ``holds`` (None unless a reader
    that can end its leases holds one) maps each such reader to (lease id, expiry) of its latest
    lease, and ``""`` to the expiry of the leases no reader can end (see ``leases``).

    ``key`` is the very bytes object the table is keyed by: a child naming this object as its
    parent stores a reference to it instead of a copy (chains of blocks are the common case).
    """

    __slots__ = ("key", "size_bytes", "placements", "writer_id", "lease_expiry_s", "pin",
                 "checksum", "parent_key", "holds")

    def __init__(self, key: ObjectKey, size_bytes: int, placements: tuple[Placement, ...],
                 writer_id: ClientId | None, pin: Pin, parent_key: ObjectKey | None,
                 checksum: int = 0, lease_expiry_s: float = 0.0) -> None:
        self.key = key
        self.size_bytes = size_bytes
        self.placements = placements
        self.writer_id = writer_id
        self.lease_expiry_s = lease_expiry_s
        self.pin = pin
        self.checksum = checksum
        self.parent_key = parent_key
        self.holds: dict[str, tuple[int, float, int]] | None = None


class ObjectTable:
    """Objects by key in recency order, PENDING objects by start time, chain child counts."""

    def __init__(self, track_children: bool) -> None:
        self.key_to_object: OrderedDict[ObjectKey, ObjectEntry] = OrderedDict()
        self.pending_key_to_started_s: OrderedDict[ObjectKey, float] = OrderedDict()
        self.parent_to_num_children: dict[ObjectKey, int] = {}
        self.track_children = track_children
        self.ready_bytes = 0  # logical bytes of READY objects (one copy each)
        self.size_to_int: dict[int, int] = {}  # interned object sizes (see put_start)
        self.dram_order: OrderedDict[ObjectKey, ObjectEntry] | None = None

    def __len__(self) -> int:
        return len(self.key_to_object)

    def add_pending(self, key: ObjectKey, entry: ObjectEntry, now: float) -> None:
        """Insert a new PENDING object (its key must be absent)."""
        self.key_to_object[key] = entry
        self.pending_key_to_started_s[key] = now
        if self.dram_order is not None:
            self.dram_order[key] = entry

    def commit(self, key: ObjectKey, entry: ObjectEntry, checksum: int) -> None:
        """Make a PENDING object READY and most recently used."""
        entry.writer_id = None
        entry.checksum = checksum
        del self.pending_key_to_started_s[key]
        self.key_to_object.move_to_end(key)
        if self.dram_order is not None and key in self.dram_order:
            self.dram_order.move_to_end(key)
        self.ready_bytes += entry.size_bytes
        if self.track_children and entry.parent_key is not None:
            counts = self.parent_to_num_children
            counts[entry.parent_key] = counts.get(entry.parent_key, 0) + 1

    def add_ready(self, key: ObjectKey, entry: ObjectEntry) -> None:
        """Insert a READY object at the most recent end (restore and tests)."""
        self.key_to_object[key] = entry
        self.ready_bytes += entry.size_bytes
        if self.track_children and entry.parent_key is not None:
            counts = self.parent_to_num_children
            counts[entry.parent_key] = counts.get(entry.parent_key, 0) + 1

    def pop(self, key: ObjectKey) -> ObjectEntry:
        """Remove ``key`` (which must be present) from every index and return its entry."""
        entry = self.key_to_object.pop(key)
        if self.dram_order is not None:
            self.dram_order.pop(key, None)
        if entry.writer_id is not None:
            del self.pending_key_to_started_s[key]
            return entry
        self.ready_bytes -= entry.size_bytes
        parent = entry.parent_key
        if self.track_children and parent is not None:
            counts = self.parent_to_num_children
            remaining = counts[parent] - 1
            if remaining:
                counts[parent] = remaining
            else:
                del counts[parent]
        return entry

    def touch(self, keys: list[ObjectKey]) -> None:
        """Move ``keys`` (read just now, all present) to the recent end of ``dram_order``
        (the main order was moved by the read itself)."""
        order = self.dram_order
        if order is not None:
            for key in keys:
                if key in order:
                    order.move_to_end(key)

    def shared_key(self, key: ObjectKey) -> ObjectKey:
        """Return the table's own copy of ``key`` when present (to share it), else ``key``."""
        entry = self.key_to_object.get(key)
        return entry.key if entry is not None else key

    def num_children(self, key: ObjectKey) -> int:
        """Return how many READY objects name ``key`` as their parent (prefix-lru only)."""
        return self.parent_to_num_children.get(key, 0)
