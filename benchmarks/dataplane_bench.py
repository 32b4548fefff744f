"""Data-plane benchmark: shm and tcp transfers between two processes, against the machine's own
single-thread memcpy and loopback TCP measured in the same run.

    .venv/bin/python benchmarks/dataplane_bench.py [--seconds 1.0] [--json out.json]

Process A (a child) creates a segment and runs a DataServer; process B (this one) writes and
reads batches of objects into it through ShmTransport and through TcpTransport (forced tcp),
zero-copy from/into its own buffers. Baselines: numpy.copyto of 256 MiB on one thread, and
sendall/recv_into of 16 MiB messages between two processes over 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np
import uvloop

from kvpool_client import capability
from kvpool_client.transfer import ShmTransport, TcpTransport
from kvpool_client.types import Op, Placement, SegmentInfo

MiB = 1 << 20
SEGMENT_BYTES = 512 * MiB
TCP_MESSAGE_BYTES = 16 * MiB


def memcpy_gbps(seconds: float) -> float:
    """Single-thread copy between two 256 MiB anonymous buffers (numpy.copyto)."""
    size = 256 * MiB
    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    np.copyto(dst, src)
    start = time.perf_counter()
    copied = 0
    while time.perf_counter() - start < seconds:
        np.copyto(dst, src)
        copied += size
    return copied / (time.perf_counter() - start) / 1e9


def loopback_tcp_gbps(seconds: float) -> float:
    """sendall/recv_into of 16 MiB messages from a child process over 127.0.0.1."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = ("import socket,sys\n"
            f"s=socket.create_connection(('127.0.0.1',{port}))\n"
            f"b=memoryview(bytearray({TCP_MESSAGE_BYTES}))\n"
            "try:\n"
            "    while True: s.sendall(b)\n"
            "except OSError: pass\n")
    sender = subprocess.Popen([sys.executable, "-c", code])
    try:
        conn, _ = listener.accept()
        buf = memoryview(bytearray(TCP_MESSAGE_BYTES))

        def receive_one() -> None:
            got = 0
            while got < TCP_MESSAGE_BYTES:
                got += conn.recv_into(buf[got:])

        for _ in range(4):
            receive_one()
        start = time.perf_counter()
        received = 0
        while time.perf_counter() - start < seconds:
            receive_one()
            received += TCP_MESSAGE_BYTES
        rate = received / (time.perf_counter() - start) / 1e9
        conn.close()
        return rate
    finally:
        sender.kill()
        sender.wait()
        listener.close()


def serve() -> None:
    """Process A: one segment and its data server; prints how to reach them, waits for EOF."""
    from kvpool_client.segments import LocalSegment, host_id
    from kvpool_client.transfer import DataServer

    key = os.urandom(32)
    segment = LocalSegment.create("bench", f"server{os.getpid()}", 0, SEGMENT_BYTES)
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


async def measure(run: Callable[[], Awaitable[list[int]]], batch_bytes: int,
                  seconds: float) -> float:
    """GB/s of repeated batches (after two warm-up batches); fails on any non-OK item."""
    for _ in range(2):
        await run()
    start = time.perf_counter()
    moved = 0
    while time.perf_counter() - start < seconds:
        statuses = await run()
        if any(statuses):
            raise SystemExit(f"transfer failed: {statuses}")
        moved += batch_bytes
    return moved / (time.perf_counter() - start) / 1e9


async def transfers(segment: SegmentInfo, key: bytes, seconds: float) -> dict[str, float]:
    """Process B: shm and tcp batches into process A's segment."""
    expiry_ms = int(time.time() * 1000) + 3_600_000

    def placement(offset: int, length: int, op: Op) -> Placement:
        return Placement(segment.segment_id, offset, length, expiry_ms,
                         capability.sign(key, segment.segment_id, offset, length, op, expiry_ms))

    results: dict[str, float] = {}
    shm = ShmTransport()
    tcp = TcpTransport()
    local = np.random.default_rng(0).integers(0, 255, 256 * MiB, dtype=np.uint8)
    view = memoryview(local)
    cases = [("shm", shm, 1 * MiB, 64), ("shm", shm, 16 * MiB, 8), ("shm", shm, 4096, 256),
             ("tcp", tcp, 16 * MiB, 8), ("tcp", tcp, 1 * MiB, 64)]
    for name, transport, object_bytes, count in cases:
        for op in (Op.WRITE, Op.READ):
            items = [(segment, placement(i * object_bytes, object_bytes, op),
                      [view[i * object_bytes:(i + 1) * object_bytes]]) for i in range(count)]
            batch = transport.write_batch if op == Op.WRITE else transport.read_batch
            rate = await measure(lambda items=items, batch=batch: batch(items),
                                 object_bytes * count, seconds)
            size = f"{object_bytes // MiB}MiB" if object_bytes >= MiB else f"{object_bytes}B"
            results[f"{name} {op.name.lower()} {count}x{size}"] = rate
    await shm.close()
    await tcp.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    memcpy = memcpy_gbps(args.seconds)
    loopback = loopback_tcp_gbps(args.seconds)
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        described = json.loads(server.stdout.readline())
        key = bytes.fromhex(described.pop("key"))
        segment = SegmentInfo(**described)
        results = uvloop.run(transfers(segment, key, args.seconds))
    finally:
        server.kill()
        server.wait()
    print(f"single-thread memcpy (numpy copyto 256 MiB): {memcpy:6.2f} GB/s")
    print(f"loopback TCP (sendall/recv_into 16 MiB):     {loopback:6.2f} GB/s")
    for name, rate in results.items():
        base, base_name = (memcpy, "memcpy") if name.startswith("shm") else (loopback, "tcp")
        print(f"{name:28s} {rate:6.2f} GB/s  {100 * rate / base:5.1f} % of {base_name}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"memcpy_gbps": memcpy, "loopback_tcp_gbps": loopback, **results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
