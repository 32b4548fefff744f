"""The lean port bounds what a caller can cost the master before it has authenticated.

- A frame longer than a small bound is refused before its bytes are buffered, until the token
  was checked: connections announcing 256 MiB frames cost the master no memory.
- A connection that never sends its first frame (METHOD_AUTH with a token) is closed after
  ``--auth-timeout``; until then, when every slot is taken, the oldest such connection makes
  room, so idle sockets cannot keep a real client out.
- One IP address holds at most ``--max-connections-per-peer`` connections.
A real client's pipelined AUTH followed at once by a large request still works."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.framing import encode_frame, error_reason
from kvpool_wire.methods import METHOD_AUTH, METHOD_ERROR, RPC_METHODS
from kvpool_wire.status import Status

TOKEN = "lean-bounds-token"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _connect(port: int, source: str = "127.0.0.1", timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s,
                                    source_address=(source, 0))
    return sock


def _closed_with(sock: socket.socket, timeout_s: float) -> tuple[Status | None, float]:
    """Read until the master closes: (status of its error frame or None, seconds waited)."""
    started = time.monotonic()
    sock.settimeout(0.1)
    received = b""
    while time.monotonic() - started < timeout_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    else:
        raise AssertionError(f"still open after {timeout_s} s")
    waited_s = time.monotonic() - started
    if len(received) >= 9:
        (length,) = struct.unpack_from("<I", received)
        if received[4] == METHOD_ERROR:
            return error_reason(received[9:4 + length])[0], waited_s
    return None, waited_s


def _auth(sock: socket.socket) -> None:
    sock.sendall(encode_frame(METHOD_AUTH, 1, pb.AuthRequest(token=TOKEN).SerializeToString()))
    header = sock.recv(9, socket.MSG_WAITALL)
    (length,) = struct.unpack_from("<I", header)
    answer = pb.AuthResponse.FromString(sock.recv(length - 5, socket.MSG_WAITALL))
    assert header[4] == METHOD_AUTH and answer.status == pb.STATUS_OK


@pytest.fixture
def token_master(start_master: Any) -> Any:
    return start_master(auth_token=TOKEN)


def test_huge_frames_before_auth_cost_no_memory(token_master: Any) -> None:
    master = token_master
    before = _rss_bytes(master.pid)
    chunk = bytes(1 << 20)
    sockets = [_connect(master.fast_port) for _ in range(8)]
    sent_bytes = 0
    started = time.monotonic()
    for sock in sockets:
        # A 256 MiB frame announced, then its bytes streamed until the master hangs up.
        with contextlib.suppress(OSError):
            sock.sendall(struct.pack("<IBI", 256 << 20, RPC_METHODS["Exist"].method_id, 1))
            for _ in range(32):
                sock.sendall(chunk)
                sent_bytes += len(chunk)
    time.sleep(0.2)  # what the master would buffer has arrived
    grown = _rss_bytes(master.pid) - before
    print(f"8 unauthenticated 256 MiB frames: {sent_bytes >> 20} MiB accepted by the kernel "
          f"in {time.monotonic() - started:.2f} s, master RSS grew {grown / 2**20:.1f} MiB")
    assert grown < 8 << 20
    statuses = [_closed_with(sock, 5.0)[0] for sock in sockets]
    for sock in sockets:
        sock.close()
    assert statuses == [Status.INVALID_ARGUMENT] * 8


def test_a_pipelined_auth_and_large_request_are_both_served(token_master: Any) -> None:
    sock = _connect(token_master.fast_port)
    with sock:
        keys = [os.urandom(64) for _ in range(2000)]  # about 130 KiB, beyond the pre-auth bound
        exist = pb.ExistRequest(keys=keys).SerializeToString()
        method = RPC_METHODS["Exist"]
        sock.sendall(encode_frame(METHOD_AUTH, 1, pb.AuthRequest(token=TOKEN).SerializeToString())
                     + encode_frame(method.method_id, 2, exist))
        answers = []
        for _ in range(2):
            header = sock.recv(9, socket.MSG_WAITALL)
            length, method_id, request_id = struct.unpack("<IBI", header)
            answers.append((method_id, request_id, sock.recv(length - 5, socket.MSG_WAITALL)))
        assert [a[:2] for a in answers] == [(METHOD_AUTH, 1), (method.method_id, 2)]
        assert len(pb.ExistResponse.FromString(answers[1][2]).statuses) == len(keys)


def test_idle_sockets_do_not_keep_a_real_client_out(start_master: Any) -> None:
    master = start_master(auth_token=TOKEN, max_connections=64)
    idle = []
    try:
        for _ in range(100):  # more than every slot, from another loopback address
            with contextlib.suppress(OSError):
                idle.append(_connect(master.fast_port, source="127.0.0.2"))
        started = time.monotonic()
        config = ClientConfig.from_dict({"master_server_address": master.address,
                                         "global_segment_size": "16mb", "rpc_timeout_s": 3,
                                         "auth_token": TOKEN})
        with KVPoolClient(config) as client:
            client.put("after-the-flood", b"z" * 4096)
            assert client.get("after-the-flood") == b"z" * 4096
        print(f"a client registered and moved bytes {time.monotonic() - started:.2f} s after "
              f"100 idle sockets hit a 64-slot lean port")
    finally:
        for sock in idle:
            sock.close()


def test_greeting_timeout_and_per_peer_cap(start_master: Any) -> None:
    master = start_master(auth_token=TOKEN, max_connections_per_peer=4, auth_timeout=0.5)
    silent = _connect(master.fast_port, source="127.0.0.5")
    status, waited_s = _closed_with(silent, 5.0)
    silent.close()
    assert status == Status.TIMEOUT and waited_s < 2.0
    authed = [_connect(master.fast_port, source="127.0.0.3") for _ in range(4)]
    try:
        for sock in authed:
            _auth(sock)
        extra = _connect(master.fast_port, source="127.0.0.3")
        status, _ = _closed_with(extra, 5.0)
        extra.close()
        assert status == Status.RESOURCE_EXHAUSTED
        other = _connect(master.fast_port, source="127.0.0.4")
        with other:
            _auth(other)  # another address is not affected
    finally:
        for sock in authed:
            sock.close()
