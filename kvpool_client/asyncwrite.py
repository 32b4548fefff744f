"""Async writes: a bounded queue of puts written in the background, in batches.

Rules of this file:
- Bounded: ``submit`` waits for room when ``queue_size`` objects are queued (back-pressure, never
  a drop).
- Every failure is counted (metrics and here) and reported: ``flush`` raises a
  :class:`KVPoolError` carrying the count and the first failures, then starts counting afresh.
  Pipelined commits of synchronous puts report their failures here too.
- Queued objects alias the caller's memory: it must stay unchanged until ``flush`` returns.
- Everything runs on the client's event loop; nothing here is thread-safe by itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence

from kvpool_client.core.regions import Regions, total_bytes
from kvpool_client.metrics import ClientMetrics
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions

logger = logging.getLogger(__name__)

WriteFn = Callable[[list[bytes], list[Regions], PutOptions], Awaitable[list[Status]]]

MAX_BATCH_KEYS = 256
MAX_BATCH_BYTES = 64 << 20
_KEPT_FAILURES = 8


class AsyncWriter:
    """Background writer of queued puts; ``flush`` waits for them and reports failures."""

    def __init__(self, write: WriteFn, queue_size: int, metrics: ClientMetrics) -> None:
        self._write = write
        self._queue_size = queue_size
        self._metrics = metrics
        self._items: collections.deque[tuple[bytes, Regions, PutOptions]] = collections.deque()
        self._room = asyncio.Semaphore(queue_size)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._pending = 0  # queued or being written
        self._pending_commits = 0  # keys of pipelined commits not yet answered
        self._failed_count = 0
        self._first_failures: list[tuple[bytes, Status]] = []
        self._worker: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        """Objects queued or being written, plus keys whose pipelined commit is unanswered."""
        return self._pending + self._pending_commits

    async def submit(self, keys: Sequence[bytes], regions: Sequence[Regions],
                     options: PutOptions) -> None:
        """Queue objects for writing; waits while the queue is full.

        Raises ``UNAVAILABLE`` after ``close``.
        """
        for key, parts in zip(keys, regions, strict=True):
            if self._closed:
                raise KVPoolError(Status.UNAVAILABLE, "the client is closed")
            await self._room.acquire()
            if self._closed:   # closed while this waited for room: ``close`` waits for no more
                self._room.release()
                raise KVPoolError(Status.UNAVAILABLE, "the client is closed")
            self._items.append((key, parts, options))
            self._pending += 1
            self._idle.clear()
        self._metrics.async_queue_depth = self._pending
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        self._wakeup.set()

    def watch_commit(self, keys: Sequence[bytes], future: asyncio.Future[list[Status]]) -> None:
        """Track a pipelined commit: ``flush`` waits for it and reports it if it failed."""
        num_keys = len(keys)
        self._pending_commits += num_keys
        self._idle.clear()

        def done(finished: asyncio.Future[list[Status]]) -> None:
            if finished.cancelled():
                statuses = [Status.UNAVAILABLE] * num_keys
            elif isinstance(finished.exception(), KVPoolError):
                error = finished.exception()
                assert isinstance(error, KVPoolError)
                statuses = [error.status] * num_keys
            elif finished.exception() is not None:
                statuses = [Status.INTERNAL_ERROR] * num_keys
            else:
                statuses = finished.result()
            self.record_failures(keys, statuses)
            self._pending_commits -= num_keys
            self._set_idle_if_done()

        future.add_done_callback(done)

    def _set_idle_if_done(self) -> None:
        if self._pending == 0 and self._pending_commits == 0:
            self._idle.set()

    def record_failures(self, keys: Sequence[bytes], statuses: Sequence[Status]) -> None:
        """Count failed background work (writes or pipelined commits) to report at ``flush``."""
        for key, status in zip(keys, statuses, strict=True):
            if status in (Status.OK, Status.ALREADY_EXISTS):
                continue
            self._failed_count += 1
            self._metrics.async_failures += 1
            if len(self._first_failures) < _KEPT_FAILURES:
                self._first_failures.append((key, Status(status)))
            logger.warning("background write of key %r failed: %s", key[:64], Status(status).name)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued object is written or has failed.

        Raises ``TIMEOUT`` when ``timeout_s`` passes first, and, when any background write failed
        since the last flush, a KVPoolError with the first failure's status and the count.
        """
        if not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                raise KVPoolError(Status.TIMEOUT,
                                  f"{self._pending + self._pending_commits} async writes or "
                                  f"commits still pending after {timeout_s} s") from None
        self.raise_failures()

    def raise_failures(self) -> None:
        """Raise (and reset) the failures counted since the last report, if any."""
        if not self._failed_count:
            return
        count, firsts = self._failed_count, self._first_failures
        self._failed_count, self._first_failures = 0, []
        listed = ", ".join(f"{key[:64]!r}: {status.name}" for key, status in firsts)
        raise KVPoolError(firsts[0][1], f"{count} async writes failed since the last flush "
                                        f"(first: {listed})")

    async def close(self) -> None:
        """Stop accepting work and wait for what is queued; failures stay for ``raise_failures``.
        (A ``submit`` that was waiting for room wakes after this; it queues nothing.)"""
        self._closed = True
        while self.pending:   # (one wait is not enough: a woken ``submit`` may queue first)
            self._idle.clear()   # work is pending: idle is set again once it is all done
            await self._idle.wait()
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None

    async def _drain(self) -> None:
        while True:
            if not self._items:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            keys, regions, options = self._take_batch()
            try:
                statuses = await self._write(keys, regions, options)
            except KVPoolError as exc:
                statuses = [exc.status] * len(keys)
            except Exception:  # a bug must not lose the count of what was queued
                logger.exception("async write batch failed")
                statuses = [Status.INTERNAL_ERROR] * len(keys)
            self.record_failures(keys, statuses)
            self._pending -= len(keys)
            for _ in keys:
                self._room.release()
            self._metrics.async_queue_depth = self._pending
            self._set_idle_if_done()

    def _take_batch(self) -> tuple[list[bytes], list[Regions], PutOptions]:
        """Take the longest run of queued objects with the same options, within batch limits."""
        options = self._items[0][2]
        keys: list[bytes] = []
        regions: list[Regions] = []
        num_bytes = 0
        seen: set[bytes] = set()
        while self._items and len(keys) < MAX_BATCH_KEYS and num_bytes < MAX_BATCH_BYTES:
            key, parts, item_options = self._items[0]
            # The same key twice in one batch would be one put_start; keep it for the next batch.
            if item_options != options or key in seen:
                break
            self._items.popleft()
            seen.add(key)
            keys.append(key)
            regions.append(parts)
            num_bytes += total_bytes(parts)
        return keys, regions, options
