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
- Only events that change durable state become log rows (``event_row``); ``Overlay`` applies
  rows on top of a snapshot and streams the restored object rows in LRU order.
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
from typing import Any, BinaryIO

import msgpack
import numpy as np

from kvpool_master.core import events as ev
from kvpool_master.core.snapshot import (
    RESTORE_CHUNK,
    Chunk,
    ObjectColumns,
    object_row,
    segment_row,
)

VERSION = 1
#: Snapshots read: 1 (chunks of rows only) and 2 (columns too); written: 2.
SNAPSHOT_VERSION = 2
_SNAPSHOT_VERSIONS = (1, 2)
_FRAME = struct.Struct("<II")
_MAX_RECORD_BYTES = 1 << 30

# Event rows: [code, fields...]. Only events that change durable state are logged.
_CLIENT_REGISTERED, _CLIENT_GONE, _SEGMENT_MOUNTED, _SEGMENT_UNMOUNTED = 1, 2, 3, 4
_OBJECT_COMMITTED, _OBJECT_REMOVED = 5, 6
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
            {row[0]: row for row in clients if isinstance(row, list) and row},
            {row[0]: row for row in segments if isinstance(row, list) and row})


def chunk_frame(chunk: Chunk) -> bytes:
    """The record of a snapshot chunk: rows as they are, columns as a map of them."""
    if type(chunk) is not ObjectColumns:
        return frame(chunk)
    return frame({"columns": [
        chunk.keys, _words(chunk.sizes), chunk.segment_ids, _words(chunk.segment_index),
        _words(chunk.offsets), _words(chunk.checksums), chunk.pins, _words(chunk.parents),
        chunk.parent_keys]})


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


def _object_columns(record: dict[Any, Any]) -> ObjectColumns:
    """The columns of a snapshot chunk; ``ValueError`` when it is not one (restore checks
    the values)."""
    fields = record.get("columns")
    if not isinstance(fields, list) or len(fields) != 9:
        raise ValueError("not a chunk of columns")
    keys, sizes, segment_ids, index, offsets, checksums, pins, parents, parent_keys = fields
    if (not isinstance(keys, list) or not isinstance(segment_ids, list)
            or not isinstance(parent_keys, list) or type(pins) is not bytes
            or len(pins) != len(keys) or not _BYTES.issuperset(map(type, keys))
            or not _STRS.issuperset(map(type, segment_ids))):
        raise ValueError("malformed chunk of columns")
    num_rows = len(keys)
    return ObjectColumns(keys, _column("Q", sizes, num_rows), segment_ids,
                         _column("I", index, num_rows), _column("Q", offsets, num_rows),
                         _column("Q", checksums, num_rows), pins,
                         _column("i", parents, num_rows), parent_keys)


_BYTES = frozenset({bytes})
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
                columns = _object_columns(record)
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
    (even if the segment came back later: a remount is fresh memory). Each row and unmount is
    numbered as it is applied, so an unmount costs O(1) here and replicas are filtered once,
    in ``objects()``: replay is linear in the log.
    """

    def __init__(self, clients: dict[str, Sequence[Any]],
                 segments: dict[str, Sequence[Any]]) -> None:
        self.clients = clients
        self.segments = segments
        self.unmounted_at: dict[str, int] = {}   # segment id -> number of its last unmount
        self.key_to_row: dict[bytes, tuple[int, list[Any] | None]] = {}  # (number, row)
        self._applied = 0

    def apply(self, record: list[Any]) -> None:
        for row in record:
            if not isinstance(row, list) or not row:
                continue
            code = row[0]
            self._applied += 1
            if code == _OBJECT_COMMITTED and len(row) == 7:
                self.key_to_row.pop(row[1], None)   # recency: a commit moves to the end
                self.key_to_row[row[1]] = (self._applied, row[1:])
            elif code == _OBJECT_REMOVED and len(row) == 2:
                self.key_to_row.pop(row[1], None)
                self.key_to_row[row[1]] = (self._applied, None)
            elif code == _CLIENT_REGISTERED and len(row) == 4:
                self.clients[row[1]] = row[1:]
            elif code == _CLIENT_GONE and len(row) == 2:
                self.clients.pop(row[1], None)
            elif code == _SEGMENT_MOUNTED and len(row) in (9, 10, 11):  # older rows are shorter
                self.segments[row[1]] = row[1:]
            elif code == _SEGMENT_UNMOUNTED and len(row) == 2:
                self.segments.pop(row[1], None)
                self.unmounted_at[row[1]] = self._applied

    def objects(self, snapshot_rows: Iterator[Sequence[Any] | ObjectColumns]
                ) -> Iterator[Sequence[Any] | ObjectColumns]:
        """Return the restored object rows (and chunks of columns): the snapshot's, then the
        log's, in LRU order.

        The log's part is built here, at once, as chunks of columns where it can be, on copies
        of the keys the log touched: the caller can then let the decoded log go
        (``key_to_row`` and its records) before the snapshot's objects restore, and none of
        its keys, kept by restored entries or by the filter of touched keys, holds the memory
        of the rows around it."""
        touched = self.key_to_row
        unmounted_at = self.unmounted_at
        unmounted = set(unmounted_at)   # every unmount of the log follows the snapshot
        if not touched and not unmounted:  # an empty log (right after a snapshot): as they are
            return snapshot_rows
        # (a key of another type is passed on as it is: restore drops its row)
        keys = [bytes(memoryview(key)) if type(key) is bytes else key for key in touched]

        def from_log() -> Iterator[Sequence[Any]]:
            for key, (number, row) in zip(keys, touched.values(), strict=True):
                if row is None:
                    continue
                if unmounted_at:
                    gone = {s for s in _segment_ids(row) if unmounted_at.get(s, 0) > number}
                    row = _without_segments(row, gone) if gone else row
                if row is not None:
                    row[0] = key   # the copy (an equal key): the decoded one goes with the log
                    yield row
        logged_items = list(_as_columns(from_log()))
        logged = _KeyFilter(keys)

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


class _KeyFilter:
    """Which keys of a chunk are among ``keys`` (those the log touched), for every chunk of a
    snapshot: a bitmap of their hashes, 2 MiB that stay in the cache, answers most keys no,
    and only the rest are looked up in ``keys`` (with a million keys logged, each lookup
    misses the cache: about 0.4 µs a snapshot object, a tenth of its restore)."""

    _MASK = (1 << 24) - 1

    def __init__(self, keys: list[bytes]) -> None:
        self._keys = set(keys)
        self._bitmap = np.zeros((self._MASK + 1) >> 3, np.uint8)
        slots = self._slots(keys)
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


def _as_columns(rows: Iterator[Sequence[Any]]) -> Iterator[Sequence[Any] | ObjectColumns]:
    """``rows`` with each run of rows with one replica as chunks of columns (restore takes a
    chunk a column at a time, a row a Python step at a time); a run that is not well formed
    stays rows, for restore to check and count one at a time."""
    for one_replica, run in groupby(rows, _one_replica):
        for batch in iter(partial(_take, run, RESTORE_CHUNK), []):
            columns = ObjectColumns.of_rows(batch) if one_replica else None
            if columns is None:
                yield from batch
            else:
                yield columns


def _take(items: Iterator[Sequence[Any]], count: int) -> list[Sequence[Any]]:
    return list(islice(items, count))


def _one_replica(row: Sequence[Any]) -> bool:
    flat = row[2] if len(row) == 6 else None
    return type(flat) is list and len(flat) == 3


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
        if flat[i] not in segment_ids:
            kept += flat[i:i + 3]
    if not kept:
        return None
    return [row[0], row[1], kept, *row[3:]]
