"""Shared-memory transport: reach a segment of any process on this host by mapping its POSIX
shared memory once and copying directly between the caller's buffers and the mapping.

Rules of this file:
- A peer's segment is mapped on first use and cached by segment id; it is unmapped on
  ``close()``, on ``forget()``, when the segment comes back under another shm name (a remount),
  and when its file has gone (checked at most once per ``recheck_interval_s``).
- A mapping is never unmapped while a copy into or out of it is running: each mapping counts
  the copies that use it and is closed by the last one to finish.
- Only files named like kvpool segments, regular, owned by this user, of the descriptor's size
  plus the header page, and carrying the ownership proof the master handed out with the
  descriptor are mapped (PERMISSION_DENIED otherwise): a descriptor that names another
  client's memory is never written through. There is no capability check on this path: a
  process of the same user could map the file anyway; the mode 0600 keeps every other user
  out. Only the segment's bytes are reachable through a mapping, never its header.
- Every placement is bounds-checked against the mapping before any byte moves.
- Any thread may use one transport: the mapping table and the copy counts are locked;
  ``copy_batch`` copies on the calling thread (taking part in large copies), ``write_batch``
  and ``read_batch`` on an event loop (worker threads copy).
- A peer's segment, once written through, has its page tables filled on a background thread
  (``populate``, default on; ``pages.Populator``), a chunk at a time, each chunk holding the
  mapping busy like a copy: the first pass of puts over a cold segment then faults far less.
  Mappings only read from are not populated: a read fault maps 16 pages at once already, and
  populating competed with the reads for the cores (``benchmarks/first_pass.py``).
- ``borrow`` lends a placement's bytes in the mapping to the caller (which moves them itself,
  e.g. by device DMA) and keeps the mapping alive meanwhile. ``pin_mappings`` installs a
  pin / unpin pair (page-locking for DMA) run on every mapping, present and future; a pinned
  mapping is unpinned before it is unmapped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvpool_client.pages import Populator
from kvpool_client.segments import HEADER_BYTES, SHM_DIR, LocalSegment, read_owner_proof
from kvpool_client.transfer.base import (
    Item,
    Regions,
    byte_views,
    check_item,
    check_range,
    status_of,
)
from kvpool_client.transfer.copy import Copy, ParallelCopier
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentInfo

logger = logging.getLogger(__name__)

_NAME_PREFIX = "kvpool."
_MAX_NAME_CHARS = 255


class _Mapping:
    """One peer segment mapped into this process."""

    __slots__ = ("address", "busy", "checked_at_s", "inode", "mapping", "populating", "retired",
                 "shm_name", "size_bytes", "unpin", "view")

    def __init__(self, shm_name: str, mapping: mmap.mmap | None, view: memoryview,
                 inode: int, now_s: float) -> None:
        self.shm_name = shm_name
        self.mapping = mapping  # None for a segment of this process (its LocalSegment owns it)
        # The ctypes object exports the buffer only while it exists; it is dropped at once.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) \
            if mapping is not None else 0
        self.view = view
        self.size_bytes = view.nbytes
        self.inode = inode
        self.busy = 0  # copies running on it
        self.populating = mapping is None  # a mapping of our own needs no populating
        self.retired = False
        self.checked_at_s = now_s
        self.unpin: Callable[[memoryview], None] | None = None  # set while pinned

    def unmap(self) -> None:
        """Unmap now, or, while slices of the view are still referenced, when the last goes
        (the mmap object unmaps itself when freed; nothing can then point into it)."""
        unpin, self.unpin = self.unpin, None
        if unpin is not None:
            with contextlib.suppress(Exception):  # never keep a mapping alive for it
                unpin(self.view)
        mapping, self.mapping = self.mapping, None
        if mapping is None:
            return
        with contextlib.suppress(BufferError):
            self.view.release()
            mapping.close()


class ShmTransport:
    """Transport to segments on this host (see the module docstring)."""

    def __init__(self, local_segments: Mapping[str, LocalSegment] | None = None, *,
                 copier: ParallelCopier | None = None, recheck_interval_s: float = 1.0,
                 populate: bool = True) -> None:
        self._local_segments = local_segments if local_segments is not None else {}
        self._copier = copier if copier is not None else ParallelCopier()
        self._recheck_interval_s = recheck_interval_s
        self._segment_id_to_mapping: dict[str, _Mapping] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._pin: tuple[Callable[[memoryview], None], Callable[[memoryview], None]] | None = None
        self._populator: Populator[_Mapping] | None = \
            Populator(self._hold_for_populate, lambda mapping: self._release([mapping])) \
            if populate else None

    async def write(self, segment: SegmentInfo, placement: Placement, src: Regions) -> None:
        """Copy ``src`` into the placement. Raises KVPoolError INVALID_ARGUMENT (bad regions,
        out of bounds, not a kvpool segment), SEGMENT_NOT_FOUND, UNAVAILABLE (closed)."""
        (error,) = await self._run([(segment, placement, src)], writing=True)
        if error is not None:
            raise error

    async def read(self, segment: SegmentInfo, placement: Placement, dst: Regions) -> None:
        """Copy the placement into ``dst``. Raises KVPoolError like write()."""
        (error,) = await self._run([(segment, placement, dst)], writing=False)
        if error is not None:
            raise error

    async def write_batch(self, items: Sequence[Item]) -> list[Status]:
        """Write every item (copies of the whole batch run together); one Status per item."""
        return [status_of(error) for error in await self._run(items, writing=True)]

    async def read_batch(self, items: Sequence[Item]) -> list[Status]:
        """Read every item (copies of the whole batch run together); one Status per item."""
        return [status_of(error) for error in await self._run(items, writing=False)]

    def copy_batch(self, items: Sequence[Item], *, writing: bool) -> list[Status]:
        """Copy every item on the calling thread (the copy workers help with large batches);
        one Status per item."""
        errors, copies, used = self._prepare_batch(items, writing)
        try:
            if copies:
                self._copier.copy(copies)
        except Exception as exc:
            failure = KVPoolError(Status.TRANSFER_FAILED, f"copy failed: {exc}")
            errors = [error if error is not None else failure for error in errors]
        finally:
            self._release(used)
        return [status_of(error) for error in errors]

    @contextlib.contextmanager
    def borrow(self, segment: SegmentInfo, placement: Placement) -> Iterator[memoryview]:
        """The placement's bytes in the mapping, mapped until the block ends. Raises
        KVPoolError like write() (bounds, not a kvpool segment, SEGMENT_NOT_FOUND, closed)."""
        if self._closed:
            raise KVPoolError(Status.UNAVAILABLE, "shm transport is closed")
        if placement.segment_id != segment.segment_id:
            raise KVPoolError(Status.INVALID_ARGUMENT, "the placement names another segment")
        with self._lock:
            mapping = self._mapping(segment)
            check_range(placement.offset, placement.length, mapping.size_bytes)
            mapping.busy += 1
        try:
            yield mapping.view[placement.offset:placement.offset + placement.length]
        finally:
            self._release([mapping])

    def pin_mappings(self, pin: Callable[[memoryview], None],
                     unpin: Callable[[memoryview], None]) -> None:
        """Run ``pin(view)`` on every mapping (this process's own segments too) now and as
        segments are mapped, and ``unpin(view)`` before each is unmapped. One pair per
        transport; a mapping that ``pin`` fails on stays in use unpinned."""
        if self._pin is not None:
            raise KVPoolError(Status.INVALID_ARGUMENT, "mappings are already pinned")
        with self._lock:
            self._pin = (pin, unpin)
            for mapping in self._segment_id_to_mapping.values():
                self._pin_one(mapping)

    def _pin_one(self, mapping: _Mapping) -> None:
        if self._pin is None or mapping.unpin is not None:
            return
        pin, unpin = self._pin
        try:
            pin(mapping.view)
        except Exception as exc:  # a lock limit, say: the mapping still works, just slower
            logger.warning("pinning segment memory %s failed: %s", mapping.shm_name, exc)
            return
        mapping.unpin = unpin

    def forget(self, segment_id: str) -> None:
        """Drop the mapping of ``segment_id`` (e.g. it was unmounted); unmapped once idle."""
        with self._lock:
            mapping = self._segment_id_to_mapping.pop(segment_id, None)
            if mapping is not None:
                self._retire(mapping)

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed

    @property
    def num_mappings(self) -> int:
        """Number of peer segments currently mapped."""
        return len(self._segment_id_to_mapping)

    async def close(self) -> None:
        """Unmap every segment once its copies finish and stop the copy threads (idempotent)."""
        self._closed = True
        if self._populator is not None:
            self._populator.stop()
        for segment_id in list(self._segment_id_to_mapping):
            self.forget(segment_id)
        self._copier.close()

    def _prepare_batch(self, items: Sequence[Item], writing: bool
                       ) -> tuple[list[KVPoolError | None], list[Copy], list[_Mapping]]:
        """(per item its error, the copies to make, the mappings they hold busy)."""
        errors: list[KVPoolError | None] = [None] * len(items)
        copies: list[Copy] = []
        used: list[_Mapping] = []
        mappings: dict[str, _Mapping] = {}  # looked up once per segment and batch
        with self._lock:
            for index, (segment, placement, regions) in enumerate(items):
                try:
                    mapping = self._prepare(segment, placement, regions, writing, copies,
                                            mappings)
                except KVPoolError as exc:
                    errors[index] = exc
                    continue
                mapping.busy += 1
                used.append(mapping)
        return errors, copies, used

    async def _run(self, items: Sequence[Item], *, writing: bool) -> list[KVPoolError | None]:
        errors, copies, used = self._prepare_batch(items, writing)
        if not copies:
            self._release(used)
            return errors
        try:
            done = self._copier.start(copies)
        except Exception as exc:
            self._release(used)
            failure = KVPoolError(Status.TRANSFER_FAILED, f"copy failed: {exc}")
            return [error if error is not None else failure for error in errors]
        if done.done():  # copied inline: release now, not from a loop callback
            self._release(used)
            return errors
        done.add_done_callback(lambda _: self._release(used))
        # Shielded: a cancelled caller must not let the mapping go while threads still copy.
        await asyncio.shield(done)
        return errors

    def _prepare(self, segment: SegmentInfo, placement: Placement, regions: Regions,
                 writing: bool, copies: list[Copy], mappings: dict[str, _Mapping]) -> _Mapping:
        """Validate one item, append its copies; return the mapping it uses (from
        ``mappings`` when this batch already looked it up)."""
        if self._closed:
            raise KVPoolError(Status.UNAVAILABLE, "shm transport is closed")
        views = byte_views(regions, writable=not writing)
        check_item(segment, placement, views)
        mapping = mappings.get(segment.segment_id)
        if mapping is None or mapping.shm_name != segment.shm_name:
            mapping = mappings[segment.segment_id] = self._mapping(segment)
        check_range(placement.offset, placement.length, mapping.size_bytes)
        if writing and not mapping.populating and self._populator is not None:
            mapping.populating = True
            self._populator.add(mapping)
        cursor = placement.offset
        for view in views:
            target = mapping.view[cursor:cursor + view.nbytes]
            copies.append((target, view) if writing else (view, target))
            cursor += view.nbytes
        return mapping

    def _mapping(self, segment: SegmentInfo) -> _Mapping:
        """Return the (cached) mapping of ``segment``, mapping it on first use."""
        now_s = time.monotonic()
        cached = self._segment_id_to_mapping.get(segment.segment_id)
        if cached is not None:
            if cached.shm_name == segment.shm_name and (
                    now_s - cached.checked_at_s < self._recheck_interval_s
                    or self._still_there(cached, now_s)):
                return cached
            self.forget(segment.segment_id)
        local = self._local_segments.get(segment.segment_id)
        if local is not None and not local.closed and local.shm_name == segment.shm_name:
            mapping = _Mapping(local.shm_name, None, local.buffer, 0, now_s)
            mapping.checked_at_s = float("inf")  # ours: it cannot vanish under us
        else:
            mapping = self._map(segment, now_s)
        self._segment_id_to_mapping[segment.segment_id] = mapping
        self._pin_one(mapping)
        return mapping

    def _hold_for_populate(self, mapping: _Mapping) -> tuple[int, int] | None:
        with self._lock:
            if mapping.retired or mapping.mapping is None or self._closed:
                return None
            mapping.busy += 1
            return mapping.address, mapping.size_bytes

    @staticmethod
    def _still_there(mapping: _Mapping, now_s: float) -> bool:
        try:
            info = os.stat(os.path.join(SHM_DIR, mapping.shm_name))
        except OSError:
            return False
        mapping.checked_at_s = now_s
        return info.st_ino == mapping.inode

    @staticmethod
    def _map(segment: SegmentInfo, now_s: float) -> _Mapping:
        segment_id, shm_name = segment.segment_id, segment.shm_name
        if (not shm_name.startswith(_NAME_PREFIX) or "/" in shm_name or "\0" in shm_name
                or len(shm_name) > _MAX_NAME_CHARS):
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"segment {segment_id!r}: {shm_name!r} is not a kvpool shm name")
        path = os.path.join(SHM_DIR, shm_name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KVPoolError(Status.SEGMENT_NOT_FOUND,
                              f"segment {segment_id!r}: {path} does not exist") from None
        except OSError as exc:
            raise KVPoolError(Status.SEGMENT_NOT_FOUND,
                              f"segment {segment_id!r}: cannot open {path}: {exc}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size <= 0:
                raise KVPoolError(Status.INVALID_ARGUMENT,
                                  f"segment {segment_id!r}: {path} is not a segment of this user")
            proof = read_owner_proof(fd, segment.size_bytes)
            if (info.st_size != segment.size_bytes + HEADER_BYTES or not segment.ownership_proof
                    or proof is None
                    or not hmac.compare_digest(proof, segment.ownership_proof)):
                raise KVPoolError(Status.PERMISSION_DENIED,
                                  f"segment {segment_id!r}: {path} is not the memory of the "
                                  f"segment's owner (size or ownership proof differ)")
            try:
                mapped = mmap.mmap(fd, info.st_size, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise KVPoolError(Status.SEGMENT_NOT_FOUND,
                                  f"segment {segment_id!r}: cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        full = memoryview(mapped)
        view = full[:segment.size_bytes]
        full.release()
        return _Mapping(shm_name, mapped, view, info.st_ino, now_s)

    def _retire(self, mapping: _Mapping) -> None:
        mapping.retired = True
        if mapping.busy == 0:
            mapping.unmap()

    def _release(self, used: list[_Mapping]) -> None:
        with self._lock:
            for mapping in used:
                mapping.busy -= 1
                if mapping.retired and mapping.busy == 0:
                    mapping.unmap()
