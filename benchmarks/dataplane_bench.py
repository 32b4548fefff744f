"""Data-plane benchmark: shm and tcp transfers between two processes, against the machine's own
single-thread memcpy and loopback TCP measured in the same run.

    .venv/bin/python benchmarks/dataplane_bench.py [--rounds 5] [--round-seconds 0.3] [--json F]

Process A (a child) creates a segment and runs a DataServer; process B (this one) writes and
reads batches of objects into it through ShmTransport and through TcpTransport (forced tcp),
zero-copy from/into its own buffers. Baselines: numpy.copyto of 256 MiB on one thread, and
sendall/recv_into of 16 MiB messages from a child process over 127.0.0.1.

The machine is shared, so its speed drifts: each case alternates short rounds of itself and of
its baseline, and the ratio printed is the median of the per-round ratios.

``--io-models`` instead compares the two ways a data server can do its I/O, on the same frames
(16-byte header + 16 MiB payload, sent or answered), each against a blocking client in another
process: threads with blocking sockets (recv_into with MSG_WAITALL, sendmsg), as DataServer
does, and a uvloop BufferedProtocol server receiving straight into the segment.

``--blocking`` instead compares, from a synchronous caller, ways of moving small and medium
objects to process A's data server: BlockingTcpTransport (busy-polling, its default, and
sleeping at once), the async TcpTransport run on a uvloop loop the caller keeps
(``run_until_complete`` per call, as a synchronous caller must), a raw client (pre-encoded
frames, one ``sendmsg``, blocking ``recv_into`` with MSG_WAITALL: the floor of a client on this
server) and a loopback echo of the same bytes by a child process (the floor of the sockets).
Cases: single 4 KiB get / put, batches of 32 x 4 KiB, and 1 MiB; variants alternate within
each round, ratios are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

from kvpool_client.segments import cleanup_stale_segments
from kvpool_client.transfer import ShmTransport, TcpTransport
from kvpool_client.transfer.base import Item
from kvpool_client.transfer.tcp_blocking import BlockingTcpTransport
from kvpool_client.transfer.tcp_frames import RESPONSE, encode_request
from kvpool_wire import capability
from kvpool_wire.types import Op, Placement, SegmentInfo

MiB = 1 << 20
SEGMENT_BYTES = 512 * MiB
TCP_MESSAGE_BYTES = 16 * MiB


class Memcpy:
    """Single-thread copy between two 256 MiB anonymous buffers (numpy.copyto)."""

    def __init__(self) -> None:
        self.src = np.ones(256 * MiB, dtype=np.uint8)
        self.dst = np.zeros(256 * MiB, dtype=np.uint8)
        np.copyto(self.dst, self.src)

    def measure(self, seconds: float) -> float:
        start = time.perf_counter()
        copied = 0
        while time.perf_counter() - start < seconds:
            np.copyto(self.dst, self.src)
            copied += self.src.nbytes
        return copied / (time.perf_counter() - start) / 1e9


class LoopbackTcp:
    """sendall of 16 MiB messages by a child process, recv_into here, over 127.0.0.1."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        port = self.listener.getsockname()[1]
        code = ("import socket\n"
                f"s=socket.create_connection(('127.0.0.1',{port}))\n"
                f"b=memoryview(bytearray({TCP_MESSAGE_BYTES}))\n"
                "try:\n"
                "    while True: s.sendall(b)\n"
                "except OSError: pass\n")
        self.sender = subprocess.Popen([sys.executable, "-c", code])
        self.conn, _ = self.listener.accept()
        self.buf = memoryview(bytearray(TCP_MESSAGE_BYTES))
        self.measure(0.1)

    def measure(self, seconds: float) -> float:
        start = time.perf_counter()
        received = 0
        while time.perf_counter() - start < seconds:
            got = 0
            while got < TCP_MESSAGE_BYTES:
                got += self.conn.recv_into(self.buf[got:])
            received += got
        return received / (time.perf_counter() - start) / 1e9

    def close(self) -> None:
        self.sender.kill()
        self.sender.wait()
        self.conn.close()
        self.listener.close()


def serve() -> None:
    """Process A: one segment and its data server; prints how to reach them, waits for EOF."""
    from kvpool_client.segments import LocalSegment, host_id
    from kvpool_client.transfer import DataServer

    key = os.urandom(32)
    segment = LocalSegment.create("bench", f"server{os.getpid()}", 0, SEGMENT_BYTES)
    segment.stamp_owner(key)  # as a client does with the key the master gave it
    server = DataServer({segment.segment_id: segment}, key)
    server.start()
    try:
        info = segment.describe(host_id(), server.endpoint)
        print(json.dumps({"key": key.hex(), "segment_id": info.segment_id,
                          "client_id": info.client_id, "size_bytes": info.size_bytes,
                          "host_id": info.host_id, "shm_name": info.shm_name,
                          "tcp_endpoint": info.tcp_endpoint}), flush=True)
        sys.stdin.read()
    finally:
        server.close()
        segment.close()


async def measure_case(run: Callable[[], Awaitable[list[int]]], batch_bytes: int,
                       baseline: Callable[[float], float], rounds: int,
                       round_s: float) -> tuple[float, float, float]:
    """Alternate rounds of the case and of its baseline; return the medians of the case GB/s,
    the baseline GB/s and the per-round ratio. Fails on any non-OK item."""
    for _ in range(2):  # warm-up: connections, mappings, page tables
        await run()
    case_rates, base_rates = [], []
    for _ in range(rounds):
        base_rates.append(baseline(round_s))
        start = time.perf_counter()
        moved = 0
        while time.perf_counter() - start < round_s:
            statuses = await run()
            if any(statuses):
                raise SystemExit(f"transfer failed: {statuses}")
            moved += batch_bytes
        case_rates.append(moved / (time.perf_counter() - start) / 1e9)
    ratios = [case / base for case, base in zip(case_rates, base_rates, strict=True)]
    return (statistics.median(case_rates), statistics.median(base_rates),
            statistics.median(ratios))


async def transfers(segment: SegmentInfo, key: bytes, rounds: int, round_s: float,
                    ) -> dict[str, tuple[float, float, float]]:
    """Process B: shm and tcp batches into process A's segment."""
    expiry_ms = int(time.time() * 1000) + 3_600_000

    def placement(offset: int, length: int, op: Op) -> Placement:
        return Placement(segment.segment_id, offset, length, expiry_ms,
                         capability.sign(key, segment.segment_id, offset, length, op, expiry_ms))

    memcpy = Memcpy()
    loopback = LoopbackTcp()
    results: dict[str, tuple[float, float, float]] = {}
    shm = ShmTransport()
    tcp = TcpTransport()
    local = np.random.default_rng(0).integers(0, 255, 256 * MiB, dtype=np.uint8)
    view = memoryview(local)
    cases = [("shm", shm, 1 * MiB, 64), ("shm", shm, 16 * MiB, 8), ("shm", shm, 4096, 256),
             ("tcp", tcp, 16 * MiB, 8), ("tcp", tcp, 1 * MiB, 64)]
    try:
        for name, transport, object_bytes, count in cases:
            baseline = memcpy.measure if name == "shm" else loopback.measure
            for op in (Op.WRITE, Op.READ):
                items = [(segment, placement(i * object_bytes, object_bytes, op),
                          [view[i * object_bytes:(i + 1) * object_bytes]]) for i in range(count)]
                batch = transport.write_batch if op == Op.WRITE else transport.read_batch
                size = f"{object_bytes // MiB}MiB" if object_bytes >= MiB else f"{object_bytes}B"
                results[f"{name} {op.name.lower()} {count}x{size}"] = await measure_case(
                    lambda items=items, batch=batch: batch(items), object_bytes * count,
                    baseline, rounds, round_s)
    finally:
        loopback.close()
        await shm.close()
        await tcp.close()
    return results


IO_FRAME = struct.Struct("<QQ")  # request id, payload length


def _io_client(port: int, op: str, frames: int) -> None:
    """Child process: send ``frames`` requests (writes carry 16 MiB), read the answers."""
    sock = socket.create_connection(("127.0.0.1", port))
    buf = memoryview(bytearray(TCP_MESSAGE_BYTES))
    header = memoryview(bytearray(IO_FRAME.size))

    def receive(view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            got += sock.recv_into(view[got:])

    def answers() -> None:
        for _ in range(frames):
            receive(header)
            if op == "read":
                receive(buf)

    reader = threading.Thread(target=answers)
    reader.start()
    for i in range(frames):
        if op == "write":
            sock.sendall(IO_FRAME.pack(i, TCP_MESSAGE_BYTES))
            sock.sendall(buf)
        else:
            sock.sendall(IO_FRAME.pack(i, TCP_MESSAGE_BYTES))
    reader.join()
    sock.close()


def _thread_server(listener: socket.socket, segment: memoryview, op: str) -> float:
    """Serve one connection on this thread; return seconds from accept to the client's close."""
    conn, _ = listener.accept()
    start = time.perf_counter()
    header = memoryview(bytearray(IO_FRAME.size))
    while conn.recv_into(header, IO_FRAME.size, socket.MSG_WAITALL) == IO_FRAME.size:
        request_id, length = IO_FRAME.unpack(header)
        if op == "write":
            conn.recv_into(segment[:length], length, socket.MSG_WAITALL)
            conn.sendall(IO_FRAME.pack(request_id, 0))
        else:
            conn.sendmsg([IO_FRAME.pack(request_id, length), segment[:length]])
    conn.close()
    return time.perf_counter() - start


def _uvloop_server(listener: socket.socket, segment: memoryview, op: str) -> float:
    """Serve one connection with a uvloop BufferedProtocol; return seconds from connection to
    the client's close."""
    timing: list[float] = []

    class Protocol(asyncio.BufferedProtocol):
        def __init__(self, done: asyncio.Future[None]) -> None:
            self.done = done
            self.header = memoryview(bytearray(IO_FRAME.size))
            self.target = self.header
            self.filled = 0
            self.request_id = 0
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            timing.append(time.perf_counter())
            self.transport = transport  # type: ignore[assignment]

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.target[self.filled:]

        def buffer_updated(self, nbytes: int) -> None:
            assert self.transport is not None
            self.filled += nbytes
            if self.filled < self.target.nbytes:
                return
            self.filled = 0
            if self.target is self.header:
                self.request_id, length = IO_FRAME.unpack(self.header)
                if op == "write":
                    self.target = segment[:length]
                else:
                    self.transport.writelines([IO_FRAME.pack(self.request_id, length),
                                               segment[:length]])
            else:
                self.target = self.header
                self.transport.write(IO_FRAME.pack(self.request_id, 0))

        def connection_lost(self, exc: Exception | None) -> None:
            timing.append(time.perf_counter())
            self.done.set_result(None)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        server = await loop.create_server(lambda: Protocol(done), sock=listener)
        await done
        server.close()

    uvloop.run(serve())
    return timing[1] - timing[0]


def io_models(frames: int) -> None:
    """Print GB/s of the two server I/O models for 16 MiB writes and reads, alternating."""
    segment = memoryview(bytearray(TCP_MESSAGE_BYTES))
    model_op_to_rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(3):
        for model in ("threads", "uvloop"):
            for op in ("write", "read"):
                listener = socket.create_server(("127.0.0.1", 0))
                port = listener.getsockname()[1]
                client = subprocess.Popen([sys.executable, __file__, "--io-client", str(port),
                                           str(frames), op])
                try:
                    serve_one = _thread_server if model == "threads" else _uvloop_server
                    elapsed_s = serve_one(listener, segment, op)
                    client.wait(120)
                finally:
                    if client.poll() is None:
                        client.kill()
                    client.wait()
                    listener.close()
                model_op_to_rates.setdefault((model, op), []).append(
                    frames * TCP_MESSAGE_BYTES / elapsed_s / 1e9)
    for (model, op), rates in model_op_to_rates.items():
        print(f"{model:8s} server, 16 MiB {op:5s}: {statistics.median(rates):5.2f} GB/s "
              f"(median of {len(rates)})")


ECHO_HEADER = struct.Struct("<QQ")  # bytes the client sends after this header, bytes to answer


def _echo_server() -> None:
    """Child process: answer each request of ``ECHO_HEADER`` + payload with the asked bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = memoryview(bytearray(ECHO_HEADER.size))
    scratch = memoryview(bytearray(64 * MiB))
    while conn.recv_into(header, ECHO_HEADER.size, socket.MSG_WAITALL) == ECHO_HEADER.size:
        request_bytes, answer_bytes = ECHO_HEADER.unpack(header)
        if request_bytes:
            conn.recv_into(scratch[:request_bytes], request_bytes, socket.MSG_WAITALL)
        conn.sendall(scratch[:answer_bytes])


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    if sock.recv_into(view, view.nbytes, socket.MSG_WAITALL) != view.nbytes:
        raise SystemExit("raw connection closed")


class RawClient:
    """The floor of a client on the data server: frames encoded once, one ``sendmsg`` per call,
    blocking ``recv_into`` (MSG_WAITALL) for every answer header and READ payload."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.header = memoryview(bytearray(RESPONSE.size))

    def call(self, op: Op, items: list[Item]) -> Callable[[], list[int]]:
        frames: list[bytes | memoryview] = []
        for request_id, (segment, placement, regions) in enumerate(items, 1):
            frames.append(encode_request(op, request_id, segment.segment_id, placement.offset,
                                         placement.length, placement.offset, placement.length,
                                         placement.capability_expiry_ms, placement.capability))
            if op == Op.WRITE:
                frames.extend(regions)
        destinations = [regions[0] for _, _, regions in items]

        def run() -> list[int]:
            self.sock.sendmsg(frames)
            statuses = []
            for destination in destinations:
                _recv_exactly(self.sock, self.header)
                status = RESPONSE.unpack(self.header)[3]
                if op == Op.READ and status == 0:
                    _recv_exactly(self.sock, destination)
                statuses.append(status)
            return statuses
        return run

    def close(self) -> None:
        self.sock.close()


class EchoClient:
    """The same bytes as a call (frames and payload out, answers back) echoed by a child."""

    def __init__(self) -> None:
        self.child = subprocess.Popen([sys.executable, __file__, "--echo"],
                                      stdout=subprocess.PIPE, text=True)
        assert self.child.stdout is not None
        port = int(self.child.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.answer = memoryview(bytearray(64 * MiB))

    def call(self, op: Op, items: list[Item]) -> Callable[[], list[int]]:
        payload = sum(placement.length for _, placement, _ in items)
        frames = sum(len(encode_request(op, 1, segment.segment_id, 0, 1, 0, 1, 0, b""))
                     for segment, _, _ in items)
        sent = frames + (payload if op == Op.WRITE else 0)
        answer = RESPONSE.size * len(items) + (payload if op == Op.READ else 0)
        request = [ECHO_HEADER.pack(sent, answer), memoryview(bytearray(sent))]
        view = self.answer[:answer]

        def run() -> list[int]:
            self.sock.sendmsg(request)
            _recv_exactly(self.sock, view)
            return []
        return run

    def close(self) -> None:
        self.sock.close()
        self.child.wait(10)


def blocking_comparison(segment: SegmentInfo, key: bytes, rounds: int, round_s: float,
                        ) -> dict[str, dict[str, float]]:
    """Per case, ops/s (objects moved per second) of every variant, and per-round ratios of
    the blocking transport to the others (see the module docstring)."""
    expiry_ms = int(time.time() * 1000) + 3_600_000
    local = memoryview(np.random.default_rng(0).integers(0, 255, 64 * MiB, dtype=np.uint8))

    def items_of(op: Op, object_bytes: int, count: int) -> list[Item]:
        return [(segment, Placement(segment.segment_id, i * object_bytes, object_bytes,
                                    expiry_ms, capability.sign(key, segment.segment_id,
                                                               i * object_bytes, object_bytes,
                                                               op, expiry_ms)),
                 [local[i * object_bytes:(i + 1) * object_bytes]]) for i in range(count)]

    blocking = BlockingTcpTransport()
    sleeping = BlockingTcpTransport(busy_poll_us=0)
    loop = uvloop.new_event_loop()
    tcp = TcpTransport()
    raw = RawClient(segment.tcp_endpoint)
    echo = EchoClient()
    results: dict[str, dict[str, float]] = {}
    try:
        for object_bytes, count in ((4096, 1), (4096, 32), (MiB, 1)):
            for op in (Op.READ, Op.WRITE):
                items = items_of(op, object_bytes, count)
                batch = blocking.read_batch if op == Op.READ else blocking.write_batch
                slow = sleeping.read_batch if op == Op.READ else sleeping.write_batch
                async_batch = tcp.read_batch if op == Op.READ else tcp.write_batch
                variants: dict[str, Callable[[], list[Any]]] = {
                    "blocking": lambda items=items, batch=batch: batch(items),
                    "blocking, no poll": lambda items=items, slow=slow: slow(items),
                    "async, loop per call": lambda items=items, async_batch=async_batch:
                        loop.run_until_complete(async_batch(items)),
                    "raw client": raw.call(op, items),
                    "loopback echo": echo.call(op, items),
                }
                name = (f"{'get' if op == Op.READ else 'put'} {count}x"
                        f"{'4KiB' if object_bytes == 4096 else '1MiB'}")
                results[name] = _alternate(variants, count, rounds, round_s)
    finally:
        loop.run_until_complete(tcp.close())
        loop.close()
        blocking.close()
        sleeping.close()
        raw.close()
        echo.close()
    return results


def _alternate(variants: dict[str, Callable[[], list[Any]]], objects: int, rounds: int,
               round_s: float) -> dict[str, float]:
    """Rounds of every variant in turn: median ops/s of each, and median per-round ratios of
    "blocking" to each other variant. Fails on any non-OK item."""
    for run in variants.values():  # warm-up: connections, page tables
        for _ in range(20):
            if any(run()):
                raise SystemExit(f"transfer failed: {run()}")
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            calls = 0
            start = time.perf_counter()
            while time.perf_counter() - start < round_s:
                statuses = run()
                if any(statuses):
                    raise SystemExit(f"{name}: transfer failed: {statuses}")
                calls += 1
            rates[name].append(calls * objects / (time.perf_counter() - start))
    out = {name: statistics.median(rate) for name, rate in rates.items()}
    for name in variants:
        if name != "blocking":
            out[f"blocking / {name}"] = statistics.median(
                b / o for b, o in zip(rates["blocking"], rates[name], strict=True))
    return out


def print_blocking(results: dict[str, dict[str, float]]) -> None:
    names = [n for n in next(iter(results.values())) if "/" not in n]
    print("ops/s (objects moved per second; a batch of 32 is 32 ops), medians of the rounds")
    print(f"{'case':12s}" + "".join(f"{n:>22s}" for n in names))
    for case, row in results.items():
        print(f"{case:12s}" + "".join(f"{row[n]:22,.0f}" for n in names))
    print("blocking transport / variant, medians of per-round ratios")
    ratios = [n for n in next(iter(results.values())) if "/" in n]
    print(f"{'case':12s}" + "".join(f"{n.split(' / ')[1]:>22s}" for n in ratios))
    for case, row in results.items():
        print(f"{case:12s}" + "".join(f"{row[n]:21.2f}x" for n in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per case")
    parser.add_argument("--round-seconds", type=float, default=0.3, help="length of a round")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--io-models", action="store_true",
                        help="compare threaded and uvloop server I/O instead")
    parser.add_argument("--blocking", action="store_true",
                        help="compare the blocking tcp transport with the async one, a raw "
                             "client and a loopback echo instead")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--io-client", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.echo:
        _echo_server()
        return
    if args.io_client:
        _io_client(int(args.io_client[0]), args.io_client[2], int(args.io_client[1]))
        return
    if args.io_models:
        io_models(frames=64)
        loopback = LoopbackTcp()
        rate = statistics.median(loopback.measure(0.5) for _ in range(3))
        print(f"loopback tcp (sendall/recv_into):   {rate:5.2f} GB/s")
        loopback.close()
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        described = json.loads(server.stdout.readline())
        key = bytes.fromhex(described.pop("key"))
        # What GetSegments hands a mapper: the descriptor with the owner's proof.
        segment = SegmentInfo(**described, ownership_proof=capability.ownership_proof(
            key, described["segment_id"], described["shm_name"], described["size_bytes"]))
        if args.blocking:
            blocking_results = blocking_comparison(segment, key, args.rounds,
                                                   args.round_seconds)
        else:
            results = uvloop.run(transfers(segment, key, args.rounds, args.round_seconds))
    finally:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.close()  # EOF: the child closes its server and segment
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server.stdout.close()
        cleanup_stale_segments("bench")
    if args.blocking:
        print_blocking(blocking_results)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(blocking_results, f, indent=1)
        return
    print(f"{'case':26s} {'GB/s':>7s} {'baseline GB/s':>22s} {'ratio':>8s}")
    for name, (rate, base, ratio) in results.items():
        base_name = "memcpy" if name.startswith("shm") else "loopback tcp"
        print(f"{name:26s} {rate:7.2f} {base_name:>13s} {base:7.2f} {100 * ratio:7.1f} %")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({name: {"gbps": rate, "baseline_gbps": base, "ratio": ratio}
                       for name, (rate, base, ratio) in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
