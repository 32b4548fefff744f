"""core.snapshot() / core.restore(): round trip in memory and validation of every row."""

from __future__ import annotations

import pytest

from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.snapshot import Snapshot
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
