"""The asyncio master stub: every call on the running event loop, over one persistent,
pipelined lean-framing connection once a registration advertised the master's ``fast_port``
(``u32 LE length | u8 method | u32 LE request id | protobuf bytes``), over gRPC otherwise
(canonical; health checking, reflection, any language). Frames on the lean connection are
served in order, which is what makes ``put_end_nowait`` safe: any call made after it is served
after it. One instance belongs to one event loop; deadlines and retries as ``rpc.endpoints``
says.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import grpc

from kvpool_client.rpc.endpoints import (
    LEAN_RETRY_AFTER_S,
    MAX_ATTEMPTS,
    NotSent,
    connect_local,
    final_error,
    grpc_channel_args,
    grpc_error,
    retry_backoff_s,
    split_address,
    ssl_context,
)
from kvpool_client.rpc.session import (
    NO_LEAN,
    After,
    MasterCalls,
    MasterSession,
    Part,
    TlsConfig,
    leg_for,
)
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.calls import Call
from kvpool_wire.framing import FrameDecoder, FrameError, encode_frame, error_reason
from kvpool_wire.methods import DEFAULT_MAX_MESSAGE_BYTES, METHOD_AUTH, METHOD_ERROR, RpcMethod
from kvpool_wire.status import KVPoolError, Status


class _Expired(Exception):
    """A lean call's deadline passed before its answer came."""


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(_Expired())


async def _settled(parts: Sequence[Awaitable[Any]]) -> list[Any]:
    """The results of ``parts``, run together, a KVPoolError in place of a part that raised
    it (any other error is raised once all are done)."""
    results = await asyncio.gather(*parts, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, KVPoolError):
            raise result
    return results


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
            await asyncio.wait_for(self._loop.create_connection(
                lambda: self, host, port, ssl=ssl_context,
                server_hostname=host if ssl_context else None), timeout_s)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
            if local_sock is not None:
                local_sock.close()
            self._fail(NotSent(Status.RPC_FAILED, f"cannot reach master lean port "
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


class _Leg:
    """The transports to one master process (a partition of a partitioned master): its gRPC
    channel, and its lean connection once the session names its lean endpoints."""

    def __init__(self, stub: MasterRpc, address: str, partition: int) -> None:
        self._stub = stub
        self.address = address
        self._host, self._port = split_address(address)
        self._partition = partition
        self._channel: grpc.aio.Channel | None = None
        self._grpc_callables: dict[str, Any] = {}
        self.followed = NO_LEAN  # the session's lean endpoints this leg uses
        self._fast_socket = ""  # the master's abstract Unix socket, while it is reachable
        self._lean: _LeanConnection | None = None
        self._lean_retry_at = 0.0
        self.grpc_nowait: set[asyncio.Task[list[Status]]] = set()

    def follow_lean(self) -> None:
        lean, followed = self._stub.session.lean_of(self._partition), self.followed
        if lean is followed:
            return
        self.followed = lean
        if (lean.port, lean.socket) != (followed.port, followed.socket):
            self._fast_socket = lean.socket
            if self._lean is not None:
                self._lean.close()
                self._lean = None

    def _grpc_callable(self, method: RpcMethod) -> Any:
        if self._channel is None:
            credentials, options = grpc_channel_args(self._stub._tls, self._stub._max_message_bytes)
            self._channel = grpc.aio.insecure_channel(self.address, options) \
                if credentials is None else \
                grpc.aio.secure_channel(self.address, credentials, options)
        call = self._grpc_callables.get(method.name)
        if call is None:
            call = self._channel.unary_unary(method.path,
                                             response_deserializer=method.response_type.FromString)
            self._grpc_callables[method.name] = call
        return call

    def lean_connection(self) -> _LeanConnection | None:
        stub = self._stub
        if stub.session.lean_of(self._partition) is not self.followed:
            self.follow_lean()
        if not (stub._use_fast_path and self.followed.port) or stub._closed:
            return None
        loop = asyncio.get_running_loop()
        if self._lean is not None and not self._lean.closed:
            return self._lean
        if loop.time() < self._lean_retry_at:
            return None
        context = ssl_context(stub._tls) if stub._tls is not None else None
        local_sock = None
        if context is None and self._fast_socket:
            local_sock = connect_local(self._fast_socket, self.followed.master_pid)
            if local_sock is None:
                self._fast_socket = ""  # not on the master's host: loopback or network TCP
        self._lean = _LeanConnection.open(loop, self._host, self.followed.port, context,
                                          stub._auth_token, stub._timeout_s,
                                          stub._max_message_bytes, local_sock)
        return self._lean

    async def call(self, method: RpcMethod, request: Any) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._stub._timeout_s
        payload = request.SerializeToString()
        for attempt in range(MAX_ATTEMPTS):
            try:
                return await self._call_once(method, payload, deadline)
            except KVPoolError as exc:
                backoff_s = retry_backoff_s(method, exc, attempt, loop.time(), deadline)
                if backoff_s is None:
                    raise final_error(method, exc) from None
                await asyncio.sleep(backoff_s)
        raise AssertionError("unreachable")

    async def _call_once(self, method: RpcMethod, payload: bytes, deadline: float) -> Any:
        loop = asyncio.get_running_loop()
        conn = self.lean_connection()
        if conn is not None:
            return await self.lean_call(conn, method, conn.send(method.method_id, payload),
                                        deadline)
        if self.grpc_nowait:
            # Commits sent without waiting must land before anything sent after them.
            await asyncio.wait(list(self.grpc_nowait), timeout=max(deadline - loop.time(), 0))
        try:
            return await self._grpc_callable(method)(
                payload, timeout=max(deadline - loop.time(), 0.001),
                metadata=self._stub._metadata)
        except grpc.aio.AioRpcError as exc:
            raise grpc_error(exc.code(), exc.details()) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stub._closed and (task is None or not task.cancelling()):
                # the channel was closed under the call (not this task cancelled): a failure
                raise KVPoolError(Status.RPC_FAILED,
                                  f"{method.name}: the stub was closed") from None
            raise

    async def lean_call(self, conn: _LeanConnection, method: RpcMethod,
                        future: asyncio.Future[bytes], deadline: float) -> Any:
        loop = asyncio.get_running_loop()
        # A timer on the future itself: asyncio.wait_for would add a task per call.
        timer = loop.call_at(deadline, _expire, future)
        try:
            raw = await future
        except _Expired:
            conn.forget(future)
            raise KVPoolError(Status.TIMEOUT,
                              f"no answer within {self._stub._timeout_s:g} s") from None
        except NotSent:
            self._lean_retry_at = loop.time() + LEAN_RETRY_AFTER_S  # use gRPC meanwhile
            raise
        finally:
            timer.cancel()
        return method.response_type.FromString(raw)

    async def close(self) -> None:
        if self.grpc_nowait:
            await asyncio.wait(list(self.grpc_nowait), timeout=self._stub._timeout_s)
        if self._lean is not None:
            self._lean.close()
            await self._lean.wait_closed(self._stub._timeout_s)
            self._lean = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._grpc_callables.clear()


class MasterRpc(MasterCalls):
    """Asyncio stub of the kvpool master: every named call of ``MasterCalls`` is a coroutine
    function here; see the module docstring for transports and deadlines. A partitioned
    master is reached through one ``_Leg`` per partition, on the host of ``address``."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, tls: TlsConfig | None = None,
                 auth_token: str = "", use_fast_path: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 session: MasterSession | None = None) -> None:
        self._address = address
        self.session = session if session is not None else MasterSession()
        self._host, _ = split_address(address)
        self._timeout_s = timeout_s
        self._tls = tls
        self._auth_token = auth_token
        self._use_fast_path = use_fast_path
        self._max_message_bytes = max_message_bytes
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._legs: list[_Leg] = [_Leg(self, address, 0)]
        self._stale: set[asyncio.Task[None]] = set()  # legs of a former map, closing
        self._closed = False

    @property
    def address(self) -> str:
        """The master's gRPC address (partition 0's)."""
        return self._address

    @property
    def fast_port(self) -> int:
        """The lean-framing port in use (0 while calls go over gRPC)."""
        return self._legs[0].followed.port if self._use_fast_path else 0

    # -- transport plumbing -----------------------------------------------------------------------

    def _leg(self, partition: int) -> _Leg:
        if not partition:
            return self._legs[0]
        leg, stale = leg_for(self._legs, partition, self._host, self.session.partitions,
                             lambda address, index: _Leg(self, address, index))
        if stale is not None:
            task = asyncio.get_running_loop().create_task(stale.close())
            self._stale.add(task)
            task.add_done_callback(self._stale.discard)
        return leg

    def _follow_lean(self) -> None:
        for leg in self._legs:
            leg.follow_lean()

    async def _run(self, call: Call[Any], after: After | None = None, partition: int = 0) -> Any:
        sent_s = asyncio.get_running_loop().time()
        result = call.decode(await self._leg(partition).call(call.method, call.request))
        return result if after is None else after(result, sent_s)

    async def _run_parts(self, parts: list[Part], join: Callable[[list[Any]], Any]) -> Any:
        # sent together: pipelined on each lean connection, served in order there
        return join(await _settled([self._run(call, None, partition)
                                    for partition, call in parts]))

    async def _then(self, first: Any, then: Callable[[Any], Any]) -> Any:
        out = then(await first)
        return await out if inspect.isawaitable(out) else out

    def _now_s(self) -> float:
        return asyncio.get_running_loop().time()

    def put_end_nowait(self, client_id: str, keys: Sequence[bytes],
                       checksums: Sequence[int] | None = None) -> asyncio.Future[list[Status]]:
        """Send a commit now without waiting; any call made afterwards is served after it.

        Returns a future of the per-key statuses (it raises KVPoolError like put_end).
        """
        loop = asyncio.get_running_loop()
        parts, join = self.put_end_calls(client_id, keys, checksums)
        if len(parts) == 1:
            return self._send_now(*parts[0])
        sent = [self._send_now(partition, part) for partition, part in parts]  # in order

        async def joined() -> list[Status]:
            return join(await _settled(sent))
        return loop.create_task(joined())

    def _send_now(self, partition: int, call: Call[list[Status]]) -> asyncio.Future[list[Status]]:
        """``put_end_nowait`` of one call."""
        loop = asyncio.get_running_loop()
        leg = self._leg(partition)
        conn = leg.lean_connection()
        if conn is not None:
            deadline = loop.time() + self._timeout_s
            # ordered on the connection from here
            sent = conn.send(call.method.method_id, call.request.SerializeToString())

            async def finish() -> list[Status]:
                try:
                    response = await leg.lean_call(conn, call.method, sent, deadline)
                except KVPoolError as exc:
                    raise KVPoolError(exc.status, f"PutEnd: {exc.message}") from None
                return call.decode(response)
            return loop.create_task(finish())
        task = loop.create_task(self._run(call, None, partition))
        leg.grpc_nowait.add(task)
        task.add_done_callback(leg.grpc_nowait.discard)
        return task

    async def close(self) -> None:
        """Close every transport; waiting calls fail with RPC_FAILED. Idempotent."""
        self._closed = True
        for leg in self._legs:
            await leg.close()
        if self._stale:
            await asyncio.wait(list(self._stale), timeout=self._timeout_s)
