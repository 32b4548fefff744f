"""Master stub: the only client code that touches protobuf. Deadlines, retries, two transports.

Rules of this file:
- Every call has a deadline (``timeout_s``, counted over all of its attempts) and never hangs.
  Transport failures become ``KVPoolError(RPC_FAILED)`` (``TIMEOUT`` when the deadline passed);
  idempotent calls are retried a bounded number of times inside the deadline.
- Two transports carry the same protobuf messages: gRPC (canonical; health checking, reflection,
  any language) and the lean framing on the master's ``fast_port`` (``u32 LE length | u8 method
  | u32 LE request id | protobuf bytes``), which costs a small fraction of a grpc.aio call in
  Python. Once a registration advertised the port, every call uses one persistent, pipelined lean
  connection; frames on it are served in order, which is what makes ``put_end_nowait`` safe.
- Identity: a ``MasterSession`` (shared by every stub of one client) holds the token the last
  registration returned, which every client-scoped call presents and a re-registration proves
  itself with, and the best known sample of the master's capability clock.
- One instance belongs to one event loop. While ``direct`` is set (by the sync client, only
  around code it runs synchronously on the thread that holds that loop), lean calls block the
  calling thread on a connection of their own instead (``lean_blocking``); a commit sent
  without waiting is never pending then (the sync client sets ``direct`` only without them).
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc

from kvpool_client._loopthread import wait_for
from kvpool_client.lean_blocking import BlockingLeanConnection
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.capability import MasterClock
from kvpool_wire.framing import FrameDecoder, FrameError, encode_frame, error_reason
from kvpool_wire.methods import (
    DEFAULT_MAX_MESSAGE_BYTES,
    METHOD_AUTH,
    METHOD_ERROR,
    RPC_METHODS,
    RpcMethod,
)
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import (
    ClientId,
    Placement,
    PutOptions,
    ReadResult,
    SegmentId,
    SegmentInfo,
    Tier,
)

# --- domain results ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Registration:
    """What the master told a client when it registered."""

    client_ttl_s: float
    capability_key: bytes
    master_id: str
    default_lease_ttl_s: float
    fast_port: int
    client_token: bytes = b""
    clock: MasterClock = MasterClock(0, 0, 0.0)


class MasterSession:
    """One client's standing with the master, shared by all of its stubs: the token of its
    latest registration and the best known sample of the master's capability clock (see
    ``kvpool_wire.capability``). Attributes are replaced whole, never mutated."""

    __slots__ = ("token", "clock")

    def __init__(self) -> None:
        self.token = b""
        self.clock = MasterClock(0, 0, 0.0)

    def learn_clock(self, sample: MasterClock) -> None:
        """Keep the tighter of the known clock and ``sample`` (``sample`` on a new epoch)."""
        self.clock = self.clock.tighter(sample)


class ClientIdTaken(KVPoolError):
    """RegisterClient answered CLIENT_ALREADY_EXISTS: another live client (or one restored
    from the master's state) holds the id; it expires within ``retry_after_s``."""

    def __init__(self, client_id: str, retry_after_s: float) -> None:
        super().__init__(Status.CLIENT_ALREADY_EXISTS,
                         f"client id {client_id!r} is held by a live client; it is free in at "
                         f"most {retry_after_s:.1f} s unless that client heartbeats")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Client-side TLS: CA to trust (system CAs when empty); cert+key for mutual TLS."""

    ca_path: str = ""
    cert_path: str = ""
    key_path: str = ""


_STATUS_BY_INT: dict[int, Status] = {int(s): s for s in Status}


def _statuses(values: Sequence[int]) -> list[Status]:
    get = _STATUS_BY_INT.get
    return [get(v, Status.INTERNAL_ERROR) for v in values]


def _status(value: int) -> Status:
    return _STATUS_BY_INT.get(value, Status.INTERNAL_ERROR)


def _placements(replicas: Any) -> tuple[Placement, ...]:
    placements = replicas.placements
    if len(placements) == 1:  # one replica: the common case, without a generator
        p = placements[0]
        return (Placement(p.segment_id, p.offset, p.length, p.capability_expiry_ms,
                          p.capability, p.put_id),)
    return tuple(Placement(p.segment_id, p.offset, p.length, p.capability_expiry_ms,
                           p.capability, p.put_id) for p in placements)


def _segment_info(d: Any) -> SegmentInfo:
    return SegmentInfo(SegmentId(d.segment_id), ClientId(d.client_id), d.size_bytes,
                       Tier(d.tier) if d.tier in Tier._value2member_map_ else Tier.DRAM,
                       d.host_id, d.shm_name, d.tcp_endpoint, d.engine_endpoint,
                       d.ownership_proof)


_GRPC_TO_STATUS = {
    grpc.StatusCode.UNAVAILABLE: Status.RPC_FAILED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Status.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: Status.PERMISSION_DENIED,
    grpc.StatusCode.PERMISSION_DENIED: Status.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    grpc.StatusCode.CANCELLED: Status.RPC_FAILED,
}
_RETRY_STATUSES = frozenset({Status.RPC_FAILED, Status.RESOURCE_EXHAUSTED})
_MAX_ATTEMPTS = 3
_LEAN_RETRY_AFTER_S = 1.0


class _NotSent(KVPoolError):
    """The request never left this process (connection refused): safe to retry any call."""


class _Expired(Exception):
    """A lean call's deadline passed before its answer came."""


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(_Expired())


# --- lean framing connection ---------------------------------------------------------------------

class _LeanConnection(asyncio.Protocol):
    """One pipelined lean-framing connection. ``send`` never awaits: frames sent before the
    connection is up are queued and flushed in order, so sends are ordered as they were made."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_frame_bytes: int) -> None:
        self._loop = loop
        self._decoder = FrameDecoder(max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._backlog: list[bytes] = []
        self._waiters: dict[int, asyncio.Future[bytes]] = {}
        self._next_id = 1
        self.closed = False
        self._failure: KVPoolError | None = None
        self._connect_task: asyncio.Task[None] | None = None
        self._lost: asyncio.Future[None] = loop.create_future()

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop, host: str, port: int,
             ssl_context: ssl.SSLContext | None, token: str, timeout_s: float,
             max_frame_bytes: int, local_sock: socket.socket | None = None) -> _LeanConnection:
        """Connect to ``host:port``, or adopt ``local_sock`` (a connected Unix socket)."""
        conn = cls(loop, max_frame_bytes)
        if token:
            conn._send_auth(token)
        # Held so the task is not garbage-collected while it connects.
        conn._connect_task = loop.create_task(
            conn._connect(host, port, ssl_context, timeout_s, local_sock))
        return conn

    async def _connect(self, host: str, port: int, ssl_context: ssl.SSLContext | None,
                       timeout_s: float, local_sock: socket.socket | None) -> None:
        try:
            if local_sock is not None:
                await self._loop.create_unix_connection(lambda: self, sock=local_sock)
                return
            await wait_for(self._loop.create_connection(
                lambda: self, host, port, ssl=ssl_context,
                server_hostname=host if ssl_context else None), timeout_s)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            if local_sock is not None:
                local_sock.close()
            self._fail(_NotSent(Status.RPC_FAILED, f"cannot reach master lean port "
                                                   f"{host}:{port}: {exc}"))

    def _send_auth(self, token: str) -> None:
        future = self.send(METHOD_AUTH, pb.AuthRequest(token=token).SerializeToString())
        future.add_done_callback(self._auth_done)

    def _auth_done(self, future: asyncio.Future[bytes]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        if pb.AuthResponse.FromString(future.result()).status != pb.STATUS_OK:
            self._fail(KVPoolError(Status.PERMISSION_DENIED, "master refused the auth token"))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        if self.closed:
            self._transport.close()
            return
        self._transport.writelines(self._backlog)
        self._backlog = []

    def send(self, method: int, payload: bytes) -> asyncio.Future[bytes]:
        """Send one request; the future resolves to the answer's protobuf bytes."""
        future: asyncio.Future[bytes] = self._loop.create_future()
        if self.closed:
            future.set_exception(self._failure or KVPoolError(Status.RPC_FAILED, "closed"))
            return future
        request_id = self._next_id
        self._next_id = (request_id + 1) & 0xFFFFFFFF or 1
        self._waiters[request_id] = future
        frame = encode_frame(method, request_id, payload)
        if self._transport is None:
            self._backlog.append(frame)
        else:
            self._transport.write(frame)
        return future

    def forget(self, future: asyncio.Future[bytes]) -> None:
        """Drop a waiter whose caller gave up (its late answer is discarded)."""
        for request_id, waiter in list(self._waiters.items()):
            if waiter is future:
                del self._waiters[request_id]
                return

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
        except FrameError as exc:
            self._fail(KVPoolError(Status.RPC_FAILED, f"bad frame from master: {exc}"))
            return
        for method, request_id, payload in frames:
            future = self._waiters.pop(request_id, None)
            if method == METHOD_ERROR:
                status, reason = error_reason(payload)
                error = KVPoolError(status, f"master closed the lean connection: {reason}")
                if future is not None and not future.done():
                    future.set_exception(error)
                self._fail(error)
                return
            if future is not None and not future.done():
                future.set_result(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(KVPoolError(Status.RPC_FAILED, f"lean connection to master lost: {exc}"))
        if not self._lost.done():
            self._lost.set_result(None)

    def _fail(self, error: KVPoolError) -> None:
        if self._failure is None:
            self._failure = error  # the first cause is the one callers see
        self.closed = True
        waiters, self._waiters = self._waiters, {}
        for future in waiters.values():
            if not future.done():
                future.set_exception(self._failure)
                future.exception()  # a forgotten waiter must not log "never retrieved"
        if self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        """Close the connection; waiting calls fail with RPC_FAILED."""
        self._fail(KVPoolError(Status.RPC_FAILED, "connection closed by the client"))

    async def wait_closed(self, timeout_s: float) -> None:
        """Wait until the socket is really closed (or the connect attempt is abandoned)."""
        task = self._connect_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=timeout_s)
        if self._transport is not None:
            await asyncio.wait([self._lost], timeout=timeout_s)


def _ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.ca_path or None)
    if tls.cert_path:
        context.load_cert_chain(tls.cert_path, tls.key_path or None)
    return context


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _connect_local(name: str, expected_pid: int) -> socket.socket | None:
    """A connected socket to the master's abstract Unix socket ``name``, or None when it
    cannot be reached from here (another host or network namespace, no such socket) or the
    process serving it is not the master that advertised it (pid ``expected_pid``)."""
    if not name or not expected_pid or not hasattr(socket, "SO_PEERCRED"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect("\0" + name)
        pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
    except OSError:
        sock.close()
        return None
    if pid != expected_pid:
        sock.close()
        return None
    return sock


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"master address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


# --- the stub ------------------------------------------------------------------------------------

class MasterRpc:
    """Async stub of the kvpool master; see the module docstring for transports and deadlines."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, tls: TlsConfig | None = None,
                 auth_token: str = "", use_fast_path: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 busy_poll_us: int = 0, session: MasterSession | None = None) -> None:
        self._address = address
        self.session = session if session is not None else MasterSession()
        self._host, self._port = _split_address(address)
        self._timeout_s = timeout_s
        self._tls = tls
        self._auth_token = auth_token
        self._use_fast_path = use_fast_path
        self._max_message_bytes = max_message_bytes
        self._busy_poll_us = busy_poll_us  # blocking calls only (see lean_blocking)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._channel: grpc.aio.Channel | None = None
        self._grpc_callables: dict[str, Any] = {}
        self._fast_port = 0
        self._fast_socket = ""  # the master's abstract Unix socket, while it is reachable
        self._master_pid = 0
        self._lean: _LeanConnection | None = None
        self._blocking: BlockingLeanConnection | None = None
        self.direct = False  # see the module docstring
        self._lean_retry_at = 0.0
        self._grpc_nowait: set[asyncio.Task[list[Status]]] = set()
        self._closed = False

    @property
    def address(self) -> str:
        """The master's gRPC address."""
        return self._address

    @property
    def fast_port(self) -> int:
        """The lean-framing port in use (0 while calls go over gRPC)."""
        return self._fast_port if self._use_fast_path else 0

    # -- transport plumbing -----------------------------------------------------------------------

    def _grpc_callable(self, method: RpcMethod) -> Any:
        if self._channel is None:
            options = [("grpc.max_send_message_length", self._max_message_bytes),
                       ("grpc.max_receive_message_length", self._max_message_bytes)]
            if self._tls is not None:
                ca, key, cert = (Path(p).read_bytes() if p else None for p in
                                 (self._tls.ca_path, self._tls.key_path, self._tls.cert_path))
                credentials = grpc.ssl_channel_credentials(ca, key, cert)
                self._channel = grpc.aio.secure_channel(self._address, credentials, options)
            else:
                self._channel = grpc.aio.insecure_channel(self._address, options)
        call = self._grpc_callables.get(method.name)
        if call is None:
            call = self._channel.unary_unary(method.path,
                                             response_deserializer=method.response_type.FromString)
            self._grpc_callables[method.name] = call
        return call

    def _lean_connection(self) -> _LeanConnection | None:
        if not (self._use_fast_path and self._fast_port) or self._closed:
            return None
        loop = asyncio.get_running_loop()
        if self._lean is not None and not self._lean.closed:
            return self._lean
        if loop.time() < self._lean_retry_at:
            return None
        ssl_context = _ssl_context(self._tls) if self._tls is not None else None
        local_sock = None
        if ssl_context is None and self._fast_socket:
            local_sock = _connect_local(self._fast_socket, self._master_pid)
            if local_sock is None:
                self._fast_socket = ""  # not on the master's host: loopback or network TCP
        self._lean = _LeanConnection.open(loop, self._host, self._fast_port, ssl_context,
                                          self._auth_token, self._timeout_s,
                                          self._max_message_bytes, local_sock)
        return self._lean

    async def _call(self, method: RpcMethod, request: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        payload = request.SerializeToString()
        for attempt in range(_MAX_ATTEMPTS):
            try:
                return await self._call_once(method, payload, deadline)
            except KVPoolError as exc:
                retry = isinstance(exc, _NotSent) or (method.idempotent
                                                       and exc.status in _RETRY_STATUSES)
                backoff_s = 0.05 * 2**attempt
                if not retry or attempt == _MAX_ATTEMPTS - 1 \
                        or loop.time() + backoff_s >= deadline:
                    raise KVPoolError(exc.status, f"{method.name}: {exc.message}") from None
                await asyncio.sleep(backoff_s)
        raise AssertionError("unreachable")

    @property
    def blocks(self) -> bool:
        """True when a call made now completes on the calling thread (``direct`` is set and
        the lean framing is usable); otherwise it waits on the loop."""
        return (self.direct and bool(self._fast_port) and self._use_fast_path
                and self._tls is None and not self._closed
                and asyncio.get_running_loop().time() >= self._lean_retry_at)

    async def _call_once(self, method: RpcMethod, payload: bytes, deadline: float) -> Any:
        loop = asyncio.get_running_loop()
        if self.blocks:
            return method.response_type.FromString(
                self._blocking_call(method, payload, deadline - loop.time()))
        conn = self._lean_connection()
        if conn is not None:
            return await self._lean_call(conn, method, conn.send(method.method_id, payload),
                                         deadline)
        if self._grpc_nowait:
            # Commits sent without waiting must land before anything sent after them.
            await asyncio.wait(list(self._grpc_nowait), timeout=max(deadline - loop.time(), 0))
        try:
            return await self._grpc_callable(method)(
                payload, timeout=max(deadline - loop.time(), 0.001), metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            status = _GRPC_TO_STATUS.get(exc.code(), Status.RPC_FAILED)
            raise KVPoolError(status, f"gRPC {exc.code().name}: {exc.details()}") from None

    async def _lean_call(self, conn: _LeanConnection, method: RpcMethod,
                         future: asyncio.Future[bytes], deadline: float) -> Any:
        loop = asyncio.get_running_loop()
        # A timer on the future itself: asyncio.wait_for would add a task per call.
        timer = loop.call_at(deadline, _expire, future)
        try:
            raw = await future
        except _Expired:
            conn.forget(future)
            raise KVPoolError(Status.TIMEOUT, f"no answer within {self._timeout_s:g} s") from None
        except _NotSent:
            self._lean_retry_at = loop.time() + _LEAN_RETRY_AFTER_S  # use gRPC meanwhile
            raise
        finally:
            timer.cancel()
        return method.response_type.FromString(raw)

    def _blocking_call(self, method: RpcMethod, payload: bytes, timeout_s: float) -> bytes:
        """One lean call on the blocking connection (opened, and authenticated, on first use)."""
        conn = self._blocking
        if conn is None or conn.closed:
            conn = self._blocking = self._open_blocking(timeout_s)
        return conn.call(method.method_id, payload, timeout_s)

    def _open_blocking(self, timeout_s: float) -> BlockingLeanConnection:
        sock = _connect_local(self._fast_socket, self._master_pid) if self._fast_socket else None
        if sock is None:
            try:
                sock = socket.create_connection((self._host, self._fast_port),
                                                timeout=max(timeout_s, 0.001))
            except OSError as exc:
                self._lean_retry_at = asyncio.get_running_loop().time() + _LEAN_RETRY_AFTER_S
                where = f"{self._host}:{self._fast_port}"
                raise _NotSent(Status.RPC_FAILED,
                               f"cannot reach master lean port {where}: {exc}") from None
        conn = BlockingLeanConnection(sock, self._max_message_bytes, self._busy_poll_us)
        if self._auth_token:
            answer = conn.call(METHOD_AUTH, pb.AuthRequest(token=self._auth_token)
                               .SerializeToString(), timeout_s)
            if pb.AuthResponse.FromString(answer).status != pb.STATUS_OK:
                conn.close()
                raise KVPoolError(Status.PERMISSION_DENIED, "master refused the auth token")
        return conn

    # -- clients and segments ---------------------------------------------------------------------

    async def register_client(self, client_id: str, host_id: str, hostname: str) -> Registration:
        """Register (or re-register, proving the session's token) a client; raises
        ClientIdTaken when another client holds the id, KVPoolError for anything else but OK."""
        session = self.session
        sent_s = time.monotonic()
        response = await self._call(RPC_METHODS["RegisterClient"], pb.RegisterClientRequest(
            client_id=client_id, host_id=host_id, hostname=hostname,
            client_token=session.token))
        status = _status(response.status)
        if status == Status.CLIENT_ALREADY_EXISTS:
            raise ClientIdTaken(client_id, response.retry_after_ms / 1000)
        if status != Status.OK:
            raise KVPoolError(status, f"RegisterClient {client_id!r} refused")
        clock = MasterClock(response.capability_epoch, response.master_clock_ms, sent_s)
        session.token = response.client_token
        session.learn_clock(clock)
        if (response.fast_port, response.fast_socket) != (self._fast_port, self._fast_socket):
            self._fast_port = response.fast_port
            self._fast_socket = response.fast_socket
            self._master_pid = response.master_pid
            if self._lean is not None:
                self._lean.close()
                self._lean = None
            if self._blocking is not None:
                self._blocking.close()
                self._blocking = None
        return Registration(response.client_ttl_ms / 1000, response.capability_key,
                            response.master_id, response.default_lease_ttl_ms / 1000,
                            response.fast_port, response.client_token, clock)

    async def heartbeat(self, client_id: str) -> Status:
        """OK, or UNKNOWN_CLIENT when the master forgot this client (re-register); an OK
        answer also tightens the session's sample of the master's clock."""
        session = self.session
        sent_s = time.monotonic()
        response = await self._call(RPC_METHODS["Heartbeat"], pb.HeartbeatRequest(
            client_id=client_id, client_token=session.token))
        status = _status(response.status)
        if status == Status.OK:
            session.learn_clock(MasterClock(session.clock.epoch, response.master_clock_ms,
                                            sent_s))
        return status

    async def unregister_client(self, client_id: str) -> Status:
        """Graceful close: OK (segments unmounted, objects dropped now) or UNKNOWN_CLIENT."""
        response = await self._call(RPC_METHODS["UnregisterClient"], pb.UnregisterClientRequest(
            client_id=client_id, client_token=self.session.token))
        return _status(response.status)

    async def mount_segment(self, client_id: str, segment: SegmentInfo) -> Status:
        """Mount (or identically remount) a segment this client owns."""
        descriptor = pb.SegmentDescriptor(
            segment_id=segment.segment_id, client_id=segment.client_id,
            size_bytes=segment.size_bytes, tier=cast(pb.Tier, int(segment.tier)),
            host_id=segment.host_id, shm_name=segment.shm_name, tcp_endpoint=segment.tcp_endpoint,
            engine_endpoint=segment.engine_endpoint)
        response = await self._call(RPC_METHODS["MountSegment"], pb.MountSegmentRequest(
            client_id=client_id, segment=descriptor, client_token=self.session.token))
        return _status(response.status)

    async def unmount_segment(self, client_id: str, segment_id: str) -> Status:
        """Unmount a segment; its objects are dropped."""
        response = await self._call(RPC_METHODS["UnmountSegment"], pb.UnmountSegmentRequest(
            client_id=client_id, segment_id=segment_id, client_token=self.session.token))
        return _status(response.status)

    async def get_segments(self, segment_ids: Sequence[str]) -> list[SegmentInfo | None]:
        """Descriptors of the given segments (None where unknown)."""
        response = await self._call(RPC_METHODS["GetSegments"],
                                    pb.GetSegmentsRequest(segment_ids=segment_ids))
        return [_segment_info(d) if s == pb.STATUS_OK else None
                for s, d in zip(response.statuses, response.segments, strict=False)]

    # -- objects ----------------------------------------------------------------------------------

    async def put_start(self, client_id: str, keys: Sequence[bytes], sizes_bytes: Sequence[int],
                        options: PutOptions, parent_keys: Sequence[bytes] | None = None
                        ) -> list[tuple[Status, tuple[Placement, ...]]]:
        """Allocate space per key: (OK, placements) | (ALREADY_EXISTS | NO_SPACE | ..., ())."""
        request = pb.PutStartRequest(
            client_id=client_id, client_token=self.session.token, keys=keys,
            sizes_bytes=sizes_bytes,
            parent_keys=parent_keys or (),
            options=pb.PutOptions(replica_num=options.replica_num,
                                  preferred_segment=options.preferred_segment,
                                  prefer_same_host=options.prefer_same_host,
                                  pin=cast(pb.Pin, int(options.pin))))
        response = await self._call(RPC_METHODS["PutStart"], request)
        return [(_status(s), _placements(r) if r.placements else ())
                for s, r in zip(response.statuses, response.replicas, strict=False)]

    def _put_end_request(self, client_id: str, keys: Sequence[bytes],
                         checksums: Sequence[int] | None) -> pb.PutEndRequest:
        return pb.PutEndRequest(client_id=client_id, keys=keys, checksums=checksums or (),
                                client_token=self.session.token)

    async def put_end(self, client_id: str, keys: Sequence[bytes],
                      checksums: Sequence[int] | None = None) -> list[Status]:
        """Commit PENDING keys: OK per key, or NOT_FOUND / PERMISSION_DENIED / ..."""
        response = await self._call(RPC_METHODS["PutEnd"],
                                    self._put_end_request(client_id, keys, checksums))
        return _statuses(response.statuses)

    def put_end_nowait(self, client_id: str, keys: Sequence[bytes],
                       checksums: Sequence[int] | None = None) -> asyncio.Future[list[Status]]:
        """Send a commit now without waiting; any call made afterwards is served after it.

        Returns a future of the per-key statuses (it raises KVPoolError like put_end).
        """
        loop = asyncio.get_running_loop()
        method = RPC_METHODS["PutEnd"]
        conn = self._lean_connection()
        if conn is not None:
            payload = self._put_end_request(client_id, keys, checksums).SerializeToString()
            deadline = loop.time() + self._timeout_s
            sent = conn.send(method.method_id, payload)  # ordered on the connection from here

            async def finish() -> list[Status]:
                try:
                    response = await self._lean_call(conn, method, sent, deadline)
                except KVPoolError as exc:
                    raise KVPoolError(exc.status, f"PutEnd: {exc.message}") from None
                return _statuses(response.statuses)
            return loop.create_task(finish())
        task = loop.create_task(self.put_end(client_id, keys, checksums))
        self._grpc_nowait.add(task)
        task.add_done_callback(self._grpc_nowait.discard)
        return task

    async def put_revoke(self, client_id: str, keys: Sequence[bytes]) -> list[Status]:
        """Abandon PENDING keys (after a failed transfer): OK per key or why not."""
        response = await self._call(RPC_METHODS["PutRevoke"],
                                    pb.PutRevokeRequest(client_id=client_id, keys=keys,
                                                        client_token=self.session.token))
        return _statuses(response.statuses)

    async def get_replicas(self, client_id: str, keys: Sequence[bytes]
                           ) -> tuple[list[ReadResult], float]:
        """Per key where its bytes are (and a read lease), or NOT_FOUND; plus lease_ttl_s.

        The lease counts from when this call was sent: reads must finish within lease_ttl_s.
        """
        response = await self._call(RPC_METHODS["GetReplicas"],
                                    pb.GetReplicasRequest(client_id=client_id, keys=keys))
        results = [ReadResult(_status(s), size, _placements(r) if r.placements else (), checksum)
                   for s, size, r, checksum in zip(response.statuses, response.sizes_bytes,
                                                   response.replicas, response.checksums,
                                                   strict=False)]
        return results, response.lease_ttl_ms / 1000

    async def exist(self, client_id: str, keys: Sequence[bytes]
                    ) -> tuple[list[Status], list[int]]:
        """Per key OK or NOT_FOUND, and its size in bytes (0 when absent)."""
        response = await self._call(RPC_METHODS["Exist"],
                                    pb.ExistRequest(client_id=client_id, keys=keys))
        return _statuses(response.statuses), list(response.sizes_bytes)

    async def query_prefix(self, client_id: str, keys: Sequence[bytes]) -> int:
        """Number of leading keys that are READY (each is leased). Raises unless OK."""
        response = await self._call(RPC_METHODS["QueryPrefix"],
                                    pb.QueryPrefixRequest(client_id=client_id, keys=keys))
        if response.status != pb.STATUS_OK:
            raise KVPoolError(_status(response.status), "QueryPrefix")
        return int(response.num_ready)

    async def remove(self, client_id: str, keys: Sequence[bytes], force: bool = False
                     ) -> list[Status]:
        """Remove keys: OK | NOT_FOUND | HAS_LEASE (unless force) | ... per key."""
        response = await self._call(RPC_METHODS["Remove"],
                                    pb.RemoveRequest(client_id=client_id, keys=keys, force=force))
        return _statuses(response.statuses)

    async def remove_all(self, client_id: str, force: bool = False) -> int:
        """Remove every removable object; returns how many. Raises unless OK."""
        response = await self._call(RPC_METHODS["RemoveAll"],
                                    pb.RemoveAllRequest(client_id=client_id, force=force))
        if response.status != pb.STATUS_OK:
            raise KVPoolError(_status(response.status), "RemoveAll")
        return int(response.num_removed)

    async def remove_by_regex(self, client_id: str, pattern: str, force: bool = False) -> int:
        """Remove objects whose key matches ``pattern``; returns how many.

        Raises KVPoolError(INVALID_ARGUMENT) for a bad pattern.
        """
        response = await self._call(RPC_METHODS["RemoveByRegex"], pb.RemoveByRegexRequest(
            client_id=client_id, pattern=pattern, force=force))
        if response.status != pb.STATUS_OK:
            raise KVPoolError(_status(response.status), f"RemoveByRegex {pattern!r}")
        return int(response.num_removed)

    async def get_stats(self) -> dict[str, Any]:
        """The master's /status document (clients, segments, capacity, usage, objects)."""
        response = await self._call(RPC_METHODS["GetStats"], pb.GetStatsRequest())
        if response.status != pb.STATUS_OK:
            raise KVPoolError(_status(response.status), "GetStats")
        document: dict[str, Any] = json.loads(response.json)
        return document

    async def close(self) -> None:
        """Close both transports; waiting calls fail with RPC_FAILED. Idempotent."""
        self._closed = True
        if self._grpc_nowait:
            await asyncio.wait(list(self._grpc_nowait), timeout=self._timeout_s)
        if self._blocking is not None:
            self._blocking.close()
            self._blocking = None
        if self._lean is not None:
            self._lean.close()
            await self._lean.wait_closed(self._timeout_s)
            self._lean = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._grpc_callables.clear()
