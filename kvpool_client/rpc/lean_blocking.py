"""A lean-framing connection driven by blocking socket calls on the calling thread.

Why: the blocking driver runs a put or get on the caller's thread; its master calls then cost
one ``sendall`` and one or two ``recv_into`` instead of an event-loop run. The messages, the
framing and the master's handlers are the same as on the asyncio lean connection (``rpc.aio``).

Waiting: after sending, the thread polls the socket for up to ``busy_poll_us`` before it
sleeps in ``poll(2)``. A master answers a small call in tens of microseconds, and waking a
sleeping thread costs about as much again on a virtual machine; polling keeps the caller on its
core. It yields the core between polls (``sched_yield``), so a process waiting to run on the
same core (the master, on a small host) is not held back. A call whose answer did not come
within the budget makes the next 1, 2, 4 ... 64 calls sleep at once (``polling.PollBackoff``),
so a slow or distant master costs little polling. ``busy_poll_us`` 0: sleep at once.

Rules of this file:
- One caller at a time (``rpc.blocking`` checks a connection out per call); nothing here
  is locked. A call is ``send`` then ``receive``: a caller with calls to several masters
  (partitions) sends each on its own connection before it takes the answers.
- The socket is non-blocking; every wait is a bounded poll, so the deadline holds throughout.
- Any failure closes the connection: a late answer must never be read as the next call's.
  A timeout raises ``TIMEOUT``, anything else ``RPC_FAILED`` (the master's reason when it sent
  one); a request id or method that does not match the call is ``RPC_FAILED`` too.
"""

from __future__ import annotations

import math
import os
import select
import socket
import time

from kvpool_wire.framing import (
    ERROR_METHOD_ID,
    FRAME_HEADER,
    FRAME_LENGTH,
    FRAME_OVERHEAD_BYTES,
    encode_frame,
    error_reason,
)
from kvpool_wire.polling import PollBackoff
from kvpool_wire.status import KVPoolError, Status

_BUFFER_BYTES = 64 << 10


class BlockingLeanConnection:
    """One lean connection over a connected socket; see the module docstring."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int, busy_poll_us: int = 0) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock: socket.socket | None = sock
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._max_frame_bytes = max_frame_bytes
        self._busy_poll_s = busy_poll_us / 1e6
        self._spin_s = 0.0  # this call's polling budget
        self.backoff = PollBackoff()
        self._buffer = bytearray(_BUFFER_BYTES)  # most answers fit; larger ones get their own
        self._next_id = 1

    @property
    def closed(self) -> bool:
        """True once closed (by ``close`` or by a failed call)."""
        return self._sock is None

    def call(self, method_id: int, payload: bytes, timeout_s: float) -> bytes:
        """Send one request and return its answer's payload.

        Raises KVPoolError: TIMEOUT (no answer within ``timeout_s``), RPC_FAILED (connection
        lost or closed, a frame that does not answer this call), or the status of the master's
        error frame.
        """
        if timeout_s <= 0:
            raise KVPoolError(Status.TIMEOUT, "deadline passed before the call was sent")
        deadline = time.monotonic() + timeout_s
        return self.receive(method_id, self.send(method_id, payload, deadline), deadline)

    def send(self, method_id: int, payload: bytes, deadline: float) -> int:
        """Send one request; -> its request id, for ``receive`` (the next call on this
        connection must be that ``receive``). Raises as ``call``."""
        sock = self._sock
        if sock is None:
            raise KVPoolError(Status.RPC_FAILED, "lean connection closed")
        request_id = self._next_id
        self._next_id = (request_id + 1) & 0xFFFFFFFF or 1
        try:
            self._send(sock, encode_frame(method_id, request_id, payload), deadline)
        except (OSError, KVPoolError) as exc:
            raise self._failed(exc) from None
        return request_id

    def receive(self, method_id: int, request_id: int, deadline: float) -> bytes:
        """The answer's payload to the request ``send`` sent. Raises as ``call``."""
        sock = self._sock
        if sock is None:
            raise KVPoolError(Status.RPC_FAILED, "lean connection closed")
        self._spin_s = self._busy_poll_s if self._busy_poll_s and self.backoff.take() else 0.0
        try:
            answer_method, answer_id, body = self._receive(sock, deadline)
        except (OSError, KVPoolError) as exc:
            raise self._failed(exc) from None
        if answer_method == ERROR_METHOD_ID:
            self.close()
            status, reason = error_reason(body)
            raise KVPoolError(status, f"master closed the lean connection: {reason}")
        if answer_id != request_id or answer_method != method_id:
            self.close()
            raise KVPoolError(Status.RPC_FAILED, f"answer {answer_method}/{answer_id} does not "
                                                 f"match call {method_id}/{request_id}")
        return body

    def _failed(self, exc: OSError | KVPoolError) -> KVPoolError:
        """Close the connection after ``exc``; -> the error the call raises."""
        self.close()
        if isinstance(exc, KVPoolError):
            return exc
        if isinstance(exc, TimeoutError):
            return KVPoolError(Status.TIMEOUT, "no answer by the call's deadline")
        return KVPoolError(Status.RPC_FAILED, f"lean connection to master lost: {exc}")

    def _send(self, sock: socket.socket, frame: bytes, deadline: float) -> None:
        view = memoryview(frame)
        while view:
            try:
                view = view[sock.send(view):]
            except BlockingIOError:  # the master is not reading: wait for room, bounded
                self._wait(sock, select.POLLOUT, deadline)

    def _receive(self, sock: socket.socket, deadline: float) -> tuple[int, int, bytes]:
        """Read one answer frame: (method, request id, payload). A small answer takes one
        ``recv_into``; nothing may follow it (the master answers one call at a time here)."""
        buffer = self._buffer
        view = memoryview(buffer)
        received = 0
        while received < FRAME_HEADER.size:
            received += self._recv_some(sock, view[received:], deadline)
        length, answer_method, answer_id = FRAME_HEADER.unpack_from(buffer)
        if not FRAME_OVERHEAD_BYTES <= length <= self._max_frame_bytes + FRAME_OVERHEAD_BYTES:
            raise KVPoolError(Status.RPC_FAILED, f"bad frame length {length} from master")
        total = FRAME_LENGTH.size + length
        if total > len(buffer):
            buffer = bytearray(total)
            buffer[:received] = view[:received]
            view = memoryview(buffer)
        while received < total:
            received += self._recv_some(sock, view[received:total], deadline)
        if received > total:
            raise KVPoolError(Status.RPC_FAILED, "the master sent more than one answer")
        return answer_method, answer_id, bytes(view[FRAME_HEADER.size:total])

    def _recv_some(self, sock: socket.socket, view: memoryview, deadline: float) -> int:
        """Receive what has arrived (at least one byte): polling first, then sleeping."""
        spin_until = time.monotonic() + self._spin_s
        while True:
            try:
                received = sock.recv_into(view)
            except BlockingIOError:
                now = time.monotonic()
                if now < spin_until and now < deadline:
                    os.sched_yield()
                    continue
                if self._spin_s:  # the budget ran out: sleep at once on the next calls
                    self._spin_s = 0.0
                    self.backoff.ran_out()
                self._wait(sock, select.POLLIN, deadline)
                continue
            if received == 0:
                raise ConnectionError("closed by the master")
            if self._spin_s:
                self.backoff.paid()
            return received

    def _wait(self, sock: socket.socket, events: int, deadline: float) -> None:
        """Sleep until ``sock`` is ready for ``events``, failed, or the deadline came (the next
        wait then raises TimeoutError)."""
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError
        self._poller.modify(sock, events)
        self._poller.poll(max(1, math.ceil(remaining_s * 1000)))

    def close(self) -> None:
        """Close the socket (idempotent)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
