"""A real client's data server facing a TCP peer that sends half a frame: another client's
transfers through the same server continue, and the stuck connection is closed after the frame
timeout (the client's transfer_timeout_s). A peer that stops reading its answers is covered by
tests/fault/test_dataplane_tcp.py."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig

TIMEOUT_S = 1.0


def closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the peer closed the connection (draining what it sends), or None."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < timeout_s:
        try:
            if not sock.recv(1 << 20):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
    return None


def test_stuck_tcp_peers_time_out_while_others_continue(start_master: Any) -> None:
    master = start_master(default_kv_lease_ttl=300)  # ms: removed objects free quickly
    base = {"master_server_address": master.address, "rpc_timeout_s": 2, "transport": "tcp"}
    owner_cfg = ClientConfig.from_dict({**base, "global_segment_size": "64mb",
                                        "transfer_timeout_s": TIMEOUT_S})
    with KVPoolClient(owner_cfg) as owner, \
            KVPoolClient(ClientConfig.from_dict({**base, "global_segment_size": 0})) as other:
        host, port = owner.hostname.rsplit(":", 1)
        half = socket.create_connection((host, int(port)), timeout=5)
        try:
            half.sendall(b"KVPQ\x01\x01" + bytes(20))  # half a request header, then silence
            started = time.monotonic()
            # Meanwhile another client moves bytes through the same data server.
            moved = 0
            while time.monotonic() - started < TIMEOUT_S / 2 and moved < 3000:
                key = f"flow-{moved}"
                data = os.urandom(16 << 10)
                other.put(key, data)
                assert other.get(key) == data
                other.remove(key, force=True)  # bytes free once the lease ends
                moved += 1
            assert closed_within(half, 5.0) is not None
            half_closed_s = time.monotonic() - started
            print(f"transfers by another client while a peer held half a frame: {moved} "
                  f"byte-exact put+get pairs in {TIMEOUT_S / 2:.1f} s; half-frame connection "
                  f"closed after {half_closed_s:.2f} s (frame timeout {TIMEOUT_S} s)")
            assert moved > 0
            assert TIMEOUT_S * 0.8 <= half_closed_s <= TIMEOUT_S + 1.5
        finally:
            half.close()
