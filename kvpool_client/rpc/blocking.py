"""The blocking master stub: every call runs on the calling thread, no event loop involved.

Transports: the lean framing once a registration advertised the master's ``fast_port`` (and no
TLS is configured), on connections of ``rpc.lean_blocking`` (one ``sendall`` and one or two
``recv_into`` per call); a synchronous gRPC channel otherwise. Any thread may call at any time:
a call checks a lean connection out of a small pool, so concurrent callers never share one,
and returns it after the answer (a failed connection is closed, never returned). Deadlines
and retries as ``rpc.endpoints`` says.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

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
)
from kvpool_client.rpc.lean_blocking import BlockingLeanConnection
from kvpool_client.rpc.session import NO_LEAN, After, MasterCalls, MasterSession, TlsConfig
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.calls import Call
from kvpool_wire.methods import DEFAULT_MAX_MESSAGE_BYTES, METHOD_AUTH, RpcMethod
from kvpool_wire.status import KVPoolError, Status

#: Idle lean connections kept for later calls (more are opened while more threads call).
MAX_IDLE_CONNECTIONS = 4


class BlockingMasterRpc(MasterCalls):
    """Blocking stub of the kvpool master; see the module docstring."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, tls: TlsConfig | None = None,
                 auth_token: str = "", use_fast_path: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, busy_poll_us: int = 0,
                 session: MasterSession | None = None) -> None:
        self._address = address
        self.session = session if session is not None else MasterSession()
        self._host, _ = split_address(address)
        self._timeout_s = timeout_s
        self._tls = tls
        self._auth_token = auth_token
        self._use_fast_path = use_fast_path and tls is None
        self._max_message_bytes = max_message_bytes
        self._busy_poll_us = busy_poll_us
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._lock = threading.Lock()
        self._idle: list[BlockingLeanConnection] = []
        self._channel: grpc.Channel | None = None
        self._grpc_callables: dict[str, Any] = {}
        self._followed = NO_LEAN  # the session's lean endpoints this stub uses
        self._fast_socket = ""  # the master's abstract Unix socket, while it is reachable
        self._lean_retry_at = 0.0
        self._closed = False

    @property
    def address(self) -> str:
        """The master's gRPC address."""
        return self._address

    def _follow_lean(self) -> None:
        with self._lock:
            lean, followed = self.session.lean, self._followed
            if lean is followed:
                return
            self._followed = lean
            if (lean.port, lean.socket) == (followed.port, followed.socket):
                return
            self._fast_socket = lean.socket
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- calls ------------------------------------------------------------------------------------

    def _run(self, call: Call[Any], after: After | None = None) -> Any:
        sent_s = time.monotonic()
        result = call.decode(self._call(call.method, call.request))
        return result if after is None else after(result, sent_s)

    def _run_parts(self, parts: list[Call[Any]], join: Callable[[list[Any]], Any]) -> Any:
        results: list[Any] = []
        for part in parts:
            try:
                results.append(self._run(part))
            except KVPoolError as exc:
                results.append(exc)
        return join(results)

    def _call(self, method: RpcMethod, request: Any) -> Any:
        deadline = time.monotonic() + self._timeout_s
        payload = request.SerializeToString()
        for attempt in range(MAX_ATTEMPTS):
            try:
                return self._call_once(method, payload, deadline)
            except KVPoolError as exc:
                backoff_s = retry_backoff_s(method, exc, attempt, time.monotonic(), deadline)
                if backoff_s is None:
                    raise final_error(method, exc) from None
                time.sleep(backoff_s)
        raise AssertionError("unreachable")

    def _call_once(self, method: RpcMethod, payload: bytes, deadline: float) -> Any:
        if self._closed:
            raise KVPoolError(Status.RPC_FAILED, "the stub is closed")
        if self.session.lean is not self._followed:
            self._follow_lean()
        if self._use_fast_path and self._followed.port and time.monotonic() >= self._lean_retry_at:
            conn = self._checkout(deadline - time.monotonic())
            try:
                answer = conn.call(method.method_id, payload, deadline - time.monotonic())
            finally:
                self._checkin(conn)
            return method.response_type.FromString(answer)
        try:
            return self._grpc_callable(method)(
                payload, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata)
        except grpc.RpcError as exc:
            raise grpc_error(exc.code(), exc.details()) from None

    def _checkout(self, timeout_s: float) -> BlockingLeanConnection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    return conn
        return self._open(timeout_s)

    def _checkin(self, conn: BlockingLeanConnection) -> None:
        if conn.closed:
            return
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _open(self, timeout_s: float) -> BlockingLeanConnection:
        lean = self._followed
        sock = connect_local(self._fast_socket, lean.master_pid) if self._fast_socket else None
        if sock is None:
            try:
                sock = socket.create_connection((self._host, lean.port),
                                                timeout=max(timeout_s, 0.001))
            except OSError as exc:
                self._lean_retry_at = time.monotonic() + LEAN_RETRY_AFTER_S  # gRPC meanwhile
                raise NotSent(Status.RPC_FAILED, f"cannot reach master lean port "
                                                 f"{self._host}:{lean.port}: {exc}") from None
        conn = BlockingLeanConnection(sock, self._max_message_bytes, self._busy_poll_us)
        if self._auth_token:
            answer = conn.call(METHOD_AUTH, pb.AuthRequest(token=self._auth_token)
                               .SerializeToString(), timeout_s)
            if pb.AuthResponse.FromString(answer).status != pb.STATUS_OK:
                conn.close()
                raise KVPoolError(Status.PERMISSION_DENIED, "master refused the auth token")
        return conn

    def _grpc_callable(self, method: RpcMethod) -> Any:
        with self._lock:
            if self._channel is None:
                credentials, options = grpc_channel_args(self._tls, self._max_message_bytes)
                self._channel = grpc.insecure_channel(self._address, options) \
                    if credentials is None else \
                    grpc.secure_channel(self._address, credentials, options)
            call = self._grpc_callables.get(method.name)
            if call is None:
                call = self._channel.unary_unary(
                    method.path, response_deserializer=method.response_type.FromString)
                self._grpc_callables[method.name] = call
            return call

    def close(self) -> None:
        """Close every connection; later calls fail with RPC_FAILED. Idempotent."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            channel, self._channel = self._channel, None
            self._grpc_callables.clear()
        for conn in idle:
            conn.close()
        if channel is not None:
            channel.close()
