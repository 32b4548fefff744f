"""The blocking master stub: every call runs on the calling thread, no event loop involved.

Transports: the lean framing once a registration advertised the master's ``fast_port`` (and no
TLS is configured), on connections of ``rpc.lean_blocking`` (one ``sendall`` and one or two
``recv_into`` per call); a synchronous gRPC channel otherwise. Any thread may call at any time:
a call checks a lean connection out of a small pool, so concurrent callers never share one,
and returns it after the answer (a failed connection is closed, never returned). Deadlines
and retries as ``rpc.endpoints`` says. The calls of one batch to several partitions are all
sent, each on a connection of its own, before their answers are taken (``_run_parts``), so
the partitions serve them at once rather than in turn.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from kvpool_wire.methods import DEFAULT_MAX_MESSAGE_BYTES, METHOD_AUTH, RpcMethod
from kvpool_wire.status import KVPoolError, Status

#: Idle lean connections kept for later calls (more are opened while more threads call).
MAX_IDLE_CONNECTIONS = 4


@dataclass(frozen=True, slots=True)
class _Sent:
    """A call sent on a lean connection (``conn``), its answer not taken yet; or one whose
    sending failed (``error``; ``conn`` None)."""

    conn: BlockingLeanConnection | None
    request_id: int
    payload: bytes
    deadline: float
    error: KVPoolError | None = None


class _Leg:
    """The transports to one master process (a partition of a partitioned master): a pool
    of lean connections once the session names its lean endpoints, a gRPC channel."""

    def __init__(self, stub: BlockingMasterRpc, address: str, partition: int) -> None:
        self._stub = stub
        self.address = address
        self._host, _ = split_address(address)
        self._partition = partition
        self._lock = threading.Lock()
        self._idle: list[BlockingLeanConnection] = []
        self._channel: grpc.Channel | None = None
        self._grpc_callables: dict[str, Any] = {}
        self.followed = NO_LEAN  # the session's lean endpoints this leg uses
        self._fast_socket = ""  # the master's abstract Unix socket, while it is reachable
        self._lean_retry_at = 0.0

    def follow_lean(self) -> None:
        with self._lock:
            lean, followed = self._stub.session.lean_of(self._partition), self.followed
            if lean is followed:
                return
            self.followed = lean
            if (lean.port, lean.socket) == (followed.port, followed.socket):
                return
            self._fast_socket = lean.socket
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def call(self, method: RpcMethod, request: Any) -> Any:
        deadline = time.monotonic() + self._stub._timeout_s
        return self._attempts(method, request.SerializeToString(), deadline)

    def send(self, method: RpcMethod, request: Any) -> _Sent | None:
        """Send ``request`` now over a lean connection of its own (``finish`` takes the
        answer), or None where this leg calls over gRPC (the caller makes the plain call)."""
        if self._stub._closed or not self._lean_ready():
            return None
        payload = request.SerializeToString()
        deadline = time.monotonic() + self._stub._timeout_s
        try:
            conn = self._checkout(deadline - time.monotonic())
        except KVPoolError as exc:
            return _Sent(None, 0, payload, deadline, exc)
        try:
            return _Sent(conn, conn.send(method.method_id, payload, deadline), payload, deadline)
        except KVPoolError as exc:   # the connection closed itself: not returned to the pool
            return _Sent(None, 0, payload, deadline, exc)

    def finish(self, method: RpcMethod, sent: _Sent) -> Any:
        """The answer to the call ``send`` sent; one that failed is made again as ``call``
        would."""
        error = sent.error
        if sent.conn is not None:
            try:
                answer = sent.conn.receive(method.method_id, sent.request_id, sent.deadline)
            except KVPoolError as exc:
                error = exc
            else:
                self._checkin(sent.conn)
                return method.response_type.FromString(answer)
        return self._attempts(method, sent.payload, sent.deadline, error)

    def _attempts(self, method: RpcMethod, payload: bytes, deadline: float,
                  first_failure: KVPoolError | None = None) -> Any:
        """The call's answer, made up to ``MAX_ATTEMPTS`` times (see ``rpc.endpoints``);
        ``first_failure``: the first attempt was made already (``finish``) and failed so."""
        failure = first_failure
        for attempt in range(MAX_ATTEMPTS):
            if attempt or failure is None:
                try:
                    return self._call_once(method, payload, deadline)
                except KVPoolError as exc:
                    failure = exc
            backoff_s = retry_backoff_s(method, failure, attempt, time.monotonic(), deadline)
            if backoff_s is None:
                raise final_error(method, failure) from None
            time.sleep(backoff_s)
        raise AssertionError("unreachable")

    def _lean_ready(self) -> bool:
        """Whether this leg calls over a lean connection now (the session's endpoints
        followed first)."""
        stub = self._stub
        if stub.session.lean_of(self._partition) is not self.followed:
            self.follow_lean()
        return bool(stub._use_fast_path and self.followed.port
                    and time.monotonic() >= self._lean_retry_at)

    def _call_once(self, method: RpcMethod, payload: bytes, deadline: float) -> Any:
        stub = self._stub
        if stub._closed:
            raise KVPoolError(Status.RPC_FAILED, "the stub is closed")
        if self._lean_ready():
            conn = self._checkout(deadline - time.monotonic())
            try:
                answer = conn.call(method.method_id, payload, deadline - time.monotonic())
            finally:
                self._checkin(conn)
            return method.response_type.FromString(answer)
        try:
            return self._grpc_callable(method)(
                payload, timeout=max(deadline - time.monotonic(), 0.001), metadata=stub._metadata)
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
            if not self._stub._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _open(self, timeout_s: float) -> BlockingLeanConnection:
        stub = self._stub
        lean = self.followed
        sock = connect_local(self._fast_socket, lean.master_pid) if self._fast_socket else None
        if sock is None:
            try:
                sock = socket.create_connection((self._host, lean.port),
                                                timeout=max(timeout_s, 0.001))
            except OSError as exc:
                self._lean_retry_at = time.monotonic() + LEAN_RETRY_AFTER_S  # gRPC meanwhile
                raise NotSent(Status.RPC_FAILED, f"cannot reach master lean port "
                                                 f"{self._host}:{lean.port}: {exc}") from None
        conn = BlockingLeanConnection(sock, stub._max_message_bytes, stub._busy_poll_us)
        if stub._auth_token:
            answer = conn.call(METHOD_AUTH, pb.AuthRequest(token=stub._auth_token)
                               .SerializeToString(), timeout_s)
            if pb.AuthResponse.FromString(answer).status != pb.STATUS_OK:
                conn.close()
                raise KVPoolError(Status.PERMISSION_DENIED, "master refused the auth token")
        return conn

    def _grpc_callable(self, method: RpcMethod) -> Any:
        with self._lock:
            if self._channel is None:
                credentials, options = grpc_channel_args(self._stub._tls,
                                                         self._stub._max_message_bytes)
                self._channel = grpc.insecure_channel(self.address, options) \
                    if credentials is None else \
                    grpc.secure_channel(self.address, credentials, options)
            call = self._grpc_callables.get(method.name)
            if call is None:
                call = self._channel.unary_unary(
                    method.path, response_deserializer=method.response_type.FromString)
                self._grpc_callables[method.name] = call
            return call

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            channel, self._channel = self._channel, None
            self._grpc_callables.clear()
        for conn in idle:
            conn.close()
        if channel is not None:
            channel.close()


class BlockingMasterRpc(MasterCalls):
    """Blocking stub of the kvpool master; see the module docstring. A partitioned master is
    reached through one ``_Leg`` per partition, on the host of ``address``."""

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
        self._legs_lock = threading.Lock()
        self._legs: list[_Leg] = [_Leg(self, address, 0)]
        self._closed = False

    @property
    def address(self) -> str:
        """The master's gRPC address (partition 0's)."""
        return self._address

    def _leg(self, partition: int) -> _Leg:
        if not partition:
            return self._legs[0]
        with self._legs_lock:
            leg, stale = leg_for(self._legs, partition, self._host, self.session.partitions,
                                 lambda address, index: _Leg(self, address, index))
        if stale is not None:
            stale.close()
        return leg

    def _follow_lean(self) -> None:
        for leg in list(self._legs):
            leg.follow_lean()

    # -- calls ------------------------------------------------------------------------------------

    def _run(self, call: Call[Any], after: After | None = None, partition: int = 0) -> Any:
        sent_s = time.monotonic()
        result = call.decode(self._leg(partition).call(call.method, call.request))
        return result if after is None else after(result, sent_s)

    def _run_parts(self, parts: list[Part], join: Callable[[list[Any]], Any]) -> Any:
        # Sent together: each partition's part on a lean connection, all sent before any
        # answer is taken, so the partitions serve them at once. A partition's further parts
        # (a batch longer than max_call_keys) go in later rounds, one at a time per partition.
        results: list[Any] = [None] * len(parts)
        rounds: dict[int, list[int]] = {}
        for index, (partition, _) in enumerate(parts):
            rounds.setdefault(partition, []).append(index)
        for batch in itertools.zip_longest(*rounds.values()):
            sent = [(index, self._send_part(*parts[index])) for index in batch
                    if index is not None]
            for index, pending in sent:
                results[index] = self._finish_part(parts[index][1], pending)
        return join(results)

    def _send_part(self, partition: int, call: Call[Any]) -> tuple[_Leg, _Sent | None] | \
            KVPoolError:
        """``call`` sent to ``partition`` (``_finish_part`` takes its result), or the
        KVPoolError naming that partition failed with."""
        try:
            leg = self._leg(partition)
        except KVPoolError as exc:
            return exc
        return leg, leg.send(call.method, call.request)

    @staticmethod
    def _finish_part(call: Call[Any], pending: tuple[_Leg, _Sent | None] | KVPoolError) -> Any:
        """A part's result, or the KVPoolError it failed with."""
        if isinstance(pending, KVPoolError):
            return pending
        leg, sent = pending
        try:
            return call.decode(leg.call(call.method, call.request) if sent is None
                               else leg.finish(call.method, sent))
        except KVPoolError as exc:
            return exc

    def _then(self, first: Any, then: Callable[[Any], Any]) -> Any:
        return then(first)

    def _now_s(self) -> float:
        return time.monotonic()

    def close(self) -> None:
        """Close every connection; later calls fail with RPC_FAILED. Idempotent."""
        with self._legs_lock:
            self._closed = True
            legs = list(self._legs)
        for leg in legs:
            leg.close()
