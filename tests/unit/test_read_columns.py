"""``GetReplicas`` answered as columns (``kvpool_wire/readcolumns.py``): the core's
``ReadColumns`` reads as the list of ``ReadResult`` it stands for, and encodes, signed by
``capability.columns_signer``, byte for byte as that list does through the key-by-key
encoder. The reads mix one-replica objects on two owners' segments, an object with two
replicas, keys absent, PENDING or malformed, and a restore's filtering."""

from __future__ import annotations

import pytest

from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire import capability, convert
from kvpool_wire.readcolumns import ReadColumns
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    Extent,
    ObjectKey,
    Op,
    PutOptions,
    ReadResult,
    SegmentId,
    SegmentInfo,
)

OWNER, OTHER = ClientId("owner"), ClientId("other")


def _core() -> tuple[MasterCore, list[ObjectKey]]:
    """A core holding one-replica objects on two owners' segments, one object with two
    replicas and one PENDING; returns it and the keys to read."""
    core = MasterCore(CoreConfig())
    assert core.register_client(OWNER, "h", b"k" * 32, 0.0)[0] == Status.OK
    assert core.register_client(OTHER, "h", b"o" * 32, 0.0)[0] == Status.OK
    assert core.mount_segment(SegmentInfo(SegmentId("a"), OWNER, 1 << 24), 0.0) == Status.OK
    single = [ObjectKey(b"s%d" % i) for i in range(40)]
    assert [s for s, _ in core.put_start(OWNER, single, [4096] * 40, PutOptions(), 1.0)] \
        == [Status.OK] * 40
    assert core.put_end(OWNER, single, 1.0, list(range(40))) == [Status.OK] * 40
    assert core.mount_segment(SegmentInfo(SegmentId("b"), OTHER, 1 << 24), 1.0) == Status.OK
    two = [ObjectKey(b"two")]
    assert core.put_start(OWNER, two, [8192], PutOptions(replica_num=2), 1.0)[0][0] \
        == Status.OK
    assert core.put_end(OWNER, two, 1.0) == [Status.OK]
    other = [ObjectKey(b"k%d" % i) for i in range(3)]
    placed = core.put_start(OTHER, other, [100] * 3, PutOptions(preferred_segment="b"), 1.0)
    assert [s for s, _ in placed] == [Status.OK] * 3
    assert core.put_end(OTHER, other, 1.0) == [Status.OK] * 3
    assert core.put_start(OWNER, [ObjectKey(b"pending")], [4096], PutOptions(), 1.0)[0][0] \
        == Status.OK
    reads = [*single[:5], ObjectKey(b"absent"), *two, ObjectKey(b"pending"), *other,
             ObjectKey(b""), *single[5:]]
    return core, reads


def test_read_columns_read_as_their_results() -> None:
    core, reads = _core()
    results = core.get_replicas(reads, 2.0)
    assert isinstance(results, ReadColumns)
    as_list = list(results)
    n = len(reads)
    assert results == as_list and len(results) == n and results[-n:] == as_list
    assert [results[i] for i in range(-n, n)] == as_list + as_list
    assert [r.status for r in as_list[5:9]] == [Status.NOT_FOUND, Status.OK, Status.NOT_FOUND,
                                                Status.OK]
    assert as_list[reads.index(ObjectKey(b""))] == ReadResult(int(Status.INVALID_KEY))
    assert len(as_list[6].placements) == 2 and as_list[6].size_bytes == 8192
    assert as_list[0] == ReadResult(0, 4096, (Extent(SegmentId("a"), 0, 4096),), 0)
    assert as_list[-1].checksum == 39
    with pytest.raises(IndexError):
        results[n]


@pytest.mark.parametrize("first_index", [0, 512])
def test_read_columns_encode_as_their_results(first_index: int) -> None:
    core, reads = _core()
    results = core.get_replicas(reads, 2.0, OWNER)
    assert isinstance(results, ReadColumns)
    one = capability.extent_signer(core.segment_key, Op.READ, 9000, 5)
    columns = capability.columns_signer(core.segment_key, Op.READ, 9000, 5)
    by_columns = convert.encode_get_replicas(results, 5.0, 9000, one, 3, True, first_index,
                                             columns)
    by_keys = convert.encode_get_replicas(list(results), 5.0, 9000, one, 3, True, first_index)
    assert by_columns.SerializeToString() == by_keys.SerializeToString()
    assert list(by_columns.columns.more_keys) == [first_index + 6]
    capabilities = by_columns.columns.capabilities
    assert capabilities[0] and capabilities[8] and not capabilities[5]   # 5 absent
    nested = convert.encode_get_replicas(results, 5.0, 9000, one, 3, False, 0, columns)
    assert nested == convert.encode_get_replicas(list(results), 5.0, 9000, one, 3, False, 0)


def test_a_restore_filters_replicas_in_columns_as_in_results() -> None:
    """While a restored segment is not mounted again, a read answers the replicas on
    mounted segments only (an object with none is NOT_FOUND): kept whole per key, encoded
    the same. (The segment table is set as a restore leaves it: "b" restored, unmounted.)"""
    core, reads = _core()
    core._segments.id_to_segment[SegmentId("b")].mounted = False
    core._segments.num_restored += 1
    assert core._segments.filtering
    results = core.get_replicas(reads, 2.0)
    assert isinstance(results, ReadColumns)
    as_list = list(results)
    assert [r.status for r in as_list[8:11]] == [Status.NOT_FOUND] * 3   # on "b" only
    assert len(as_list[6].placements) == 1   # its replica on "b" filtered out
    one = capability.extent_signer(core.segment_key, Op.READ, 9000, 5)
    columns = capability.columns_signer(core.segment_key, Op.READ, 9000, 5)
    assert convert.encode_get_replicas(results, 5.0, 9000, one, 0, True, 0, columns) \
        .SerializeToString() == convert.encode_get_replicas(
            as_list, 5.0, 9000, one, 0, True, 0).SerializeToString()
