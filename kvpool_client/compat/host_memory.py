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
- Each lease is an anonymous mapping of its own, aligned to ``alignment``, registered on
  acquire and unregistered and unmapped on release. Mooncake leases slices of its
  pre-registered local buffer to spare RDMA registrations; kvpool's transports copy from any
  host memory, so a pinned pool would only hold memory. ``prewarm`` does nothing, as in
  Mooncake.
- ``release`` refuses while a view from ``buffer`` is alive (the bytes would be unmapped under
  it), and changes nothing then. A lease dropped without ``release`` gives its share of the
  pool back; its mapping goes with its last view.
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

import ctypes
import logging
import mmap
import threading
import time
from typing import Any

from kvpool_client.compat import codes

logger = logging.getLogger(__name__)

_PAGE_BYTES = mmap.PAGESIZE


class BufferLease:
    """Registered host memory leased from a ``BufferPool`` (``with`` releases it)."""

    __slots__ = ("_pool", "_map", "_offset", "_ptr", "_size", "_held_bytes")

    def __init__(self, pool: BufferPool, mapping: mmap.mmap, offset: int, ptr: int,
                 size: int, held_bytes: int) -> None:
        self._pool: BufferPool | None = pool
        self._map = mapping
        self._offset = offset
        self._ptr = ptr
        self._size = size
        self._held_bytes = held_bytes   # of the pool, registered (at least 1)

    @property
    def ptr(self) -> int:
        """The address of the leased bytes."""
        self._check_open()
        return self._ptr

    @property
    def size(self) -> int:
        """The size asked for, in bytes."""
        return self._size

    @property
    def buffer(self) -> memoryview:
        """A writable view of the leased bytes (release refuses while one is alive)."""
        self._check_open()
        return memoryview(self._map)[self._offset:self._offset + self._size]

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
            pool._release(self, check_views=False)

    def _check_open(self) -> None:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")


class BufferPool:
    """Mooncake's pool of registered staging buffers over a set-up store; see the module
    docstring."""

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
        self.max_size_class = self.max_bytes if max_size_class is None else int(max_size_class)
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._default_timeout_s = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else int(max_regions)
        self._cond = threading.Condition()
        self._held_bytes = 0   # leased or being set up
        self._held = 0
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
        size = max(requested, 1)   # what it takes of the pool (Mooncake's rule)
        if size > self.max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._raise_if_closed()
                if self._fits(size):
                    self._held_bytes += size
                    self._held += 1
                    break
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left_s = None if deadline is None else deadline - time.monotonic()
                if left_s is not None and left_s <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left_s)
        try:
            return self._lease(size, requested)
        except BaseException:
            self._give_back(size)
            raise

    def buffer(self, size: int, block: bool | None = None,
               timeout: float | None = None) -> BufferLease:
        """The same as ``acquire``."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Nothing (as in Mooncake)."""

    def close(self) -> None:
        """Refuse further leases (idempotent); RuntimeError while leases are held."""
        with self._cond:
            if self._closed:
                return
            if self._held:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._cond.notify_all()

    def _fits(self, size: int) -> bool:
        return self._held_bytes + size <= self.max_bytes and (
            self._max_regions is None or self._held < self._max_regions)

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")

    def _lease(self, size: int, requested: int) -> BufferLease:
        spare = self._alignment if self._alignment > _PAGE_BYTES else 0
        mapping = mmap.mmap(-1, size + spare)
        base = _address(mapping)
        offset = -base % self._alignment if spare else 0
        if self._store.register_buffer(base + offset, size) != codes.OK:
            mapping.close()
            raise RuntimeError("overflow buffer registration failed")
        return BufferLease(self, mapping, offset, base + offset, requested, size)

    def _release(self, lease: BufferLease, *, check_views: bool) -> None:
        with self._cond:
            if lease._pool is None:
                return
            lease._pool = None   # one release wins
        self._store.unregister_buffer(lease._ptr)
        try:
            lease._map.close()
        except BufferError:
            if check_views:
                # Nothing changes: the lease stays held and its bytes registered.
                self._store.register_buffer(lease._ptr, lease._held_bytes)
                lease._pool = self
                raise RuntimeError("cannot release buffer while exported views exist") from None
            # dropped with a view alive: the view keeps the mapping until it goes
        self._give_back(lease._held_bytes)

    def _give_back(self, size: int) -> None:
        with self._cond:
            self._held_bytes -= size
            self._held -= 1
            self._cond.notify_all()



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
