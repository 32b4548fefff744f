"""The lean framing server: the Master service over plain (or TLS) TCP, beside gRPC.

Why it exists: on this machine a Python grpc.aio unary call costs about 670 µs end to end while
a raw uvloop TCP round trip costs about 44 µs, and the master's work per small call is a few
microseconds. The lean port serves the very same protobuf messages through the very same
``Servicer.serve`` path, so it is a second thin adapter, not a second implementation.

Framing (see ``Method`` in proto/kvpool.proto): ``u32 LE length | u8 method | u32 LE request id
| protobuf bytes``; the answer echoes method and request id. Frames on one connection are served
in order, synchronously, as soon as they are complete. A frame that cannot be served is
answered with method 255 whose payload is ``"STATUS_NAME: reason"``, and the connection is
closed. With a token configured, the first frame must be ``METHOD_AUTH``. After serving, the
server lingers on its connections for a moment instead of sleeping (``busypoll``).

Rules of this file (bounded work before authentication):
- Until a connection has authenticated (with a token configured) its frames may be at most
  ``PRE_AUTH_MAX_FRAME_BYTES`` long: a longer length field closes it before any byte of the
  frame is buffered, and only the first frame is parsed before the token is checked. Once
  authenticated, or from the start when no token is configured (every caller is then trusted),
  frames may be ``max_frame_bytes`` long.
- A connection must complete its first frame (``METHOD_AUTH`` when a token is configured)
  within ``auth_timeout_s``; otherwise it is closed. Until then it is "greeting": when all
  ``max_connections`` slots are taken, the oldest greeting connection is closed to make room,
  so sockets that never authenticate cannot keep anyone out.
- At most ``max_connections_per_peer`` connections per peer IP address (the abstract Unix
  socket, reachable only from the master's network namespace, is not capped per peer).
- TCP keepalive on every TCP connection closes half-open ones (peer host gone) after about
  ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL_S`` seconds of silence.
  Authenticated connections are not closed for idling: clients keep one open for their life.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import ssl
from collections.abc import Callable
from typing import cast

from kvpool_master.rpc.busypoll import BusyPoller
from kvpool_master.rpc.servicer import BadRequest, InternalError, Pending, Servicer, Stepped
from kvpool_wire import convert
from kvpool_wire.framing import (
    FRAME_HEADER,
    FRAME_OVERHEAD_BYTES,
    FrameDecoder,
    FrameError,
    encode_frame,
)
from kvpool_wire.methods import METHOD_AUTH, METHOD_ERROR, METHODS_BY_ID
from kvpool_wire.status import Status

log = logging.getLogger("kvpool.master.lean")

TRANSPORT = "lean"
_WRITE_HIGH_WATER_BYTES = 4 * 2**20
#: Longest frame accepted before authentication: an AuthRequest with a token of up to about
#: 4 KiB (a longer configured token raises the bound to fit it).
PRE_AUTH_MAX_FRAME_BYTES = 4096
KEEPALIVE_IDLE_S = 60
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_COUNT = 3


class LeanServer:
    """Accepts lean-framing connections and serves them with a Servicer."""

    def __init__(self, servicer: Servicer, *, max_connections: int, max_frame_bytes: int,
                 frame_timeout_s: float = 30.0, auth_token: str = "",
                 max_connections_per_peer: int = 256, auth_timeout_s: float = 5.0,
                 ssl_context: ssl.SSLContext | None = None,
                 on_refusal: Callable[[str, str], None] = lambda transport, reason: None,
                 busy_poll_us: int = 0) -> None:
        self._servicer = servicer
        self._max_connections = max_connections
        self._max_frame_bytes = max_frame_bytes
        # A peer that sends half a frame and stops must not pin a buffer forever.
        self._frame_timeout_s = frame_timeout_s
        self._auth_token = auth_token.encode()
        self._max_connections_per_peer = max_connections_per_peer
        self._auth_timeout_s = auth_timeout_s
        # An AuthRequest is the token plus a few bytes of protobuf framing.
        self._pre_auth_frame_bytes = (max(PRE_AUTH_MAX_FRAME_BYTES, len(self._auth_token) + 64)
                                      if self._auth_token else max_frame_bytes)
        self._ssl_context = ssl_context
        self._on_refusal = on_refusal
        self._method_by_id = METHODS_BY_ID
        self._server: asyncio.Server | None = None
        self._local_server: asyncio.AbstractServer | None = None
        self.connections: set[_LeanProtocol] = set()
        self._peer_to_count: dict[str, int] = {}
        # Connections that have not completed their first frame, oldest first.
        self._greeting: dict[_LeanProtocol, None] = {}
        self.poller = BusyPoller(busy_poll_us)

    async def start(self, host: str, port: int) -> int:
        """Listen; return the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _LeanProtocol(self), host, port,
                                                ssl=self._ssl_context, reuse_address=True,
                                                backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    async def start_local(self) -> str:
        """Also listen on an abstract Unix socket (Linux) with a random name; return the name.

        Why: a round trip over a Unix socket costs a third to half less than over loopback TCP
        here, and clients on the master's host make every call on it. The name is random and
        only reachable from the master's network namespace; clients also check the peer's pid
        (the client connects to it). Raises OSError where abstract sockets do not exist.
        """
        name = f"kvpool-master-{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
            sock.listen(1024)
            sock.setblocking(False)
            self._local_server = await asyncio.get_running_loop().create_unix_server(
                lambda: _LeanProtocol(self), sock=sock)
        except BaseException:
            sock.close()
            raise
        return name

    async def close(self) -> None:
        """Stop accepting; close every connection after its queued answers are written."""
        servers = [s for s in (self._server, self._local_server) if s is not None]
        for server in servers:
            server.close()
        for conn in list(self.connections):
            conn.close()
        for server in servers:
            await server.wait_closed()
        self.poller.close()

    def _admit(self, conn: _LeanProtocol) -> str:
        """Take a slot for ``conn``; return "" or the refusal reason. At a cap, the oldest
        greeting connection (of the same peer for the per-peer cap) is closed to make room."""
        peer = conn.peer
        if (peer and self._peer_to_count.get(peer, 0) >= self._max_connections_per_peer
                and not self._evict_greeting(peer)):
            return "max_connections_per_peer"
        if len(self.connections) >= self._max_connections and not self._evict_greeting(""):
            return "max_connections"
        self.connections.add(conn)
        self._greeting[conn] = None
        if peer:
            self._peer_to_count[peer] = self._peer_to_count.get(peer, 0) + 1
        return ""

    def _evict_greeting(self, peer: str) -> bool:
        victim = next((c for c in self._greeting if not peer or c.peer == peer), None)
        if victim is None:
            return False
        self._on_refusal(TRANSPORT, "evicted_unauthenticated")
        victim.refuse(0, 0, Status.RESOURCE_EXHAUSTED,
                      "closed to make room: no request (or authentication) yet")
        return True

    def _greeted(self, conn: _LeanProtocol) -> None:
        self._greeting.pop(conn, None)

    def _release(self, conn: _LeanProtocol) -> None:
        """Give back the slot of ``conn`` (idempotent)."""
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        self._greeting.pop(conn, None)
        if conn.peer:
            left = self._peer_to_count[conn.peer] - 1
            if left:
                self._peer_to_count[conn.peer] = left
            else:
                del self._peer_to_count[conn.peer]


class _LeanProtocol(asyncio.Protocol):
    def __init__(self, server: LeanServer) -> None:
        self._server = server
        self._decoder = FrameDecoder(server._pre_auth_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._authenticated = not server._auth_token
        self._greeted = False  # first frame (AUTH with a token) served
        self._closing = False
        self._partial_timer: asyncio.TimerHandle | None = None
        self._greeting_timer: asyncio.TimerHandle | None = None
        self._fd = -1
        self.peer = ""  # the peer's IP address; "" on the local Unix socket
        self._later: set[asyncio.Task[None]] = set()  # answers that come later (Pending)
        # frames that came behind a call served in steps (Stepped): served once it answered
        self._held: list[tuple[int, int, bytes]] | None = None
        self._writing_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            self.peer = str(peername[0])
        server = self._server
        refusal = server._admit(self)
        if refusal:
            server._on_refusal(TRANSPORT, refusal)
            limit = (f"max_connections_per_peer {server._max_connections_per_peer}"
                     if refusal == "max_connections_per_peer"
                     else f"max_connections {server._max_connections}")
            self.refuse(0, 0, Status.RESOURCE_EXHAUSTED, f"too many connections ({limit})")
            return
        self._transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER_BYTES)
        self._greeting_timer = asyncio.get_running_loop().call_later(
            server._auth_timeout_s, self._greeting_expired)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._fd = sock.fileno()
            server.poller.watch(self._fd, self)
            if self.peer:
                _keepalive(sock)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._release(self)
        self._server.poller.forget(self._fd, self)
        self._closing = True
        for timer in (self._partial_timer, self._greeting_timer):
            if timer is not None:
                timer.cancel()
        for task in list(self._later):  # nobody to answer: a waiting CopyTasks hands nothing
            task.cancel()

    def pause_writing(self) -> None:
        # The peer is not reading its answers: stop reading its requests until it does.
        self._writing_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._transport is not None and not self._closing and self._held is None:
            self._transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        served = False
        try:
            if not self._greeted:
                # Only the first frame is parsed before it is served: with a token, the rest
                # is read under the larger bound only once the token was checked.
                first = self._decoder.feed(data, 1)
                if not first:
                    self._watch_partial_frame()
                    return
                self._serve_frame(*first[0])
                if self._closing:
                    return
                served = True
                data = b""
            frames = self._decoder.feed(data)
        except FrameError as exc:
            self.refuse(0, 0, Status.INVALID_ARGUMENT, str(exc))
            return
        self._serve_in_order(frames)
        if frames or served:
            self._server.poller.served()
        self._watch_partial_frame()

    def _serve_in_order(self, frames: list[tuple[int, int, bytes]]) -> None:
        """Serve ``frames`` in order; those behind a call served in steps wait for it."""
        for index, frame in enumerate(frames):
            if self._closing:
                return
            if self._held is not None:
                self._held.extend(frames[index:])
                return
            self._serve_frame(*frame)

    def _watch_partial_frame(self) -> None:
        if self._decoder.pending_bytes:
            if self._partial_timer is None:
                self._partial_timer = asyncio.get_running_loop().call_later(
                    self._server._frame_timeout_s, self._partial_frame_expired)
        elif self._partial_timer is not None:
            self._partial_timer.cancel()
            self._partial_timer = None

    def _partial_frame_expired(self) -> None:
        self._partial_timer = None
        if self._held is not None:  # the master is not reading (a call in steps), not the peer
            self._watch_partial_frame()
            return
        if self._decoder.pending_bytes and not self._closing:
            self.refuse(0, 0, Status.TIMEOUT,
                        f"incomplete frame for {self._server._frame_timeout_s:g} s")

    def _greeting_expired(self) -> None:
        self._greeting_timer = None
        if self._greeted or self._closing:
            return
        self._server._on_refusal(TRANSPORT, "auth_timeout")
        what = "authentication (METHOD_AUTH)" if self._server._auth_token else "request"
        self.refuse(0, 0, Status.TIMEOUT,
                    f"no {what} within {self._server._auth_timeout_s:g} s of connecting")

    def _greet(self) -> None:
        """The first frame (the token, when one is required) was accepted."""
        self._greeted = True
        self._decoder.max_frame_bytes = self._server._max_frame_bytes
        self._server._greeted(self)
        if self._greeting_timer is not None:
            self._greeting_timer.cancel()
            self._greeting_timer = None

    def _serve_frame(self, method_id: int, request_id: int, payload: bytes) -> None:
        if not self._greeted and self._authenticated:
            self._greet()  # no token configured: any first frame
        if method_id == METHOD_AUTH:
            self._authenticate(request_id, payload)
            return
        if not self._authenticated:
            self._server._on_refusal(TRANSPORT, "no_token")
            self.refuse(method_id, request_id, Status.PERMISSION_DENIED,
                        "authenticate first: this master requires a token (METHOD_AUTH)")
            return
        method = self._server._method_by_id.get(method_id)
        if method is None:
            self.refuse(method_id, request_id, Status.INVALID_ARGUMENT,
                        f"unknown method {method_id}")
            return
        try:
            answer = self._server._servicer.serve(method, payload, TRANSPORT)
        except BadRequest as exc:
            self.refuse(method_id, request_id, Status.INVALID_ARGUMENT, str(exc))
            return
        except InternalError as exc:
            self.refuse(method_id, request_id, Status.INTERNAL_ERROR, str(exc))
            return
        if not isinstance(answer, bytes):  # answered later (a removal, a wait, steps)
            if isinstance(answer, Stepped):
                self._held = []  # this connection's later calls come after it
                if self._transport is not None:
                    self._transport.pause_reading()
            task = asyncio.get_running_loop().create_task(
                self._answer_later(method_id, request_id, answer))
            self._later.add(task)
            task.add_done_callback(self._later.discard)
            return
        self._write_answer(method_id, request_id, answer)
        self._server._servicer.finish()  # work that could wait for the answer to go out

    def _write_answer(self, method_id: int, request_id: int, answer: bytes) -> None:
        assert self._transport is not None
        self._transport.writelines(
            (FRAME_HEADER.pack(len(answer) + FRAME_OVERHEAD_BYTES, method_id, request_id),
             answer))

    async def _answer_later(self, method_id: int, request_id: int, pending: Pending) -> None:
        """Write the answer of a call that answers later once it is ready (others are
        answered meanwhile: the frame's request id pairs it with its call); after a call
        served in steps, serve the frames that came behind it."""
        try:
            answer = await pending.answer()
        except InternalError as exc:
            if not self._closing:
                self.refuse(method_id, request_id, Status.INTERNAL_ERROR, str(exc))
            return
        if self._transport is None or self._closing:
            return
        self._write_answer(method_id, request_id, answer)
        if isinstance(pending, Stepped):
            held, self._held = self._held or [], None
            self._serve_in_order(held)
            if held:
                self._server.poller.served()
            if self._held is None and not self._writing_paused and not self._closing:
                self._transport.resume_reading()

    def _authenticate(self, request_id: int, payload: bytes) -> None:
        assert self._transport is not None
        try:
            token = convert.decode_auth(payload).encode()
        except BadRequest as exc:
            self.refuse(METHOD_AUTH, request_id, Status.INVALID_ARGUMENT, str(exc))
            return
        expected = self._server._auth_token
        if not expected or hmac.compare_digest(token, expected):
            self._authenticated = True
            if not self._greeted:
                self._greet()
            self._transport.write(encode_frame(METHOD_AUTH, request_id,
                                               convert.encode_auth(Status.OK)))
            return
        self._server._on_refusal(TRANSPORT, "bad_token")
        self._transport.write(encode_frame(METHOD_AUTH, request_id,
                                           convert.encode_auth(Status.PERMISSION_DENIED)))
        self.close()

    def refuse(self, method_id: int, request_id: int, status: Status, reason: str) -> None:
        """Answer with an error frame naming the status and why, then close the connection."""
        log.debug("lean request refused (%s): %s", status.name, reason)
        if self._transport is not None:
            text = f"{status.name}: {reason}".encode()[:4096]
            self._transport.write(encode_frame(METHOD_ERROR, request_id, text))
        self.close()

    def close(self) -> None:
        """Close after the queued answers are written; the slot is free at once."""
        self._closing = True
        self._server._release(self)
        if self._transport is not None:
            self._transport.close()


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle TCP connection so that a vanished peer's is closed by the kernel."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
