"""A client's TCP data server cannot be filled by peers without a valid capability.

Idle sockets, half-sent headers and refused WRITEs whose payload never comes are "unproven":
when every slot (or a peer's share) is taken, the longest unproven one is closed to admit a new
connection, so TCP puts and gets through the server keep working. A connection that sends no
request header is closed within ``first_request_timeout_s``; one IP address holds at most
``max_connections_per_peer`` connections."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.segments import LocalSegment
from kvpool_client.transfer.tcp import DataServer
from kvpool_client.transfer.tcp_frames import RESPONSE, encode_request
from kvpool_wire import capability
from kvpool_wire.status import Status
from kvpool_wire.types import Op

SEGMENT_BYTES = 1 << 20


def _connect(host: str, port: int, source: str) -> socket.socket:
    return socket.create_connection((host, port), timeout=5, source_address=(source, 0))


def _answer_status(sock: socket.socket, timeout_s: float) -> tuple[Status | None, float]:
    """(status of the server's answer or None, seconds until it closed the connection)."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            data += chunk
    status = Status(RESPONSE.unpack_from(data)[3]) if len(data) >= RESPONSE.size else None
    return status, time.monotonic() - started


def test_idle_and_stalled_peers_do_not_stop_tcp_transfers(start_master: Any) -> None:
    master = start_master()
    base = {"master_server_address": master.address, "rpc_timeout_s": 3, "transport": "tcp",
            "transfer_timeout_s": 3}
    with KVPoolClient(ClientConfig.from_dict({**base, "global_segment_size": "32mb"})) as owner, \
            KVPoolClient(ClientConfig.from_dict({**base, "global_segment_size": 0})) as other:
        host, port_text = owner.hostname.rsplit(":", 1)
        port = int(port_text)
        held = []
        try:
            for index in range(90):  # 64 slots by default
                sock = _connect(host, port, f"127.0.0.{2 + index % 3}")
                if index % 3 == 1:  # half a request header, then silence
                    sock.sendall(b"KVPQ\x01\x02")
                elif index % 3 == 2:  # a refused WRITE (no such segment) whose payload never comes
                    sock.sendall(encode_request(Op.WRITE, 1, "nope", 0, 32 << 20, 0, 32 << 20,
                                                int(time.time() * 1000) + 60_000, bytes(16)))
                held.append(sock)
            time.sleep(0.2)  # every one of them is being served (or waited on) by now
            started = time.monotonic()
            for index in range(20):
                data = os.urandom(64 << 10)
                other.put(f"through-{index}", data)
                assert other.get(f"through-{index}") == data
            print(f"20 TCP put+get pairs in {time.monotonic() - started:.2f} s with 90 idle "
                  f"or stalled peer connections open to the data server")
        finally:
            for sock in held:
                sock.close()


@pytest.fixture
def small_server() -> Iterator[tuple[DataServer, LocalSegment, bytes]]:
    segment = LocalSegment.create(f"test-{uuid.uuid4().hex[:12]}", "owner", 0, SEGMENT_BYTES)
    key = os.urandom(32)
    server = DataServer({segment.segment_id: segment}, key, "127.0.0.1", 0,
                        max_connections_per_peer=3, first_request_timeout_s=0.5,
                        frame_timeout_s=10)
    try:
        server.start()
        yield server, segment, key
    finally:
        server.close()
        segment.close()


def test_silent_connections_close_fast_and_peers_are_capped(small_server: Any) -> None:
    server, segment, key = small_server
    silent = _connect("127.0.0.1", server.port, "127.0.0.5")
    with silent:
        status, waited_s = _answer_status(silent, 5.0)
    assert status is None and waited_s < 2.0

    expiry_ms = int(time.time() * 1000) + 60_000
    write = encode_request(Op.WRITE, 1, segment.segment_id, 0, 4096, 0, 4096, expiry_ms,
                           capability.sign(key, segment.segment_id, 0, 4096, Op.WRITE,
                                           expiry_ms))
    busy = [_connect("127.0.0.1", server.port, "127.0.0.3") for _ in range(3)]
    try:
        for sock in busy:  # in service: a checked WRITE whose payload is awaited
            sock.sendall(write)
        deadline = time.monotonic() + 5
        while (server.active_connections < 3 or server.unproven_connections) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        with _connect("127.0.0.1", server.port, "127.0.0.3") as extra:
            assert _answer_status(extra, 5.0)[0] == Status.RESOURCE_EXHAUSTED
        with _connect("127.0.0.1", server.port, "127.0.0.4") as elsewhere:
            elsewhere.sendall(write + bytes(4096))
            elsewhere.shutdown(socket.SHUT_WR)
            assert _answer_status(elsewhere, 5.0)[0] == Status.OK
    finally:
        for sock in busy:
            sock.close()
