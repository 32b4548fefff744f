"""core.snapshot() / core.restore(): round trip in memory and validation of every row."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from helpers import columns_of_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.snapshot import ObjectColumns, RestoreCounts, Snapshot
from kvpool_wire.capability import client_token
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo

A = ClientId("a")
SEG = SegmentInfo(SegmentId("s"), A, 1 << 16, host_id="h")
CLIENT_ROW = ["a", "h", b"k" * 16]
SEGMENT_ROW = ["s", "a", 1 << 16, 0, "h", "", "", ""]


def restore(objects: list[list[object]], now: float = 0.0) -> tuple[MasterCore, int]:
    core = MasterCore(CoreConfig())
    counts = core.restore(Snapshot([CLIENT_ROW], [SEGMENT_ROW], objects), now, 10.0)
    core.register_client(A, "h", b"x" * 16, now, client_token(b"k" * 16))
    core.mount_segment(SEG, now)
    return core, counts.num_dropped_rows


def test_snapshot_round_trip_in_memory() -> None:
    core = MasterCore(CoreConfig())
    core.register_client(A, "h", b"k" * 16, 0.0)
    core.mount_segment(SEG, 0.0)
    keys = [ObjectKey(b"x%d" % i) for i in range(5)]
    core.put_start(A, keys, [100] * 5, PutOptions(), 0.0, parent_keys=[b""] + keys[:4])  # type: ignore[list-item]
    core.put_end(A, keys[:4], 0.0, checksums=[1, 2, 3, 4])
    snapshot = core.snapshot()
    rows = list(snapshot.objects)
    assert [r[0] for r in rows] == keys[:4]           # READY only, LRU order
    copy = MasterCore(CoreConfig())
    counts = copy.restore(Snapshot(snapshot.clients, snapshot.segments, rows), 5.0, 10.0)
    assert (counts.num_clients, counts.num_segments, counts.num_objects) == (1, 1, 4)
    copy.register_client(A, "h", b"y" * 16, 5.0, client_token(b"k" * 16))
    copy.mount_segment(SEG, 5.0)
    assert copy.get_replicas(keys, 6.0) == core.get_replicas(keys, 6.0)
    with pytest.raises(ValueError, match="fresh"):
        copy.restore(Snapshot([], [], []), 7.0, 1.0)


@pytest.mark.parametrize("row", [
    [b"", 64, ["s", 0, 64], 0, 0, None],             # empty key
    [b"k", 0, ["s", 0, 0], 0, 0, None],              # zero size
    [b"k", 64, ["t", 0, 64], 0, 0, None],            # unknown segment
    [b"k", 64, ["s", 3, 64], 0, 0, None],            # unaligned offset
    [b"k", 64, ["s", 1 << 16, 64], 0, 0, None],      # past the end of the segment
    [b"k", 64, ["s", 0, 65], 0, 0, None],            # length differs from size
    [b"k", 64, ["s", 0, 64], -1, 0, None],           # checksum out of range
    [b"k", 64, ["s", 0, 64], 0, 9, None],            # unknown pin
    [b"k", 64, ["s", 0, 64], 0, 0, "str-parent"],    # parent not bytes
    [b"k", 64, ["s", 0, 64, "s", 64, 64], 0, 0, None],   # two replicas on one segment
    [b"k", 64, [], 0, 0, None],                      # no replica
    [b"k", 64, ["s", 0], 0, 0, None],                # ragged placements
    "not a row",
])
def test_malformed_object_rows_are_dropped(row: list[object]) -> None:
    core, dropped = restore([row, [b"good", 64, ["s", 128, 64], 5, 0, None]])
    assert dropped == 1
    assert core.exist([ObjectKey(b"k"), ObjectKey(b"good")], 1.0)[0] == [
        Status.NOT_FOUND, Status.OK]


def test_objects_claiming_one_extent_are_all_dropped_and_counted() -> None:
    core = MasterCore(CoreConfig(write_capability_ttl_s=5.0))
    counts = core.restore(Snapshot([CLIENT_ROW], [SEGMENT_ROW], [
        [b"first", 128, ["s", 0, 128], 0, 0, None],
        [b"second", 64, ["s", 64, 64], 0, 0, None],      # inside first's extent
        [b"third", 64, ["s", 4096, 64], 0, 0, None],      # exactly on fourth's extent
        [b"fourth", 64, ["s", 4096, 64], 0, 0, None],
        [b"alone", 64, ["s", 8192, 64], 0, 0, None],
        [b"first", 64, ["s", 1024, 64], 0, 0, None]]), 0.0, 10.0)
    assert counts.num_conflicting_objects == 4
    assert counts.num_dropped_rows == 1   # the duplicate key
    assert counts.num_objects == 1
    core.register_client(A, "h", b"x" * 16, 0.0, client_token(b"k" * 16))
    core.mount_segment(SEG, 0.0)
    keys = [ObjectKey(k) for k in (b"first", b"second", b"third", b"fourth", b"alone")]
    assert core.exist(keys, 1.0)[0] == [Status.NOT_FOUND] * 4 + [Status.OK]
    core.tick(6.0)   # past the restart quarantine: only "alone" holds bytes
    assert core.stats().tier_to_used_bytes[0] == 64


def test_malformed_client_and_segment_rows_are_dropped() -> None:
    core = MasterCore(CoreConfig())
    counts = core.restore(Snapshot(
        [CLIENT_ROW, ["", "h", b"k" * 16], ["b", "h"], ["c", "h", b"short"]],
        [SEGMENT_ROW, ["orphan", "nobody", 4096, 0, "", "", "", ""], ["bad", "a", -1, 0, "",
                                                                      "", "", ""]],
        []), 0.0, 1.0)
    assert (counts.num_clients, counts.num_segments, counts.num_dropped_rows) == (1, 1, 5)


def test_a_restored_segment_is_kept_from_another_owner() -> None:
    core = MasterCore(CoreConfig())
    core.restore(Snapshot([CLIENT_ROW], [SEGMENT_ROW], [[b"k", 64, ["s", 0, 64], 0, 0, None]]),
                 0.0, 10.0)
    core.register_client(ClientId("thief"), "h", b"t" * 16, 1.0)
    thief = SegmentInfo(SegmentId("s"), ClientId("thief"), 1 << 16, host_id="h")
    assert core.mount_segment(thief, 1.0) == Status.SEGMENT_ALREADY_EXISTS
    assert core.mount_segment(SEG, 1.0) == Status.UNKNOWN_CLIENT   # owner not back yet
    core.register_client(A, "h", b"x" * 16, 2.0, client_token(b"k" * 16))
    assert core.mount_segment(SEG, 2.0) == Status.OK
    assert core.exist([ObjectKey(b"k")], 3.0)[0] == [Status.OK]


def test_restored_free_space_is_quarantined_and_fresh_segments_are_not() -> None:
    """PENDING puts are not persisted: a writer of the previous master may still write into
    space that is free in the restored index until its write capability runs out."""
    core = MasterCore(CoreConfig(write_capability_ttl_s=5.0))
    core.restore(Snapshot([CLIENT_ROW], [SEGMENT_ROW],
                          [[b"kept", 64, ["s", 0, 64], 0, 0, None]]), 100.0, 10.0)
    core.register_client(A, "h", b"x" * 16, 100.0, client_token(b"k" * 16))
    core.mount_segment(SEG, 100.0)
    assert core.stats().quarantined_bytes == (1 << 16) - 64
    [(status, _)] = core.put_start(A, [ObjectKey(b"early")], [64], PutOptions(), 101.0)
    assert status == Status.NO_SPACE
    assert core.exist([ObjectKey(b"kept")], 101.0)[0] == [Status.OK]   # nothing evicted
    fresh = SegmentInfo(SegmentId("fresh"), A, 1 << 16, host_id="h")
    assert core.mount_segment(fresh, 101.0) == Status.OK
    [(status, [placement])] = core.put_start(A, [ObjectKey(b"on-fresh")], [64], PutOptions(),
                                             101.0)
    assert status == Status.OK and placement.segment_id == "fresh"
    [(status, [placement])] = core.put_start(A, [ObjectKey(b"later")], [64],
                                             PutOptions(preferred_segment="s"), 105.0)
    assert status == Status.OK and placement.segment_id == "s"
    assert core.stats().quarantined_bytes == 0


def test_segment_rows_with_and_without_the_engine_base_address() -> None:
    engine = SegmentInfo(SegmentId("e"), A, 1 << 16, host_id="h",
                         engine_endpoint="10.0.0.1:15001", engine_base_address=0x7F0000000000)
    rows = [["e", "a", 1 << 16, 0, "h", "", "", "10.0.0.1:15001", 0x7F0000000000],
            SEGMENT_ROW,                                                   # before engine bases
            ["x1", "a", 1 << 16, 0, "h", "", "", "10.0.0.1:15001", "0x7f"],  # not an int
            ["x2", "a", 1 << 16, 0, "h", "", "", "", 0x1000],              # base, no engine
            ["x3", "a", 1 << 16, 0, "h", "", "", "10.0.0.1:15001", 1, 2],  # path not a str
            ["x4", "a", 1 << 16, 1, "h", "", "", "", 0, "/ssd/f", 3]]   # too long
    core = MasterCore(CoreConfig())
    counts = core.restore(Snapshot([CLIENT_ROW], rows, []), 0.0, 10.0)
    assert (counts.num_segments, counts.num_dropped_rows) == (2, 4)
    core.register_client(A, "h", b"x" * 16, 0.0, client_token(b"k" * 16))
    assert core.mount_segment(engine, 0.0) == Status.OK
    assert core.mount_segment(SEG, 0.0) == Status.OK
    rows_now = {row[0]: row for row in core.snapshot().segments}
    assert rows_now["e"][8] == 0x7F0000000000 and rows_now["s"][8] == 0
    assert rows_now["e"][9] == "" and rows_now["s"][9] == ""


# ---- chunks of columns (how a snapshot stores objects with one replica) ---------------------

SEG_T = SegmentInfo(SegmentId("t"), A, 1 << 15, host_id="h")   # smaller than "s"
TWO_SEGMENTS = [SEGMENT_ROW, ["t", "a", 1 << 15, 0, "h", "", "", ""]]
#: A chain k0 <- k1 <- k2 (parents in the chunk), k3 whose parent is outside it, k4 on "t".
GOOD_ROWS: list[list[object]] = [
    [b"k0", 64, ["s", 0, 64], 1, 0, None],
    [b"k1", 100, ["s", 4096, 100], 2, 1, b"k0"],
    [b"k2", 64, ["s", 8192, 64], 3, 0, b"k1"],
    [b"k3", 4096, ["s", 12288, 4096], (1 << 64) - 1, 2, b"elsewhere"],
    [b"k4", 64, ["t", 0, 64], 5, 0, b"k2"],
]
KEYS = [ObjectKey(b"k%d" % i) for i in range(5)] + [ObjectKey(b"elsewhere"), ObjectKey(b"x")]


def restore_two(objects: Iterable[Sequence[object] | ObjectColumns]
                ) -> tuple[MasterCore, RestoreCounts]:
    core = MasterCore(CoreConfig(max_key_bytes=16))
    counts = core.restore(Snapshot([CLIENT_ROW], TWO_SEGMENTS, objects), 0.0, 10.0)
    # the free space each segment's allocator was rebuilt with: restore holds it back
    core.restored_free = sorted(  # type: ignore[attr-defined]
        (held[2].info.segment_id, held[3], held[4]) for held in core._quarantine._heap)
    core.register_client(A, "h", b"x" * 16, 0.0, client_token(b"k" * 16))
    assert core.mount_segment(SEG, 0.0) == Status.OK
    assert core.mount_segment(SEG_T, 0.0) == Status.OK
    return core, counts


def state(core: MasterCore) -> tuple[object, ...]:
    snapshot = core.snapshot()
    return (list(snapshot.objects), core.get_replicas(KEYS, 1.0), core.stats().num_objects,
            core.stats().tier_to_used_bytes, core.restored_free)  # type: ignore[attr-defined]


def changed(field: str, make: Callable[[Any], Any]) -> Callable[[ObjectColumns], ObjectColumns]:
    return lambda columns: dataclasses.replace(columns, **{field: make(getattr(columns, field))})


def at(index: int, value: object) -> Callable[[Any], Any]:
    def change(column: Any) -> Any:
        values = list(column)
        values[index] = value
        return type(column)(column.typecode, values) if isinstance(column, array) else (
            bytes(values) if isinstance(column, bytes) else values)
    return change


@pytest.mark.parametrize("mutate", [
    pytest.param(lambda c: c, id="as written"),
    pytest.param(lambda c: columns_of_rows([GOOD_ROWS[0], [b"k4", 64, ["t", 16384, 64], 5, 0,
                                                           b"k2"], *GOOD_ROWS[1:4]]),
                 id="segments interleaved"),
    pytest.param(changed("keys", at(1, b"")), id="empty key"),
    pytest.param(changed("keys", at(1, b"x" * 17)), id="key too long"),
    pytest.param(changed("keys", at(1, "k1")), id="key not bytes"),
    pytest.param(changed("keys", at(2, b"k0")), id="key twice"),
    pytest.param(changed("sizes", at(2, 0)), id="zero size"),
    pytest.param(changed("segment_ids", at(0, "gone")), id="unknown segment"),
    pytest.param(changed("segment_ids", at(0, ["s"])), id="unhashable segment id"),
    pytest.param(changed("segment_index", at(4, 7)), id="segment index out of range"),
    pytest.param(changed("offsets", at(2, 8192 + 8)), id="unaligned offset"),
    pytest.param(changed("offsets", at(4, 1 << 16)), id="past the end of the segment"),
    pytest.param(changed("offsets", at(4, 1 << 15)), id="past the end of the smaller segment"),
    pytest.param(changed("sizes", at(4, (1 << 16) + 1)), id="longer than the segment"),
    pytest.param(changed("pins", at(3, 9)), id="unknown pin"),
    pytest.param(changed("parents", at(2, 5)), id="parent index past the names"),
    pytest.param(changed("parents", at(2, -2)), id="negative parent index"),
    pytest.param(changed("parent_keys", at(0, b"")), id="empty parent key"),
    pytest.param(changed("parent_keys", at(0, 7)), id="parent key not bytes"),
    pytest.param(changed("offsets", lambda c: array("q", c)), id="signed offsets"),
    pytest.param(changed("checksums", lambda c: list(c)), id="checksums not machine words"),
    pytest.param(changed("sizes", lambda c: c[:-1]), id="ragged"),
])
def test_a_chunk_of_columns_restores_as_its_rows_do(
        mutate: Callable[[ObjectColumns], ObjectColumns], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restore checks columns a column at a time and takes a chunk row by row when any check
    fails: either way it keeps exactly the objects, fields and order its rows give."""
    written = columns_of_rows(GOOD_ROWS)
    columns = mutate(written)
    by_rows, counts_by_rows = restore_two(columns.rows())
    if columns is written:

        def not_row_by_row(self: ObjectColumns) -> list[list[Any]]:
            raise AssertionError("a clean chunk is restored a column at a time")
        monkeypatch.setattr(ObjectColumns, "rows", not_row_by_row)
    by_columns, counts = restore_two([columns])
    assert state(by_columns) == state(by_rows)
    ragged = len(columns.keys) - len(columns.sizes)
    assert (counts.num_objects, counts.num_dropped_rows) == (
        counts_by_rows.num_objects, counts_by_rows.num_dropped_rows + ragged)


def test_a_clean_chunk_of_columns_restores_every_field_and_shares_parent_keys() -> None:
    columns = columns_of_rows(GOOD_ROWS)
    assert columns.parent_keys == [b"elsewhere"]
    parent = [b"elsewhere", 64, ["t", 4096, 64], 0, 0, None]
    core, counts = restore_two([parent, columns, [b"x", 64, ["t", 8192, 64], 0, 0, b"k4"]])
    assert (counts.num_objects, counts.num_dropped_rows) == (7, 0)
    rows = list(core.snapshot().objects)
    assert [list(r) for r in rows] == [parent, *GOOD_ROWS,
                                       [b"x", 64, ["t", 8192, 64], 0, 0, b"k4"]]
    table = core._objects
    for key in (b"k1", b"k2", b"k3", b"k4", b"x"):
        entry = table.get(ObjectKey(key))
        assert entry is not None and entry.parent_key is not None
        assert entry.parent_key is table.get(entry.parent_key).key   # type: ignore[union-attr]


def test_columns_without_some_rows_name_their_removed_parents_by_key() -> None:
    columns = columns_of_rows(GOOD_ROWS)
    kept = columns.without([False, True, False, False, True])   # k1 (a parent) and k4
    assert kept.rows() == [[r[0], r[1], r[2], r[3], r[4], r[5]]
                           for r in (GOOD_ROWS[0], GOOD_ROWS[2], GOOD_ROWS[3])]
    assert kept.keys == [b"k0", b"k2", b"k3"] and kept.parent_keys == [b"elsewhere", b"k1"]


@st.composite
def any_columns(draw: st.DrawFn) -> ObjectColumns:
    """Columns as a snapshot file could hold them: well formed (keys may repeat, extents may
    overlap), or with one value anywhere replaced by an arbitrary one."""
    num_rows = draw(st.integers(1, 8))
    rows = st.lists(st.integers(0, num_rows - 1), min_size=num_rows, max_size=num_rows)
    segment_ids = draw(st.lists(st.sampled_from(["s", "t"]), min_size=1, max_size=2,
                                unique=True))
    parent_keys = draw(st.lists(st.sampled_from([b"a", b"elsewhere"]), max_size=2))
    columns = ObjectColumns(
        [b"k%d" % i for i in draw(rows)],
        array("Q", draw(st.lists(st.sampled_from([1, 64, 4096, 5000]), min_size=num_rows,
                                 max_size=num_rows))),
        segment_ids,
        array("I", draw(st.lists(st.integers(0, len(segment_ids) - 1), min_size=num_rows,
                                 max_size=num_rows))),
        array("Q", [4096 * i for i in draw(rows)]),
        array("Q", draw(st.lists(st.integers(0, (1 << 64) - 1), min_size=num_rows,
                                 max_size=num_rows))),
        bytes(draw(st.lists(st.integers(0, 2), min_size=num_rows, max_size=num_rows))),
        array("i", draw(st.lists(st.integers(-1, num_rows + len(parent_keys) - 1),
                                 min_size=num_rows, max_size=num_rows))),
        parent_keys)
    if draw(st.booleans()):
        return columns
    field = draw(st.sampled_from(sorted(ANY_VALUE)))
    values = list(getattr(columns, field))
    if not values:
        return columns
    values[draw(st.integers(0, len(values) - 1))] = draw(st.sampled_from(ANY_VALUE[field]))
    column = getattr(columns, field)
    return dataclasses.replace(columns, **{field: (
        array(column.typecode, values) if isinstance(column, array)
        else bytes(values) if isinstance(column, bytes) else values)})


#: What a snapshot file's columns can carry (``statefile.py`` decodes them): number columns
#: of their machine words, keys as bytes, segment ids as str, parent keys as anything.
_WORDS = [0, 1, 8, 4096, 1 << 16, (1 << 64) - 1]
ANY_VALUE: dict[str, list[Any]] = {
    "keys": [b"", b"x" * 17, b"k1", b"a"],
    "sizes": _WORDS, "offsets": _WORDS, "checksums": _WORDS,
    "segment_ids": ["s", "t", "gone", ""],
    "segment_index": [0, 1, 2, (1 << 32) - 1],
    "pins": [0, 2, 3, 255],
    "parents": [-(1 << 31), -2, -1, 0, 1, 7, (1 << 31) - 1],
    "parent_keys": [b"", b"x" * 17, b"k1", "k1", 7, None, [b"k1"]],
}


@settings(max_examples=300, deadline=None)
@given(any_columns())
def test_any_chunk_of_columns_restores_exactly_as_its_rows_do(columns: ObjectColumns) -> None:
    """Whatever the columns hold, restoring them keeps what restoring their rows one at a time
    keeps: the same objects with the same fields in the same order, the same counts."""
    by_rows, counts_by_rows = restore_two(columns.rows())
    by_columns, counts = restore_two([columns])
    assert state(by_columns) == state(by_rows)
    assert counts == counts_by_rows


@settings(max_examples=200, deadline=None)
@given(st.lists(any_columns(), min_size=1, max_size=3))
def test_chunks_joined_are_their_rows_and_restore_as_the_chunks_do(
        chunks: list[ObjectColumns]) -> None:
    """A log's chunks are joined before they restore: the joined chunk holds the chunks' rows
    in order (a segment or parent index out of its chunk's range stays out of range), and
    restores what the chunks one after the other restore."""
    joined = ObjectColumns.concat(chunks)
    assert joined.rows() == [row for chunk in chunks for row in chunk.rows()]
    by_parts, counts_by_parts = restore_two(chunks)
    by_joined, counts = restore_two([joined])
    assert state(by_joined) == state(by_parts)
    assert counts == counts_by_parts


def test_chunks_joined_name_each_segment_once_and_keep_parents() -> None:
    first = columns_of_rows(GOOD_ROWS[:2])
    second = columns_of_rows([[b"k5", 64, ["t", 4096, 64], 0, 0, b"k1"],
                              [b"k6", 64, ["s", 16384, 64], 0, 0, b"k5"]])
    joined = ObjectColumns.concat([first, second])
    assert joined.segment_ids == ["s", "t"] and joined.segment_index.tolist() == [0, 0, 1, 0]
    assert joined.parents.tolist() == [-1, 0, 4, 2] and joined.parent_keys == [b"k1"]
    with pytest.raises(ValueError, match="ragged"):
        ObjectColumns.concat([first, dataclasses.replace(second, sizes=second.sizes[:1])])
