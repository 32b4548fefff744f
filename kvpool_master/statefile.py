"""The files of ``--state-dir`` (see ``persist.py``): their records, and replaying a log over a
snapshot.

Rules of this file:
- A record is ``u32 LE payload length | u32 LE crc32(payload) | msgpack payload``; a torn or
  corrupt one is reported (``next_record``) or raised as ``Corrupt`` (``read_frame``), never
  half-used.
- A snapshot's objects come in chunks, each either a list of rows (``core/snapshot.py``) or,
  for objects with one replica each (snapshot version 2), a map ``{"columns": [...]}`` of
  ``ObjectColumns`` whose number columns are little-endian machine words (``chunk_frame``):
  restore reads them without making an object per row and field.
- Only events that change durable state become log rows (``log_rows``): a run of commits
  with one replica each is one row of the same columns (a call's commits decode without an
  object per field), a run of removals one row of keys, anything else a row of its own
  (``event_row``). ``Overlay`` applies them on top of a snapshot and streams the restored
  objects in LRU order.
- A snapshot written in the background (``persist.py``, a step at a time) may show each
  object as it was at any moment while it was written; the log records of everything that
  changed since it started follow its end record as its *tail*, and a fixed trailer
  (``TAIL_MAGIC``, the tail's offset) ends the file. They apply before the log of the
  snapshot's generation. A snapshot without the trailer has no tail.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import chain, groupby, islice
from operator import attrgetter, itemgetter
from typing import Any, BinaryIO

import msgpack
import numpy as np

from kvpool_master.core import events as ev
from kvpool_master.core.objects import KEY_TYPES
from kvpool_master.core.snapshot import (
    RESTORE_CHUNK,
    Chunk,
    ObjectColumns,
    object_row,
    one_replica_row,
    segment_row,
)

#: Logs read: 1 (rows only) and 2 (runs of commits and removals as columns); written: 2.
VERSION = 2
VERSIONS = (1, 2)
#: Snapshots read: 1 (chunks of rows only), 2 (columns too) and 3 (a tail of version 2 log
#: records); written: 3. A master that reads none of these sets the file aside.
SNAPSHOT_VERSION = 3
_SNAPSHOT_VERSIONS = (1, 2, 3)
_FRAME = struct.Struct("<II")
_MAX_RECORD_BYTES = 1 << 30

# Event rows: [code, fields...]. Only events that change durable state are logged.
_CLIENT_REGISTERED, _CLIENT_GONE, _SEGMENT_MOUNTED, _SEGMENT_UNMOUNTED = 1, 2, 3, 4
_OBJECT_COMMITTED, _OBJECT_REMOVED = 5, 6
#: A run of commits with one replica each: [7, the nine fields of a chunk of columns]; a run of
#: removals: [8, [key, ...]] (log version 2).
_OBJECTS_COMMITTED, _OBJECTS_REMOVED = 7, 8
#: Runs shorter than this stay rows: a row of columns has a fixed cost of a few µs to write
#: (``master_core.py --log-batches``).
_MIN_LOG_RUN = 16
_BATCH = -1   # log_rows' code of an ObjectsCommitted (no row code of its own)
#: The trailer of a snapshot with a tail: this magic, then the tail's offset (u64 LE).
TAIL_MAGIC = b"KVPTAIL1"
_TRAILER = struct.Struct("<8sQ")


# ---- records -------------------------------------------------------------------------------

class Corrupt(Exception):
    """A snapshot that cannot be read."""


def frame(payload: Any) -> bytes:
    body: bytes = msgpack.packb(payload, use_bin_type=True)
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def _unpack(body: bytes | memoryview) -> Any:
    return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)


def next_record(data: bytes, offset: int) -> tuple[Any, int, str]:
    """Return (payload, offset after it, "") or (None, offset, what is wrong)."""
    if len(data) - offset < _FRAME.size:
        return None, offset, "torn record header"
    length, crc = _FRAME.unpack_from(data, offset)
    start = offset + _FRAME.size
    if length > _MAX_RECORD_BYTES or start + length > len(data):
        return None, offset, "torn record"
    body = memoryview(data)[start:start + length]
    if zlib.crc32(body) != crc:
        return None, offset, "record checksum mismatch"
    try:
        return _unpack(body), start + length, ""
    except Exception:  # msgpack raises several types on garbage; all mean "corrupt"
        return None, offset, "undecodable record"


def read_frame(f: BinaryIO) -> Any:
    head = f.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise Corrupt("truncated snapshot")
    length, crc = _FRAME.unpack(head)
    if length > _MAX_RECORD_BYTES:
        raise Corrupt("impossible record length")
    body = f.read(length)
    if len(body) < length or zlib.crc32(body) != crc:
        raise Corrupt("snapshot record checksum mismatch")
    try:
        return _unpack(body)
    except Exception as exc:  # any decoding failure means corruption
        raise Corrupt("undecodable snapshot record") from exc


def read_snapshot_head(f: BinaryIO) -> tuple[int, dict[str, Sequence[Any]],
                                              dict[str, Sequence[Any]]]:
    header = read_frame(f)
    if (not isinstance(header, dict) or header.get("format") != "kvpool-snapshot"
            or header.get("version") not in _SNAPSHOT_VERSIONS
            or type(header.get("generation")) is not int):
        raise Corrupt("not a kvpool snapshot")
    clients, segments = read_frame(f), read_frame(f)
    if not isinstance(clients, list) or not isinstance(segments, list):
        raise Corrupt("malformed snapshot")
    return (header["generation"],
            {row[0]: row for row in clients if isinstance(row, list) and row
             and type(row[0]) is str},
            {row[0]: row for row in segments if isinstance(row, list) and row
             and type(row[0]) is str})


def chunk_frame(chunk: Chunk) -> bytes:
    """The record of a snapshot chunk: rows as they are, columns as a map of them."""
    if type(chunk) is not ObjectColumns:
        return frame(chunk)
    return frame({"columns": _fields(chunk)})


def _fields(chunk: ObjectColumns) -> list[Any]:
    """What a file holds of ``chunk``: its nine columns, numbers as machine words."""
    return [chunk.keys, _words(chunk.sizes), chunk.segment_ids, _words(chunk.segment_index),
            _words(chunk.offsets), _words(chunk.checksums), chunk.pins, _words(chunk.parents),
            chunk.parent_keys]


def chunk_len(chunk: Chunk) -> int:
    """How many objects ``chunk`` holds."""
    return len(chunk.keys) if type(chunk) is ObjectColumns else len(chunk)


def _words(column: array[int]) -> bytes:
    if sys.byteorder == "big":
        column = array(column.typecode, column)
        column.byteswap()
    return column.tobytes()


def _column(typecode: str, data: Any, num_rows: int) -> array[int]:
    if type(data) is not bytes:
        raise ValueError("a number column is not bytes")
    column = array(typecode)
    if len(data) != num_rows * column.itemsize:
        raise ValueError("a column's length differs from the keys'")
    column.frombytes(data)
    if sys.byteorder == "big":
        column.byteswap()
    return column


def _object_columns(fields: Any) -> ObjectColumns:
    """The columns of a chunk as ``_fields`` wrote them; ``ValueError`` when they are not
    (restore checks the values)."""
    if not isinstance(fields, list) or len(fields) != 9:
        raise ValueError("not a chunk of columns")
    keys, sizes, segment_ids, index, offsets, checksums, pins, parents, parent_keys = fields
    if (not isinstance(keys, list) or not isinstance(segment_ids, list)
            or not isinstance(parent_keys, list) or type(pins) is not bytes
            or len(pins) != len(keys) or not KEY_TYPES.issuperset(map(type, keys))
            or not _STRS.issuperset(map(type, segment_ids))):
        raise ValueError("malformed chunk of columns")
    num_rows = len(keys)
    return ObjectColumns(keys, _column("Q", sizes, num_rows), segment_ids,
                         _column("I", index, num_rows), _column("Q", offsets, num_rows),
                         _column("Q", checksums, num_rows), pins,
                         _column("i", parents, num_rows), parent_keys)


_STRS = frozenset({str})
assert (array("Q").itemsize, array("I").itemsize, array("i").itemsize) == (8, 4, 4)


def whole_records_bytes(data: bytes) -> int:
    """How many leading bytes of ``data`` are whole records (by their lengths; a record still
    being appended is left out)."""
    offset = 0
    while len(data) - offset >= _FRAME.size:
        length = _FRAME.unpack_from(data, offset)[0]
        if offset + _FRAME.size + length > len(data):
            break
        offset += _FRAME.size + length
    return offset


def trailer_tail_offset(f: BinaryIO) -> int:
    """The tail offset named by the trailer that ends ``f``, or -1 when it has none."""
    size = f.seek(0, 2)
    if size < _TRAILER.size:
        return -1
    f.seek(size - _TRAILER.size)
    magic, tail_offset = _TRAILER.unpack(f.read(_TRAILER.size))
    return tail_offset if magic == TAIL_MAGIC else -1


def tail_trailer(tail_offset: int) -> bytes:
    """The bytes that end a snapshot whose tail starts at ``tail_offset``."""
    return _TRAILER.pack(TAIL_MAGIC, tail_offset)


def read_snapshot_tail(f: BinaryIO, warnings: list[str]) -> list[list[Any]]:
    """The tail records of the snapshot open in ``f`` (none without a trailer); ``f`` is
    left where it was. A damaged tail record ends the tail, with a warning."""
    here = f.tell()
    try:
        tail_offset = trailer_tail_offset(f)
        if tail_offset < 0:
            return []
        end = f.seek(0, 2) - _TRAILER.size
        if not 0 < tail_offset <= end:
            warnings.append("snapshot: impossible tail offset; changes made while it was "
                            "written are lost")
            return []
        f.seek(tail_offset)
        data = f.read(end - tail_offset)
    finally:
        f.seek(here)
    records: list[list[Any]] = []
    offset = 0
    while offset < len(data):
        record, offset, problem = next_record(data, offset)
        if problem or not isinstance(record, list):
            warnings.append(f"snapshot tail: {problem or 'malformed record'}; changes after "
                            "it are lost")
            break
        records.append(record)
    return records


def read_snapshot_objects(f: BinaryIO, warnings: list[str],
                          on_rows: Callable[[int], None] | None = None
                          ) -> Iterator[Sequence[Any] | ObjectColumns]:
    """The object rows of the snapshot open in ``f``, a record at a time: each chunk of
    columns whole, as ``ObjectColumns``; ``on_rows(n)`` (when given) as each record of ``n``
    rows is read."""
    while True:
        try:
            record = read_frame(f)
        except Corrupt as exc:
            warnings.append(f"snapshot: {exc}; objects after the damage are lost")
            return
        if isinstance(record, dict) and record.get("end"):
            return
        if isinstance(record, dict):
            try:
                columns = _object_columns(record.get("columns"))
            except ValueError as exc:
                warnings.append(f"snapshot: {exc}; objects after it are lost")
                return
            if on_rows is not None:
                on_rows(len(columns.keys))
            yield columns
            continue
        if not isinstance(record, list):
            warnings.append("snapshot: malformed object chunk; objects after it are lost")
            return
        if on_rows is not None:
            on_rows(len(record))
        yield from record


# ---- events -> rows -> state -----------------------------------------------------------------

def log_rows(events: Sequence[ev.Event]) -> list[list[Any]]:
    """The log rows of ``events``: each run of commits with one replica and each run of
    removals as one row of columns (decoded without an object per field), the rest as
    ``event_row`` makes them."""
    if len(events) < _MIN_LOG_RUN and ev.ObjectsCommitted not in set(map(type, events)):
        return list(filter(None, map(event_row, events)))   # no run that long: rows
    rows: list[list[Any]] = []
    for code, run in groupby(events, _run_code):
        if code == _BATCH:
            for batch_event in run:
                rows += _batch_rows(batch_event)
            continue
        if code:
            batch = list(run)
            if len(batch) >= _MIN_LOG_RUN:
                rows.append([_OBJECTS_REMOVED, list(map(_KEY, batch))] if code == _OBJECT_REMOVED
                            else [_OBJECTS_COMMITTED, *_fields(_commit_columns(batch))])
                continue
            run = iter(batch)
        rows += filter(None, map(event_row, run))
    return rows


def _batch_rows(event: ev.ObjectsCommitted) -> list[list[Any]]:
    """The rows of a batch commit: one row of columns, or a row each when it is short."""
    if len(event.keys) < _MIN_LOG_RUN:
        return [[_OBJECT_COMMITTED, *one_replica_row(*fields)] for fields in zip(
            event.keys, event.sizes_bytes, event.segment_ids, event.offsets, event.checksums,
            event.pins, event.parent_keys, strict=True)]
    return [[_OBJECTS_COMMITTED, *_fields(ObjectColumns.of_fields(
        event.keys, event.sizes_bytes, event.segment_ids, event.offsets, event.checksums,
        event.pins, event.parent_keys))]]


def _run_code(event: ev.Event) -> int:
    """Which run ``event`` may join: commits with one replica, removals, a batch commit (a
    run of its own), or none (0)."""
    if type(event) is ev.ObjectRemoved:
        return _OBJECT_REMOVED
    if type(event) is ev.ObjectsCommitted:
        return _BATCH
    if (isinstance(event, ev.ObjectCommitted) and len(event.placements) == 1
            and event.placements[0].length == event.size_bytes):   # (or ReplicasChanged)
        return _OBJECT_COMMITTED
    return 0


def _commit_columns(commits: list[Any]) -> ObjectColumns:
    firsts = list(map(_FIRST, map(_PLACEMENTS, commits)))
    return ObjectColumns.of_fields(list(map(_KEY, commits)), map(_SIZE, commits),
                                   list(map(_SEGMENT_ID, firsts)), map(_OFFSET, firsts),
                                   map(_CHECKSUM, commits), map(_PIN, commits),
                                   list(map(_PARENT_KEY, commits)))


_KEY, _SIZE, _PLACEMENTS, _SEGMENT_ID, _OFFSET, _CHECKSUM, _PIN, _PARENT_KEY = (
    attrgetter(name) for name in ("key", "size_bytes", "placements", "segment_id", "offset",
                                  "checksum", "pin", "parent_key"))
_FIRST = itemgetter(0)


def event_row(event: ev.Event) -> list[Any] | None:
    if isinstance(event, ev.ObjectCommitted):  # a commit, or ReplicasChanged: the new state
        return [_OBJECT_COMMITTED, *object_row(event.key, event.size_bytes, event.placements,
                                               event.checksum, event.pin, event.parent_key)]
    if isinstance(event, ev.ObjectRemoved):
        return [_OBJECT_REMOVED, event.key]
    if isinstance(event, ev.ClientRegistered):
        return [_CLIENT_REGISTERED, event.client_id, event.host_id, event.capability_key]
    if isinstance(event, ev.ClientExpired | ev.ClientUnregistered):
        return [_CLIENT_GONE, event.client_id]
    if isinstance(event, ev.SegmentMounted):
        return [_SEGMENT_MOUNTED, *segment_row(event.segment)]
    if isinstance(event, ev.SegmentUnmounted):
        return [_SEGMENT_UNMOUNTED, event.segment_id]
    return None  # EvictionPass, PendingReclaimed: nothing durable changed


class Overlay:
    """The log's effect on a snapshot: clients and segments in full, objects as changes.

    Objects of the snapshot stream through ``objects()``: a key the log touched takes its
    logged state; a replica on a segment the log unmounted after that state was logged is gone
    (even if the segment came back later: a remount is fresh memory). Every object row, each
    object of a row of columns, and every unmount is numbered as it is applied; ``latest``
    maps each key the log touched to the number of its last commit or removal, so a key's
    state and its place in the LRU order are its last one. Replay is linear in the log: a row
    of columns costs one C-level dict update, and replicas are filtered once, in
    ``objects()``.
    """

    def __init__(self, clients: dict[str, Sequence[Any]],
                 segments: dict[str, Sequence[Any]]) -> None:
        self.clients = clients
        self.segments = segments
        self.unmounted_at: dict[str, int] = {}   # segment id -> number of its last unmount
        self.latest: dict[Any, int] = {}         # key -> number of its last commit or removal
        # (number, row) of each commit row (its code first), (number of its first, chunk)
        # of each row of columns, in log order
        self._commits: list[tuple[int, list[Any] | ObjectColumns]] = []
        self._applied = 0

    def apply(self, record: list[Any]) -> None:
        """Apply a log record (a list of rows). An object row's key is replaced by a copy in
        the row itself, so that what restore keeps holds no memory of the decoded record."""
        for row in record:
            if not isinstance(row, list) or not row:
                continue
            code = row[0]
            if code in (_OBJECTS_COMMITTED, _OBJECTS_REMOVED):
                self._apply_run(row)
                continue
            self._applied += 1
            if (code == _OBJECT_COMMITTED and len(row) == 7
                    or code == _OBJECT_REMOVED and len(row) == 2):
                key = row[1]
                if type(key) is bytes:   # a copy: the decoded one goes with the log
                    key = row[1] = bytes(memoryview(key))
                try:
                    self.latest[key] = self._applied
                except TypeError:   # unhashable: no restore takes it
                    continue
                if code == _OBJECT_COMMITTED:
                    self._commits.append((self._applied, row))
            elif len(row) < 2 or type(row[1]) is not str:
                continue   # a client or segment row names its id first
            elif code == _CLIENT_REGISTERED and len(row) == 4:
                self.clients[row[1]] = row[1:]
            elif code == _CLIENT_GONE and len(row) == 2:
                self.clients.pop(row[1], None)
            elif code == _SEGMENT_MOUNTED and len(row) in (9, 10, 11):  # older rows are shorter
                self.segments[row[1]] = row[1:]
            elif code == _SEGMENT_UNMOUNTED and len(row) == 2:
                self.segments.pop(row[1], None)
                self.unmounted_at[row[1]] = self._applied

    def _apply_run(self, row: list[Any]) -> None:
        """Apply a row of columns (a malformed one is skipped, as a malformed row is)."""
        chunk = None
        if row[0] == _OBJECTS_REMOVED:
            keys = row[1] if len(row) == 2 and isinstance(row[1], list) else None
            if keys is None or not KEY_TYPES.issuperset(map(type, keys)):
                return
        else:
            try:
                chunk = _object_columns(row[1:])   # (its keys are bytes)
            except ValueError:
                return
            keys = chunk.keys
        first = self._applied + 1
        self._applied += len(keys)
        self.latest.update(zip(keys, range(first, self._applied + 1), strict=True))
        if chunk is not None and keys:
            self._commits.append((first, chunk))

    def objects(self, snapshot_rows: Iterator[Sequence[Any] | ObjectColumns]
                ) -> Iterator[Sequence[Any] | ObjectColumns]:
        """Return the restored object rows (and chunks of columns): the snapshot's, then the
        log's, in LRU order.

        The log's part is built here, at once, as chunks of columns where it can be (of
        thousands of objects, joined from the log's rows and chunks): the caller can then let
        the decoded log go (``drop_log`` and its records) before the snapshot's objects
        restore; the keys of its rows were copied as they were applied, so none of them, kept
        by a restored entry or by the filter of touched keys, holds the memory of the rows
        around it."""
        latest = self.latest
        unmounted = set(self.unmounted_at)   # every unmount of the log follows the snapshot
        if not latest and not unmounted:  # an empty log (right after a snapshot): as they are
            return snapshot_rows
        alive = np.zeros(self._applied + 1, np.bool_)   # the numbers of each key's last state
        alive[np.fromiter(latest.values(), np.int64, len(latest))] = True
        logged_items = list(_in_chunks(self._logged(alive)))
        logged = _KeyFilter(latest)

        def from_snapshot() -> Iterator[Sequence[Any] | ObjectColumns]:
            for row in _rows_where_unmounted(snapshot_rows, unmounted):
                if type(row) is ObjectColumns:
                    gone = logged.marks(row.keys)
                    yield row.without(gone) if gone else row
                elif not isinstance(row, list) or len(row) != 6 or type(row[0]) is not bytes:
                    yield row   # the core counts it as dropped
                elif not logged.has(row[0]):
                    kept = _without_segments(row, unmounted) if unmounted else row
                    if kept is not None:
                        yield kept
        return chain(from_snapshot(), logged_items)

    def drop_log(self) -> None:
        """Let go of the log's objects (``objects`` built what restores of them)."""
        self.latest = {}
        self._commits = []

    def _logged(self, alive: Any) -> Iterator[Sequence[Any] | ObjectColumns]:
        """The commits of the log that are their key's last state (``alive``, by number), in
        log order, less their replicas on segments unmounted after them."""
        unmounted_at = self.unmounted_at
        flags = alive.tobytes()   # (one flag a row looked up: faster than numpy's)
        for number, item in self._commits:
            if type(item) is ObjectColumns:
                keep = alive[number:number + len(item.keys)]
                gone = [i for i, s in enumerate(item.segment_ids)   # (after the whole run)
                        if type(s) is str and unmounted_at.get(s, 0) > number]
                if gone:
                    keep = keep & ~np.isin(np.asarray(item.segment_index), gone)
                if keep.all():
                    yield item
                elif keep.any():
                    yield item.without((~keep).tolist())
            elif flags[number]:
                row: list[Any] | None = item[1:]
                if unmounted_at:
                    lost = {s for s in _segment_ids(row)
                            if type(s) is str and unmounted_at.get(s, 0) > number}
                    row = _without_segments(row, lost) if lost else row
                if row is not None:
                    yield row


class _KeyFilter:
    """Which keys of a chunk are keys of ``keys`` (those the log touched), for every chunk of a
    snapshot: a bitmap of their hashes, 2 MiB that stay in the cache, answers most keys no,
    and only the rest are looked up in ``keys`` (with a million keys logged, each lookup
    misses the cache: about 0.4 µs a snapshot object, a tenth of its restore)."""

    _MASK = (1 << 24) - 1

    def __init__(self, keys: dict[Any, Any]) -> None:
        # the overlay's own dict, looked up as it is: a set of its keys is a table more
        self._keys = keys
        self._bitmap = np.zeros((self._MASK + 1) >> 3, np.uint8)
        slots = self._slots(list(keys))
        np.bitwise_or.at(self._bitmap, slots >> 3, np.left_shift(1, slots & 7).astype(np.uint8))

    def has(self, key: Any) -> bool:
        """Whether ``key`` (hashable) is among the filter's keys."""
        return key in self._keys

    def _slots(self, keys: list[Any]) -> Any:
        return np.fromiter(map(hash, keys), np.int64, len(keys)).view(np.uint64) & np.uint64(
            self._MASK)

    def marks(self, keys: list[Any]) -> list[bool] | None:
        """One flag per key of ``keys`` (hashable), set for those among the filter's keys;
        None when there is none."""
        if not self._keys:
            return None
        slots = self._slots(keys)
        maybe = np.flatnonzero(self._bitmap[slots >> 3] & np.left_shift(1, slots & 7))
        found = [i for i in maybe.tolist() if keys[i] in self._keys]
        if not found:
            return None
        marks = [False] * len(keys)
        for i in found:
            marks[i] = True
        return marks


def _in_chunks(items: Iterator[Sequence[Any] | ObjectColumns]
               ) -> Iterator[Sequence[Any] | ObjectColumns]:
    """``items`` with runs of rows with one replica as chunks of columns, and neighbouring
    chunks joined up to ``RESTORE_CHUNK`` objects (restore takes a chunk a column at a time,
    a row a Python step at a time, and each chunk has a fixed cost); a run that is not well
    formed stays rows, for restore to check and count one at a time."""
    pending: list[ObjectColumns] = []
    count = 0
    for item in _as_columns(items):
        if type(item) is ObjectColumns:
            if pending and count + len(item.keys) > RESTORE_CHUNK:
                yield ObjectColumns.concat(pending)
                pending, count = [], 0
            pending.append(item)
            count += len(item.keys)
            continue
        if pending:
            yield ObjectColumns.concat(pending)
            pending, count = [], 0
        yield item
    if pending:
        yield ObjectColumns.concat(pending)


def _as_columns(items: Iterator[Sequence[Any] | ObjectColumns]
                ) -> Iterator[Sequence[Any] | ObjectColumns]:
    """``items`` with each run of rows with one replica as chunks of columns."""
    for kind, run in groupby(items, _item_kind):
        if kind != _ONE_REPLICA:
            yield from run
            continue
        for batch in iter(partial(_take, run, RESTORE_CHUNK), []):
            columns = ObjectColumns.of_rows(batch)
            if columns is None:
                yield from batch
            else:
                yield columns


def _take(items: Iterator[Sequence[Any] | ObjectColumns], count: int
          ) -> list[Sequence[Any]]:
    return list(islice(items, count))  # type: ignore[arg-type]


_OTHER, _ONE_REPLICA, _COLUMNS = 0, 1, 2


def _item_kind(item: Sequence[Any] | ObjectColumns) -> int:
    if type(item) is ObjectColumns:
        return _COLUMNS
    flat = item[2] if len(item) == 6 else None
    return _ONE_REPLICA if type(flat) is list and len(flat) == 3 else _OTHER


def _rows_where_unmounted(items: Iterator[Sequence[Any] | ObjectColumns], unmounted: set[str]
                          ) -> Iterator[Sequence[Any] | ObjectColumns]:
    """``items`` with each chunk of columns that has objects on ``unmounted`` segments as its
    rows (the rows lose those replicas)."""
    for item in items:
        if type(item) is ObjectColumns and not unmounted.isdisjoint(item.segment_ids):
            yield from item.rows()
        else:
            yield item


def _segment_ids(row: Sequence[Any]) -> list[Any]:
    """The segment ids of a row's replicas (flattened as id, offset, length)."""
    flat = row[2]
    return flat[0::3] if isinstance(flat, list) else []


def _without_segments(row: Sequence[Any], segment_ids: set[str]) -> list[Any] | None:
    """Return ``row`` without its replicas on ``segment_ids``, or None when none is left."""
    flat = row[2]
    if not isinstance(flat, list):
        return list(row)
    kept: list[Any] = []
    for i in range(0, len(flat) - 2, 3):
        if type(flat[i]) is not str or flat[i] not in segment_ids:   # (another: restore judges)
            kept += flat[i:i + 3]
    if not kept:
        return None
    return [row[0], row[1], kept, *row[3:]]
