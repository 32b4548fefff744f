"""TCP data plane on 127.0.0.1: byte-exact transfers, refusals that change nothing, a seeded
fuzzer of 10,000 garbage frames, truncated frames, stuck peers on either side, and limits.

Each test runs its coroutines on uvloop (the loop kvpool uses) through ``uvloop.run``; the
byte-exact test also runs on CPython's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvloop
from served_data import SEGMENT_BYTES, Served, served_segment

from kvpool_client.transfer import TcpTransport
from kvpool_client.transfer.tcp_frames import REQUEST, RESPONSE
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement


@pytest.fixture
def served() -> Iterator[Served]:
    with served_segment(frame_timeout_s=0.5) as s:
        yield s


def run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return uvloop.run(coroutine)


def recv_exact(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None when the peer closed (or reset) first."""
    data = bytearray()
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def read_answer(sock: socket.socket) -> tuple[int, int, bytes] | None:
    """(status, request_id, message + payload), or None when closed before an answer."""
    header = recv_exact(sock, RESPONSE.size)
    if header is None:
        return None
    magic, _, msg_len, status, request_id, length = RESPONSE.unpack(header)
    assert magic == b"KVPR"
    return status, request_id, recv_exact(sock, msg_len + length) or b""


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closes the connection within the socket's timeout."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# -- byte-exact transfers ----------------------------------------------------------------------


@pytest.mark.parametrize("loop_runner", [uvloop.run, asyncio.run], ids=["uvloop", "asyncio"])
def test_scatter_gather_round_trip_is_byte_exact(
        served: Served, loop_runner: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    async def main() -> None:
        tcp = TcpTransport(chunk_bytes=64 << 10, connections_per_peer=3)
        try:
            offset = 0
            for size in (1, 4095, 65536, 65537, (1 << 20) + 3):
                data = os.urandom(size)
                cut1, cut2 = size // 3, 2 * size // 3
                view = memoryview(data)
                await tcp.write(served.info, served.placement(offset, size, Op.WRITE),
                                [view[:cut1], view[cut1:cut2], view[cut2:]])
                assert bytes(served.segment.buffer[offset:offset + size]) == data
                out = bytearray(size)
                back = memoryview(out)
                await tcp.read(served.info, served.placement(offset, size, Op.READ),
                               [back[:cut2], back[cut2:]])
                assert bytes(out) == data
                offset += size
            assert 1 <= tcp.num_connections <= 3
        finally:
            await tcp.close()

    loop_runner(main())


def test_batches_pipeline_within_the_limits(served: Served) -> None:
    async def main() -> None:
        tcp = TcpTransport(connections_per_peer=2, max_inflight_per_connection=2)
        try:
            outs = [bytearray(4096) for _ in range(50)]
            items = [(served.info, served.placement(i * 4096, 4096, Op.READ), [memoryview(o)])
                     for i, o in enumerate(outs)]
            assert await tcp.read_batch(items) == [Status.OK] * 50
            for i, out in enumerate(outs):
                assert bytes(out) == bytes(served.segment.buffer[i * 4096:(i + 1) * 4096])
            assert tcp.num_connections <= 2
            assert served.server.active_connections <= 2
        finally:
            await tcp.close()

    run(main())


def test_mixed_batch_reports_each_item(served: Served) -> None:
    async def main() -> None:
        tcp = TcpTransport()
        try:
            ok = served.placement(0, 8, Op.WRITE)
            forged = dataclasses.replace(served.placement(8, 8, Op.WRITE), capability=bytes(16))
            statuses = await tcp.write_batch([
                (served.info, ok, [memoryview(b"12345678")]),
                (served.info, forged, [memoryview(b"abcdefgh")]),
                (served.info, ok, [memoryview(b"short")]),  # 5 bytes for 8: refused locally
            ])
            assert statuses == [Status.OK, Status.PERMISSION_DENIED, Status.INVALID_ARGUMENT]
            assert bytes(served.segment.buffer[:8]) == b"12345678"
        finally:
            await tcp.close()

    run(main())


# -- refusals change nothing -------------------------------------------------------------------


def test_bad_capabilities_are_all_refused_and_change_nothing(served: Served) -> None:
    now_ms = int(time.time() * 1000)
    cases: list[tuple[str, Op, Placement]] = []
    for i in range(40):
        off = 4096 * i
        cases += [
            ("forged", Op.WRITE, dataclasses.replace(served.placement(off, 4096, Op.WRITE),
                                                     capability=os.urandom(16))),
            ("expired", Op.WRITE, served.placement(off, 4096, Op.WRITE, expiry_ms=now_ms - 1)),
            ("wrong op", Op.WRITE, served.placement(off, 4096, Op.WRITE, sign_op=Op.READ)),
            ("wrong range", Op.WRITE, served.placement(off, 4096, Op.WRITE,
                                                       signed_range=(off + 4096, 4096))),
            ("other key", Op.WRITE, served.placement(off, 4096, Op.WRITE, key=os.urandom(32))),
            ("no capability", Op.WRITE, Placement(served.info.segment_id, off, 4096)),
            ("forged read", Op.READ, dataclasses.replace(served.placement(off, 4096, Op.READ),
                                                         capability=os.urandom(16))),
        ]
    before = served.digest()

    async def main() -> list[Status]:
        tcp = TcpTransport()
        try:
            statuses = []
            for _, op, placement in cases:
                regions = [memoryview(bytearray(os.urandom(4096)))]
                batch = tcp.write_batch if op == Op.WRITE else tcp.read_batch
                statuses += await batch([(served.info, placement, regions)])
            return statuses
        finally:
            await tcp.close()

    statuses = run(main())
    refused = sum(status == Status.PERMISSION_DENIED for status in statuses)
    print(f"capability refusals: {refused}/{len(cases)} refused")
    assert refused == len(cases)
    assert served.server.refused_total == len(cases)
    assert served.server.bytes_written_total == served.server.bytes_read_total == 0
    assert served.digest() == before


def test_request_outside_its_capability_range_is_refused(served: Served) -> None:
    before = served.digest()
    with served.connect() as sock:
        # A valid signature for [0, 4096), used for [4096, 8192): refused, payload dropped.
        sock.sendall(served.frame(Op.WRITE, 4096, 4096, cap=(0, 4096), request_id=4)
                     + bytes(4096))
        assert read_answer(sock) == (Status.PERMISSION_DENIED, 4,
                                     b"request outside its capability")
        sock.sendall(served.frame(Op.READ, 0, 8, cap=(8, 8), request_id=5))
        assert read_answer(sock) == (Status.PERMISSION_DENIED, 5,
                                     b"request outside its capability")
        sock.sendall(served.frame(Op.READ, 8, 8, cap=(0, 64), request_id=6))
        assert read_answer(sock) == (Status.OK, 6, bytes(served.segment.buffer[8:16]))
        # A refused write too long to drop closes the connection instead.
        sock.sendall(served.frame(Op.WRITE, 0, 2**40, cap=(0, 8), request_id=7))
        assert read_answer(sock) == (Status.INVALID_ARGUMENT, 7, (
            f"[0, {2**40}) is outside {served.info.segment_id!r} ({SEGMENT_BYTES} bytes)"
        ).encode())
        assert closed_by_peer(sock)
    assert served.digest() == before


def test_out_of_bounds_is_refused_by_the_server(served: Served) -> None:
    lying = dataclasses.replace(served.info, size_bytes=2 * SEGMENT_BYTES)  # passes the client
    before = served.digest()

    async def main() -> None:
        tcp = TcpTransport()
        try:
            for offset, length in ((SEGMENT_BYTES - 8, 16), (SEGMENT_BYTES, 8)):
                with pytest.raises(KVPoolError) as err:
                    await tcp.write(lying, served.placement(offset, length, Op.WRITE),
                                    [memoryview(bytes(length))])
                assert err.value.status == Status.INVALID_ARGUMENT
        finally:
            await tcp.close()

    run(main())
    with served.connect() as sock:  # past 2**64 wrap-around attempts too
        sock.sendall(served.frame(Op.READ, 2**64 - 8, 16, cap=(2**64 - 8, 16)))
        answer = read_answer(sock)
        assert answer is not None and answer[0] == Status.INVALID_ARGUMENT
    assert served.server.refused_total == 3
    assert served.digest() == before


# -- garbage, truncated and stuck peers --------------------------------------------------------


def _fuzz_frame(rng: random.Random, served: Served) -> tuple[bytes, bool]:
    """One garbage frame; True when it is a read (the only kind that may be answered OK)."""
    kind = rng.randrange(6)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randrange(1, 200)), False
    if kind == 1:  # right magic, random fields
        header = struct.pack("<4sBBHQQQQQQ16s", b"KVPQ", rng.choice([0, 1, 2, 255]),
                             rng.randrange(256), rng.randrange(300), rng.getrandbits(64),
                             rng.getrandbits(64), rng.getrandbits(rng.choice([4, 16, 64])),
                             rng.getrandbits(64), rng.getrandbits(64), rng.getrandbits(64),
                             rng.randbytes(16))
        return header + rng.randbytes(rng.randrange(0, 300)), False
    offset = rng.randrange(SEGMENT_BYTES - 4096)
    length = rng.randrange(1, 4096)
    if kind == 2:  # a well-formed write with a forged capability
        return served.frame(Op.WRITE, offset, length, forged=True) + rng.randbytes(length), False
    if kind == 3:  # a well-formed unauthorised frame cut anywhere (for a correctly signed
        # write cut short, see test_half_sent_write_only_touches_its_authorised_range)
        frame = served.frame(rng.choice([Op.WRITE, Op.READ]), offset, length, forged=True)
        whole = frame + rng.randbytes(length)
        return whole[:rng.randrange(1, len(whole))], False
    if kind == 4:  # a correctly signed read with one header byte changed
        frame = bytearray(served.frame(Op.READ, offset, length))
        frame[rng.randrange(REQUEST.size)] ^= 1 << rng.randrange(8)
        return bytes(frame), frame[5] == Op.READ
    # a bad segment id: not UTF-8, or unknown
    seg = rng.choice([b"\xff\xfe", b"nope", rng.randbytes(8)])
    header = struct.pack("<4sBBHQQQQQQ16s", b"KVPQ", 1, Op.WRITE, len(seg), 1, 0, 8, 0, 8,
                         2**62, rng.randbytes(16))
    return header + seg + rng.randbytes(8), False


def test_ten_thousand_garbage_frames_change_nothing(served: Served,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(20240611)
    before = served.digest()
    started = time.monotonic()
    answered_ok_writes = 0
    frames = 10_000
    for _ in range(frames):
        frame, is_read = _fuzz_frame(rng, served)
        with served.connect() as sock:
            with contextlib.suppress(OSError):  # the server may close (or reset) first
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)  # the rest of the frame never comes
            while (answer := read_answer(sock)) is not None:
                if answer[0] == Status.OK and not is_read:
                    answered_ok_writes += 1
        assert time.monotonic() - started < 120, "fuzzing is bounded in time"
    elapsed_s = time.monotonic() - started
    server = served.server
    print(f"{frames} garbage frames in {elapsed_s:.1f} s: bad_frames_total="
          f"{server.bad_frames_total} refused_total={server.refused_total} "
          f"bytes_written_total={server.bytes_written_total}")
    assert answered_ok_writes == 0
    assert server.bytes_written_total == 0
    assert server.bad_frames_total > 1000 and server.refused_total > 1000
    assert served.digest() == before
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # ... and the server still serves
    with served.connect() as sock:
        sock.sendall(served.frame(Op.READ, 0, 16, request_id=9))
        assert read_answer(sock) == (Status.OK, 9, bytes(served.segment.buffer[:16]))


def test_half_sent_write_only_touches_its_authorised_range(served: Served) -> None:
    before = bytes(served.segment.buffer)
    with served.connect() as sock:
        sock.sendall(served.frame(Op.WRITE, 8192, 4096) + b"\xaa" * 1000)
        sock.shutdown(socket.SHUT_WR)
        assert read_answer(sock) is None  # closed without an answer
    after = bytes(served.segment.buffer)
    # Bytes outside [8192, 12288) never change; inside, the PENDING object's range may hold
    # the 1000 bytes that arrived (the put fails and is revoked: nobody reads them).
    assert after[:8192] == before[:8192] and after[12288:] == before[12288:]
    assert after[8192:9192] == b"\xaa" * 1000 and after[9192:12288] == before[9192:12288]
    assert served.server.bytes_written_total == 0


def test_half_a_frame_times_out_while_other_transfers_continue(served: Served) -> None:
    stuck = served.connect(timeout_s=5.0)
    try:
        stuck.sendall(served.frame(Op.WRITE, 0, 4096)[:40])  # half a header, then silence
        started = time.monotonic()

        async def others() -> None:
            tcp = TcpTransport()
            try:
                data = os.urandom(256 << 10)
                await tcp.write(served.info, served.placement(65536, len(data), Op.WRITE),
                                [memoryview(data)])
                out = bytearray(len(data))
                await tcp.read(served.info, served.placement(65536, len(data), Op.READ),
                               [memoryview(out)])
                assert bytes(out) == data
            finally:
                await tcp.close()

        run(others())
        assert time.monotonic() - started < 0.5  # not held up by the stuck connection
        assert closed_by_peer(stuck)  # after frame_timeout_s
        waited_s = time.monotonic() - started
        print(f"half-sent frame closed after {waited_s:.2f} s (frame_timeout_s=0.5)")
        assert 0.3 < waited_s < 3.0
        assert served.server.timeouts_total == 1
    finally:
        stuck.close()


def test_peer_that_stops_reading_is_dropped_while_others_continue(served: Served) -> None:
    stuck = served.connect(timeout_s=5.0)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        for i in range(8):  # 32 MiB of answers it never reads
            stuck.sendall(served.frame(Op.READ, 0, SEGMENT_BYTES, request_id=i + 1))

        async def others() -> None:
            tcp = TcpTransport()
            try:
                out = bytearray(1 << 20)
                for _ in range(5):
                    await tcp.read(served.info, served.placement(0, len(out), Op.READ),
                                   [memoryview(out)])
                assert bytes(out) == bytes(served.segment.buffer[:len(out)])
            finally:
                await tcp.close()

        run(others())
        deadline = time.monotonic() + 5.0
        while served.server.timeouts_total == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.server.timeouts_total == 1
        assert served.server.active_connections == 0
    finally:
        stuck.close()


@contextmanager
def fake_server(behaviour: Callable[[socket.socket], None]) -> Iterator[str]:
    """A listener whose connections get ``behaviour`` on a thread; yields its endpoint."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5.0)
    stop = threading.Event()
    accepted: list[socket.socket] = []

    def serve() -> None:
        try:
            while not stop.is_set():
                conn, _ = listener.accept()
                accepted.append(conn)
                behaviour(conn)
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        listener.close()
        for conn in accepted:
            conn.close()
        thread.join(6.0)


def _never_reads(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)


def _half_answer(conn: socket.socket) -> None:
    conn.settimeout(5.0)
    recv_exact(conn, REQUEST.size)
    conn.sendall(b"KVPR\x01\x00")  # 6 of 28 header bytes, then silence


def _wrong_magic(conn: socket.socket) -> None:
    conn.settimeout(5.0)
    recv_exact(conn, REQUEST.size)
    conn.sendall(b"XXXX" + bytes(RESPONSE.size - 4))


@pytest.mark.parametrize(("behaviour", "op", "expected"), [
    (_never_reads, Op.WRITE, Status.TIMEOUT),
    (_half_answer, Op.READ, Status.TIMEOUT),
    (_wrong_magic, Op.READ, Status.TRANSFER_FAILED),
], ids=["stops-reading", "half-an-answer", "wrong-magic"])
def test_stuck_or_broken_server_fails_cleanly_while_others_continue(
        served: Served, behaviour: Callable[[socket.socket], None], op: Op,
        expected: Status) -> None:
    size = 64 << 20 if op == Op.WRITE else 4096
    with fake_server(behaviour) as endpoint:
        broken = dataclasses.replace(served.info, tcp_endpoint=endpoint,
                                     size_bytes=size)

        async def main() -> tuple[float, list[Status]]:
            tcp = TcpTransport(timeout_s=0.5)
            try:
                buf = memoryview(bytearray(size))
                started = time.monotonic()
                stuck = asyncio.ensure_future(
                    tcp.read(broken, served.placement(0, size, op), [buf]) if op == Op.READ
                    else tcp.write(broken, served.placement(0, size, op), [buf]))
                good = [bytearray(65536) for _ in range(8)]
                statuses = await tcp.read_batch(
                    [(served.info, served.placement(i * 65536, 65536, Op.READ),
                      [memoryview(g)]) for i, g in enumerate(good)])
                with pytest.raises(KVPoolError) as err:
                    await stuck
                assert err.value.status == expected
                return time.monotonic() - started, statuses
            finally:
                await tcp.close()

        elapsed_s, statuses = run(main())
    print(f"{behaviour.__name__}: failed with {expected.name} after {elapsed_s:.2f} s")
    assert statuses == [Status.OK] * 8
    assert elapsed_s < 3.0


def test_connection_limit_is_enforced(served: Served) -> None:
    with served_segment(max_connections=2) as small:
        held = [small.connect(), small.connect()]
        try:
            for sock in held:  # each in service: a checked WRITE whose payload is awaited
                sock.sendall(small.frame(Op.WRITE, 0, 1 << 20))
            deadline = time.monotonic() + 5.0
            while (small.server.active_connections < 2
                   or small.server.unproven_connections) and time.monotonic() < deadline:
                time.sleep(0.01)
            with small.connect() as third:
                assert read_answer(third) == (Status.RESOURCE_EXHAUSTED, 0,
                                              b"too many connections")

            async def main() -> None:
                tcp = TcpTransport()
                try:
                    with pytest.raises(KVPoolError) as err:
                        await tcp.read(small.info, small.placement(0, 8, Op.READ),
                                       [memoryview(bytearray(8))])
                    assert err.value.status == Status.RESOURCE_EXHAUSTED
                finally:
                    await tcp.close()

            run(main())
            assert small.server.connections_rejected_total == 2
        finally:
            for sock in held:
                sock.close()


def test_closed_transport_and_unreachable_server_fail_cleanly(served: Served) -> None:
    async def main() -> None:
        tcp = TcpTransport(timeout_s=1.0)
        out = [memoryview(bytearray(8))]
        await tcp.read(served.info, served.placement(0, 8, Op.READ), out)
        await tcp.close()
        with pytest.raises(KVPoolError) as err:
            await tcp.read(served.info, served.placement(0, 8, Op.READ), out)
        assert err.value.status == Status.UNAVAILABLE
        tcp = TcpTransport(timeout_s=1.0)
        port = served.server.port
        served.server.close()
        gone = dataclasses.replace(served.info, tcp_endpoint=f"127.0.0.1:{port}")
        with pytest.raises(KVPoolError) as err:
            await tcp.read(gone, served.placement(0, 8, Op.READ), out)
        assert err.value.status == Status.TRANSFER_FAILED
        await tcp.close()

    run(main())
