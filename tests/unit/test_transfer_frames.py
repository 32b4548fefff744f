"""The tcp data plane without sockets: frame layout, request authorisation by the data server
(bounds, capability range, MAC, op, expiry), request chunking, endpoint parsing."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from kvpool_client.segments import LocalSegment
from kvpool_client.transfer.tcp import DataServer
from kvpool_client.transfer.tcp_frames import (
    REQUEST,
    RESPONSE,
    chunks,
    encode_request,
    encode_response,
    parse_endpoint,
)
from kvpool_wire import capability
from kvpool_wire.capability import MasterClock
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement

NOW_MS = 1_700_000_000_000
KEY = bytes(range(32))


@pytest.fixture
def segment() -> Iterator[LocalSegment]:
    seg = LocalSegment.create(f"test-{uuid.uuid4().hex[:12]}", "owner", 0, 1 << 20)
    try:
        yield seg
    finally:
        seg.close()


@pytest.fixture
def server(segment: LocalSegment) -> DataServer:
    # Never started: _authorise is checked directly, with a fixed clock.
    return DataServer({segment.segment_id: segment}, KEY, clock_ms=lambda: NOW_MS)


def test_frame_layout_is_fixed() -> None:
    assert REQUEST.size == 80 and RESPONSE.size == 28
    frame = encode_request(Op.WRITE, 7, "seg", 1, 2, 0, 4, NOW_MS, bytes(16), put_id=9)
    assert frame[:4] == b"KVPQ" and frame[4] == 2 and frame[5] == Op.WRITE
    assert REQUEST.unpack_from(frame)[10] == 9
    assert frame[REQUEST.size:] == b"seg" and len(frame) == REQUEST.size + 3
    answer = encode_response(Status.PERMISSION_DENIED, 7, message="no")
    magic, version, msg_len, status, request_id, length = RESPONSE.unpack_from(answer)
    assert (magic, version, msg_len, status, request_id, length) == (
        b"KVPR", 2, 2, Status.PERMISSION_DENIED, 7, 0)
    assert answer[RESPONSE.size:] == b"no"
    assert len(encode_response(Status.INTERNAL_ERROR, 1, message="x" * 5000)) == \
        RESPONSE.size + 1024


def _authorise(server: DataServer, segment: LocalSegment, op: Op, offset: int, length: int,
               cap_offset: int, cap_length: int, *, sign_op: Op | None = None,
               expiry_ms: int = NOW_MS + 1000, key: bytes = KEY,
               segment_id: str | None = None) -> Status:
    seg_id = segment_id or segment.segment_id
    cap = capability.sign(key, seg_id, cap_offset, cap_length, sign_op or op, expiry_ms)
    view, error, _ = server._authorise(seg_id, op, offset, length, cap_offset, cap_length,
                                    expiry_ms, cap)
    if view is not None:
        assert error is None and view.nbytes == length
        view.release()
        return Status.OK
    assert error is not None
    return error.status


def test_valid_requests_are_served(server: DataServer, segment: LocalSegment) -> None:
    assert _authorise(server, segment, Op.WRITE, 0, 4096, 0, 4096) == Status.OK
    assert _authorise(server, segment, Op.READ, 4096, 100, 4000, 8192) == Status.OK  # inside
    assert _authorise(server, segment, Op.READ, (1 << 20) - 1, 1, 0, 1 << 20) == Status.OK


@pytest.mark.parametrize(("case", "expected"), [
    ("outside the segment", Status.INVALID_ARGUMENT),
    ("zero length", Status.INVALID_ARGUMENT),
    ("before the capability range", Status.PERMISSION_DENIED),
    ("past the capability range", Status.PERMISSION_DENIED),
    ("wrong op", Status.PERMISSION_DENIED),
    ("expired", Status.PERMISSION_DENIED),
    ("another key", Status.PERMISSION_DENIED),
    ("unknown segment", Status.SEGMENT_NOT_FOUND),
])
def test_bad_requests_are_refused(server: DataServer, segment: LocalSegment, case: str,
                                  expected: Status) -> None:
    size = 1 << 20
    status = {
        "outside the segment": lambda: _authorise(server, segment, Op.WRITE, size - 10, 11,
                                                  size - 10, 11),
        "zero length": lambda: _authorise(server, segment, Op.READ, 0, 0, 0, 0),
        "before the capability range": lambda: _authorise(server, segment, Op.WRITE, 0, 8,
                                                          4, 8),
        "past the capability range": lambda: _authorise(server, segment, Op.WRITE, 4, 8, 0, 8),
        "wrong op": lambda: _authorise(server, segment, Op.WRITE, 0, 8, 0, 8,
                                       sign_op=Op.READ),
        "expired": lambda: _authorise(server, segment, Op.READ, 0, 8, 0, 8,
                                      expiry_ms=NOW_MS - 1),
        "another key": lambda: _authorise(server, segment, Op.READ, 0, 8, 0, 8,
                                          key=os.urandom(32)),
        "unknown segment": lambda: _authorise(server, segment, Op.READ, 0, 8, 0, 8,
                                              segment_id="nope"),
    }[case]()
    assert status == expected


def test_forged_capability_bytes_are_refused(server: DataServer, segment: LocalSegment) -> None:
    refused = 0
    for trial in range(200):
        forged = os.urandom(16) if trial % 2 else bytes(16)
        view, error, _ = server._authorise(segment.segment_id, Op.WRITE, 0, 8, 0, 8,
                                        NOW_MS + 1000, forged)
        refused += view is None and error is not None and error.status == \
            Status.PERMISSION_DENIED
    assert refused == 200


def test_closed_segment_is_not_found(server: DataServer, segment: LocalSegment) -> None:
    segment.close()
    assert _authorise(server, segment, Op.READ, 0, 8, 0, 8) == Status.SEGMENT_NOT_FOUND


def test_chunks_cut_regions_at_chunk_boundaries() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    view = memoryview(data)
    regions = [view[:1000], view[1000:1001], view[1001:]]
    placement = Placement("seg", 5000, len(data))
    cut = chunks(placement, regions, 4096)
    assert [(off, length) for off, length, _ in cut] == [(5000, 4096), (9096, 4096),
                                                           (13192, 2048)]
    assert b"".join(bytes(r) for _, _, rs in cut for r in rs) == data
    for _, length, rs in cut:
        assert sum(r.nbytes for r in rs) == length
    assert [len(rs) for _, _, rs in chunks(placement, regions, 1 << 20)] == [3]


def test_parse_endpoint() -> None:
    assert parse_endpoint("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_endpoint("[::1]:80") == ("::1", 80)
    for bad in ("", "host", "host:", ":80", "host:0", "host:65536", "host:x"):
        with pytest.raises(KVPoolError) as err:
            parse_endpoint(bad)
        assert err.value.status == Status.INVALID_ARGUMENT


def test_capabilities_bind_the_master_epoch_and_put_and_expire_on_the_master_clock(
        segment: LocalSegment) -> None:
    # The owner's sample of the master's capability clock: 1000 ms, read just now. The
    # host's wall clock plays no part, so a skewed host neither extends nor cuts capabilities.
    clock = MasterClock(epoch=77, master_ms=1000, sent_s=time.monotonic())
    server = DataServer({segment.segment_id: segment}, KEY, clock=lambda: clock)
    seg = segment.segment_id

    def ask(expiry_ms: int, epoch: int, put_id: int, signed_put_id: int | None = None) -> Status:
        cap = capability.sign(KEY, seg, 0, 64, Op.WRITE, expiry_ms, epoch,
                              put_id if signed_put_id is None else signed_put_id)
        view, error, deadline_s = server._authorise(seg, Op.WRITE, 0, 64, 0, 64, expiry_ms,
                                                    cap, put_id)
        if view is not None:
            view.release()
            assert deadline_s == clock.local_deadline_s(expiry_ms)
            return Status.OK
        assert error is not None
        return error.status

    assert ask(60_000, 77, 3) == Status.OK
    assert ask(60_000, 76, 3) == Status.PERMISSION_DENIED    # another master incarnation
    assert ask(60_000, 77, 3, signed_put_id=4) == Status.PERMISSION_DENIED  # another put
    assert ask(900, 77, 3) == Status.PERMISSION_DENIED       # past, on the master's clock
