"""Fast memory copies between caller buffers and mapped segments.

Small pieces are copied with memoryview slice assignment (the cheapest call, but it holds the
GIL), and large pieces with the GIL released, so that two threads overlap their copies: with
streaming stores (``_ntcopy``, see ``STREAM_MIN_BYTES``) where the extension was built, else
``numpy.copyto`` (a few microseconds per call). So small pieces, and batches too small to be
worth a thread hand-off, are copied at once on the caller's thread; the large pieces of a
larger batch are cut into parts of equal byte count, one per copy thread.

Who copies those parts depends on the caller: ``copy`` (the blocking driver) copies one part
on the calling thread while the workers copy the rest, and returns when every byte is copied;
``start`` (an event loop) has the workers copy every part while the loop stays free.
``benchmarks/copy_policy.py`` measures both against single-thread memcpy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import numpy as np

_stream_copy: Callable[[memoryview, memoryview], None] | None
try:  # the optional C extension (see setup.py); numpy copies where it was not built
    from kvpool_client.transfer._ntcopy import copy as _stream_copy
except ImportError:  # pragma: no cover - built wherever a C compiler is at hand
    _stream_copy = None

Copy = tuple[memoryview, memoryview]  # (destination, source), flat byte views of equal size

#: Pieces at least this large are copied with streaming (non-temporal) stores: they bypass the
#: caches, which the destination would only pollute (see ``_ntcopy.c``; README, "Data plane").
STREAM_MIN_BYTES = 256 << 10

#: Total size below which a batch is copied at once on the calling thread: a thread hand-off
#: costs tens of microseconds, more than copying this much.
INLINE_MAX_BYTES = 512 << 10
#: Pieces smaller than this are always copied inline: per call, slice assignment is cheaper
#: than numpy, and the GIL it holds is held for less time than a thread hand-off takes.
#: Pieces are not cut smaller than this when a batch is split across threads either.
MIN_SPLIT_BYTES = 64 << 10


def copy_now(copies: Sequence[Copy]) -> None:
    """Copy every pair on this thread, holding the GIL (cheapest per call for small pieces)."""
    for dst, src in copies:
        dst[:] = src


def copy_nogil(copies: Sequence[Copy]) -> None:
    """Copy every pair with the GIL released: with streaming stores (``_ntcopy``, where it was
    built) from ``STREAM_MIN_BYTES`` up, otherwise numpy.copyto on flat uint8 arrays."""
    stream, stream_min_bytes = _stream_copy, STREAM_MIN_BYTES
    for dst, src in copies:
        if stream is not None and dst.nbytes >= stream_min_bytes:
            stream(dst, src)
        else:
            np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def split_by_bytes(copies: Sequence[Copy], parts: int) -> list[list[Copy]]:
    """Cut ``copies`` into at most ``parts`` lists of nearly equal byte counts, splitting a
    large pair where needed; order within each list follows the input."""
    total_bytes = sum(dst.nbytes for dst, _ in copies)
    share_bytes = max(MIN_SPLIT_BYTES, -(-total_bytes // max(parts, 1)))
    result: list[list[Copy]] = [[]]
    room_bytes = share_bytes
    for dst, src in copies:
        start = 0
        while start < dst.nbytes:
            if room_bytes == 0:
                result.append([])
                room_bytes = share_bytes
            take = min(room_bytes, dst.nbytes - start)
            result[-1].append((dst[start:start + take], src[start:start + take]))
            start += take
            room_bytes -= take
    return [part for part in result if part]


class ParallelCopier:
    """Runs batches of copies: small ones inline, large ones on ``num_threads`` threads (see
    the module docstring for who those are)."""

    def __init__(self, num_threads: int = 2, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self.num_threads = max(1, num_threads)
        self.inline_max_bytes = inline_max_bytes
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def _split(self, copies: Sequence[Copy]) -> list[Copy]:
        """Copy the pieces to make on this thread now; return the large ones to spread."""
        large = [pair for pair in copies if pair[0].nbytes >= MIN_SPLIT_BYTES]
        if self.num_threads == 1 or sum(dst.nbytes for dst, _ in large) <= self.inline_max_bytes:
            large = []
        copy_now([pair for pair in copies if pair[0].nbytes < MIN_SPLIT_BYTES] if large
                 else copies)
        return large

    def copy(self, copies: Sequence[Copy]) -> None:
        """Copy everything, the calling thread taking part; return when every byte has been
        copied. Raises what a copy raised (no copy is left running then)."""
        large = self._split(copies)
        if large:
            self._copy_with_caller(large)

    def start(self, copies: Sequence[Copy]) -> asyncio.Future[list[None]]:
        """Start copying on the running event loop; return a future that completes when every
        byte has been copied (already completed when the copies were made on this thread).

        The future completes only after the worker threads are done, even if the task awaiting
        it is cancelled, so callers can tie the lifetime of mappings to it (await it through
        ``asyncio.shield``).
        """
        loop = asyncio.get_running_loop()
        large = self._split(copies)
        if not large:
            done: asyncio.Future[list[None]] = loop.create_future()
            done.set_result([])
            return done
        executor = self._workers()
        return asyncio.gather(*(loop.run_in_executor(executor, copy_nogil, part)
                                for part in split_by_bytes(large, self.num_threads)))

    def _copy_with_caller(self, large: Sequence[Copy]) -> None:
        """Copy ``large`` on this thread and ``num_threads - 1`` workers; return when all are
        done (also when one failed: then raise its error, no copy being left running)."""
        mine, *theirs = split_by_bytes(large, self.num_threads)
        executor = self._workers()
        helpers: list[concurrent.futures.Future[None]] = []
        try:
            for part in theirs:
                helpers.append(executor.submit(copy_nogil, part))
            copy_nogil(mine)
        finally:
            concurrent.futures.wait(helpers)  # also when a submit failed: none is left running
        for helper in helpers:
            helper.result()

    def _workers(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.num_threads, thread_name_prefix="kvpool-copy")
            return self._executor

    def close(self) -> None:
        """Stop the worker threads once their current copies are done (idempotent)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)
