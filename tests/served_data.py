"""A real data server for data-plane tests: a random-filled shared-memory segment served on
127.0.0.1, and placements signed as the master signs them."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import xxhash

from kvpool_client.segments import LocalSegment
from kvpool_client.transfer import DataServer
from kvpool_client.transfer.tcp_frames import encode_request
from kvpool_wire import capability
from kvpool_wire.types import Op, Placement, SegmentInfo

SEGMENT_BYTES = 4 << 20


@dataclasses.dataclass
class Served:
    """A random-filled segment and the data server serving it."""

    segment: LocalSegment
    server: DataServer
    key: bytes
    info: SegmentInfo  # as a peer on another host sees it

    def placement(self, offset: int, length: int, op: Op, *, expiry_ms: int | None = None,
                  key: bytes | None = None, sign_op: Op | None = None,
                  signed_range: tuple[int, int] | None = None) -> Placement:
        """A placement signed like the master signs it (or deliberately wrong)."""
        expiry_ms = int(time.time() * 1000) + 60_000 if expiry_ms is None else expiry_ms
        cap_offset, cap_length = signed_range or (offset, length)
        cap = capability.sign(key or self.key, self.info.segment_id, cap_offset, cap_length,
                              sign_op or op, expiry_ms)
        return Placement(self.info.segment_id, offset, length, expiry_ms, cap)

    def frame(self, op: Op, offset: int, length: int, *, cap: tuple[int, int] | None = None,
              forged: bool = False, request_id: int = 1) -> bytes:
        """A raw request header + segment id, signed for ``cap`` (default: the request)."""
        cap_offset, cap_length = cap or (offset, length)
        expiry_ms = int(time.time() * 1000) + 60_000
        mac = os.urandom(16) if forged else capability.sign(
            self.key, self.info.segment_id, cap_offset, cap_length, op, expiry_ms)
        return encode_request(op, request_id, self.info.segment_id, offset, length, cap_offset,
                              cap_length, expiry_ms, mac)

    def digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(self.segment.buffer)

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.server.port), timeout=timeout_s)


@contextmanager
def served_segment(segment_bytes: int = SEGMENT_BYTES, **options: Any) -> Iterator[Served]:
    """A random-filled segment of ``segment_bytes`` served by a started DataServer on
    127.0.0.1 (``options`` go to the DataServer); both are closed on exit."""
    segment = LocalSegment.create(f"test-{uuid.uuid4().hex[:12]}", "owner", 0, segment_bytes)
    server = None
    try:
        segment.buffer[:] = os.urandom(segment_bytes)
        key = os.urandom(32)
        server = DataServer({segment.segment_id: segment}, key, "127.0.0.1", 0, **options)
        server.start()
        yield Served(segment, server, key, segment.describe("another-host", server.endpoint))
    finally:
        if server is not None:
            server.close()
        segment.close()
