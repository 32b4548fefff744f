"""Snapshot and restore of the durable part of the core's state, as plain rows.

Rules of this file:
- Durable: clients (with their capability keys), segments, READY objects (in LRU order).
  Not durable: leases (they last seconds; a restarted master has no readers in flight that it
  promised anything to) and PENDING objects (their writers learn of the restart from
  UNKNOWN_CLIENT and put again; keeping half-written objects would only leak their space).
- Rows are tuples of str/int/bytes/None so any serialiser (``persist.py`` uses msgpack) can
  carry them; a row read back may be a list instead of a tuple.
- Restore goes into a fresh core. Restored clients and segments wait for their owner: a
  client must register again (it gets its old key back) and mount each segment again with an
  identical descriptor before ``now + grace_s``; until then objects on that segment are not
  readable, and after it they are dropped (``tick``). Every row is validated; a malformed
  row or a replica on an unknown segment is dropped (counted).
- Two objects claiming one extent (overlapping extents on a segment) are never resolved in
  favour of either: the bytes there belong to at most one of them and nothing says which, so
  every object in the overlap is dropped (counted apart, ``num_conflicting_objects``).
"""

from __future__ import annotations

import heapq
import operator
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain, compress, groupby, islice, pairwise, repeat
from typing import Any

import numpy as np

from kvpool_master.core.allocator import ALIGN_BYTES, WHOLE, Allocator, Part, aligned
from kvpool_master.core.clients import ClientState, ClientTable, registration_error
from kvpool_master.core.objects import INT_TYPES, KEY_TYPES, ObjectEntry, ObjectTable
from kvpool_master.core.segments import SegmentState, SegmentTable, segment_info_error
from kvpool_wire.types import ClientId, Extent, ObjectKey, Pin, SegmentId, SegmentInfo, Tier

#: (client_id, host_id, capability_key)
ClientRow = tuple[str, str, bytes]
#: SegmentInfo fields in declaration order, tier as an int.
#: rows written before the engine base address have 8 fields; both restore
SegmentRow = tuple[str, str, int, int, str, str, str, str, int, str]
#: (key, size_bytes, [segment_id, offset, length, ...] flattened, checksum, pin, parent_key)
ObjectRow = tuple[bytes, int, list[Any], int, int, bytes | None]


@dataclass(frozen=True, slots=True)
class ObjectColumns:
    """Object rows with one replica each, as columns: how a snapshot stores them
    (``statefile.py`` packs the number columns as machine words), so that restore makes no
    per-row objects and checks a column at a time.

    ``segment_index`` indexes ``segment_ids``; ``parents`` indexes ``keys + parent_keys`` (a
    parent in the same chunk is named by its position, others are in ``parent_keys``), -1
    for none. Nothing here is trusted: restore checks every column (``_column_entries``) and
    takes the rows one at a time (``rows``) when any check fails.
    """

    keys: list[Any]
    sizes: array[int]            # "Q"
    segment_ids: list[Any]
    segment_index: array[int]    # "I"
    offsets: array[int]          # "Q"
    checksums: array[int]        # "Q"
    pins: bytes
    parents: array[int]          # "i"
    parent_keys: list[Any]

    @classmethod
    def of_entries(cls, entries: list[ObjectEntry]) -> ObjectColumns:
        """The columns of READY ``entries`` with one replica each (``more`` empty)."""
        return cls.of_fields(list(map(_KEY, entries)), map(_SIZE, entries),
                             list(map(_SEGMENT_ID, entries)), map(_OFFSET, entries),
                             map(_CHECKSUM, entries), map(_PIN, entries),
                             list(map(_PARENT_KEY, entries)))

    @classmethod
    def of_fields(cls, keys: list[Any], sizes: Iterable[int], ids: list[Any],
                  offsets: Iterable[int], checksums: Iterable[int], pins: Iterable[int],
                  parents: list[Any]) -> ObjectColumns:
        """The columns of objects given field by field (``ids``: each one's segment id,
        ``parents``: each one's parent key or None). Raises ``TypeError`` (an unhashable id
        or parent) or ``OverflowError`` (a number no column holds)."""
        segment_ids = list(dict.fromkeys(ids))
        if len(segment_ids) == 1:   # the common case: all on one segment
            segment_index = array("I", bytes(4 * len(ids)))
        else:
            position = {s: i for i, s in enumerate(segment_ids)}
            segment_index = array("I", map(position.__getitem__, ids))
        key_position: dict[Any, int] = dict(zip(keys, range(len(keys)), strict=True))
        key_position[None] = -1
        parent_index: list[Any] = list(map(key_position.get, parents))   # None: not here
        parent_keys: list[Any] = []
        if None in parent_index:   # parents outside these objects: named by key, each once
            parent_keys = list(dict.fromkeys(compress(parents, map(_IS_NONE, parent_index))))
            key_position.update(zip(parent_keys, range(len(keys), len(keys) + len(parent_keys)),
                                    strict=True))
            parent_index = list(map(key_position.__getitem__, parents))
        return cls(keys, array("Q", sizes), segment_ids, segment_index, array("Q", offsets),
                   array("Q", checksums), bytes(pins), array("i", parent_index), parent_keys)

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[Any]]) -> ObjectColumns | None:
        """The columns of object ``rows`` with one replica each (how a log's rows restore a
        column at a time), or None when one is not such a row: a shape and type check only,
        as restore checks the columns it takes as it checks rows. The chunk holds the rows'
        own key objects."""
        try:
            row_keys, sizes, flats, checksums, pins, parents = zip(*rows, strict=True)
            segment_ids, offsets, lengths = zip(*flats, strict=True)
            if not (_LISTS.issuperset(map(type, flats)) and {*map(len, flats)} == {3}
                    and lengths == sizes and KEY_TYPES.issuperset(map(type, row_keys))
                    and INT_TYPES.issuperset(map(type, chain(sizes, offsets, checksums, pins)))):
                return None
            return cls.of_fields(list(row_keys), sizes, list(segment_ids), offsets, checksums,
                                 pins, list(parents))
        except (TypeError, ValueError, OverflowError):   # ragged, unhashable, out of range
            return None

    @classmethod
    def concat(cls, chunks: Sequence[ObjectColumns]) -> ObjectColumns:
        """The rows of ``chunks`` in order as one chunk (a log's records hold a call's objects
        each; restore takes thousands a chunk). A segment or parent index out of its chunk's
        range stays out of range, so restore refuses the chunk as it would have refused
        that one; a parent named by position in its chunk keeps naming the same key."""
        if len(chunks) == 1:
            return chunks[0]
        keys: list[Any] = []
        parent_keys: list[Any] = []
        position: dict[Any, int] = {}
        # each chunk's segments' positions in the joined list, then one out of range
        remap: list[int] = []
        sizes, offsets, checksums = array("Q"), array("Q"), array("Q")
        segment_index, parents = array("I"), array("i")
        pins = bytearray()
        # per chunk: its rows, its parent keys, where its keys, parent keys and remap start
        # in the joined lists, and how many segments it names
        bases: list[tuple[int, int, int, int, int, int]] = []
        for c in chunks:
            num = len(c.keys)
            if {len(c.sizes), len(c.segment_index), len(c.offsets), len(c.checksums),
                    len(c.pins), len(c.parents)} != {num}:
                raise ValueError("a ragged chunk of columns")
            bases.append((num, len(c.parent_keys), len(keys), len(parent_keys), len(remap),
                          len(c.segment_ids)))
            remap += [position.setdefault(s, len(position)) for s in c.segment_ids]
            remap.append(_NO_INDEX)
            keys += c.keys
            parent_keys += c.parent_keys
            sizes += c.sizes
            offsets += c.offsets
            checksums += c.checksums
            segment_index += c.segment_index
            parents += c.parents
            pins += c.pins
        table = np.array(bases, np.int64)
        num, named, key_base, named_base, remap_base, num_ids = np.repeat(
            table, table[:, 0], axis=0).T   # each row's chunk's
        index = np.minimum(np.asarray(segment_index, np.int64), num_ids) + remap_base
        parent = np.asarray(parents, np.int64)
        joined = np.where(parent < num, parent + key_base,
                          parent - num + len(keys) + named_base)
        joined[parent == -1] = -1
        joined[(parent < -1) | (parent >= num + named)] = -2
        # written over the joined columns in place (``index`` and ``parent`` are copies)
        np.frombuffer(segment_index, np.uint32)[:] = np.asarray(remap, np.uint32)[index]
        np.frombuffer(parents, np.int32)[:] = joined
        return cls(keys, sizes, list(position), segment_index, offsets, checksums, bytes(pins),
                   parents, parent_keys)

    def rows(self) -> list[list[Any]]:
        """The rows these columns hold (a chunk that fails a check is restored row by row);
        an index out of range gives an invalid row, which restore drops."""
        names = self.keys + self.parent_keys
        ids = self.segment_ids
        return [[key, size, [ids[s] if 0 <= s < len(ids) else None, offset, size], checksum,
                 pin, names[parent] if -1 < parent < len(names) else None if parent == -1
                 else b""]
                for key, size, s, offset, checksum, pin, parent in zip(
                    self.keys, self.sizes, self.segment_index, self.offsets, self.checksums,
                    self.pins, self.parents, strict=False)]

    def without(self, gone: list[bool]) -> ObjectColumns:
        """These columns less the rows marked in ``gone`` (one flag per row): a parent among
        them is named by its key from then on."""
        keep = [not g for g in gone]
        num_keys = len(self.keys)
        position = list(accumulate(keep, initial=-1))[1:]   # of each kept row, from 0
        kept_keys = list(compress(self.keys, keep))
        parent_keys = list(self.parent_keys)
        parents = array("i")
        for parent in compress(self.parents, keep):
            if parent < num_keys:
                if parent < 0 or keep[parent]:
                    parents.append(parent if parent < 0 else position[parent])
                else:
                    parents.append(len(kept_keys) + len(parent_keys))
                    parent_keys.append(self.keys[parent])
            elif parent < num_keys + len(self.parent_keys):
                parents.append(parent - num_keys + len(kept_keys))
            else:
                parents.append(-2)   # out of range: stays invalid
        return ObjectColumns(kept_keys, array("Q", compress(self.sizes, keep)),
                             self.segment_ids, array("I", compress(self.segment_index, keep)),
                             array("Q", compress(self.offsets, keep)),
                             array("Q", compress(self.checksums, keep)),
                             bytes(compress(self.pins, keep)), parents, parent_keys)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The durable state; ``objects`` (rows, or chunks of them as ``ObjectColumns``) may be a
    one-shot iterator (consume it at once)."""

    clients: Sequence[Sequence[Any]]
    segments: Sequence[Sequence[Any]]
    objects: Iterable[Sequence[Any] | ObjectColumns]


@dataclass(frozen=True, slots=True)
class RestoreCounts:
    """What ``restore`` brought back and what it had to drop."""

    num_clients: int
    num_segments: int
    num_objects: int
    num_dropped_rows: int
    num_conflicting_objects: int = 0   # dropped because their extents overlapped


def segment_row(info: SegmentInfo) -> SegmentRow:
    """Return the row of a segment descriptor."""
    return (info.segment_id, info.client_id, info.size_bytes, int(info.tier), info.host_id,
            info.shm_name, info.tcp_endpoint, info.engine_endpoint, info.engine_base_address,
            info.file_path)


def object_row(key: bytes, size_bytes: int, placements: tuple[Extent, ...], checksum: int,
               pin: int, parent_key: bytes | None) -> ObjectRow:
    """Return the row of one READY object."""
    return _row(key, size_bytes, [], placements, checksum, pin, parent_key)


def one_replica_row(key: bytes, size_bytes: int, segment_id: str, offset: int, checksum: int,
                    pin: int, parent_key: bytes | None) -> ObjectRow:
    """``object_row`` of an object with one replica, from its fields (no ``Extent``)."""
    return _row(key, size_bytes, [segment_id, offset, size_bytes], (), checksum, pin,
                parent_key)


def _entry_row(entry: ObjectEntry) -> ObjectRow:
    """``object_row`` of a table entry, from its fields (no ``Extent`` built per object)."""
    return _row(entry.key, entry.size_bytes, [entry.segment_id, entry.offset, entry.size_bytes],
                entry.more, entry.checksum, entry.pin, entry.parent_key)


def _row(key: bytes, size_bytes: int, flat: list[Any], placements: tuple[Extent, ...],
         checksum: int, pin: int, parent_key: bytes | None) -> ObjectRow:
    for p in placements:
        flat += (p.segment_id, p.offset, p.length)
    return (key, size_bytes, flat, checksum, int(pin), parent_key)


def take_snapshot(clients: ClientTable, segments: SegmentTable,
                  objects: ObjectTable) -> Snapshot:
    """Return the durable state; its ``objects`` iterator must be consumed before the core
    changes again."""
    head = snapshot_head(clients, segments)
    return Snapshot(head.clients, head.segments, _object_rows(objects, segments.dying))


def snapshot_head(clients: ClientTable, segments: SegmentTable) -> Snapshot:
    """Return the clients and segments as they are now (no objects)."""
    return Snapshot(
        clients=[(c.client_id, c.host_id, c.capability_key)
                 for c in clients.id_to_client.values()],
        segments=[segment_row(s.info) for s in segments.id_to_segment.values()],
        objects=(),
    )


def _object_rows(objects: ObjectTable, dying: Mapping[SegmentId, Any]) -> Iterator[ObjectRow]:
    for entry in objects.entries():
        if entry.writer_id is None:
            if not dying or not _on_any(entry, dying):
                yield _entry_row(entry)
            elif (row := _row_without(entry, dying)) is not None:
                yield row


#: A snapshot's objects as written: columns of a run with one replica each, or rows.
Chunk = ObjectColumns | list[ObjectRow]


def walk_chunks(objects: ObjectTable, max_objects: int,
                dying: Mapping[SegmentId, Any]) -> list[Chunk] | None:
    """The READY objects among the next ``max_objects`` of the table's stepped walk
    (``Recency.start_walk``), as chunks (``live_chunks``); None once it visited them all."""
    entries = objects.recency.walk(max_objects)
    if entries is None:
        return None
    return live_chunks([entry for entry in entries if entry.writer_id is None], dying)


def all_chunks(objects: ObjectTable, max_objects: int,
               dying: Mapping[SegmentId, Any]) -> Iterator[Chunk]:
    """Every READY object, least recently used first, as chunks of ``max_objects`` at most
    (the table must not change meanwhile)."""
    entries = objects.entries()
    while batch := list(islice(entries, max_objects)):
        yield from live_chunks([entry for entry in batch if entry.writer_id is None], dying)


def live_chunks(entries: list[ObjectEntry], dying: Mapping[SegmentId, Any]) -> list[Chunk]:
    """``entry_chunks`` of ``entries`` as they are once the sweep of the segments of ``dying``
    (lost, their objects not all swept yet) reaches them: without their replicas there, and
    without those left with none. The segment's loss may be logged before the snapshot
    starts, where no restore applies it to these rows."""
    if not dying:
        return entry_chunks(entries)
    chunks: list[Chunk] = []
    for lost, run in groupby(entries, partial(_on_any, dying=dying)):
        if not lost:
            chunks += entry_chunks(list(run))
        elif rows := [row for row in (_row_without(e, dying) for e in run) if row is not None]:
            chunks.append(rows)
    return chunks


def _on_any(entry: ObjectEntry, dying: Mapping[SegmentId, Any]) -> bool:
    """Whether a replica of ``entry`` is on a segment of ``dying``."""
    return entry.segment_id in dying or any(p.segment_id in dying for p in entry.more)


def _row_without(entry: ObjectEntry, dying: Mapping[SegmentId, Any]) -> ObjectRow | None:
    """The row of ``entry`` without its replicas on ``dying`` (None when none is left)."""
    kept = tuple(p for p in entry.extents() if p.segment_id not in dying)
    return object_row(entry.key, entry.size_bytes, kept, entry.checksum, entry.pin,
                      entry.parent_key) if kept else None


def entry_chunks(entries: list[ObjectEntry]) -> list[Chunk]:
    """``entries`` in order: each run with one replica as ``ObjectColumns``, the others as
    rows."""
    return [ObjectColumns.of_entries(run) if one_replica else [_entry_row(e) for e in run]
            for one_replica, run in ((one, list(run))
                                     for one, run in groupby(entries, _one_replica))]


def _one_replica(entry: ObjectEntry) -> bool:
    return not entry.more


_IS_NONE = partial(operator.is_, None)
_KEY, _SIZE, _SEGMENT_ID, _OFFSET, _CHECKSUM, _PIN, _PARENT_KEY = (
    operator.attrgetter(name) for name in ("key", "size_bytes", "segment_id", "offset",
                                           "checksum", "pin", "parent_key"))


def restore_into(clients: ClientTable, segments: SegmentTable, objects: ObjectTable,
                 snapshot: Snapshot, now: float, grace_s: float,
                 max_key_bytes: int, part: Part = WHOLE) -> RestoreCounts:
    """Load ``snapshot`` into empty tables (of partition ``part``, whose share of each segment
    its allocators cover); return what was restored and dropped."""
    if clients.id_to_client or segments.id_to_segment or len(objects):
        raise ValueError("restore needs a fresh core")
    deadline_s = now + grace_s
    dropped = conflicting = 0
    for row in snapshot.clients:
        try:
            client_id, host_id, key = row
        except (TypeError, ValueError):
            dropped += 1
            continue
        if registration_error(client_id, host_id, key) or client_id in clients.id_to_client:
            dropped += 1
            continue
        clients.add(ClientState(ClientId(client_id), host_id, key, now, restored=True,
                                restore_deadline_s=deadline_s))
    infos: dict[SegmentId, SegmentInfo] = {}
    for row in snapshot.segments:
        info = _segment_info(row)
        if info is None or info.segment_id in infos or info.client_id not in clients.id_to_client:
            dropped += 1
            continue
        infos[info.segment_id] = info
    # Each segment's extents as two columns of machine words until its allocator is built:
    # ints made here for every object, between the entries that stay, would leave the
    # process's memory fragmented for good (about 40 bytes an object); so would pieces of
    # columns kept a chunk at a time (one array per segment grows by reallocation instead)
    segment_to_offsets: dict[SegmentId, array[int]] = {s: array("Q") for s in infos}
    segment_to_sizes: dict[SegmentId, array[int]] = {s: array("Q") for s in infos}
    usable = {s: info.size_bytes - info.size_bytes % ALIGN_BYTES for s, info in infos.items()}
    mask = _ALIGN_MASK

    def note_extents(added: list[ObjectEntry]) -> None:
        """Note the extents of ``added`` (in the table now) on their segments."""
        for entry in added:
            extent_bytes = (entry.size_bytes + mask) & ~mask
            segment_to_offsets[entry.segment_id].append(entry.offset)
            segment_to_sizes[entry.segment_id].append(extent_bytes)
            for p in entry.more:
                segment_to_offsets[p.segment_id].append(p.offset)
                segment_to_sizes[p.segment_id].append(extent_bytes)

    def add_rows(rows: Sequence[Sequence[Any]]) -> int:
        """Add the objects of ``rows``; return how many were dropped (malformed, or keys seen
        before)."""
        chunk = []
        for row in rows:
            entry = _object_entry(row, infos, usable, max_key_bytes, size_to_int)
            if entry is not None:
                chunk.append(entry)
        added = objects.add_ready_all(chunk)
        note_extents(added)
        return len(rows) - len(added)

    def add_columns(columns: ObjectColumns) -> int:
        """``add_rows`` for a chunk of columns: a column at a time when every check passes."""
        checked = _column_entries(columns, infos, usable, max_key_bytes, size_to_int, objects)
        if checked is None:
            rows = columns.rows()   # (a ragged chunk's extra values count as dropped rows)
            return add_rows(rows) + len(columns.keys) - len(rows)
        chunk, extents_bytes = checked
        added = objects.add_ready_all(chunk, share_parents=False)
        if len(added) < len(chunk):   # keys seen before
            note_extents(added)
            return len(chunk) - len(added)
        # a segment's extents in this chunk at a time, split by numpy
        positions = np.asarray(columns.segment_index)
        order = np.argsort(positions, kind="stable")
        cuts = np.searchsorted(positions[order], np.arange(len(columns.segment_ids) + 1))
        offsets = np.asarray(columns.offsets)[order]
        extents_bytes = extents_bytes[order]
        for position, (lo, hi) in enumerate(pairwise(cuts.tolist())):
            if lo < hi:
                segment_id = infos[columns.segment_ids[position]].segment_id
                segment_to_offsets[segment_id].frombytes(offsets[lo:hi].data.cast("B"))
                segment_to_sizes[segment_id].frombytes(extents_bytes[lo:hi].data.cast("B"))
        return 0

    size_to_int = objects.size_to_int
    rows: list[Sequence[Any]] = []
    for item in snapshot.objects:
        if type(item) is not ObjectColumns:
            rows.append(item)   # type: ignore[arg-type]
            if len(rows) == RESTORE_CHUNK:
                dropped += add_rows(rows)
                rows = []
            continue
        if rows:
            dropped += add_rows(rows)
            rows = []
        if item.keys:
            dropped += add_columns(item)
    dropped += add_rows(rows)
    try:
        allocators: dict[SegmentId, Allocator] = {}
        for s in infos:   # one segment's packed extents alive at a time
            allocators[s] = Allocator.from_columns(infos[s].size_bytes,
                                                   segment_to_offsets.pop(s),
                                                   segment_to_sizes.pop(s), part)
    except ValueError:
        # Overlapping extents: an index that lost a change. Drop every object in an overlap,
        # then rebuild (the slow path; a whole log never takes it).
        doomed = _overlapping(_extents(objects))
        for key in doomed:
            objects.pop(key)
        conflicting = len(doomed)
        segment_to_extents = _extents(objects)
        allocators = {s: Allocator.from_used(info.size_bytes,
                                             [(o, n) for o, n, _ in
                                              segment_to_extents.get(s, ())], part)
                      for s, info in infos.items()}
    for segment_id, info in infos.items():
        segments.add(SegmentState(info, allocators[segment_id], mounted=False,
                                  restore_deadline_s=deadline_s))
    return RestoreCounts(len(clients), len(infos), len(objects), dropped, conflicting)


#: Objects restore builds before it adds them to the table in one call.
RESTORE_CHUNK = 4096


def _extents(objects: ObjectTable) -> dict[SegmentId, list[tuple[int, int, ObjectKey]]]:
    """(offset, aligned size, key) of every replica in ``objects``, by segment."""
    segment_to_extents: dict[SegmentId, list[tuple[int, int, ObjectKey]]] = defaultdict(list)
    for shard in objects.shards:
        for key, entry in shard.items():
            for p in entry.extents():
                segment_to_extents[p.segment_id].append((p.offset, aligned(p.length), key))
    return segment_to_extents


def _overlapping(segment_to_extents: dict[SegmentId, list[tuple[int, int, ObjectKey]]]
                 ) -> set[ObjectKey]:
    """Return the keys of every object whose extent overlaps another one on a segment."""
    doomed: set[ObjectKey] = set()
    for extents in segment_to_extents.values():
        open_extents: list[tuple[int, ObjectKey]] = []   # heap of (end, key) not yet passed
        for offset, size, key in sorted(extents):
            while open_extents and open_extents[0][0] <= offset:
                heapq.heappop(open_extents)
            if open_extents:
                doomed.add(key)
                doomed.update(k for _, k in open_extents)
            heapq.heappush(open_extents, (offset + size, key))
    return doomed


def _segment_info(row: Sequence[Any]) -> SegmentInfo | None:
    try:
        segment_id, client_id, size_bytes, tier, host_id, shm, tcp, engine, *rest = row
        base_address = rest[0] if rest else 0   # rows written before engines lack it
        file_path = rest[1] if len(rest) > 1 else ""   # ... and before the SSD tier this
        if len(rest) > 2 or not isinstance(base_address, int):
            return None
        info = SegmentInfo(SegmentId(segment_id), ClientId(client_id), size_bytes, Tier(tier),
                           host_id, shm, tcp, engine, base_address, file_path)
    except (TypeError, ValueError):
        return None
    if not all(isinstance(s, str) for s in (segment_id, client_id, host_id, shm, tcp, engine,
                                            file_path)) or segment_info_error(info):
        return None
    return info


def _column_entries(columns: ObjectColumns, infos: dict[SegmentId, SegmentInfo],
                    usable: dict[SegmentId, int], max_key_bytes: int,
                    size_to_int: dict[int, int], objects: ObjectTable
                    ) -> tuple[list[ObjectEntry], Any] | None:
    """The entries of ``columns`` with their aligned sizes (a numpy column), or None when any
    row would fail ``_object_entry``'s checks (the caller then takes the rows one at a time).

    The checks are ``_object_entry``'s, made a column at a time: the keys through C-level
    ``map``s and set operations, the number columns (machine words, so non-negative ints below
    2**64 by construction) by numpy, with no Python step per row. A parent named by position
    is the chunk's own key object, so only parents from ``parent_keys`` are shared with the
    table here.
    """
    keys, names = columns.keys, columns.keys + columns.parent_keys
    sizes, offsets = columns.sizes, columns.offsets
    number_columns = (sizes, columns.segment_index, offsets, columns.checksums, columns.parents)
    if (tuple(type(c) is array and c.typecode for c in number_columns) != _TYPECODES
            or type(columns.pins) is not bytes or type(names) is not list
            or {len(c) for c in (*number_columns, columns.pins)} != {len(keys)}):
        return None
    try:
        ids = [infos[s].segment_id for s in columns.segment_ids]   # KeyError: unknown
        limits = np.array([usable[s] for s in ids], np.uint64)
        size_col, offset_col = np.asarray(sizes), np.asarray(offsets)
        parent_col, position_col = np.asarray(columns.parents), np.asarray(columns.segment_index)
        if not (KEY_TYPES.issuperset(map(type, names))
                and min(map(len, names)) > 0 and max(map(len, names)) <= max_key_bytes
                and max(columns.pins) < _NUM_PINS
                and parent_col.min() >= -1 and parent_col.max() < len(names)
                and position_col.max() < len(ids)
                # bounds first, so that no sum below wraps around
                and size_col.min() > 0 and size_col.max() <= limits.max()
                and offset_col.max() <= limits.max()
                and not (offset_col & _ALIGN_MASK_U64).any()):
            return None
        extents_bytes = (size_col + _ALIGN_MASK_U64) & ~_ALIGN_MASK_U64
        if not (offset_col + extents_bytes <= limits[position_col]).all():
            return None
    except (TypeError, KeyError, IndexError, ValueError):   # unhashable, unknown, empty
        return None
    segment_ids = list(map(ids.__getitem__, columns.segment_index))
    names[len(keys):] = map(objects.shared_key, columns.parent_keys)
    names.append(None)   # parent -1: none
    entries = list(map(ObjectEntry, keys, map(size_to_int.setdefault, sizes, sizes),
                       segment_ids, offsets, repeat(None), map(_PINS.__getitem__, columns.pins),
                       map(names.__getitem__, columns.parents), columns.checksums))
    return entries, extents_bytes


_LISTS = frozenset({list, tuple})
#: The machine words of ``ObjectColumns``: sizes, segment index, offsets, checksums, parents.
_TYPECODES = ("Q", "I", "Q", "Q", "i")


def _object_entry(row: Sequence[Any], infos: dict[SegmentId, SegmentInfo],
                  usable: dict[SegmentId, int], max_key_bytes: int,
                  size_to_int: dict[int, int]) -> ObjectEntry | None:
    """Return the entry a row describes (None when malformed, or when none of its replicas is
    on a segment of ``infos``: one on a segment lost since the row was written is left out);
    ``usable``: the bytes of each segment extents may reach.

    Sizes and segment ids are shared with the table (one int per size, the descriptor's id
    string; parent keys once added, ``add_ready_all``), as ``put_start`` does, so restored
    objects cost no more memory than new ones. One
    replica (the common case) takes a path without a loop: restore is linear in the index and
    this is its inner step.
    """
    try:
        key, size_bytes, flat, checksum, pin, parent_key = row
        if (type(key) is not bytes or not 0 < len(key) <= max_key_bytes
                or type(size_bytes) is not int or size_bytes <= 0
                or type(checksum) is not int or not 0 <= checksum < _U64
                or type(pin) is not int or not 0 <= pin < _NUM_PINS
                or not (parent_key is None or (type(parent_key) is bytes
                                               and 0 < len(parent_key) <= max_key_bytes))):
            return None
        # checked bytes: ObjectKey(...) would only cost a call per row
        object_key: ObjectKey = key  # type: ignore[assignment]
        parent: ObjectKey | None = parent_key  # type: ignore[assignment]
        size_bytes = size_to_int.setdefault(size_bytes, size_bytes)
        extent_bytes = (size_bytes + _ALIGN_MASK) & ~_ALIGN_MASK
        if len(flat) == 3:
            segment_id, offset, length = flat
            info = infos.get(segment_id)
            if (info is None or type(offset) is not int or offset < 0 or offset & _ALIGN_MASK
                    or length != size_bytes or offset + extent_bytes > usable[segment_id]):
                return None
            return ObjectEntry(object_key, size_bytes, info.segment_id, offset, None,
                               _PINS[pin], parent, checksum)
        if len(flat) % 3 or not flat:
            return None
        found: list[Extent] = []
        for i in range(0, len(flat), 3):
            segment_id, offset, length = flat[i], flat[i + 1], flat[i + 2]
            info = infos.get(segment_id)
            if info is None:   # a replica on a segment lost since: the others still hold it
                continue
            if (type(offset) is not int or offset < 0
                    or offset & _ALIGN_MASK or length != size_bytes
                    or offset + extent_bytes > usable[segment_id]
                    or any(p.segment_id == segment_id for p in found)):
                return None
            found.append(Extent(info.segment_id, offset, size_bytes))
        if not found:
            return None
    except (TypeError, ValueError):   # not a sequence, unhashable segment id, ...
        return None
    return ObjectEntry.of_extents(object_key, size_bytes, tuple(found), None, _PINS[pin],
                                  parent, checksum)


_PINS = tuple(Pin)
_NUM_PINS = len(_PINS)
_U64 = 1 << 64
_ALIGN_MASK = ALIGN_BYTES - 1
_ALIGN_MASK_U64 = np.uint64(_ALIGN_MASK)
#: A segment index no chunk holds (``ObjectColumns.concat``).
_NO_INDEX = (1 << 32) - 1
