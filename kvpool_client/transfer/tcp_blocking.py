"""Blocking TCP transport: batches moved on the caller's own thread, no event loop.

The same requests, answers and statuses as ``tcp_client.TcpTransport`` (the wire format is in
``tcp_frames.py``), for a driver that moves bytes synchronously.

Rules of this file:
- Per peer (``host:port``) a pool of connections, opened on demand. A batch checks one out per
  peer, so one caller at a time uses a connection; any thread may call. At most
  ``connections_per_peer`` idle connections are kept; one the server closed while idle is
  noticed when checked out and replaced.
- One batch's requests to one peer are pipelined on its connection, in windows of
  ``max_inflight_per_connection`` requests: a window's request frames go out in one
  ``sendmsg`` (a WRITE's payload straight from the caller's regions), then its answers are read
  in order (a READ's payload straight into the caller's regions with ``recv_into``); the
  window bounds the bytes either side leaves unread, so neither can stall the other. A
  placement larger than ``chunk_bytes`` is sent as several requests (``tcp_frames.chunks``).
  Peers are served one after the other.
- Answers are validated (``tcp_frames.parse_response``). Only the header and message bytes
  known to come next are read into the connection's own buffer; payload bytes never are.
- Every wait is bounded: the socket is non-blocking and every wait is a ``poll(2)`` bounded
  by the window's deadline, ``timeout_s`` after its requests were sent. After sending, the
  thread polls the socket for up to ``busy_poll_us`` before it sleeps, with the backoff of
  ``polling.PollBackoff`` (see ``lean_blocking``, which waits the same way).
- Any failure of a connection (deadline, reset, malformed answer, an answer to another
  request, a READ answered with another length) closes it and fails every request not yet
  answered on it: TIMEOUT when the deadline passed, the server's status when it refused the
  connection, TRANSFER_FAILED otherwise; the peer's requests not yet sent fail likewise. A
  request the server refused (non-OK answer) fails alone and the connection stays in use. An
  item is OK only when every one of its requests was answered OK and, for a READ, its payload
  was received whole.
- ``close`` fails later calls with UNAVAILABLE and shuts down the connections in use, so that
  calls running on other threads end promptly.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import threading
import time
from collections.abc import Sequence

from kvpool_client.transfer.base import Item, byte_views, check_item
from kvpool_client.transfer.tcp_frames import (
    RESPONSE,
    chunks,
    encode_request,
    parse_endpoint,
    parse_response,
    refusal,
)
from kvpool_wire.polling import PollBackoff
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_CONTROL_BYTES = 8 << 10  # room for a window's answer headers and one message


class _Request:
    __slots__ = ("item", "length", "offset", "placement", "regions")

    def __init__(self, item: int, placement: Placement, offset: int, length: int,
                 regions: list[memoryview]) -> None:
        self.item = item  # index of its item in the batch
        self.placement = placement
        self.offset = offset
        self.length = length
        self.regions = regions  # payload source (WRITE) or destination (READ)


class _Connection:
    """One connection to a data server, used by one caller at a time."""

    def __init__(self, sock: socket.socket, busy_poll_s: float) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock: socket.socket | None = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._events = select.POLLIN  # what the poller waits for
        self._busy_poll_s = busy_poll_s
        self._spin_s = 0.0  # this window's polling budget
        self.backoff = PollBackoff()
        self._next_id = 1
        # Answer headers and messages: bytes [_start, _end) received and not yet parsed.
        self._control = bytearray(_CONTROL_BYTES)
        self._control_view = memoryview(self._control)
        self._start = 0
        self._end = 0

    @property
    def closed(self) -> bool:
        return self.sock is None

    def close(self) -> None:
        """Close the socket (idempotent)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def shutdown(self) -> None:
        """Wake and fail the call using this connection (the caller then closes it)."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def stale(self) -> bool:
        """True when an idle connection is unusable: the server closed it, or sent something
        that answers nothing."""
        if self.sock is None:
            return True
        self._watch(select.POLLIN)
        return bool(self._poller.poll(0))

    # -- one peer's share of a batch ----------------------------------------------------------

    def exchange(self, op: Op, requests: Sequence[_Request], window: int,
                 timeout_s: float) -> list[Status]:
        """Send the requests and read their answers; return one status per request. A
        failure of the connection closes it and fails every request not yet answered."""
        statuses: list[Status] = []
        try:
            for first in range(0, len(requests), window):
                part = requests if len(requests) <= window else requests[first:first + window]
                deadline = time.monotonic() + timeout_s
                first_id = self._send(op, part, deadline)
                self._receive(op, part, first_id, deadline, statuses)
        except BaseException as exc:
            self.close()
            status = _failure_status(exc)
            statuses.extend([status] * (len(requests) - len(statuses)))
            if not isinstance(exc, Exception):
                raise
        return statuses

    def _send(self, op: Op, part: Sequence[_Request], deadline: float) -> int:
        """Send the requests' frames (and a WRITE's payload); return the first request id."""
        sock = self.sock
        if sock is None:
            raise KVPoolError(Status.TRANSFER_FAILED, "data connection is closed")
        first_id = request_id = self._next_id
        views: list[bytes | memoryview] = []
        write = op == Op.WRITE
        for request in part:
            placement = request.placement
            views.append(encode_request(op, request_id, placement.segment_id, request.offset,
                                        request.length, placement.offset, placement.length,
                                        placement.capability_expiry_ms, placement.capability,
                                        placement.put_id))
            if write:
                views.extend(request.regions)
            request_id += 1
        self._next_id = request_id
        index = 0
        while index < len(views):
            try:
                sent = sock.sendmsg(views if index == 0 and len(views) <= _IOV_MAX
                                    else views[index:index + _IOV_MAX])
            except BlockingIOError:  # the server is not reading yet: wait for room, bounded
                self._wait(select.POLLOUT, deadline)
                continue
            while index < len(views):
                size = len(views[index])
                if sent < size:
                    if sent:
                        views[index] = memoryview(views[index])[sent:]
                    break
                sent -= size
                index += 1
        return first_id

    def _receive(self, op: Op, part: Sequence[_Request], first_id: int, deadline: float,
                 statuses: list[Status]) -> None:
        """Read the answers to ``part``, in order, appending their statuses."""
        self._spin_s = self._busy_poll_s if self._busy_poll_s and self.backoff.take() else 0.0
        header_size = RESPONSE.size
        read = op == Op.READ
        count = len(part)
        for k, request in enumerate(part):
            later = count - k - 1  # answers after this one
            # A WRITE's answers are all headers (and messages): read ahead through them. After
            # a READ's header comes its payload, which must land in the caller's regions.
            header = self._take(header_size, header_size * (1 if read else later + 1), deadline)
            status, msg_len, connection_error = parse_response(
                header, first_id + k, op, request.length)
            payload = request.regions if read and status == Status.OK else None
            message = b""
            if msg_len:
                follows = 0 if payload is not None or connection_error else \
                    header_size * (min(later, 1) if read else later)
                message = bytes(self._take(msg_len, msg_len + follows, deadline))
            if connection_error:
                raise refusal(status, message)
            if payload is not None:
                self._fill(payload, later > 0, deadline)
            statuses.append(status)

    # -- receiving -------------------------------------------------------------------------------

    def _take(self, need: int, allowance: int, deadline: float) -> memoryview:
        """The next ``need`` header or message bytes. Receives as needed, up to ``allowance``
        bytes in all, all known to be headers or messages."""
        if self._end - self._start < need:
            if self._start:
                left = self._end - self._start
                self._control[:left] = self._control[self._start:self._end]
                self._start, self._end = 0, left
            limit = min(len(self._control), max(allowance, need))
            while self._end < need:
                self._end += self._recv([self._control_view[self._end:limit]], deadline)
        view = self._control_view[self._start:self._start + need]
        self._start += need
        return view

    def _fill(self, regions: list[memoryview], header_next: bool, deadline: float) -> None:
        """Receive a READ's payload into ``regions`` (whole); with ``header_next``, bytes of the
        next answer's header that arrive with it go to the control buffer."""
        if not header_next and len(regions) == 1:  # the common case, in plain recv_into calls
            view = regions[0]
            while view.nbytes:
                view = view[self._recv([view], deadline):]
            return
        if self._start == self._end:
            self._start = self._end = 0
        header_room = self._control_view[self._end:self._end + RESPONSE.size]
        views = list(regions)
        index = 0
        while index < len(views):
            target = views[index:index + _IOV_MAX - 1] if index or len(views) >= _IOV_MAX \
                else views
            if header_next and index + len(target) == len(views):
                target = [*target, header_room]
            received = self._recv(target, deadline)
            while received and index < len(views):
                size = views[index].nbytes
                if received < size:
                    views[index] = views[index][received:]
                    received = 0
                    break
                received -= size
                index += 1
            self._end += received  # what went past the payload, into header_room

    def _recv(self, views: list[memoryview], deadline: float) -> int:
        """Receive what has arrived into ``views``, in order (at least one byte): polling first
        within this window's budget, then sleeping in poll(2)."""
        sock = self.sock
        if sock is None:
            raise KVPoolError(Status.TRANSFER_FAILED, "data connection is closed")
        spin_until = 0.0
        while True:
            try:
                received = sock.recv_into(views[0]) if len(views) == 1 \
                    else sock.recvmsg_into(views)[0]
            except BlockingIOError:
                now = time.monotonic()
                if self._spin_s:
                    if not spin_until:
                        spin_until = now + self._spin_s
                    if now < spin_until and now < deadline:
                        os.sched_yield()
                        continue
                    self._spin_s = 0.0  # the budget ran out: sleep at once on the next calls
                    self.backoff.ran_out()
                self._wait(select.POLLIN, deadline)
                continue
            if received == 0:
                raise ConnectionError("closed by the data server")
            if self._spin_s:
                self.backoff.paid()
            return received

    def _wait(self, events: int, deadline: float) -> None:
        """Sleep until the socket is ready for ``events``, failed, or the deadline came (the
        next wait then raises TimeoutError)."""
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError
        self._watch(events)
        self._poller.poll(max(1, math.ceil(remaining_s * 1000)))

    def _watch(self, events: int) -> None:
        if events != self._events and self.sock is not None:
            self._poller.modify(self.sock, events)
            self._events = events


def _failure_status(exc: BaseException) -> Status:
    """The status of the requests left unanswered by a failed connection."""
    if isinstance(exc, KVPoolError):
        return exc.status
    if isinstance(exc, TimeoutError):
        return Status.TIMEOUT
    return Status.TRANSFER_FAILED


class BlockingTcpTransport:
    """Blocking batches to segments on other hosts (see the module docstring)."""

    def __init__(self, *, timeout_s: float = 10.0, connections_per_peer: int = 4,
                 max_inflight_per_connection: int = 64, chunk_bytes: int = 4 << 20,
                 busy_poll_us: int = 500) -> None:
        if timeout_s <= 0 or connections_per_peer < 1 or max_inflight_per_connection < 1 \
                or chunk_bytes < 1 or busy_poll_us < 0:
            raise ValueError("timeout_s, connections_per_peer, max_inflight_per_connection and "
                             "chunk_bytes must be positive, busy_poll_us at least 0")
        self.timeout_s = timeout_s
        self.connections_per_peer = connections_per_peer
        self.max_inflight_per_connection = max_inflight_per_connection
        self.chunk_bytes = chunk_bytes
        self.busy_poll_s = busy_poll_us / 1e6
        self.closed = False
        self._lock = threading.Lock()
        self._endpoint_to_address: dict[str, tuple[str, int]] = {}
        self._endpoint_to_idle: dict[str, list[_Connection]] = {}
        self._in_use: set[_Connection] = set()

    def write_batch(self, items: Sequence[Item]) -> list[Status]:
        """Write every item; one Status per item (never raises for a bad item)."""
        return self._batch(Op.WRITE, items)

    def read_batch(self, items: Sequence[Item]) -> list[Status]:
        """Read every item; one Status per item (never raises for a bad item)."""
        return self._batch(Op.READ, items)

    def close(self) -> None:
        """Close every connection; calls in progress fail promptly, later ones with
        UNAVAILABLE (idempotent)."""
        with self._lock:
            self.closed = True
            idle = [c for conns in self._endpoint_to_idle.values() for c in conns]
            self._endpoint_to_idle.clear()
            in_use = list(self._in_use)
        for connection in idle:
            connection.close()
        for connection in in_use:
            connection.shutdown()  # its caller closes it

    def forget(self, endpoint: str) -> None:
        """Close the idle connections to ``endpoint`` (a peer that went away or restarted)."""
        with self._lock:
            idle = self._endpoint_to_idle.pop(endpoint, [])
            self._endpoint_to_address.pop(endpoint, None)
        for connection in idle:
            connection.close()

    @property
    def num_connections(self) -> int:
        """Open connections, idle or in use, over all peers."""
        with self._lock:
            return len(self._in_use) + sum(len(c) for c in self._endpoint_to_idle.values())

    def _batch(self, op: Op, items: Sequence[Item]) -> list[Status]:
        if self.closed:
            return [Status.UNAVAILABLE] * len(items)
        outcomes: list[Status | None] = [None] * len(items)
        endpoint_to_requests: dict[str, list[_Request]] = {}
        read = op == Op.READ
        for index, (segment, placement, regions) in enumerate(items):
            try:
                views = byte_views(regions, writable=read)
                check_item(segment, placement, views)
                endpoint = segment.tcp_endpoint
                if endpoint not in self._endpoint_to_address:
                    if not endpoint:
                        raise KVPoolError(Status.INVALID_ARGUMENT,
                                          f"segment {segment.segment_id!r} has no tcp endpoint")
                    self._endpoint_to_address[endpoint] = parse_endpoint(endpoint)
            except KVPoolError as exc:
                outcomes[index] = exc.status
                continue
            requests = endpoint_to_requests.setdefault(endpoint, [])
            if placement.length <= self.chunk_bytes:
                requests.append(_Request(index, placement, placement.offset, placement.length,
                                         views))
                continue
            for offset, length, part in chunks(placement, views, self.chunk_bytes):
                requests.append(_Request(index, placement, offset, length, part))
        for endpoint, requests in endpoint_to_requests.items():
            for request, status in zip(requests, self._exchange(endpoint, op, requests),
                                       strict=True):
                if status != Status.OK and outcomes[request.item] is None:
                    outcomes[request.item] = status
        return [Status.OK if outcome is None else outcome for outcome in outcomes]

    def _exchange(self, endpoint: str, op: Op, requests: list[_Request]) -> list[Status]:
        """Run one peer's requests on a connection of the pool; one status per request."""
        try:
            connection = self._checkout(endpoint)
        except KVPoolError as exc:
            return [exc.status] * len(requests)
        try:
            return connection.exchange(op, requests, self.max_inflight_per_connection,
                                       self.timeout_s)
        finally:
            self._checkin(endpoint, connection)

    def _checkout(self, endpoint: str) -> _Connection:
        """An idle connection to ``endpoint``, or a new one. Raises KVPoolError UNAVAILABLE
        (closed), TIMEOUT, TRANSFER_FAILED (cannot connect)."""
        while True:
            with self._lock:
                if self.closed:
                    raise KVPoolError(Status.UNAVAILABLE, "tcp transport is closed")
                idle = self._endpoint_to_idle.get(endpoint)
                connection = idle.pop() if idle else None
                if connection is not None:
                    self._in_use.add(connection)
            if connection is None:
                break
            if not connection.stale():
                return connection
            connection.close()
            with self._lock:
                self._in_use.discard(connection)
        # (forget() may have dropped the parsed address since the batch checked it)
        address = self._endpoint_to_address.get(endpoint) or parse_endpoint(endpoint)
        try:
            sock = socket.create_connection(address, timeout=self.timeout_s)
        except TimeoutError:
            raise KVPoolError(Status.TIMEOUT, f"connecting to {endpoint} timed out") from None
        except OSError as exc:
            raise KVPoolError(Status.TRANSFER_FAILED,
                              f"cannot connect to {endpoint}: {exc}") from None
        connection = _Connection(sock, self.busy_poll_s)
        with self._lock:
            if not self.closed:
                self._in_use.add(connection)
                return connection
        connection.close()
        raise KVPoolError(Status.UNAVAILABLE, "tcp transport is closed")

    def _checkin(self, endpoint: str, connection: _Connection) -> None:
        """Return a connection to the pool (closing it when it failed, the pool is full or the
        transport closed)."""
        with self._lock:
            self._in_use.discard(connection)
            keep = not connection.closed and not self.closed
            if keep:
                idle = self._endpoint_to_idle.setdefault(endpoint, [])
                keep = len(idle) < self.connections_per_peer
                if keep:
                    idle.append(connection)
        if not keep:
            connection.close()
