"""TCP transport: reach a segment on another host through its owner's data server.

Rules of this file (the wire format is in ``tcp_frames.py``):
- Per peer (``host:port``) up to ``connections_per_peer`` connections, opened on demand; each
  carries up to ``max_inflight_per_connection`` pipelined requests. A placement larger than
  ``chunk_bytes`` is sent as several requests (sub-ranges under the same capability) spread
  over the connections.
- No intermediate copy: a request's header and payload go to the event loop's transport in one
  ``writelines`` of views of the caller's regions (uvloop sends them with ``writev`` and keeps
  references to what it could not send yet, it never copies them; CPython 3.11's own loop would
  join them into one bytes object, so kvpool runs on uvloop), and an answer's payload is
  received straight into the caller's regions (``BufferedProtocol.get_buffer``).
- Every request has a deadline (``timeout_s`` from when it is sent, or from when it starts
  waiting for a connection). When it passes, the request fails with TIMEOUT and its connection
  is aborted, since the stream position is lost; the other requests of that connection fail
  with TRANSFER_FAILED (both retryable). Other connections and peers are not affected.
- Answers are validated (magic, version, request id, lengths); a malformed answer aborts the
  connection with TRANSFER_FAILED. A transfer cancelled by its caller aborts the connections it
  used, so that no byte is written into the caller's buffers afterwards.
- One instance belongs to one event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from kvpool_client.transfer.base import Item, Regions, byte_views, check_item, status_of
from kvpool_client.transfer.tcp_frames import (
    RESPONSE,
    chunks,
    encode_request,
    parse_endpoint,
    parse_response,
    refusal,
)
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement, SegmentInfo


class _Request:
    __slots__ = ("future", "length", "op", "regions", "request_id", "timer")

    def __init__(self, op: Op, request_id: int, length: int, regions: list[memoryview],
                 future: asyncio.Future[None]) -> None:
        self.op = op
        self.request_id = request_id
        self.length = length
        self.regions = regions  # payload source (WRITE) or destination (READ)
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class _Connection(asyncio.BufferedProtocol):
    """One pipelined connection to a data server; answers arrive in request order."""

    def __init__(self, peer: _Peer) -> None:
        self._peer = peer
        self._transport: asyncio.Transport | None = None
        self.pending: collections.deque[_Request] = collections.deque()
        self.closed = False
        self.close_reason: KVPoolError | None = None
        self._next_request_id = 1
        self._header = bytearray(RESPONSE.size)
        self._buffer = memoryview(self._header)  # what get_buffer fills now
        self._filled = 0
        self._stage = "header"  # header | message | payload
        self._status = Status.OK
        self._connection_error = False
        self._message = bytearray()
        self._region_index = 0

    # -- sending ---------------------------------------------------------------------------

    def send(self, op: Op, segment_id: str, offset: int, length: int, placement: Placement,
             regions: list[memoryview], timeout_s: float) -> asyncio.Future[None]:
        """Queue one request; return the future of its answer (set by this connection)."""
        if self._transport is None or self.closed:
            raise KVPoolError(Status.TRANSFER_FAILED, "data connection is closed")
        loop = asyncio.get_running_loop()
        request = _Request(op, self._next_request_id, length, regions, loop.create_future())
        self._next_request_id += 1
        self.pending.append(request)
        request.timer = loop.call_later(timeout_s, self._expire, request)
        header = encode_request(op, request.request_id, segment_id, offset, length,
                                placement.offset, placement.length,
                                placement.capability_expiry_ms, placement.capability,
                                placement.put_id)
        # One writelines: uvloop sends header and payload views in one writev, without copying.
        self._transport.writelines([header, *regions] if op == Op.WRITE else [header])
        return request.future

    def abort(self, error: KVPoolError) -> None:
        """Drop the connection now and fail everything pending on it."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = error
        if self._transport is not None:
            self._transport.abort()  # releases the caller's views it held; nothing more moves
        while self.pending:
            self._finish(self.pending.popleft(), error)
        self._peer.connection_closed(self)

    def _expire(self, request: _Request) -> None:
        if request.future.done():
            return
        self._finish(request, KVPoolError(Status.TIMEOUT, "data server did not answer in time"))
        self.abort(KVPoolError(Status.TRANSFER_FAILED,
                               "connection aborted: an earlier request on it timed out"))

    def _finish(self, request: _Request, error: KVPoolError | None) -> None:
        if request.timer is not None:
            request.timer.cancel()
        if not request.future.done():
            if error is None:
                request.future.set_result(None)
            else:
                request.future.set_exception(error)
        self._peer.slot_freed()

    # -- receiving ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.abort(KVPoolError(Status.TRANSFER_FAILED, f"data connection lost: {exc or 'EOF'}"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < self._buffer.nbytes:
            return
        try:
            self._advance()
        except KVPoolError as exc:
            self.abort(exc)

    def eof_received(self) -> bool:
        return False  # close; connection_lost fails what is pending

    def _advance(self) -> None:
        """The current buffer is full: move to the next stage."""
        request = self.pending[0] if self.pending else None
        if self._stage == "header":
            if request is None:
                status, msg_len, connection_error = parse_response(self._header, 0, Op.READ, 0)
            else:
                status, msg_len, connection_error = parse_response(
                    self._header, request.request_id, request.op, request.length)
            self._status = status
            self._connection_error = connection_error
            if msg_len:
                self._message = bytearray(msg_len)
                self._start("message", memoryview(self._message))
                return
            self._message = bytearray()
        elif self._stage == "payload":
            assert request is not None
            self._region_index += 1
            if self._region_index < len(request.regions):
                self._start("payload", request.regions[self._region_index])
                return
            self._complete(request)
            return
        # header or message done
        if self._connection_error:
            raise refusal(self._status, self._message)
        assert request is not None
        if self._status == Status.OK and request.op == Op.READ:
            self._region_index = 0
            self._start("payload", request.regions[0])
        else:
            self._complete(request)

    def _start(self, stage: str, buffer: memoryview) -> None:
        self._stage = stage
        self._buffer = buffer
        self._filled = 0

    def _complete(self, request: _Request) -> None:
        self.pending.popleft()
        error = None if self._status == Status.OK else refusal(self._status, self._message)
        self._finish(request, error)
        self._start("header", memoryview(self._header))


class _Peer:
    """The connections to one data server."""

    def __init__(self, owner: TcpTransport, host: str, port: int) -> None:
        self._owner = owner
        self.host = host
        self.port = port
        self.connections: list[_Connection] = []
        self._connecting = 0
        self._slot_freed = asyncio.Event()

    def connection_closed(self, connection: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self.connections.remove(connection)
        self.slot_freed()

    def slot_freed(self) -> None:
        self._slot_freed.set()

    async def connection(self, timeout_s: float) -> _Connection:
        """Return a connection with room for one more request (opening one if allowed)."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        owner = self._owner
        while True:
            best = min(self.connections, key=lambda c: len(c.pending), default=None)
            can_open = len(self.connections) + self._connecting < owner.connections_per_peer
            if best is not None and (not best.pending or not can_open) and \
                    len(best.pending) < owner.max_inflight_per_connection:
                return best
            remaining_s = deadline_s - loop.time()
            if remaining_s <= 0:
                raise KVPoolError(Status.TIMEOUT, f"no free connection to {self.host}:{self.port}")
            if can_open:
                return await self._open(remaining_s)
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), remaining_s)

    async def _open(self, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port),
                timeout_s)
        except TimeoutError:
            raise KVPoolError(Status.TIMEOUT,
                              f"connecting to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise KVPoolError(Status.TRANSFER_FAILED,
                              f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        finally:
            self._connecting -= 1
            self.slot_freed()  # waiters re-check: a connection opened, or one may be tried
        if self._owner.closed:
            connection.abort(KVPoolError(Status.UNAVAILABLE, "tcp transport is closed"))
            raise KVPoolError(Status.UNAVAILABLE, "tcp transport is closed")
        if connection.closed:  # e.g. the server answered "too many connections" at once
            raise connection.close_reason or KVPoolError(
                Status.TRANSFER_FAILED, f"{self.host}:{self.port} closed the connection at once")
        self.connections.append(connection)
        return connection


async def _wait_all(used: list[_Connection], futures: list[asyncio.Future[None]],
                    ) -> list[KVPoolError | None]:
    """Wait for every request (each is bounded by its deadline); return their errors.

    If the caller is cancelled meanwhile, the connections of unfinished requests are aborted,
    so that no byte moves into or out of the caller's regions after it regains control.
    """
    try:
        if futures:
            await asyncio.wait(futures)
    except asyncio.CancelledError:
        _abort_unfinished(used, futures)
        raise
    errors: list[KVPoolError | None] = []
    for future in futures:
        exc = future.exception()
        errors.append(exc if isinstance(exc, KVPoolError) or exc is None else
                      KVPoolError(Status.TRANSFER_FAILED, str(exc)))
    return errors


def _abort_unfinished(used: list[_Connection], futures: list[asyncio.Future[None]]) -> None:
    """Abort the connections of unfinished requests (the caller gives up on them)."""
    for connection, future in zip(used, futures, strict=True):
        if not future.done():
            connection.abort(KVPoolError(Status.TRANSFER_FAILED, "transfer cancelled"))
    for future in futures:
        future.exception()  # retrieved: no "exception never retrieved" warning


class TcpTransport:
    """Transport to segments on other hosts (see the module docstring)."""

    def __init__(self, *, timeout_s: float = 10.0, connections_per_peer: int = 4,
                 max_inflight_per_connection: int = 8, chunk_bytes: int = 4 << 20) -> None:
        if timeout_s <= 0 or connections_per_peer < 1 or max_inflight_per_connection < 1 \
                or chunk_bytes < 1:
            raise ValueError("timeout_s, connections_per_peer, max_inflight_per_connection and "
                             "chunk_bytes must be positive")
        self.timeout_s = timeout_s
        self.connections_per_peer = connections_per_peer
        self.max_inflight_per_connection = max_inflight_per_connection
        self.chunk_bytes = chunk_bytes
        self.closed = False
        self._endpoint_to_peer: dict[str, _Peer] = {}

    async def write(self, segment: SegmentInfo, placement: Placement, src: Regions) -> None:
        """Send ``src`` to the placement. Raises KVPoolError INVALID_ARGUMENT (bad regions or
        placement, no tcp endpoint), PERMISSION_DENIED / SEGMENT_NOT_FOUND (refused by the
        server), TIMEOUT, TRANSFER_FAILED, UNAVAILABLE (closed)."""
        await self._transfer(Op.WRITE, segment, placement, byte_views(src, writable=False))

    async def read(self, segment: SegmentInfo, placement: Placement, dst: Regions) -> None:
        """Receive the placement into ``dst``. Raises KVPoolError like write()."""
        await self._transfer(Op.READ, segment, placement, byte_views(dst, writable=True))

    async def write_batch(self, items: Sequence[Item]) -> list[Status]:
        """Write every item concurrently; one Status per item."""
        return await self._batch(self.write, items)

    async def read_batch(self, items: Sequence[Item]) -> list[Status]:
        """Read every item concurrently; one Status per item."""
        return await self._batch(self.read, items)

    async def close(self) -> None:
        """Abort every connection; pending transfers fail with UNAVAILABLE (idempotent)."""
        self.closed = True
        for peer in list(self._endpoint_to_peer.values()):
            for connection in list(peer.connections):
                connection.abort(KVPoolError(Status.UNAVAILABLE, "tcp transport is closed"))
        self._endpoint_to_peer.clear()

    @property
    def num_connections(self) -> int:
        """Open connections over all peers."""
        return sum(len(peer.connections) for peer in self._endpoint_to_peer.values())

    async def _batch(self, transfer: Callable[[SegmentInfo, Placement, Regions],
                                              Awaitable[None]],
                     items: Sequence[Item]) -> list[Status]:
        outcomes = await asyncio.gather(*(transfer(*item) for item in items),
                                        return_exceptions=True)
        return [status_of(outcome) for outcome in outcomes]

    async def _transfer(self, op: Op, segment: SegmentInfo, placement: Placement,
                        views: list[memoryview]) -> None:
        if self.closed:
            raise KVPoolError(Status.UNAVAILABLE, "tcp transport is closed")
        check_item(segment, placement, views)
        peer = self._peer(segment)
        used: list[_Connection] = []
        futures: list[asyncio.Future[None]] = []
        first_error: KVPoolError | None = None
        try:
            for offset, length, regions in chunks(placement, views, self.chunk_bytes):
                connection = await peer.connection(self.timeout_s)
                futures.append(connection.send(op, segment.segment_id, offset, length,
                                               placement, regions, self.timeout_s))
                used.append(connection)
        except KVPoolError as exc:
            first_error = exc  # the chunks already sent still finish (or time out) below
        except BaseException:  # cancelled while sending
            _abort_unfinished(used, futures)
            raise
        errors = await _wait_all(used, futures)
        first_error = first_error or next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error

    def _peer(self, segment: SegmentInfo) -> _Peer:
        endpoint = segment.tcp_endpoint
        peer = self._endpoint_to_peer.get(endpoint)
        if peer is None:
            if not endpoint:
                raise KVPoolError(Status.INVALID_ARGUMENT,
                                  f"segment {segment.segment_id!r} has no tcp endpoint")
            host, port = parse_endpoint(endpoint)
            peer = self._endpoint_to_peer[endpoint] = _Peer(self, host, port)
        return peer
