"""KV blocks <-> pool objects: ``StagedBlockIO`` for device caches, and ``make_block_io``, which
picks the ``BlockIO`` of a cache (see ``tensors`` for the cache).

Rules of this file:
- torch is imported on first use (``tensors.import_torch``), never at import time.
- A chunk of blocks is gathered on the device in a few kernels (one indexed gather per K or V
  tensor, one stack into object order) into a device staging buffer; loading runs the same
  steps backwards. All device work is on one side stream, ordered after the caller's queued
  work, and a load is ordered before the caller's later work.
- Direct (CUDA cache, pool with ``batch_put_with``): the chunk crosses by DMA between the device
  staging buffer and the segments' own memory, page-locked through ``pin_shared_memory``; one
  stream synchronize per pool call, before its commit or lease check.
- Engine (device cache, pool with a transfer engine): the device staging buffer is registered
  with the engine, and each chunk goes between it and the placements, wherever they are, in the
  engine's batch calls (``AddressRange`` regions): no host copy on kvpool's side.
- Staged (otherwise): it crosses in one copy to one of two pinned, registered host staging
  buffers, so that the pool moves one chunk while the device copies the next. One device
  staging buffer serves every chunk, the side stream ordering its uses.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from kvpool_client.core.regions import AddressRange
from kvpool_client.prefix import RegionBlockIO
from kvpool_client.tensors import (
    PagedKVCache,
    RegisteringPool,
    device_module,
    host_view,
    import_torch,
)
from kvpool_wire.status import KVPoolError, Status

#: Bytes of blocks a staged transfer moves per pool call, by default. Each of the two host
#: staging buffers and the device staging buffer is this large. On an H100 host, 2 MiB blocks
#: saved / loaded 32 MiB per call moved at 8.3 / 7.6 GB/s, 128 MiB per call at 12.4 / 11.7
#: (``benchmarks/gpu_kv_bench.py``, 4 copy threads).
CHUNK_BYTES = 64 << 20


class StagedBlockIO:
    """Device blocks <-> pool objects, a chunk per pool call (see the module docstring).

    It also runs on a CPU cache (the host staging buffer is then gathered into directly and
    copies are synchronous), which is how its chunking is tested where no accelerator exists.
    """

    def __init__(self, cache: PagedKVCache, pool: RegisteringPool, *,
                 chunk_blocks: int | None = None, direct: bool | None = None) -> None:
        torch = import_torch()
        if chunk_blocks is None:  # one pool call per CHUNK_BYTES: master calls amortized
            chunk_blocks = max(1, CHUNK_BYTES // cache.object_bytes)
        if chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be > 0, got {chunk_blocks}")
        self.cache = cache
        self.pool = pool
        self.chunk_blocks = chunk_blocks
        self.module = device_module(cache.device)
        self.stream = None if self.module is None else self.module.Stream(device=cache.device)
        #: CUDA caches over a pool that lets the caller move the bytes: blocks cross between
        #: the device staging buffer and the segments by DMA, with no host copy
        #: (None: whenever both hold; False: always through the host staging buffers)
        #: device caches over a pool with a transfer engine: the engine moves each chunk
        #: between the device staging buffer and the placements (False: never)
        self.engine = cache.device.type != "cpu" and bool(getattr(pool, "has_engine", False)) \
            and direct is not False
        self.direct = not self.engine and cache.device.type == "cuda" and callable(
            getattr(pool, "batch_put_with", None)) and direct is not False
        size = chunk_blocks * cache.object_bytes
        # two host staging buffers, pinned, for the staged path only
        self.staging = [] if self.direct or self.engine else \
            [self._host_buffer(torch, size) for _ in range(2)]
        self.staging_views = [host_view(t) for t in self.staging]
        for view in self.staging_views:
            pool.register_buffer(view)
        self.device_staging = None if self.module is None else torch.empty(
            size, dtype=torch.uint8, device=cache.device)
        # every K and V tensor as [num_blocks, region bytes], in object order
        self.region_tables = [t.view(cache.num_blocks, -1).view(torch.uint8)
                              for pair in zip(cache.k_caches, cache.v_caches, strict=True)
                              for t in pair]
        # async writes keep their own staging alive until the pool has written them (flush)
        self._async_buffers: list[Any] = []
        if self.direct:
            _pin_segments_for_cuda(pool)
        if self.engine:
            assert self.device_staging is not None
            pool.register_memory(self.device_staging.data_ptr(), size)  # type: ignore[attr-defined]

    def _host_buffer(self, torch: Any, size_bytes: int) -> Any:
        return torch.empty(size_bytes, dtype=torch.uint8, pin_memory=self.module is not None)

    def _object_views(self, view: memoryview, count: int) -> list[list[memoryview]]:
        size = self.cache.object_bytes
        return [[view[i * size:(i + 1) * size]] for i in range(count)]

    def _objects(self, flat: Any, count: int) -> Any:
        """``flat``'s first ``count`` objects as ``[count, regions, region bytes]``."""
        return flat[:count * self.cache.object_bytes].view(count, len(self.region_tables), -1)

    def _index(self, block_ids: Sequence[int]) -> Any:
        torch = import_torch()
        return torch.as_tensor(list(block_ids), dtype=torch.long).to(self.cache.device,
                                                                     non_blocking=True)

    def _on_side_stream(self, work: Any) -> Any:
        """Run ``work()`` on the side stream after the caller's queued work; return an event
        that completes with it (None on CPU, where it ran synchronously)."""
        module, stream = self.module, self.stream
        if module is None or stream is None:
            work()
            return None
        # the side stream starts after the work already queued (the KV being written)
        stream.wait_stream(module.current_stream(self.cache.device))
        with module.stream(stream):
            work()
            event = module.Event()
            event.record(stream)
        return event

    def _gather(self, block_ids: Sequence[int], host: Any) -> Any:
        """Copy the blocks, in object order, to the start of ``host`` (None: only to the device
        staging buffer); return an event."""
        torch = import_torch()
        count = len(block_ids)

        def work() -> None:
            index = self._index(block_ids)
            rows = [table.index_select(0, index) for table in self.region_tables]
            if self.device_staging is None:
                torch.stack(rows, dim=1, out=self._objects(host, count))
                return
            torch.stack(rows, dim=1, out=self._objects(self.device_staging, count))
            if host is None:
                return
            nbytes = count * self.cache.object_bytes
            host[:nbytes].copy_(self.device_staging[:nbytes], non_blocking=True)

        return self._on_side_stream(work)

    def _scatter(self, block_ids: Sequence[int], positions: Sequence[int], host: Any) -> Any:
        """Copy the objects at ``positions`` of ``host`` into ``block_ids[position]``."""
        if not positions:
            return None
        count = max(positions) + 1

        def work() -> None:
            if host is not None and self.device_staging is not None:
                nbytes = count * self.cache.object_bytes
                self.device_staging[:nbytes].copy_(host[:nbytes], non_blocking=True)
            # host None: the objects are in the device staging buffer already
            objects = self._objects(host if self.device_staging is None
                                    else self.device_staging, count)
            if len(positions) < count:  # some objects did not arrive: skip their rows
                objects = objects[self._index(positions)]
            index = self._index([block_ids[p] for p in positions])
            for region, table in enumerate(self.region_tables):
                table.index_copy_(0, index, objects[:, region])

        return self._on_side_stream(work)

    @staticmethod
    def _wait(event: Any) -> None:
        if event is not None:
            event.synchronize()

    def put_blocks(self, keys: Sequence[str], block_ids: Sequence[int], *,
                   async_write: bool = False) -> list[bool]:
        """Write device blocks to the pool; True per block written (or queued, with async)."""
        if len(keys) != len(block_ids):
            raise ValueError("one key per block")
        for block_id in block_ids:
            self.cache._check_block(block_id)
        if not keys:
            return []
        if async_write:
            return self._put_async(keys, block_ids)
        if self.engine:
            return self._put_engine(keys, block_ids)
        if self.direct:
            return self._put_direct(keys, block_ids)
        ok: list[bool] = []
        pending: tuple[Sequence[str], int, Any] | None = None
        for start in range(0, len(keys), self.chunk_blocks):
            slot = (start // self.chunk_blocks) % 2
            chunk_ids = block_ids[start:start + self.chunk_blocks]
            event = self._gather(chunk_ids, self.staging[slot])
            if pending is not None:  # the previous chunk goes to the pool while this one copies
                ok += self._put_slot(*pending)
            pending = (keys[start:start + self.chunk_blocks], slot, event)
        if pending is not None:
            ok += self._put_slot(*pending)
        return ok

    def _put_slot(self, keys: Sequence[str], slot: int, event: Any) -> list[bool]:
        self._wait(event)
        statuses = self.pool.batch_put_regions(
            keys, self._object_views(self.staging_views[slot], len(keys)))
        return [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]

    def _put_direct(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        size = self.cache.object_bytes
        staging, pool, stream = self._direct_parts()
        ok: list[bool] = []
        for start in range(0, len(keys), self.chunk_blocks):
            chunk_keys = keys[start:start + self.chunk_blocks]
            self._wait(self._gather(block_ids[start:start + self.chunk_blocks], None))
            held: list[Any] = []  # host tensors over the views, alive until the copies end

            def fill(i: int, view: memoryview, held: list[Any] = held) -> None:
                held.append(self._dma(view, staging[i * size:(i + 1) * size], to_device=False))

            statuses = pool.batch_put_with(chunk_keys, [size] * len(chunk_keys), fill,
                                           done=stream.synchronize)
            ok += [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]
        return ok

    def _device_ranges(self, count: int) -> list[list[AddressRange]]:
        """The first ``count`` objects of the device staging buffer, by address."""
        assert self.device_staging is not None
        base, size = self.device_staging.data_ptr(), self.cache.object_bytes
        return [[AddressRange(base + i * size, size)] for i in range(count)]

    def _put_engine(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        ok: list[bool] = []
        for start in range(0, len(keys), self.chunk_blocks):
            chunk_keys = keys[start:start + self.chunk_blocks]
            self._wait(self._gather(block_ids[start:start + self.chunk_blocks], None))
            statuses = self.pool.batch_put_regions(
                chunk_keys, self._device_ranges(len(chunk_keys)))  # type: ignore[arg-type]
            ok += [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]
        return ok

    def _get_engine(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        ok: list[bool] = []
        for start in range(0, len(keys), self.chunk_blocks):
            chunk_keys = keys[start:start + self.chunk_blocks]
            # the engine fills the staging buffer: the last chunk's scatter was waited for
            got = self.pool.batch_get_regions(
                chunk_keys, self._device_ranges(len(chunk_keys)))  # type: ignore[arg-type]
            chunk_ok = [n == self.cache.object_bytes for n in got]
            arrived = [i for i, good in enumerate(chunk_ok) if good]
            self._wait(self._scatter(block_ids[start:start + self.chunk_blocks], arrived, None))
            ok += chunk_ok
        self.module.current_stream(self.cache.device).wait_stream(self.stream)
        return ok

    def _get_direct(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        size = self.cache.object_bytes
        staging, pool, stream = self._direct_parts()
        ok: list[bool] = []
        event = None
        for start in range(0, len(keys), self.chunk_blocks):
            # the next chunk's copies into the device staging buffer queue behind the last
            # chunk's scatter on the same stream
            held: list[Any] = []

            def consume(i: int, view: memoryview, held: list[Any] = held) -> None:
                if view.nbytes != size:
                    raise ValueError(f"object of {view.nbytes} bytes, a block is {size}")
                held.append(self._dma(view, staging[i * size:(i + 1) * size], to_device=True))

            got = pool.batch_get_with(keys[start:start + self.chunk_blocks], consume,
                                      done=stream.synchronize)
            chunk_ok = [n == size for n in got]
            arrived = [i for i, good in enumerate(chunk_ok) if good]
            event = self._scatter(block_ids[start:start + self.chunk_blocks], arrived, None)
            ok += chunk_ok
        self._wait(event)
        self.module.current_stream(self.cache.device).wait_stream(self.stream)
        return ok

    def _direct_parts(self) -> tuple[Any, Any, Any]:
        """(device staging buffer, the pool as one with ``batch_put_with``, side stream)."""
        assert self.device_staging is not None and self.stream is not None
        return self.device_staging, self.pool, self.stream

    def _dma(self, view: memoryview, device_bytes: Any, *, to_device: bool) -> Any:
        """Queue a copy between a pool view and device bytes on the side stream; return the
        host tensor over the view (keep it until the stream is synchronized)."""
        torch = import_torch()
        host = torch.frombuffer(view, dtype=torch.uint8)
        with self.module.stream(self.stream):
            if to_device:
                device_bytes.copy_(host, non_blocking=True)
            else:
                host.copy_(device_bytes, non_blocking=True)
        return host

    def _put_async(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        torch = import_torch()
        size = self.cache.object_bytes
        staging = self._host_buffer(torch, len(keys) * size)
        for start in range(0, len(keys), self.chunk_blocks):
            chunk_ids = block_ids[start:start + self.chunk_blocks]
            self._wait(self._gather(chunk_ids, staging[start * size:]))
        view = host_view(staging)
        self.pool.register_buffer(view)
        self._async_buffers.append((staging, view))
        statuses = self.pool.batch_put_regions(
            keys, self._object_views(view, len(keys)), async_write=True)
        return [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]

    def flush(self) -> None:
        """Wait for the pool's async writes, then drop their staging buffers."""
        try:
            self.pool.flush()
        finally:
            self._async_buffers.clear()

    def get_blocks(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        """Read pool objects into device blocks; True per block whose bytes all arrived.

        Returns once the data is on the device and ordered before later work on the current
        stream.
        """
        if len(keys) != len(block_ids):
            raise ValueError("one key per block")
        for block_id in block_ids:
            self.cache._check_block(block_id)
        if self.engine:
            return self._get_engine(keys, block_ids)
        if self.direct:
            return self._get_direct(keys, block_ids)
        ok: list[bool] = []
        events: list[Any] = [None, None]
        for start in range(0, len(keys), self.chunk_blocks):
            slot = (start // self.chunk_blocks) % 2
            self._wait(events[slot])  # the scatter that last used this staging is done
            chunk_keys = keys[start:start + self.chunk_blocks]
            views = self._object_views(self.staging_views[slot], len(chunk_keys))
            got = self.pool.batch_get_regions(chunk_keys, views)
            chunk_ok = [n == self.cache.object_bytes for n in got]
            chunk_ids = block_ids[start:start + self.chunk_blocks]
            arrived = [i for i, good in enumerate(chunk_ok) if good]
            events[slot] = self._scatter(chunk_ids, arrived, self.staging[slot])
            ok += chunk_ok
        for event in events:
            self._wait(event)
        if self.module is not None:
            self.module.current_stream(self.cache.device).wait_stream(self.stream)
        return ok


def make_block_io(cache: PagedKVCache, pool: RegisteringPool, *,
                  chunk_blocks: int | None = None) -> RegionBlockIO | StagedBlockIO:
    """The ``BlockIO`` for ``cache``: in place for a CPU cache, staged for a device cache.

    A CPU cache's tensors are registered with the pool as they are; a device cache gets
    pinned staging buffers, registered likewise.
    """
    if cache.device.type == "cpu":
        for view in cache.storage_views():
            pool.register_buffer(view)
        return RegionBlockIO(pool, cache.block_regions)
    return StagedBlockIO(cache, pool, chunk_blocks=chunk_blocks)


def _pin_segments_for_cuda(pool: Any) -> None:
    """Have ``pool`` page-lock every segment it maps with CUDA (once per pool), so copies
    between them and the device are DMA; a pool already pinning is left as it is."""
    torch = import_torch()
    cudart = torch.cuda.cudart()

    def address(view: memoryview) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))

    def pin(view: memoryview) -> None:
        # portable: pinned for every device's context, not only the current one
        err = cudart.cudaHostRegister(address(view), view.nbytes, 1)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")

    def unpin(view: memoryview) -> None:
        cudart.cudaHostUnregister(address(view))

    try:
        pool.pin_shared_memory(pin, unpin)
    except KVPoolError as exc:
        if exc.status != Status.INVALID_ARGUMENT:  # INVALID_ARGUMENT: pinned already
            raise
