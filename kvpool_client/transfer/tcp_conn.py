"""One data-server connection's stream: buffered receiving and batched answers.

Requests arrive pipelined, so the server reads ahead: one ``recv`` fills a private buffer with
as many frames as have arrived, and small WRITE payloads are copied out of it. Only the part of
a payload that has not arrived yet is received directly into its target (one ``MSG_WAITALL``
call). Read-ahead bytes stay in this buffer, never in a segment, until their request passed its
checks. Answers are queued and sent together with one ``sendmsg`` whenever the connection would
otherwise wait (or the queue is full), so a batch of small requests costs a few system calls,
not four per request. A READ's answer holds its view of the segment until it is sent. An
answer still being made on another thread (an SSD read, ``answer_later``) takes its place in
the queue; sending waits for it when it comes to it, so reads run while earlier answers go out.

Every wait is bounded by a deadline (``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` set before a blocking
call only); a missed deadline, an error or the end of the stream raise ``Closed``.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

READ_AHEAD_BYTES = 128 << 10
MAX_QUEUED_ANSWERS = 64
MAX_QUEUED_BYTES = 8 << 20
_TIMEVAL = struct.Struct("@ll")


class Closed(Exception):
    """The connection must end (closed by the peer, a deadline passed, or a send failed)."""


class Connection:
    """The receive buffer and answer queue of one connection (used by one thread).

    ``on_timeout`` is called once for every deadline that passes.
    """

    def __init__(self, sock: socket.socket, on_timeout: Callable[[], None]) -> None:
        self.sock = sock
        self._on_timeout = on_timeout
        self._buffer = bytearray(READ_AHEAD_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0
        self._answers: list[memoryview | Future[list[Any]]] = []
        self._held: list[memoryview] = []
        self._queued_bytes = 0
        self._send_deadline_s = float("inf")
        self._idle_timeout_s = 0.0  # SO_RCVTIMEO when it was last set for an idle wait

    # -- receiving --------------------------------------------------------------------------------

    def wait_frame(self, idle_s: float) -> None:
        """Return once at least one byte of the next frame is here; waiting for it (answers
        sent first) at most ``idle_s``. Raises Closed when the peer closed or stayed idle that
        long (not counted as a timeout: idleness is allowed)."""
        if self._end > self._start:
            return
        self._start = self._end = 0
        self.flush()
        if idle_s <= 0:
            raise Closed
        if self._idle_timeout_s != idle_s:  # the same idle limit stays set between frames
            _set_timeout(self.sock, socket.SO_RCVTIMEO, idle_s)
            self._idle_timeout_s = idle_s
        count = _recv(self.sock, self._view, 0)
        if count <= 0:
            raise Closed
        self._end = count

    def take(self, size: int, deadline_s: float) -> memoryview:
        """The next ``size`` bytes (at most the buffer's size), valid until the next call."""
        if self._end - self._start < size:
            if self._start:
                left = self._end - self._start
                self._view[:left] = self._view[self._start:self._end]
                self._start, self._end = 0, left
            while self._end < size:
                if self._fill(deadline_s) <= 0:
                    raise Closed
        view = self._view[self._start:self._start + size]
        self._start += size
        return view

    def receive_into(self, target: memoryview, deadline_s: float) -> None:
        """Fill ``target`` with the next bytes of the stream: those already buffered first,
        the rest received straight into it."""
        have = min(self._end - self._start, target.nbytes)
        if have:
            target[:have] = self._view[self._start:self._start + have]
            self._start += have
        received = have
        while received < target.nbytes:
            self.flush()
            if not self._settimeout(socket.SO_RCVTIMEO, deadline_s):
                raise Closed
            count = _recv(self.sock, target[received:], socket.MSG_WAITALL)
            if count == 0:
                raise Closed
            received += max(count, 0)

    def discard(self, length: int, deadline_s: float) -> None:
        """Read and drop the next ``length`` bytes (a refused WRITE's payload)."""
        while length > 0:
            if self._end == self._start:
                self._start = self._end = 0
                if self._fill(deadline_s) <= 0:
                    raise Closed
            step = min(length, self._end - self._start)
            self._start += step
            length -= step

    def _fill(self, deadline_s: float) -> int:
        """One receive into the free end of the buffer (answers sent first); the bytes
        received, -1 after a deadline passed without any, 0 at the end of the stream."""
        self.flush()
        if not self._settimeout(socket.SO_RCVTIMEO, deadline_s):
            return -1
        count = _recv(self.sock, self._view[self._end:], 0)
        if count < 0:
            self._on_timeout()
        if count > 0:
            self._end += count
        return count

    # -- answering --------------------------------------------------------------------------------

    def answer(self, parts: list[Any], deadline_s: float, hold: memoryview | None = None) -> None:
        """Queue an answer (its parts in order) to send by ``deadline_s``; ``hold``: a view
        that must stay alive until it is sent (released after). Sends the queue when full."""
        for part in parts:
            view = memoryview(part)
            self._answers.append(view)
            self._queued_bytes += view.nbytes
        if hold is not None:
            self._held.append(hold)
        self._queued(deadline_s)

    def answer_later(self, parts: Future[list[Any]], num_bytes: int, deadline_s: float) -> None:
        """Queue an answer another thread is still making (its parts, once done)."""
        self._answers.append(parts)
        self._queued_bytes += num_bytes
        self._queued(deadline_s)

    def _queued(self, deadline_s: float) -> None:
        """An answer was queued: keep the earliest deadline; send the queue when full."""
        self._send_deadline_s = min(self._send_deadline_s, deadline_s)
        if len(self._answers) >= MAX_QUEUED_ANSWERS or self._queued_bytes >= MAX_QUEUED_BYTES:
            self.flush()

    def flush(self) -> None:
        """Send every queued answer (before the earliest of their deadlines) and release the
        views they held."""
        views = self._answers
        flags: int = socket.MSG_DONTWAIT  # first without waiting: no timeout to set if room
        try:
            while views:
                ready = next((i for i, v in enumerate(views[:1024])
                              if isinstance(v, Future)), min(len(views), 1024))
                if not ready:  # an answer made elsewhere comes next: wait for it
                    made = views[0]
                    assert isinstance(made, Future)
                    views[0:1] = [memoryview(part) for part in made.result()]
                    continue
                if not flags and not self._settimeout(socket.SO_SNDTIMEO,
                                                      self._send_deadline_s):
                    raise Closed
                try:
                    sent = self.sock.sendmsg(views[:ready], [], flags)  # type: ignore[arg-type]
                except (BlockingIOError, InterruptedError):
                    flags = 0  # no room (or SO_SNDTIMEO passed): wait, the deadline decides
                    continue
                except OSError:
                    raise Closed from None
                index = 0
                while index < ready and sent >= views[index].nbytes:  # type: ignore[union-attr]
                    sent -= views[index].nbytes  # type: ignore[union-attr]
                    index += 1
                del views[:index]
                if sent:
                    views[0] = views[0][sent:]  # type: ignore[index]
                flags = 0
        finally:
            self.release()

    def release(self) -> None:
        """Drop the queue (unsent answers included) and release the views it held."""
        self._answers.clear()
        for view in self._held:
            view.release()
        self._held.clear()
        self._queued_bytes = 0
        self._send_deadline_s = float("inf")

    def _settimeout(self, option: int, deadline_s: float) -> bool:
        """Set the socket's timeout to what is left until ``deadline_s``; False (counted as a
        timeout) when nothing is left."""
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            self._on_timeout()
            return False
        _set_timeout(self.sock, option, remaining_s)
        if option == socket.SO_RCVTIMEO:
            self._idle_timeout_s = 0.0
        return True


def _recv(sock: socket.socket, view: memoryview, flags: int) -> int:
    """recv_into returning the byte count, 0 at end of stream (or reset), -1 when the socket's
    receive timeout passed with nothing received."""
    try:
        return sock.recv_into(view, view.nbytes, flags)
    except (BlockingIOError, InterruptedError, TimeoutError):
        return -1
    except OSError:
        return 0


def _set_timeout(sock: socket.socket, option: int, timeout_s: float) -> None:
    """Set SO_RCVTIMEO / SO_SNDTIMEO: the socket stays blocking, so MSG_WAITALL and large
    sendmsg calls run in one system call each, and still cannot block past the deadline."""
    whole_s = int(timeout_s)
    micros = int((timeout_s - whole_s) * 1e6)
    if whole_s == 0 and micros == 0:
        micros = 1  # an all-zero timeval would mean "wait forever"
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole_s, micros))
