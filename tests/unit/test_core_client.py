"""The client's data-path core, stepped by hand: no sockets, no loop, ``now`` passed in."""

from __future__ import annotations

import pytest

from kvpool_client.buffers import to_key
from kvpool_client.core.keys import KeyBatch
from kvpool_client.core.put_plan import (
    PutPlan,
    WriteWindow,
    answered_again,
    granted_any,
    space_refused,
)
from kvpool_client.core.read_plan import ReadPlan, lease_deadline
from kvpool_client.core.regions import checksum
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, Placement, ReadResult, SegmentId, SegmentInfo

SEG_A = SegmentInfo(SegmentId("a"), ClientId("c"), 1 << 20, host_id="here", shm_name="x")
SEG_B = SegmentInfo(SegmentId("b"), ClientId("c"), 1 << 20, host_id="there")
INFOS = {"a": SEG_A, "b": SEG_B}
OPEN = WriteWindow(Status.OK, 1000.0)


def place(segment: str, offset: int = 0, length: int = 4, expiry_ms: int = 0) -> Placement:
    return Placement(SegmentId(segment), offset, length, capability_expiry_ms=expiry_ms)


def test_a_put_commits_written_keys_and_revokes_failed_ones() -> None:
    plan = PutPlan([b"k0", b"k1", b"k2", b"k3"], [4, 4, 4, 4], [11, 12, 13, 14])
    plan.started([(Status.OK, (place("a"),)), (Status.ALREADY_EXISTS, ()),
                  (Status.NO_SPACE, ()), (Status.OK, (place("a", 8), place("b", 8)))])
    assert plan.statuses == [Status.OK, Status.OK, Status.NO_SPACE, Status.OK]
    assert plan.segment_ids == {"a", "b"}
    jobs = plan.writable(INFOS, OPEN)
    assert [(index, p.segment_id) for _, index, _, p in jobs] == [(0, "a"), (3, "a"), (3, "b")]
    plan.copied(jobs, [Status.OK, Status.OK, Status.TRANSFER_FAILED])  # one replica of k3
    assert plan.revoke_keys() == [b"k3"]  # a key is committed only with every replica
    assert plan.commit_indices() == [0]
    assert plan.commit_checksums([0]) == [11]
    plan.committed([0], [Status.OK])
    assert plan.statuses == [Status.OK, Status.OK, Status.NO_SPACE, Status.TRANSFER_FAILED]


def test_a_put_writes_nothing_outside_its_window() -> None:
    plan = PutPlan([b"k0", b"k1", b"k2"], [4, 4, 4], None)
    plan.started([(Status.OK, (place("a", expiry_ms=500),)), (Status.OK, (place("gone"),)),
                  (Status.OK, (place("b", expiry_ms=5000),))])
    jobs = plan.writable(INFOS, OPEN)  # the clock reads 1000 ms
    assert [index for _, index, _, _ in jobs] == [2]
    assert plan.statuses[:2] == [Status.TIMEOUT, Status.SEGMENT_NOT_FOUND]
    assert plan.commit_checksums([2]) is None
    again = PutPlan([b"k"], [4], None)
    again.started([(Status.OK, (place("a"),))])
    window = WriteWindow.at(granted_epoch=1, epoch=2, alive=True, clock_ms=0)
    assert again.writable(INFOS, window) == [] and again.statuses == [Status.UNKNOWN_CLIENT]
    lapsed = WriteWindow.at(granted_epoch=1, epoch=1, alive=False, clock_ms=0)
    assert lapsed.allows(place("a")) == Status.TIMEOUT


def test_short_answers_never_pass_for_success() -> None:
    plan = PutPlan([b"k0", b"k1"], [4, 4], None)
    with pytest.raises(KVPoolError) as error:
        plan.started([(Status.OK, (place("a"),))])
    assert error.value.status == Status.INTERNAL_ERROR
    plan = PutPlan([b"k0"], [4], None)
    plan.started([(Status.OK, (place("a"),))])
    plan.copied(plan.writable(INFOS, OPEN), [Status.OK])
    plan.committed([0], [])  # a short PutEnd answer fails the keys it left out
    assert plan.statuses == [Status.INTERNAL_ERROR]


def test_keys_refused_for_space_are_asked_again_alone() -> None:
    first = [(Status.OK, [place("a")]), (Status.NO_SPACE, []), (Status.ALREADY_EXISTS, []),
             (Status.NO_SPACE, [])]
    refused = space_refused(first)
    assert refused == [1, 3]
    assert granted_any(first) and not granted_any([first[1], first[2]])
    merged = answered_again(first, refused, [(Status.OK, [place("a", 8)]), (Status.NO_SPACE, [])])
    assert [status for status, _ in merged] == [Status.OK, Status.OK, Status.ALREADY_EXISTS,
                                                Status.NO_SPACE]
    assert merged[0] == first[0] and merged[1][1] == [place("a", 8)]
    with pytest.raises(KVPoolError) as short:
        answered_again(first, refused, [(Status.OK, [place("a", 8)])])
    assert short.value.status == Status.INTERNAL_ERROR


def test_a_read_moves_to_the_next_replica_and_judges_by_lease_and_checksum() -> None:
    good = memoryview(bytearray(b"abcd"))
    plan = ReadPlan([b"k0", b"k1", b"k2"], check_checksums=True)
    replies = [ReadResult(Status.OK, 4, (place("b"), place("a")), checksum([good])),
               ReadResult(Status.NOT_FOUND),
               ReadResult(Status.OK, 4, (place("a", 8),), checksum([good]))]
    plan.granted(replies, sent_s=100.0, lease_ttl_s=5.0)
    assert plan.deadline_s == lease_deadline(100.0, 5.0) < 105.0
    dsts = {0: [memoryview(bytearray(4))], 2: [memoryview(bytearray(4))]}
    plan.choose(INFOS, lambda i, size: dsts[i], prefers=lambda info: info.host_id == "here")
    first = plan.attempt()
    assert [item[1].segment_id for item in first] == ["a", "a"]  # same host first
    dsts[2][0][:] = b"abcx"  # k2's bytes came back wrong
    dsts[0][0][:] = b"zzzz"
    plan.attempted([Status.TRANSFER_FAILED, Status.OK], now_s=101.0)
    assert plan.results[1:] == [int(Status.NOT_FOUND), int(Status.CHECKSUM_MISMATCH)]
    second = plan.attempt()
    assert [item[1].segment_id for item in second] == ["b"]  # k0's other replica
    dsts[0][0][:] = b"abcd"
    plan.attempted([Status.OK], now_s=101.5)
    assert plan.results[0] == 4 and plan.attempt() == []


def test_a_read_finished_after_its_lease_is_void() -> None:
    plan = ReadPlan([b"k"], check_checksums=False)
    plan.granted([ReadResult(Status.OK, 4, (place("a"),))], sent_s=0.0, lease_ttl_s=1.0)
    plan.choose(INFOS, lambda i, size: [memoryview(bytearray(size))], lambda info: True)
    plan.attempted([Status.OK], now_s=0.999)  # past the margin before the lease's end
    assert plan.results == [int(Status.LEASE_EXPIRED)]
    late = ReadPlan([b"k"], check_checksums=False)
    late.granted([ReadResult(Status.OK, 4, (place("a"), place("b")))], 0.0, 1.0)
    late.choose(INFOS, lambda i, size: [memoryview(bytearray(size))], lambda info: True)
    late.attempted([Status.TRANSFER_FAILED], now_s=2.0)  # no retry once the lease is over
    assert late.results == [int(Status.TRANSFER_FAILED)]


def test_a_destination_refused_up_front_fails_its_key_alone() -> None:
    plan = ReadPlan([b"k0", b"k1"], check_checksums=False)
    plan.granted([ReadResult(Status.OK, 8, (place("a", length=8),)),
                  ReadResult(Status.OK, 4, (place("nowhere"),))], 0.0, 5.0)
    plan.choose(INFOS, lambda i, size: Status.BUFFER_OVERFLOW if i == 0 else
                [memoryview(bytearray(size))], lambda info: True)
    assert plan.results == [int(Status.BUFFER_OVERFLOW), int(Status.SEGMENT_NOT_FOUND)]
    assert plan.attempt() == []


def test_one_duplicate_key_policy() -> None:
    batch = KeyBatch(["a", "", "b", "a", "c", "b"], [1, 2, 3, 4, None, 6], to_key)
    assert batch.keys == [b"a", b"b"] and batch.values == [1, 3]  # the first value wins
    assert batch.positions == [0, 2] and batch.repeats == [(3, 0), (5, 1)]
    out = batch.spread(["ra", "rb"])
    assert out == ["ra", Status.INVALID_KEY, "rb", "ra", Status.INVALID_ARGUMENT, "rb"]
    batch.refuse(0, Status.INVALID_ARGUMENT)  # "a" taken out: its repeat fails with it
    assert batch.keys == [b"b"] and batch.repeats == [(5, 0)]
    assert batch.spread(["rb"])[:4] == [Status.INVALID_ARGUMENT, Status.INVALID_KEY, "rb",
                                        Status.INVALID_ARGUMENT]


def test_a_repeated_key_read_gets_a_copy_of_the_bytes_in_its_own_regions() -> None:
    from kvpool_client.api import ReadRequest

    first = [memoryview(bytearray(3)), memoryview(bytearray(5))]
    again = [memoryview(bytearray(2)), memoryview(bytearray(4)), memoryview(bytearray(4))]
    small = [memoryview(bytearray(4))]
    request = ReadRequest(["k", "k", "k"], [first, again, small])
    assert request.batch.keys == [b"k"]
    dst = request.dst_for(0, 8)
    assert not isinstance(dst, Status)
    data = b"abcdefgh"
    cursor = 0
    for view in dst:
        view[:] = data[cursor:cursor + view.nbytes]
        cursor += view.nbytes
    assert request.finish([8]) == [8, 8, int(Status.BUFFER_OVERFLOW)]
    assert b"".join(bytes(v) for v in again)[:8] == data
    assert bytes(small[0]) == bytes(4)  # too small: untouched


def test_a_repeated_key_read_into_memory_named_by_address_fails_alone() -> None:
    """Device memory (an AddressRange) cannot be copied into here: the repeat fails, the
    first occurrence keeps its bytes."""
    from kvpool_client.api import ReadRequest
    from kvpool_client.core.regions import AddressRange

    request = ReadRequest(["k", "k"], [[AddressRange(0x1000, 64)], [AddressRange(0x2000, 64)]])
    assert request.batch.keys == [b"k"]
    assert request.finish([64]) == [64, int(Status.INVALID_ARGUMENT)]
