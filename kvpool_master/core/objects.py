"""The object table: every PENDING and READY object, by key and in recency order.

Rules of this file:
- Lookups go through ``shards``: ``NUM_SHARDS`` plain dicts, an object in
  ``shards[hash(key) & SHARD_MASK]``. A dict that churns at a constant size rebuilds its whole
  table every so many inserts; one dict of ten million objects would stall the master for
  seconds each time, a shard for well under a millisecond. Hot loops index the shard inline
  (``table.get`` is the same, for the rest).
- Recency is a ``Recency``: a doubly linked list through the entries themselves (``older`` /
  ``newer``), least recently used first. A put appends, a commit or a successful read moves
  the object to the recent end, so eviction walks it from the front. No operation on it ever
  rebuilds anything.
- An object is PENDING while ``writer_id`` is set (only its writer may commit or revoke it;
  readers never see it) and READY once ``writer_id`` is None. Objects are write-once.
- Per-object state is one slotted ``ObjectEntry``. Its first replica lives in the entry itself
  (``segment_id``, ``offset``; its length is ``size_bytes``), any others in ``more`` (usually
  the empty tuple): at ten million objects a one-replica tuple and its ``Extent`` would cost
  about 100 bytes an object. ``extents()`` builds the replicas as ``Extent``s when a caller
  needs them (reads hand them out; the hot loops read the fields).
- ``child_counts`` (sharded like the objects) counts READY children per parent key; only the
  prefix-lru policy needs it, so it is kept only then.
- ``dram_order`` (None until an SSD segment is first mounted, see ``core/tiering.py``) is a
  second recency list of the objects with a replica in DRAM (through a ``_Link`` per object,
  ``entry.dram``), so a DRAM eviction or demotion pass never walks past the objects that live
  on SSD only. Puts always land in DRAM; the tiering code moves objects in and out of it when
  replicas change tier.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence

from kvpool_wire.types import ClientId, Extent, ObjectKey, Pin, SegmentId

#: Shards of the key index: ten million objects make about 10 k per shard.
NUM_SHARDS = 1024
SHARD_MASK = NUM_SHARDS - 1
#: ``set(map(type, column))`` of a column of keys, and of ints, when it is well formed: whole
#: columns (a batch's keys, a snapshot chunk's) are checked with one C-level map.
KEY_TYPES = frozenset({bytes})
INT_TYPES = frozenset({int})


class ObjectEntry:
    """One object. ``lease_expiry_s`` is 0.0 until its first read: the time until which its
    bytes are protected, the latest of every live lease on it. ``holds`` (None unless a reader
    that can end its leases holds one) maps each such reader to (lease id, expiry) of its latest
    lease, and ``""`` to the expiry of the leases no reader can end (see ``leases``).

    Replicas: the first is (``segment_id``, ``offset``, ``size_bytes``) and the rest are
    ``more`` (DRAM replicas come first, see ``core/tiering.py``). Every object has at least one.

    ``key`` is the very bytes object the table is keyed by: a child naming this object as its
    parent stores a reference to it instead of a copy (chains of blocks are the common case).
    ``older`` / ``newer`` link it into the table's recency list (None once out of it);
    ``dram`` is its link in ``dram_order`` (None when not in it).
    """

    __slots__ = ("key", "size_bytes", "segment_id", "offset", "more", "writer_id",
                 "lease_expiry_s", "pin", "checksum", "parent_key", "holds", "older", "newer",
                 "dram")

    def __init__(self, key: ObjectKey, size_bytes: int, segment_id: SegmentId, offset: int,
                 writer_id: ClientId | None, pin: Pin, parent_key: ObjectKey | None,
                 checksum: int = 0, more: tuple[Extent, ...] = ()) -> None:
        self.key = key
        self.size_bytes = size_bytes
        self.segment_id = segment_id
        self.offset = offset
        self.more = more
        self.writer_id = writer_id
        self.lease_expiry_s = 0.0
        self.pin = pin
        self.checksum = checksum
        self.parent_key = parent_key
        self.holds: dict[str, tuple[int, float, int]] | None = None
        self.older: ObjectEntry | _Link | None = None
        self.newer: ObjectEntry | _Link | None = None
        self.dram: _Link | None = None

    @classmethod
    def of_extents(cls, key: ObjectKey, size_bytes: int, extents: tuple[Extent, ...],
                   writer_id: ClientId | None, pin: Pin, parent_key: ObjectKey | None,
                   checksum: int = 0) -> ObjectEntry:
        """The entry of an object whose replicas are ``extents`` (at least one)."""
        first = extents[0]
        return cls(key, size_bytes, first.segment_id, first.offset, writer_id, pin, parent_key,
                   checksum, extents[1:])

    def extents(self) -> tuple[Extent, ...]:
        """The replicas, first one first (a new tuple: the entry keeps them as fields)."""
        first = Extent(self.segment_id, self.offset, self.size_bytes)
        return (first, *self.more) if self.more else (first,)

    def set_extents(self, extents: tuple[Extent, ...]) -> None:
        """Replace the replicas with ``extents`` (at least one, the fastest tier first)."""
        first = extents[0]
        self.segment_id = first.segment_id
        self.offset = first.offset
        self.more = extents[1:]

    def on_segment(self, segment_id: SegmentId) -> bool:
        """True when a replica is on ``segment_id``."""
        return self.segment_id == segment_id or any(p.segment_id == segment_id
                                                    for p in self.more)


_SIZE_OF = operator.attrgetter("size_bytes")
_NEWER = operator.attrgetter("newer")


class _Link:
    """A list's end (its sentinel), or an object's node in ``dram_order``."""

    __slots__ = ("older", "newer", "entry")

    def __init__(self, entry: ObjectEntry | None) -> None:
        self.older: ObjectEntry | _Link | None = None
        self.newer: ObjectEntry | _Link | None = None
        self.entry = entry


Node = ObjectEntry | _Link


class Recency:
    """Nodes least recently used first: a circular doubly linked list around one end node
    (``end.newer`` is the oldest, ``end.older`` the newest). Appending, touching and unlinking
    cost O(1); a node out of the list has ``newer`` None. Walks read a node's successor before
    handing the node out, so the walker may unlink the node it holds (and nothing else).

    A *stepped walk* (``start_walk``, ``walk``; the snapshot written between requests, see
    ``core/snapshot.py``) visits every node that was in the list when it started, once, in
    that order, a step at a time while the list changes between steps. Two ``_Link`` nodes
    with no entry mark it in the list (every other walk skips them): a cursor after the last
    node visited and a stop mark after the newest node at the start (nodes appended later come
    after it). Moving a READY object would let it jump the cursor unvisited, so from the start
    of a walk until ``settle`` has caught up, ``touch_all`` only notes the READY objects it is
    given and ``settle`` moves them afterwards, in the order they were touched. Meanwhile
    eviction sees those objects where they were when the walk started (their leases still
    protect the ones being read).
    """

    __slots__ = ("_end", "_count", "_of_links", "_cursor", "_stop", "_deferred", "_settled")

    def __init__(self, of_links: bool) -> None:
        end = _Link(None)
        end.older = end.newer = end
        self._end = end
        self._count = 0
        self._of_links = of_links  # nodes are _Links (walks yield their entries)
        self._cursor: _Link | None = None
        self._stop: _Link | None = None
        self._deferred: list[ObjectEntry] | None = None  # touches waiting for ``settle``
        self._settled = 0  # how many of ``_deferred`` are applied

    def __len__(self) -> int:
        return self._count

    @property
    def walking(self) -> bool:
        """A stepped walk runs, or its touches wait for ``settle``."""
        return self._deferred is not None

    def append(self, node: Node) -> None:
        """Link ``node`` (not in any list) at the recent end."""
        end = self._end
        last = end.older
        last.newer = node  # type: ignore[union-attr]
        node.older = last
        node.newer = end
        end.older = node
        self._count += 1

    def append_all(self, nodes: list[Node]) -> None:
        """Link ``nodes`` (in no list) at the recent end, in order (restore's bulk path)."""
        if not nodes:
            return
        end = self._end
        last = end.older
        for node in nodes:
            last.newer = node  # type: ignore[union-attr]
            node.older = last
            last = node
        last.newer = end  # type: ignore[union-attr]
        end.older = last
        self._count += len(nodes)

    def touch_all(self, nodes: Iterable[Node]) -> None:
        """Move each of ``nodes`` (in this list) to the recent end, in turn (one call for a
        batch: the moves are the hot path of every read). During a stepped walk READY
        objects are only noted (see the class)."""
        deferred = self._deferred
        if deferred is None:
            self._move_to_end(nodes)
            return
        pending: list[Node] = []
        for node in nodes:
            if node.writer_id is None:  # type: ignore[union-attr]
                deferred.append(node)  # type: ignore[arg-type]
            else:  # PENDING: never in a snapshot, free to move
                pending.append(node)
        self._move_to_end(pending)

    def _move_to_end(self, nodes: Iterable[Node]) -> None:
        end = self._end
        for node in nodes:
            newer = node.newer
            if newer is end:
                continue
            older = node.older
            older.newer = newer  # type: ignore[union-attr]
            newer.older = older  # type: ignore[union-attr]
            last = end.older
            last.newer = node  # type: ignore[union-attr]
            node.older = last
            node.newer = end
            end.older = node

    def unlink_all(self, nodes: list[Node]) -> None:
        """``unlink`` of each of ``nodes`` (in this list, distinct): one splice and C-level
        maps when they lie back to back, oldest first (an eviction pass's victims, mostly)."""
        if not nodes:
            return
        if not all(map(operator.is_, map(_NEWER, itertools.islice(nodes, len(nodes) - 1)),
                       itertools.islice(nodes, 1, None))):
            for node in nodes:
                self.unlink(node)
            return
        older = nodes[0].older
        newer = nodes[-1].newer
        older.newer = newer  # type: ignore[union-attr]
        newer.older = older  # type: ignore[union-attr]
        repeat = itertools.repeat
        deque(map(setattr, nodes, repeat("older"), repeat(None)), maxlen=0)
        deque(map(setattr, nodes, repeat("newer"), repeat(None)), maxlen=0)
        self._count -= len(nodes)

    def unlink(self, node: Node) -> None:
        """Take ``node`` (in this list) out of it."""
        older = node.older
        newer = node.newer
        older.newer = newer  # type: ignore[union-attr]
        newer.older = older  # type: ignore[union-attr]
        node.older = node.newer = None
        self._count -= 1

    def entries(self) -> Iterator[ObjectEntry]:
        """Walk the objects, least recently used first."""
        end = self._end
        node = end.newer
        if self._of_links:
            while node is not end:
                following = node.newer  # type: ignore[union-attr]
                yield node.entry  # type: ignore[union-attr,misc]
                node = following
        else:
            while node is not end:
                following = node.newer  # type: ignore[union-attr]
                if type(node) is ObjectEntry:  # not a stepped walk's mark
                    yield node
                node = following

    # ---- stepped walks ----------------------------------------------------------------------

    def start_walk(self) -> None:
        """Start a stepped walk (none may be running or settling: ``walking`` is False)."""
        assert self._deferred is None and not self._of_links
        self._cursor, self._stop = _Link(None), _Link(None)
        self._insert_after(self._cursor, self._end)
        self._insert_after(self._stop, self._end.older)  # type: ignore[arg-type]
        self._deferred = []
        self._settled = 0

    def walk(self, max_nodes: int) -> list[ObjectEntry] | None:
        """The next ``max_nodes`` objects of the walk at most; None once it has visited them
        all (it then ends, see ``end_walk``)."""
        cursor, stop = self._cursor, self._stop
        if cursor is None:
            return None
        visited: list[ObjectEntry] = []
        node = cursor.newer
        while node is not stop and len(visited) < max_nodes:
            visited.append(node)  # type: ignore[arg-type]
            node = node.newer  # type: ignore[union-attr]
        if not visited:
            self.end_walk()
            return None
        self._remove_mark(cursor)
        self._insert_after(cursor, visited[-1])
        return visited

    def end_walk(self) -> None:
        """End the walk now (done or abandoned); its noted touches wait for ``settle``."""
        for mark in (self._cursor, self._stop):
            if mark is not None:
                self._remove_mark(mark)
        self._cursor = self._stop = None

    def settle(self, max_nodes: int | None) -> bool:
        """Once the walk has ended, make up to ``max_nodes`` (all with None) of the touches it
        held back, in order; True while more are left (touches go on being noted until none
        is)."""
        deferred = self._deferred
        if deferred is None:
            return False
        if self._cursor is not None:
            return True
        start = self._settled
        stop = len(deferred) if max_nodes is None else min(len(deferred), start + max_nodes)
        self._move_to_end([node for node in itertools.islice(deferred, start, stop)
                           if node.newer is not None])  # still in the table
        if stop < len(deferred):
            self._settled = stop
            return True
        self._deferred = None
        self._settled = 0
        return False

    def _insert_after(self, mark: _Link, node: Node) -> None:
        following = node.newer
        mark.older = node
        mark.newer = following
        node.newer = mark
        following.older = mark  # type: ignore[union-attr]

    def _remove_mark(self, mark: _Link) -> None:
        mark.older.newer = mark.newer  # type: ignore[union-attr]
        mark.newer.older = mark.older  # type: ignore[union-attr]
        mark.older = mark.newer = None


class ObjectTable:
    """Objects by key in recency order, PENDING objects by start time, chain child counts."""

    def __init__(self, track_children: bool) -> None:
        self.shards: list[dict[ObjectKey, ObjectEntry]] = [{} for _ in range(NUM_SHARDS)]
        self.recency = Recency(of_links=False)
        self.pending_key_to_started_s: OrderedDict[ObjectKey, float] = OrderedDict()
        self.child_counts: list[dict[ObjectKey, int]] | None = \
            [{} for _ in range(NUM_SHARDS)] if track_children else None
        self.track_children = track_children
        self.ready_bytes = 0  # logical bytes of READY objects (one copy each)
        self.size_to_int: dict[int, int] = {}  # interned object sizes (see put_start)
        self.dram_order: Recency | None = None

    def __len__(self) -> int:
        return len(self.recency)

    def __contains__(self, key: object) -> bool:
        return type(key) is bytes and key in self.shards[hash(key) & SHARD_MASK]

    def get(self, key: ObjectKey) -> ObjectEntry | None:
        """Return the entry of ``key`` (bytes), or None."""
        return self.shards[hash(key) & SHARD_MASK].get(key)

    def entries(self) -> Iterator[ObjectEntry]:
        """Walk every object, least recently used first (the table must not change meanwhile,
        but for the walker dropping the entry it holds)."""
        return self.recency.entries()

    def add_pending(self, key: ObjectKey, entry: ObjectEntry, now: float) -> None:
        """Insert a new PENDING object (its key must be absent)."""
        self.shards[hash(key) & SHARD_MASK][key] = entry
        self.recency.append(entry)
        self.pending_key_to_started_s[key] = now
        if self.dram_order is not None:
            self.dram_add(entry)

    def add_pending_all(self, shards: list[dict[ObjectKey, ObjectEntry]],
                        keys: Sequence[ObjectKey], entries: list[ObjectEntry],
                        now: float) -> None:
        """``add_pending`` of each of ``entries`` (distinct keys, all absent; ``shards`` the
        shard of each key), in order, with C-level maps: a batch's inserts without a Python
        step per key."""
        deque(map(dict.__setitem__, shards, keys, entries), maxlen=0)
        self.recency.append_all(entries)  # type: ignore[arg-type]
        self.pending_key_to_started_s.update(zip(keys, itertools.repeat(now)))
        if self.dram_order is not None:
            for entry in entries:
                self.dram_add(entry)

    def commit_all(self, keys: Sequence[ObjectKey], entries: list[ObjectEntry],
                   checksums: Sequence[int] | None) -> None:
        """``commit`` of each of ``entries`` (PENDING, distinct, the entries of ``keys``) with
        its checksum (0 for each when None), with C-level maps."""
        deque(map(setattr, entries, itertools.repeat("writer_id"), itertools.repeat(None)),
              maxlen=0)
        if checksums is not None:  # a PENDING entry's checksum is 0 until its commit
            deque(map(setattr, entries, itertools.repeat("checksum"), checksums), maxlen=0)
        deque(map(self.pending_key_to_started_s.__delitem__, keys), maxlen=0)
        self.ready_bytes += sum(map(_SIZE_OF, entries))
        if self.child_counts is not None:
            for entry in entries:
                if entry.parent_key is not None:
                    self._count_child(entry.parent_key, 1)

    def commit(self, key: ObjectKey, entry: ObjectEntry, checksum: int) -> None:
        """Make a PENDING object READY. The caller makes it most recently used (``touch_all``
        on the batch's commits, in order)."""
        entry.writer_id = None
        entry.checksum = checksum
        del self.pending_key_to_started_s[key]
        self.ready_bytes += entry.size_bytes
        if self.child_counts is not None and entry.parent_key is not None:
            self._count_child(entry.parent_key, 1)

    def add_ready(self, key: ObjectKey, entry: ObjectEntry) -> None:
        """Insert a READY object at the most recent end (tests)."""
        self.add_ready_all([entry])

    def add_ready_all(self, entries: list[ObjectEntry],
                      share_parents: bool = True) -> list[ObjectEntry]:
        """Insert READY objects at the most recent end, in order (restore, a chunk at a time);
        an entry whose key is present already (in the table, or earlier in ``entries``) is
        left out. A parent key present in the table by then is shared (``shared_key``) unless
        ``share_parents`` is False (the caller shared them). Returns the entries added."""
        shards = self.shards
        counts = self.child_counts
        added: list[ObjectEntry] = []
        append = added.append
        for entry in entries:
            key = entry.key
            if shards[hash(key) & SHARD_MASK].setdefault(key, entry) is entry:
                append(entry)
        if share_parents or counts is not None:
            for entry in added:
                parent = entry.parent_key
                if parent is not None:
                    if share_parents:
                        entry.parent_key = parent = self.shared_key(parent)
                    if counts is not None:
                        self._count_child(parent, 1)
        self.recency.append_all(added)  # type: ignore[arg-type]
        self.ready_bytes += sum(map(_SIZE_OF, added))
        return added

    def pop(self, key: ObjectKey) -> ObjectEntry:
        """Remove ``key`` (which must be present) from every index and return its entry."""
        entry = self.shards[hash(key) & SHARD_MASK].pop(key)
        self.recency.unlink(entry)
        if entry.dram is not None:
            self.dram_remove(entry)
        if entry.writer_id is not None:
            del self.pending_key_to_started_s[key]
            return entry
        self.ready_bytes -= entry.size_bytes
        if self.child_counts is not None and entry.parent_key is not None:
            self._count_child(entry.parent_key, -1)
        return entry

    def pop_all_ready(self, keys: Sequence[ObjectKey], entries: list[ObjectEntry]) -> None:
        """``pop`` of each of ``keys`` (distinct), whose ``entries`` are READY and not in
        ``dram_order``, with C-level maps (but for the child counts of prefix-lru)."""
        deque(map(dict.__delitem__, self.shards_of(keys), keys), maxlen=0)
        self.recency.unlink_all(entries)  # type: ignore[arg-type]
        self.ready_bytes -= sum(map(_SIZE_OF, entries))
        if self.child_counts is not None:
            for entry in entries:
                if entry.parent_key is not None:
                    self._count_child(entry.parent_key, -1)

    def touch_all(self, entries: list[ObjectEntry]) -> None:
        """Move ``entries`` (read or committed just now, all in the table) to the recent end,
        in turn, of the recency list and of ``dram_order``."""
        self.recency.touch_all(entries)
        if self.dram_order is not None:
            self.dram_order.touch_all([e.dram for e in entries if e.dram is not None])

    def start_dram_order(self, in_dram: Iterable[ObjectEntry]) -> None:
        """Start keeping ``dram_order``, with ``in_dram`` (in recency order)."""
        self.dram_order = Recency(of_links=True)
        for entry in in_dram:
            self.dram_add(entry)

    def dram_add(self, entry: ObjectEntry) -> None:
        """Put ``entry`` (a replica in DRAM now) at the recent end of ``dram_order``, unless
        it is in it."""
        if entry.dram is None:
            entry.dram = _Link(entry)
            self.dram_order.append(entry.dram)  # type: ignore[union-attr]

    def dram_remove(self, entry: ObjectEntry) -> None:
        """Take ``entry`` (no replica in DRAM any more) out of ``dram_order``."""
        link = entry.dram
        if link is not None:
            self.dram_order.unlink(link)  # type: ignore[union-attr]
            link.entry = None
            entry.dram = None

    def shared_key(self, key: ObjectKey) -> ObjectKey:
        """Return the table's own copy of ``key`` when present (to share it), else ``key``."""
        entry = self.shards[hash(key) & SHARD_MASK].get(key)
        return entry.key if entry is not None else key

    def shards_of(self, keys: Sequence[ObjectKey]) -> list[dict[ObjectKey, ObjectEntry]]:
        """The shard of each of ``keys`` (hashable), by C-level maps."""
        return list(map(self.shards.__getitem__, map(SHARD_MASK.__and__, map(hash, keys))))

    def get_all(self, keys: Sequence[ObjectKey]) -> list[ObjectEntry | None]:
        """``get`` of each of ``keys`` (hashable), by C-level maps."""
        return list(map(dict.get, self.shards_of(keys), keys))

    def shared_parents(self, parents: Sequence[ObjectKey]) -> list[ObjectKey | None]:
        """``shared_key`` of each of ``parents``, None for an empty one (no parent)."""
        return [entry.key if entry is not None else (parent or None)
                for entry, parent in zip(self.get_all(parents), parents, strict=True)]

    def num_children(self, key: ObjectKey) -> int:
        """Return how many READY objects name ``key`` as their parent (prefix-lru only)."""
        counts = self.child_counts
        return counts[hash(key) & SHARD_MASK].get(key, 0) if counts is not None else 0

    def _count_child(self, parent: ObjectKey, change: int) -> None:
        counts = self.child_counts[hash(parent) & SHARD_MASK]  # type: ignore[index]
        remaining = counts.get(parent, 0) + change
        if remaining:
            counts[parent] = remaining
        else:
            del counts[parent]
