"""TCP data plane: the data server every client runs for its own segments (the wire format is
in ``tcp_frames``).

Server rules:
- A request is checked completely before any byte of any segment is touched: magic, version,
  op, segment id, bounds (``offset + length <= segment size``), request inside the capability's
  range, capability MAC (the segment owner's key and the master epoch it registered in) and
  expiry (against an upper bound of the master's capability clock, ``clock``: skew between
  the hosts' wall clocks plays no part). Only then is a WRITE's payload moved into the segment
  (what the connection had read ahead is copied from its buffer, the rest received straight
  into the segment with ``recv_into``), or a READ's answer sent from the segment (``sendmsg``).
- A refused request (SEGMENT_NOT_FOUND, INVALID_ARGUMENT for bounds, PERMISSION_DENIED for the
  capability) is answered and counted in ``refused_total``; the connection stays usable. A
  refused WRITE's payload is read into a scratch buffer and dropped, never into a segment; one
  longer than ``MAX_DRAIN_BYTES`` closes the connection instead.
- A malformed frame (bad magic, version, op, segment-id length or UTF-8) is answered with
  INVALID_ARGUMENT, counted in ``bad_frames_total``, and the connection is closed. The server
  keeps serving every other connection.
- Time limits: a connection may sit idle between frames for ``idle_timeout_s``; its first
  request's header must arrive within ``first_request_timeout_s`` of connecting; once a frame's
  first byte arrived, the whole frame must arrive, and every answer be sent, within
  ``frame_timeout_s``; otherwise the connection is closed (``timeouts_total``). TCP keepalive
  closes connections whose peer host vanished. A WRITE cut
  short (timeout or disconnect) leaves the bytes received so far in its authorised range. That
  range belongs to an object that is still PENDING: the master makes it READY only after the
  writer reports success, so no reader sees them, and the failed put is revoked.
- Limits: at most ``max_connections`` connections, and at most ``max_connections_per_peer``
  from one IP address. A connection is "unproven" while it waits for, or reads, a request that
  has not passed the checks above (so also while a refused WRITE's payload is drained). At a
  limit, the connection unproven the longest (of the same peer, for the per-peer limit) is
  closed to admit the new one (``connections_evicted_total``): idle sockets, or peers with no
  valid capability, cannot keep a client with one out. With none to close, the new connection
  is answered RESOURCE_EXHAUSTED and closed (``connections_rejected_total``). Each connection
  has one request in service, so at most ``max_connections`` requests are in service, and
  pipelined requests wait in the kernel's socket buffers under TCP flow control.

The server runs threads with blocking sockets: one accepts, one serves each connection
(``benchmarks/dataplane_bench.py --io-models`` compares that with a uvloop server). Threads
keep serving while the owner's event loop is busy and make every time limit a plain
socket option; the GIL is released during the large ``recv_into`` (one MSG_WAITALL call per
payload) and ``sendmsg`` calls that dominate. Each connection reads ahead and answers
pipelined requests together (``tcp_conn``): a batch of small requests costs a few system
calls, not several per request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_client.segments import LocalSegment
from kvpool_client.ssd import SsdSegment
from kvpool_client.transfer.tcp_conn import Closed, Connection
from kvpool_client.transfer.tcp_frames import (
    MAX_SEGMENT_ID_BYTES,
    REQUEST,
    REQUEST_MAGIC,
    VERSION,
    encode_response,
)
from kvpool_wire import capability
from kvpool_wire.capability import MasterClock
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op

log = logging.getLogger(__name__)

MAX_DRAIN_BYTES = 64 << 20  # payload of a refused WRITE read and dropped to keep the stream
_OPS = frozenset(int(op) for op in Op)


def _wall_ms() -> int:
    return int(time.time() * 1000)


class DataServer:
    """Serves READ and WRITE requests on this client's segments (see the module docstring).

    ``segments`` is read at every request, so segments added to or removed from the mapping
    later are served or refused accordingly. ``capability_key`` may be replaced (e.g. after
    re-registration). ``clock`` returns the owner's current sample of the master's capability
    clock (epoch and time; see ``kvpool_wire.capability.MasterClock``): a client always
    passes it. Without one (a data server on its own), ``clock_ms`` is the time base and the
    epoch is 0. Counters are plain ints, read by the
    client's metrics.
    """

    def __init__(self, segments: Mapping[str, LocalSegment | SsdSegment], capability_key: bytes,
                 host: str = "127.0.0.1", port: int | tuple[int, int] = 0, *,
                 max_connections: int = 64,
                 max_connections_per_peer: int = 32, frame_timeout_s: float = 30.0,
                 idle_timeout_s: float = 120.0, first_request_timeout_s: float = 5.0,
                 clock_ms: Callable[[], int] = _wall_ms,
                 clock: Callable[[], MasterClock] | None = None) -> None:
        self.segments = segments
        self.capability_key = capability_key
        self.host = host
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.first_request_timeout_s = first_request_timeout_s
        self._clock_ms = clock_ms
        self.clock = clock
        self._requested_port = port
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._sock_to_thread: dict[socket.socket, threading.Thread] = {}
        self._sock_to_peer: dict[socket.socket, str] = {}
        self._peer_to_count: dict[str, int] = {}
        # Connections whose current request has not passed its checks, longest unproven first.
        self._unproven: dict[socket.socket, None] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._ssd_reads: concurrent.futures.ThreadPoolExecutor | None = None
        self.requests_total = 0
        self.refused_total = 0
        self.bad_frames_total = 0
        self.timeouts_total = 0
        self.connections_total = 0
        self.connections_rejected_total = 0
        self.connections_evicted_total = 0
        self.bytes_read_total = 0
        self.bytes_written_total = 0

    def start(self) -> int:
        """Bind, listen and start serving; return the port. Raises OSError when binding fails."""
        if self._listener is not None:
            return self.port
        listener = _listen(self.host, self._requested_port)
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"kvpool-data-accept-{self.port}")
        self._accept_thread.start()
        return self.port

    @property
    def port(self) -> int:
        """The port served on (0 before start)."""
        return self._listener.getsockname()[1] if self._listener is not None else 0

    @property
    def endpoint(self) -> str:
        """``host:port`` as peers should dial it (the tcp endpoint of mounted segments)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def active_connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._sock_to_thread)

    @property
    def unproven_connections(self) -> int:
        """Connections waiting for, or reading, a request not yet checked (the ones closed
        first to make room)."""
        with self._lock:
            return len(self._unproven)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every connection and wait (bounded) for the threads."""
        self._closing = True
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            listener.close()
        with self._lock:
            connections = dict(self._sock_to_thread)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline_s = time.monotonic() + timeout_s
        threads = [*connections.values()]
        if self._accept_thread is not None:
            threads.append(self._accept_thread)
        for thread in threads:
            thread.join(max(0.0, deadline_s - time.monotonic()))
        if self._ssd_reads is not None:
            self._ssd_reads.shutdown(wait=False)

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def _accept_loop(self) -> None:
        listener = self._listener
        while not self._closing and listener is not None:
            try:
                sock, address = listener.accept()
            except OSError:
                if self._closing:
                    return
                time.sleep(0.01)  # e.g. EMFILE: back off instead of spinning
                continue
            sock.settimeout(None)
            peer = str(address[0]) if isinstance(address, tuple) else ""
            with self._lock:
                evicted, full = self._admit(sock, peer)
                if not full:
                    thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                              name="kvpool-data-conn")
                    self._sock_to_thread[sock] = thread
                    self.connections_total += 1
                else:
                    self.connections_rejected_total += 1
            for victim in evicted:
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)  # its thread wakes up and exits
            if full:
                with contextlib.suppress(OSError):
                    sock.sendall(encode_response(Status.RESOURCE_EXHAUSTED, 0,
                                                 message="too many connections"))
                sock.close()
                continue
            thread.start()

    def _admit(self, sock: socket.socket, peer: str) -> tuple[list[socket.socket], bool]:
        """(connections to close to make room, whether ``sock`` is refused); under the lock.
        On success ``sock`` is counted (its thread is registered by the caller)."""
        evicted: list[socket.socket] = []
        if peer and self._peer_to_count.get(peer, 0) >= self.max_connections_per_peer:
            victim = next((s for s in self._unproven if self._sock_to_peer.get(s) == peer), None)
            if victim is None:
                return evicted, True
            evicted.append(victim)
            self._forget(victim)
        if len(self._sock_to_thread) >= self.max_connections:
            victim = next(iter(self._unproven), None)
            if victim is None:
                return evicted, True
            evicted.append(victim)
            self._forget(victim)
        self.connections_evicted_total += len(evicted)
        self._sock_to_peer[sock] = peer
        self._unproven[sock] = None
        if peer:
            self._peer_to_count[peer] = self._peer_to_count.get(peer, 0) + 1
        return evicted, False

    def _forget(self, sock: socket.socket) -> None:
        """Stop counting ``sock`` (idempotent); under the lock."""
        if self._sock_to_thread.pop(sock, None) is None:
            return
        self._unproven.pop(sock, None)
        peer = self._sock_to_peer.pop(sock, "")
        if peer:
            left = self._peer_to_count[peer] - 1
            if left:
                self._peer_to_count[peer] = left
            else:
                del self._peer_to_count[peer]

    def _set_unproven(self, sock: socket.socket, unproven: bool) -> None:
        """Mark the connection's current request as (not) yet checked; raise Closed when the
        connection was closed to make room for another."""
        with self._lock:
            if sock not in self._sock_to_thread:
                raise Closed
            if unproven:
                self._unproven[sock] = None
            else:
                self._unproven.pop(sock, None)

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock, lambda: self._count(timeouts_total=1))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
            self._serve_one(conn, time.monotonic() + self.first_request_timeout_s)
            while not self._closing:
                self._serve_one(conn, None)
            conn.flush()
        except Closed:
            pass
        except Exception:  # a bug must cost one connection, never the server
            log.exception("data connection failed")
        finally:
            conn.release()
            with self._lock:
                self._forget(sock)
            sock.close()

    def _serve_one(self, conn: Connection, first_deadline_s: float | None) -> None:
        """Read one request and answer it (the answer may wait in the queue while more
        requests are buffered); raise Closed when the connection must end.
        ``first_deadline_s``: for the first request, when its header must have arrived."""
        self._set_unproven(conn.sock, True)
        conn.wait_frame(self.idle_timeout_s if first_deadline_s is None
                        else first_deadline_s - time.monotonic())
        deadline_s = time.monotonic() + self.frame_timeout_s
        header_deadline_s = min(deadline_s, first_deadline_s or deadline_s)
        (magic, version, op, seg_len, request_id, offset, length, cap_offset, cap_length,
         cap_expiry_ms, put_id, cap) = REQUEST.unpack(conn.take(REQUEST.size, header_deadline_s))
        if (magic != REQUEST_MAGIC or version != VERSION or op not in _OPS
                or not 1 <= seg_len <= MAX_SEGMENT_ID_BYTES):
            self._refuse(conn, deadline_s, Status.INVALID_ARGUMENT, 0,
                         "malformed request header", bad_frame=True, closing=True)
            raise Closed
        try:
            segment_id = str(conn.take(seg_len, header_deadline_s), "utf-8")
        except UnicodeDecodeError:
            self._refuse(conn, deadline_s, Status.INVALID_ARGUMENT, request_id,
                         "segment id is not UTF-8", bad_frame=True, closing=True)
            raise Closed from None
        target, error, cap_deadline_s = self._authorise(
            segment_id, Op(op), offset, length, cap_offset, cap_length, cap_expiry_ms, cap,
            put_id)
        if target is None:
            assert error is not None
            if op == Op.WRITE:  # its payload follows: drop it (or give up the connection)
                if length > MAX_DRAIN_BYTES:
                    self._refuse(conn, deadline_s, error.status, request_id, error.message,
                                 closing=True)
                    raise Closed
                conn.discard(length, deadline_s)
            self._refuse(conn, deadline_s, error.status, request_id, error.message)
            return
        self._set_unproven(conn.sock, False)
        if isinstance(target, _SsdRead):  # read on the pool; later requests go on meanwhile
            conn.answer_later(self._ssd_pool().submit(self._read_ssd, target, request_id),
                              length, deadline_s)
        elif op == Op.WRITE:
            with target:
                # Not one byte lands after the capability expired: the master may have given
                # the range to another object by then.
                conn.receive_into(target, min(deadline_s, cap_deadline_s))
            self._count(requests_total=1, bytes_written_total=length)
            conn.answer([encode_response(Status.OK, request_id)], deadline_s)
        else:
            self._count(requests_total=1, bytes_read_total=length)
            conn.answer([encode_response(Status.OK, request_id, length), target], deadline_s,
                        hold=target)

    def _authorise(self, segment_id: str, op: Op, offset: int, length: int, cap_offset: int,
                   cap_length: int, cap_expiry_ms: int, cap: bytes, put_id: int = 0,
                   ) -> tuple[memoryview | _SsdRead | None, KVPoolError | None, float]:
        """Return (a view of the requested bytes, or the read of an SSD segment to make, None,
        the monotonic time the capability expires), or (None, why it is refused, 0)."""
        segment = self.segments.get(segment_id)
        if segment is None or segment.closed:
            return None, KVPoolError(Status.SEGMENT_NOT_FOUND,
                                     f"no segment {segment_id!r} here"), 0.0
        if length <= 0 or offset + length > segment.size_bytes:
            return None, KVPoolError(Status.INVALID_ARGUMENT,
                                     f"[{offset}, {offset + length}) is outside {segment_id!r} "
                                     f"({segment.size_bytes} bytes)"), 0.0
        if offset < cap_offset or offset + length > cap_offset + cap_length:
            return None, KVPoolError(Status.PERMISSION_DENIED,
                                     "request outside its capability"), 0.0
        clock = self.clock() if self.clock is not None else None
        if clock is None:
            epoch, now_ms, deadline_s = 0, self._clock_ms(), float("inf")
        else:
            epoch, now_ms = clock.epoch, clock.now_ms(time.monotonic())
            deadline_s = clock.local_deadline_s(cap_expiry_ms)
        if not capability.verify(self.capability_key, cap, segment_id, cap_offset, cap_length,
                                 op, cap_expiry_ms, now_ms, epoch, put_id):
            return None, KVPoolError(Status.PERMISSION_DENIED,
                                     "invalid or expired capability"), 0.0
        try:
            if isinstance(segment, SsdSegment):  # read from the file (see _serve_one)
                if op != Op.READ:
                    return None, KVPoolError(Status.PERMISSION_DENIED,
                                             "an SSD segment takes no remote writes"), 0.0
                return _SsdRead(segment, offset, length), None, deadline_s
            return segment.buffer[offset:offset + length], None, deadline_s
        except KVPoolError as exc:  # closed since the lookup, or an I/O error
            return None, exc, 0.0

    def _ssd_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._ssd_reads
        if pool is None:
            with self._lock:
                if self._ssd_reads is None:
                    self._ssd_reads = concurrent.futures.ThreadPoolExecutor(
                        SSD_READ_THREADS, thread_name_prefix="kvpool-ssd-serve")
                pool = self._ssd_reads
        return pool

    def _read_ssd(self, read: _SsdRead, request_id: int) -> list[Any]:
        """The answer to one READ of an SSD segment: its bytes, or why not."""
        try:
            data = read.segment.read(read.offset, read.length)
        except KVPoolError as exc:
            self._count(refused_total=1, requests_total=1)
            return [encode_response(exc.status, request_id, message=exc.message)]
        self._count(requests_total=1, bytes_read_total=read.length)
        return [encode_response(Status.OK, request_id, read.length), data]

    def _refuse(self, conn: Connection, deadline_s: float, status: Status, request_id: int,
                message: str, *, bad_frame: bool = False, closing: bool = False) -> None:
        """Count a refused request or bad frame and queue its answer; ``closing``: the
        connection ends after it, so send what is queued at once (best effort)."""
        self._count(**{"bad_frames_total" if bad_frame else "refused_total": 1},
                    requests_total=0 if bad_frame else 1)
        conn.answer([encode_response(status, request_id, message=message)], deadline_s)
        if closing:
            with contextlib.suppress(Closed, OSError):
                conn.flush()


#: SSD reads one data server makes at once (for all its connections).
SSD_READ_THREADS = 4


@dataclass(frozen=True, slots=True)
class _SsdRead:
    """A READ of an SSD segment that passed its checks, to be made on the read pool."""

    segment: SsdSegment
    offset: int
    length: int


def _listen(host: str, port: int | tuple[int, int]) -> socket.socket:
    """A listening socket on ``port`` (0: any free port), or on a free port of the range
    ``(low, high)``, tried in random order. Raises OSError (EADDRINUSE when the whole range is
    taken)."""
    low, high = (port, port) if isinstance(port, int) else port
    if low == high:
        return socket.create_server((host, low), backlog=128, reuse_port=False)
    candidates = list(range(low, high + 1))
    random.shuffle(candidates)
    for candidate in candidates:
        try:
            return socket.create_server((host, candidate), backlog=128, reuse_port=False)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"every port of {low}-{high} on {host} is in use")


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection so that one whose peer host vanished is closed by the kernel."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
