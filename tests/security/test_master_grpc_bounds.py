"""The gRPC port checks the token on a call's headers, before its message is read: callers
without it cost no memory however large the message they send. A connection that does not
finish its HTTP/2 handshake within ``--auth-timeout`` is closed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc

TOKEN = "grpc-bounds-token"
MESSAGE_BYTES = 64 << 20


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_unauthenticated_large_messages_are_not_buffered(start_master: Any) -> None:
    master = start_master(auth_token=TOKEN)
    before = _rss_bytes(master.pid)
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes(master.pid))
            time.sleep(0.01)

    codes: list[grpc.StatusCode] = []
    # Field 2 (keys) of an ExistRequest announcing MESSAGE_BYTES: never parsed.
    payload = b"\x12" + bytes([0x80, 0x80, 0x80, 0x20]) + bytes(MESSAGE_BYTES)

    def call() -> None:
        with grpc.insecure_channel(master.address, options=[
                ("grpc.max_send_message_length", 2 * MESSAGE_BYTES)]) as channel:
            exist = channel.unary_unary("/kvpool.v1.Master/Exist")
            try:
                exist(payload, timeout=20)
            except grpc.RpcError as exc:
                codes.append(exc.code())

    watcher = threading.Thread(target=watch)
    watcher.start()
    callers = [threading.Thread(target=call) for _ in range(4)]
    started = time.monotonic()
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(30)
    done.set()
    watcher.join(5)
    grown = peak[0] - before
    print(f"4 unauthenticated {MESSAGE_BYTES >> 20} MiB gRPC calls: answered in "
          f"{time.monotonic() - started:.2f} s, master RSS peak +{grown / 2**20:.1f} MiB")
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    assert grown < 48 << 20


def test_a_silent_connection_to_the_grpc_port_is_closed(start_master: Any) -> None:
    master = start_master(auth_token=TOKEN, auth_timeout=1)
    sock = socket.create_connection(("127.0.0.1", master.grpc_port), timeout=5)
    with sock:
        started = time.monotonic()
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            while sock.recv(4096):
                pass
        closed_s = time.monotonic() - started
    print(f"silent gRPC connection closed after {closed_s:.2f} s (auth timeout 1 s)")
    assert closed_s < 4
