"""A data-server connection sends answers made on other threads in the order of their
requests, whatever order they finish in, and drops them with the connection."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

from kvpool_client.transfer.tcp_conn import Connection


def test_answers_made_elsewhere_go_out_in_request_order() -> None:
    server, client = socket.socketpair()
    try:
        conn = Connection(server, lambda: None)
        release_first = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            def slow() -> list[bytes]:
                release_first.wait(5)
                return [b"first:", b"A" * 100_000]
            first = pool.submit(slow)
            conn.answer_later(first, 100_006, time.monotonic() + 5)
            conn.answer([b"middle;"], time.monotonic() + 5)
            second = pool.submit(lambda: [b"second!"])
            conn.answer_later(second, 7, time.monotonic() + 5)
            second.result(5)                         # the later one is done first
            release_first.set()
            conn.flush()
        expected = b"first:" + b"A" * 100_000 + b"middle;" + b"second!"
        received = b""
        client.settimeout(5)
        while len(received) < len(expected):
            received += client.recv(1 << 20)
        assert received == expected
    finally:
        server.close()
        client.close()
