"""The blocking lean connection against a peer that answers badly (a socketpair plays the
master): every bad answer fails the call with a clear status and closes the connection, so a
late or stray frame is never read as the next call's answer. Every case runs with the caller
sleeping at once (``busy_poll_us`` 0) and polling first (200 µs), and deadlines hold with any
polling budget."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool_client.rpc.lean_blocking import BlockingLeanConnection
from kvpool_wire.framing import FRAME_HEADER, encode_frame
from kvpool_wire.status import KVPoolError, Status

METHOD = 7


@pytest.fixture(params=[0, 200], ids=["sleep", "busy-poll"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[BlockingLeanConnection, socket.socket]]:
    ours, theirs = socket.socketpair()
    conn = BlockingLeanConnection(ours, max_frame_bytes=1 << 20, busy_poll_us=request.param)
    yield conn, theirs
    conn.close()
    theirs.close()


def _request_id(theirs: socket.socket) -> int:
    header = theirs.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
    length, _method, request_id = FRAME_HEADER.unpack(header)
    theirs.recv(length - 5, socket.MSG_WAITALL)
    return int(request_id)


def _call_fails(conn: BlockingLeanConnection, timeout_s: float = 2.0) -> KVPoolError:
    with pytest.raises(KVPoolError) as info:
        conn.call(METHOD, b"request", timeout_s)
    assert conn.closed
    return info.value


def test_answers_come_back_in_order(pair) -> None:
    conn, theirs = pair
    theirs.settimeout(5)
    for payload in (b"one", b"", b"three" * 1000, bytes(range(256)) * 1000):  # > its buffer
        # the peer answers only after reading the request, as the master does
        worker = threading.Thread(target=lambda data=payload: theirs.sendall(
            encode_frame(METHOD, _request_id(theirs), data)))
        worker.start()
        assert conn.call(METHOD, b"request", 5.0) == payload
        worker.join(5)
    assert not conn.closed


def test_an_error_frame_raises_its_status(pair) -> None:
    conn, theirs = pair
    theirs.sendall(encode_frame(255, 1, b"PERMISSION_DENIED: authenticate first"))
    error = _call_fails(conn)
    assert error.status == Status.PERMISSION_DENIED and "authenticate first" in error.message


def test_an_answer_to_another_call_is_refused(pair) -> None:
    conn, theirs = pair
    theirs.sendall(encode_frame(METHOD, 99, b"stale"))  # request id 1 was sent
    assert _call_fails(conn).status == Status.RPC_FAILED
    with pytest.raises(KVPoolError) as info:  # closed: nothing more is read from it
        conn.call(METHOD, b"again", 1.0)
    assert info.value.status == Status.RPC_FAILED


def test_a_stray_frame_after_the_answer_is_refused(pair) -> None:
    conn, theirs = pair
    theirs.sendall(encode_frame(METHOD, 1, b"answer") + encode_frame(METHOD, 2, b"stray"))
    assert _call_fails(conn).status == Status.RPC_FAILED


def test_a_bad_length_is_refused(pair) -> None:
    conn, theirs = pair
    theirs.sendall(struct.pack("<IBI", (1 << 20) + 100, METHOD, 1))
    assert _call_fails(conn).status == Status.RPC_FAILED
    ours, theirs2 = socket.socketpair()
    short = BlockingLeanConnection(ours, max_frame_bytes=1 << 20)
    theirs2.sendall(struct.pack("<IBI", 2, METHOD, 1))  # shorter than method + request id
    assert _call_fails(short).status == Status.RPC_FAILED
    theirs2.close()


def test_a_peer_that_closes_mid_frame_fails_the_call(pair) -> None:
    conn, theirs = pair
    theirs.sendall(encode_frame(METHOD, 1, b"complete answer")[:-4])
    theirs.shutdown(socket.SHUT_WR)
    assert _call_fails(conn).status == Status.RPC_FAILED


def test_no_answer_times_out_within_the_deadline(pair) -> None:
    conn, _theirs = pair
    started = time.monotonic()
    assert _call_fails(conn, timeout_s=0.3).status == Status.TIMEOUT
    elapsed_s = time.monotonic() - started
    print(f"silent peer: TIMEOUT after {elapsed_s:.2f} s (deadline 0.3 s)")
    assert elapsed_s < 2.0
    ours, theirs = socket.socketpair()
    expired = BlockingLeanConnection(ours, 1 << 20)
    with pytest.raises(KVPoolError) as info:
        expired.call(METHOD, b"", 0.0)
    assert info.value.status == Status.TIMEOUT
    expired.close()
    theirs.close()


def test_a_polling_budget_longer_than_the_deadline_still_times_out() -> None:
    ours, theirs = socket.socketpair()
    conn = BlockingLeanConnection(ours, 1 << 20, busy_poll_us=100_000)  # polls up to 0.1 s
    try:
        started = time.monotonic()
        assert _call_fails(conn, timeout_s=0.02).status == Status.TIMEOUT
        elapsed_s = time.monotonic() - started
        print(f"busy-polling caller: TIMEOUT after {elapsed_s * 1000:.1f} ms (deadline 20 ms)")
        assert elapsed_s < 0.09
    finally:
        theirs.close()


def test_a_large_request_waits_for_room_and_a_peer_that_never_reads_times_out(pair) -> None:
    conn, theirs = pair
    request = bytes(range(256)) * (16 << 10)  # 4 MiB: far more than a socket buffer holds

    def serve() -> None:
        header = theirs.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
        length, _method, request_id = FRAME_HEADER.unpack(header)
        received = bytearray()
        while len(received) < length - 5:
            time.sleep(0.001)  # a slow reader: the caller must wait for room, not fail
            received += theirs.recv(1 << 16)
        theirs.sendall(encode_frame(METHOD, request_id, bytes(received[-10:])))

    worker = threading.Thread(target=serve)
    worker.start()
    assert conn.call(METHOD, request, 10.0) == request[-10:]
    worker.join(10)
    started = time.monotonic()
    assert _call_fails(conn, timeout_s=0.3).status == Status.TIMEOUT  # nobody reads it now
    assert time.monotonic() - started < 2.0


def test_polling_backs_off_while_answers_come_late_and_resumes_when_they_come_in_time() -> None:
    ours, theirs = socket.socketpair()
    conn = BlockingLeanConnection(ours, 1 << 20, busy_poll_us=1000)
    theirs.settimeout(5)

    def answer(delay_s: float) -> None:
        request_id = _request_id(theirs)
        time.sleep(delay_s)
        theirs.sendall(encode_frame(METHOD, request_id, b"late" if delay_s else b"prompt"))

    def call(delay_s: float) -> None:
        worker = threading.Thread(target=answer, args=(delay_s,))
        worker.start()
        assert conn.call(METHOD, b"request", 5.0) == (b"late" if delay_s else b"prompt")
        worker.join(5)

    try:
        skipped = []
        for _ in range(4):
            call(0.02)  # 20 ms: far beyond the 1 ms budget
            skipped.append(conn.backoff.state[0])
        assert skipped == [1, 0, 2, 1]  # polled, slept, polled, slept: the backoff doubles
        call(0.02)  # slept at once
        assert conn.backoff.state == (0, 2)
        call(0.0)  # polled, and the answer came in time: the backoff is reset
        assert conn.backoff.state == (0, 0)
        assert not conn.closed
    finally:
        conn.close()
        theirs.close()
