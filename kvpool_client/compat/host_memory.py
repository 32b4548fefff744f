"""Host memory that Mooncake's module hands its callers: leases of registered staging buffers
(``BufferPool``: TransferQueue, Mooncake's structured object store) and plain allocations
(``MooncakeHostMemAllocator``: SGLang HiCache's host KV pool when its storage backend is
``mooncake``).

Rules of this file:
- The contracts are Mooncake's (0.3.12 on). ``BufferPool``: a pool bounded by ``max_bytes``
  (0: twice the store's ``local_buffer_size``; never less than it) and by ``max_regions``
  leases at once. ``acquire`` waits while the pool is full (unless ``block=False``, and at
  most ``timeout`` seconds) and raises RuntimeError when it cannot lease, with Mooncake's
  messages. A lease's bytes stay registered with the store while it is held, so the store's
  ``*_into`` and ``*_from`` calls take them.
- Leases are regions: anonymous mappings aligned to ``alignment``, registered with the store
  once, when made. A released region stays mapped and registered, idle, and the next lease
  that fits it (less than twice its size) takes it again: no page faults, no registration
  (with a transfer engine that is an RDMA registration), as Mooncake's pool spares them by
  leasing from its pre-registered local buffer. Idle regions count against ``max_bytes`` and
  are unregistered and unmapped, oldest first, when a new lease needs the room, and all of
  them on ``close``. ``prewarm`` does nothing, as in Mooncake.
- ``release`` refuses while a view from ``buffer`` is alive, and changes nothing then. A lease
  dropped without ``release`` gives its share of the pool back, but its region is never leased
  again while a view of it is alive (the view would see the next lease's bytes): it is
  unregistered, and unmapped once its last view goes.
- ``MooncakeHostMemAllocator.alloc(size)`` maps ``size`` bytes of shared memory, faulted in
  (as Mooncake's), and returns the address; ``free(address)`` unmaps it: 0, or -1 for an
  address ``alloc`` did not return (logged). The allocations belong to the process, not to
  the allocator object, as in Mooncake. The caller registers them with the store itself.
- ``get_alloc_func_addr()`` / ``get_free_func_addr()`` are the addresses of C functions
  ``void *alloc(size_t)`` and ``void free(void *)``, for callers that allocate through ctypes
  (LMCache's Mooncake allocators): the C library's ``valloc`` (page-aligned) and ``free``,
  where Mooncake hands out its huge-page allocator's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvpool_client.compat import codes

logger = logging.getLogger(__name__)

_PAGE_BYTES = mmap.PAGESIZE


@dataclass(slots=True)
class _Region:
    """One registered mapping of a pool: ``capacity`` bytes at ``ptr`` (``offset`` into
    ``mapping``, for alignment)."""

    mapping: mmap.mmap
    offset: int
    ptr: int
    capacity: int

    def has_views(self) -> bool:
        """Whether a view of the mapping is alive (resizing to its own size changes nothing
        and is refused exactly then)."""
        try:
            self.mapping.resize(len(self.mapping))
        except BufferError:
            return True
        return False


class BufferLease:
    """Registered host memory leased from a ``BufferPool`` (``with`` releases it)."""

    __slots__ = ("_pool", "_region", "_size")

    def __init__(self, pool: BufferPool, region: _Region, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._region = region
        self._size = size

    @property
    def ptr(self) -> int:
        """The address of the leased bytes."""
        self._check_open()
        return self._region.ptr

    @property
    def size(self) -> int:
        """The size asked for, in bytes."""
        return self._size

    @property
    def buffer(self) -> memoryview:
        """A writable view of the leased bytes (release refuses while one is alive)."""
        self._check_open()
        region = self._region
        return memoryview(region.mapping)[region.offset:region.offset + self._size]

    def release(self) -> None:
        """Give the bytes back to the pool (nothing when released already)."""
        pool = self._pool
        if pool is not None:
            pool._release(self, check_views=True)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        pool = self._pool
        if pool is not None:
            with contextlib.suppress(Exception):  # at interpreter exit, as the rest goes
                pool._release(self, check_views=False)

    def _check_open(self) -> None:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")


class BufferPool:
    """Mooncake's pool of registered staging buffers over a set-up store; see the module
    docstring. ``max_size_class``, ``prewarm_size`` and ``prewarm_count`` are taken and
    unused, as Mooncake uses them only for its counters and its no-op ``prewarm``."""

    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 64 * 1024,
                 max_size_class: int | None = None, alignment: int = 8 * 1024 * 1024,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        client = getattr(store, "_client", None)
        if client is None or not callable(getattr(store, "register_buffer", None)):
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local_bytes = int(client.config.local_buffer_size)
        if local_bytes <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self.max_bytes = 2 * local_bytes if max_bytes == 0 else max(int(max_bytes), local_bytes)
        self._min_region_bytes = int(min_size_class)
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._default_timeout_s = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else int(max_regions)
        self._cond = threading.Condition()
        self._held_bytes = 0   # of leases held or being set up (their sizes, as Mooncake counts)
        self._held = 0
        self._idle: list[_Region] = []   # released, still registered, oldest first
        self._idle_bytes = 0
        self._closed = False

    def acquire(self, size: int, block: bool | None = None,
                timeout: float | None = None) -> BufferLease:
        """Lease ``size`` bytes of registered memory; waits while the pool is full (see the
        module docstring). Raises RuntimeError when it cannot."""
        should_block = self._block if block is None else bool(block)
        timeout_s = self._default_timeout_s if timeout is None else float(timeout)
        if timeout_s is not None and timeout_s < 0:
            raise RuntimeError("timeout must be non-negative")
        requested = int(size)
        if requested < 0:
            raise TypeError(f"acquire: size must be a non-negative int, got {size!r}")
        size = _pool_bytes(requested)
        if size > self.max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        dropped: list[_Region] = []
        with self._cond:
            while True:
                self._raise_if_closed()
                if self._held_bytes + size <= self.max_bytes and (
                        self._max_regions is None or self._held < self._max_regions):
                    region = self._reusable(size)
                    # idle regions give way to this lease, oldest first
                    while region is None and self._idle and \
                            self._held_bytes + self._idle_bytes + size > self.max_bytes:
                        dropped.append(self._take_idle(0))
                    self._held_bytes += size
                    self._held += 1
                    break
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left_s = None if deadline is None else deadline - time.monotonic()
                if left_s is not None and left_s <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left_s)
        self._drop(dropped)
        try:
            if region is None:
                region = self._new_region(size)
        except BaseException:
            self._give_back(size)
            raise
        return BufferLease(self, region, requested)

    def buffer(self, size: int, block: bool | None = None,
               timeout: float | None = None) -> BufferLease:
        """The same as ``acquire``."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Nothing (as in Mooncake)."""

    def close(self) -> None:
        """Refuse further leases and free the idle memory (idempotent); RuntimeError while
        leases are held."""
        with self._cond:
            if self._held:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            idle, self._idle, self._idle_bytes = self._idle, [], 0
            self._cond.notify_all()
        self._drop(idle)

    def __del__(self) -> None:
        idle, self._idle = getattr(self, "_idle", []), []
        with contextlib.suppress(Exception):  # at interpreter exit, as the rest goes
            self._drop(idle)

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")

    def _reusable(self, size: int) -> _Region | None:
        """Take the smallest idle region that holds ``size`` bytes and is less than twice
        their size (None when there is none); under the lock."""
        best = -1
        for index, region in enumerate(self._idle):
            if size <= region.capacity <= max(2 * size, self._min_region_bytes) and (
                    best < 0 or region.capacity < self._idle[best].capacity):
                best = index
        return None if best < 0 else self._take_idle(best)

    def _take_idle(self, index: int) -> _Region:
        region = self._idle.pop(index)
        self._idle_bytes -= region.capacity
        return region

    def _new_region(self, size: int) -> _Region:
        capacity = -(-size // _PAGE_BYTES) * _PAGE_BYTES
        spare = self._alignment if self._alignment > _PAGE_BYTES else 0
        mapping = mmap.mmap(-1, capacity + spare)
        base = _address(mapping)
        offset = -base % self._alignment if spare else 0
        if self._store.register_buffer(base + offset, capacity) != codes.OK:
            mapping.close()
            raise RuntimeError("overflow buffer registration failed")
        return _Region(mapping, offset, base + offset, capacity)

    def _release(self, lease: BufferLease, *, check_views: bool) -> None:
        region = lease._region
        views = region.has_views()
        if views and check_views:
            raise RuntimeError("cannot release buffer while exported views exist")
        with self._cond:
            if lease._pool is None:
                return
            lease._pool = None   # one release wins
            self._held_bytes -= _pool_bytes(lease._size)
            self._held -= 1
            # A region with a view alive (a lease dropped with one) is never leased again.
            keep = not views and not self._closed
            if keep:
                self._idle.append(region)
                self._idle_bytes += region.capacity
            self._cond.notify_all()
        if not keep:
            self._drop([region], unmap=not views)

    def _give_back(self, size: int) -> None:
        with self._cond:
            self._held_bytes -= size
            self._held -= 1
            self._cond.notify_all()

    def _drop(self, regions: list[_Region], *, unmap: bool = True) -> None:
        """Unregister ``regions`` and unmap them (a view still alive keeps its mapping until
        it goes)."""
        for region in regions:
            self._store.unregister_buffer(region.ptr)
            if unmap:
                with contextlib.suppress(BufferError):
                    region.mapping.close()


class MooncakeHostMemAllocator:
    """Mooncake's host-memory allocator; see the module docstring."""

    def alloc(self, size: int) -> int:
        """Map ``size`` bytes of shared memory (faulted in) and return their address. Raises
        RuntimeError when it cannot."""
        try:
            mapping = mmap.mmap(-1, int(size), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except (OSError, ValueError, OverflowError) as exc:
            raise RuntimeError(f"Failed to map shared memory: {exc}") from None
        address = _address(mapping)
        with _ALLOCATED_LOCK:
            _ALLOCATED[address] = mapping
        return address

    def free(self, ptr: int) -> int:
        """Unmap the memory ``alloc`` returned at ``ptr``: 0, or -1 (logged) for an address
        it did not return."""
        with _ALLOCATED_LOCK:
            mapping = _ALLOCATED.pop(int(ptr), None)
        if mapping is None:
            logger.error("Attempted to free unknown shared memory address: 0x%x", int(ptr))
            return -1
        mapping.close()
        return 0


#: address -> mapping of every live ``MooncakeHostMemAllocator`` allocation of the process
_ALLOCATED: dict[int, mmap.mmap] = {}
_ALLOCATED_LOCK = threading.Lock()


def _pool_bytes(size: int) -> int:
    """What a lease of ``size`` bytes takes of its pool: at least 1 (Mooncake's rule)."""
    return max(size, 1)


def _address(mapping: mmap.mmap) -> int:
    """The address of ``mapping``'s first byte (leaving no export behind that would keep it
    from closing)."""
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor
    return address


def get_alloc_func_addr() -> int:
    """The address of ``void *alloc(size_t size)``: page-aligned host memory (``valloc``);
    ``get_free_func_addr`` frees it."""
    return _function_address(_LIBC.valloc)


def get_free_func_addr() -> int:
    """The address of ``void free(void *ptr)``, for memory from ``get_alloc_func_addr``'s."""
    return _function_address(_LIBC.free)


_LIBC = ctypes.CDLL(None)   # the C library this process runs on


def _function_address(function: Any) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address
    return address
