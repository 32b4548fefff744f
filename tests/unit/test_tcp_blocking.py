"""BlockingTcpTransport against a real DataServer on 127.0.0.1 (and a few fake servers): byte-exact
batches of every size, pipelining on one pooled connection, concurrent callers, refusals that
leave the connection usable, a server that dies mid-batch, silent and malformed servers, and
close."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from served_data import Served, served_segment

from kvpool_client.segments import LocalSegment
from kvpool_client.transfer import BlockingTcpTransport, DataServer
from kvpool_client.transfer.tcp_frames import REQUEST, RESPONSE_MAGIC, VERSION, encode_response
from kvpool_wire.status import Status
from kvpool_wire.types import Op

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def served() -> Iterator[Served]:
    with served_segment(frame_timeout_s=2.0) as s:
        yield s


@contextmanager
def transport(**options: Any) -> Iterator[BlockingTcpTransport]:
    tcp = BlockingTcpTransport(**options)
    try:
        yield tcp
    finally:
        tcp.close()


def segment_bytes(served: Served, offset: int, length: int) -> bytes:
    return bytes(served.segment.buffer[offset:offset + length])


# -- byte-exact transfers ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [4 << 20, 64 << 10], ids=["default-chunks", "64KiB-chunks"])
def test_every_size_round_trips_byte_exact(chunk_bytes: int) -> None:
    sizes = [1, 4 * KiB, MiB, 16 * MiB, 3 * MiB + 5]
    with served_segment(segment_bytes=24 * MiB, frame_timeout_s=5.0) as served, \
            transport(chunk_bytes=chunk_bytes) as tcp:
        offset = 0
        for size in sizes:
            data = os.urandom(size)
            view = memoryview(data)
            cuts = sorted({0, size // 3, size // 2, size})
            # one region, then several: the object is their concatenation
            for regions in ([view], [view[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]):
                served.segment.buffer[offset:offset + size] = bytes(size)
                put = served.placement(offset, size, Op.WRITE)
                assert tcp.write_batch([(served.info, put, regions)]) == [Status.OK]
                assert segment_bytes(served, offset, size) == data
                out = bytearray(size)
                back = memoryview(out)
                dst = [back] if len(regions) == 1 else [back[:size // 2], back[size // 2:]]
                get = served.placement(offset, size, Op.READ)
                assert tcp.read_batch([(served.info, get, dst)]) == [Status.OK]
                assert out == data
            offset += size
        assert tcp.num_connections == 1
        assert served.server.connections_total == 1


def test_a_batch_of_32_is_pipelined_on_one_connection(served: Served) -> None:
    for window in (64, 5):  # one window, then several
        with transport(max_inflight_per_connection=window) as tcp:
            data = [os.urandom(4 * KiB) for _ in range(32)]
            puts = [(served.info, served.placement(i * 8 * KiB, 4 * KiB, Op.WRITE),
                     [memoryview(d)]) for i, d in enumerate(data)]
            assert tcp.write_batch(puts) == [Status.OK] * 32
            outs = [bytearray(4 * KiB) for _ in range(32)]
            gets = [(served.info, served.placement(i * 8 * KiB, 4 * KiB, Op.READ),
                     [memoryview(o)]) for i, o in enumerate(outs)]
            assert tcp.read_batch(gets) == [Status.OK] * 32
            assert outs == data
            for i, d in enumerate(data):
                assert segment_bytes(served, i * 8 * KiB, 4 * KiB) == d
            assert tcp.num_connections == 1
    assert served.server.connections_total == 2  # one per transport


def test_more_regions_or_requests_than_one_sendmsg_takes(served: Served) -> None:
    # 2000 regions per object, and 600 pipelined requests: more than IOV_MAX (1024) buffers
    with transport(max_inflight_per_connection=1000) as tcp:
        data = [os.urandom(2000 * 7) for _ in range(3)]
        puts = [(served.info, served.placement(i * 16 * KiB, len(d), Op.WRITE),
                 [memoryview(d)[j:j + 7] for j in range(0, len(d), 7)])
                for i, d in enumerate(data)]
        assert tcp.write_batch(puts) == [Status.OK] * 3
        outs = [bytearray(len(d)) for d in data]
        gets = [(served.info, served.placement(i * 16 * KiB, len(o), Op.READ),
                 [memoryview(o)[j:j + 7] for j in range(0, len(o), 7)])
                for i, o in enumerate(outs)]
        assert tcp.read_batch(gets) == [Status.OK] * 3
        assert outs == data
        small = [os.urandom(16) for _ in range(600)]
        puts = [(served.info, served.placement(64 * KiB + i * 16, 16, Op.WRITE),
                 [memoryview(d)]) for i, d in enumerate(small)]
        assert tcp.write_batch(puts) == [Status.OK] * 600
        outs = [bytearray(16) for _ in range(600)]
        gets = [(served.info, served.placement(64 * KiB + i * 16, 16, Op.READ),
                 [memoryview(o)]) for i, o in enumerate(outs)]
        assert tcp.read_batch(gets) == [Status.OK] * 600
        assert outs == small
        assert served.server.connections_total == 1


def test_concurrent_callers_share_the_pool(served: Served) -> None:
    errors: list[str] = []
    with transport(connections_per_peer=4) as tcp:
        def caller(thread: int) -> None:
            base = thread * MiB
            for round_ in range(20):
                size = 4 * KiB if round_ % 2 else 64 * KiB + thread
                data = [os.urandom(size) for _ in range(4)]
                puts = [(served.info, served.placement(base + i * 128 * KiB, size, Op.WRITE),
                         [memoryview(d)]) for i, d in enumerate(data)]
                outs = [bytearray(size) for _ in range(4)]
                gets = [(served.info, served.placement(base + i * 128 * KiB, size, Op.READ),
                         [memoryview(o)]) for i, o in enumerate(outs)]
                if tcp.write_batch(puts) != [Status.OK] * 4 or \
                        tcp.read_batch(gets) != [Status.OK] * 4 or outs != data:
                    errors.append(f"thread {thread}, round {round_}")

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert 1 <= tcp.num_connections <= 4
        assert served.server.connections_total <= 4


# -- refusals ----------------------------------------------------------------------------------


def test_refused_items_fail_alone_and_the_connection_stays_usable(served: Served) -> None:
    with transport() as tcp:
        good = os.urandom(4 * KiB)
        forged = dataclasses.replace(served.placement(8 * KiB, 4 * KiB, Op.WRITE),
                                     capability=bytes(16))
        before = segment_bytes(served, 8 * KiB, 4 * KiB)
        statuses = tcp.write_batch([
            (served.info, served.placement(0, 4 * KiB, Op.WRITE), [memoryview(good)]),
            (served.info, forged, [memoryview(os.urandom(4 * KiB))]),
            (served.info, served.placement(16 * KiB, 4 * KiB, Op.WRITE), [memoryview(good)]),
            (served.info, served.placement(0, 8, Op.WRITE), [memoryview(b"short")]),  # local
        ])
        assert statuses == [Status.OK, Status.PERMISSION_DENIED, Status.OK,
                            Status.INVALID_ARGUMENT]
        assert segment_bytes(served, 8 * KiB, 4 * KiB) == before
        assert segment_bytes(served, 16 * KiB, 4 * KiB) == good
        outs = [bytearray(4 * KiB) for _ in range(3)]
        expired = served.placement(0, 4 * KiB, Op.READ, expiry_ms=int(time.time() * 1000) - 1)
        unknown = dataclasses.replace(served.info, segment_id="nope")
        statuses = tcp.read_batch([
            (served.info, expired, [memoryview(outs[0])]),
            (served.info, served.placement(0, 4 * KiB, Op.READ), [memoryview(outs[1])]),
            (unknown, dataclasses.replace(served.placement(0, 4 * KiB, Op.READ),
                                          segment_id="nope"), [memoryview(outs[2])]),
        ])
        assert statuses == [Status.PERMISSION_DENIED, Status.OK, Status.SEGMENT_NOT_FOUND]
        assert outs[1] == good and outs[0] == outs[2] == bytes(4 * KiB)  # refused: untouched
        assert tcp.num_connections == 1
        assert served.server.connections_total == 1 and served.server.refused_total == 3


def test_pipelined_refusals_amid_read_ahead_payloads_change_only_authorised_bytes() -> None:
    # The server reads pipelined frames ahead into its connection buffer: payloads that arrived
    # whole, in part, or not yet (1 B .. 300 KiB, beyond the read-ahead buffer), every third
    # request forged. Only the authorised writes land; a refused payload is dropped from the
    # stream; reads between them return exactly the committed bytes.
    sizes = [1, 7, 4 * KiB, 100 * KiB, 300 * KiB, 33, 64 * KiB + 1] * 6
    slot = 512 * KiB
    with served_segment(segment_bytes=len(sizes) * slot, frame_timeout_s=5.0) as served, \
            transport(max_inflight_per_connection=64) as tcp:
        before = bytes(served.segment.buffer)
        data = [os.urandom(size) for size in sizes]
        writes = []
        for i, (size, payload) in enumerate(zip(sizes, data, strict=True)):
            placement = served.placement(i * slot, size, Op.WRITE)
            if i % 3 == 1:
                placement = dataclasses.replace(placement, capability=os.urandom(16))
            writes.append((served.info, placement, [memoryview(payload)]))
        statuses = tcp.write_batch(writes)
        assert statuses == [Status.PERMISSION_DENIED if i % 3 == 1 else Status.OK
                            for i in range(len(sizes))]
        for i, size in enumerate(sizes):
            expected = before[i * slot:i * slot + size] if i % 3 == 1 else data[i]
            assert segment_bytes(served, i * slot, size) == expected
        outs = [bytearray(size) for size in sizes]
        reads = []
        for i, size in enumerate(sizes):
            placement = served.placement(i * slot, size, Op.READ)
            if i % 3 == 2:
                placement = dataclasses.replace(placement, capability=os.urandom(16))
            reads.append((served.info, placement, [memoryview(outs[i])]))
        statuses = tcp.read_batch(reads)
        assert statuses == [Status.PERMISSION_DENIED if i % 3 == 2 else Status.OK
                            for i in range(len(sizes))]
        for i, size in enumerate(sizes):
            if i % 3 == 0:
                assert outs[i] == data[i]
            elif i % 3 == 2:
                assert outs[i] == bytes(size)  # refused: untouched
        assert tcp.num_connections == 1 and served.server.connections_total == 1
        assert served.server.refused_total == 2 * len(sizes) // 3


def test_items_without_a_usable_endpoint_or_buffer_are_refused_locally(served: Served) -> None:
    with transport() as tcp:
        get = served.placement(0, 8, Op.READ)
        statuses = tcp.read_batch([
            (dataclasses.replace(served.info, tcp_endpoint=""), get,
             [memoryview(bytearray(8))]),
            (dataclasses.replace(served.info, tcp_endpoint="no-port"), get,
             [memoryview(bytearray(8))]),
            (dataclasses.replace(served.info, tcp_endpoint="127.0.0.1:0"), get,
             [memoryview(bytearray(8))]),
            (served.info, get, [memoryview(bytes(8))]),  # read-only destination
            (served.info, get, [memoryview(bytearray(8))]),
        ])
        assert statuses == [Status.INVALID_ARGUMENT] * 4 + [Status.OK]


# -- failures ----------------------------------------------------------------------------------


class _ClosingSegments(dict[str, LocalSegment]):
    """Segments whose ``close_at``-th lookup closes the data server before it answers."""

    def __init__(self, segment: LocalSegment, close_at: int) -> None:
        super().__init__({segment.segment_id: segment})
        self.server: Any = None
        self.lookups = 0
        self.close_at = close_at

    def get(self, key: str, default: Any = None) -> Any:
        self.lookups += 1
        if self.lookups == self.close_at:
            # close() shuts every connection down, then waits for their threads (this one
            # too: bounded)
            closer = threading.Thread(target=self.server.close, args=(0.2,))
            closer.start()
            closer.join(5.0)
        return super().get(key, default)


@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_a_server_that_dies_mid_batch_never_yields_ok_for_unmoved_bytes(
        served: Served, op: Op) -> None:
    segments = _ClosingSegments(served.segment, close_at=6)  # serves 5 requests, then dies
    server = DataServer(segments, served.key, "127.0.0.1", 0)  # a second server on the segment
    segments.server = server
    server.start()
    try:
        info = dataclasses.replace(served.info, tcp_endpoint=server.endpoint)
        size = 256 * KiB
        data = [os.urandom(size) for _ in range(16)]
        outs = [bytearray(size) for _ in range(16)]
        with transport(timeout_s=5.0) as tcp:
            placements = [served.placement(i * size, size, op) for i in range(16)]
            if op == Op.WRITE:
                statuses = tcp.write_batch([(info, p, [memoryview(d)])
                                            for p, d in zip(placements, data, strict=True)])
            else:
                statuses = tcp.read_batch([(info, p, [memoryview(o)])
                                           for p, o in zip(placements, outs, strict=True)])
            # The server answers pipelined requests in batches, so answers it had queued die
            # with it: at most the 5 served requests succeed, and only a prefix of them.
            served_ok = statuses.count(Status.OK)
            assert served_ok <= 5
            assert statuses[:served_ok] == [Status.OK] * served_ok
            assert all(status != Status.OK for status in statuses[served_ok:])
            for i, status in enumerate(statuses):
                if status == Status.OK:
                    moved = segment_bytes(served, i * size, size)
                    assert moved == (data[i] if op == Op.WRITE else bytes(outs[i]))
            assert tcp.num_connections == 0  # the failed connection was closed
            again = tcp.read_batch([(info, served.placement(0, 8, Op.READ),
                                     [memoryview(bytearray(8))])])
            assert again == [Status.TRANSFER_FAILED]  # nobody listens any more
    finally:
        server.close()


@contextmanager
def silent_listener() -> Iterator[tuple[socket.socket, str]]:
    """A listening socket on 127.0.0.1 that accepts nothing: connections complete in its
    backlog and are never answered."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        yield listener, f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_a_server_that_never_answers_times_out_within_the_bound(served: Served) -> None:
    with silent_listener() as (_, endpoint), transport(timeout_s=0.3) as tcp:
        silent = dataclasses.replace(served.info, tcp_endpoint=endpoint,
                                     size_bytes=64 * MiB)
        for op, size, count in ((Op.READ, 4 * KiB, 1), (Op.READ, 4 * KiB, 8),
                                (Op.WRITE, 32 * MiB, 1)):  # the write cannot even be sent
            buffers = [memoryview(bytearray(size)) for _ in range(count)]
            items = [(silent, served.placement(i * size, size, op), [b])
                     for i, b in enumerate(buffers)]
            started = time.monotonic()
            statuses = (tcp.read_batch if op == Op.READ else tcp.write_batch)(items)
            elapsed_s = time.monotonic() - started
            assert statuses == [Status.TIMEOUT] * count
            assert 0.25 <= elapsed_s < 1.0, elapsed_s
            assert tcp.num_connections == 0
        # the other peer is unaffected
        assert tcp.read_batch([(served.info, served.placement(0, 8, Op.READ),
                                [memoryview(bytearray(8))])]) == [Status.OK]


def _answer_with(answer: Callable[[int, int], bytes]) -> Callable[[socket.socket], None]:
    """A fake server behaviour: read one request, send ``answer(request_id, length)``, wait."""
    def behaviour(conn: socket.socket) -> None:
        request = bytearray()
        while len(request) < REQUEST.size:
            chunk = conn.recv(REQUEST.size - len(request))
            if not chunk:
                return
            request += chunk
        fields = REQUEST.unpack(bytes(request))
        conn.sendall(answer(fields[4], fields[6]))
        time.sleep(0.5)
    return behaviour


@contextmanager
def fake_server(behaviour: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener whose connections get ``behaviour`` on a thread; yields its endpoint."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                conn, _ = listener.accept()
                with conn:
                    behaviour(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5.0)


PAYLOAD = bytes(4 * KiB)


@pytest.mark.parametrize(("answer", "expected"), [
    (lambda rid, n: b"XXXX" + encode_response(Status.OK, rid, n)[4:] + PAYLOAD,
     Status.TRANSFER_FAILED),
    (lambda rid, n: RESPONSE_MAGIC + bytes([VERSION + 1]) + encode_response(Status.OK, rid, n)[5:]
     + PAYLOAD, Status.TRANSFER_FAILED),
    (lambda rid, n: encode_response(Status.OK, rid + 1, n) + PAYLOAD, Status.TRANSFER_FAILED),
    (lambda rid, n: encode_response(Status.OK, rid, n - 1) + PAYLOAD, Status.TRANSFER_FAILED),
    (lambda rid, n: encode_response(Status.OK, rid, n + 1) + PAYLOAD, Status.TRANSFER_FAILED),
    (lambda rid, n: encode_response(Status.OK, rid, n)[:10], Status.TIMEOUT),
    (lambda rid, n: encode_response(Status.OK, rid, n) + PAYLOAD[:100], Status.TIMEOUT),
    (lambda rid, n: encode_response(Status.RESOURCE_EXHAUSTED, 0, message="too many"),
     Status.RESOURCE_EXHAUSTED),
], ids=["bad-magic", "bad-version", "another-request-id", "short-length", "long-length",
        "half-a-header", "half-a-payload", "connection-refused"])
def test_a_malformed_or_missing_answer_fails_the_items_and_closes_the_connection(
        served: Served, answer: Callable[[int, int], bytes], expected: Status) -> None:
    with fake_server(_answer_with(answer)) as endpoint, transport(timeout_s=0.3) as tcp:
        broken = dataclasses.replace(served.info, tcp_endpoint=endpoint)
        outs = [bytearray(4 * KiB) for _ in range(2)]
        statuses = tcp.read_batch([(broken, served.placement(0, 4 * KiB, Op.READ),
                                    [memoryview(out)]) for out in outs])
        assert statuses == [expected] * 2
        assert tcp.num_connections == 0


def test_an_idle_connection_the_server_closed_is_replaced(served: Served) -> None:
    with served_segment(idle_timeout_s=0.2) as short, transport() as tcp:
        get = [(short.info, short.placement(0, 8, Op.READ), [memoryview(bytearray(8))])]
        assert tcp.read_batch(get) == [Status.OK]
        deadline = time.monotonic() + 5.0
        while short.server.active_connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tcp.num_connections == 1  # idle, closed by the server
        assert tcp.read_batch(get) == [Status.OK]
        assert short.server.connections_total == 2


def test_close_fails_later_calls_and_wakes_calls_in_progress(served: Served) -> None:
    with transport(timeout_s=10.0) as tcp:
        get = [(served.info, served.placement(0, 8, Op.READ), [memoryview(bytearray(8))])]
        assert tcp.read_batch(get) == [Status.OK]
        tcp.close()
        tcp.close()
        started = time.monotonic()
        assert tcp.read_batch(get) == [Status.UNAVAILABLE]
        assert tcp.write_batch([(served.info, served.placement(0, 8, Op.WRITE),
                                 [memoryview(bytes(8))])]) == [Status.UNAVAILABLE]
        assert time.monotonic() - started < 0.5
        assert tcp.num_connections == 0
    with silent_listener() as (_, endpoint), transport(timeout_s=10.0) as tcp:
        silent = dataclasses.replace(served.info, tcp_endpoint=endpoint)
        result: list[list[Status]] = []
        caller = threading.Thread(target=lambda: result.append(tcp.read_batch(
            [(silent, served.placement(0, 8, Op.READ), [memoryview(bytearray(8))])])))
        started = time.monotonic()
        caller.start()
        while tcp.num_connections == 0 and time.monotonic() - started < 5.0:
            time.sleep(0.01)
        time.sleep(0.1)
        tcp.close()
        caller.join(5.0)
        assert result and result[0] != [Status.OK]
        assert time.monotonic() - started < 2.0
        assert tcp.num_connections == 0
