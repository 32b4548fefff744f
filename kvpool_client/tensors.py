"""Paged KV-cache tensors <-> pool objects. The only kvpool module that imports torch.

Rules of this file:
- torch (and torch_npu, for ``npu`` devices) is imported on first use, never at import time,
  so ``kvpool_client`` stays importable without it.
- A cache holds, per layer, a K and a V tensor ``[num_blocks, block_size, heads, head_dim]``
  (or one fused ``[2, num_blocks, block_size, heads, head_dim]`` tensor, whose two halves are
  exactly those). One pool object holds one block of one rank: every layer's K and V of that
  block, as regions in the order ``[L0.K, L0.V, L1.K, L1.V, ...]`` (MindIE's order).
- No extra copies. A CPU cache is read and written in place: each region is a ``memoryview``
  onto the tensor's own storage. A device cache (``cuda``, ``npu``) goes through two pinned,
  registered host staging buffers: one chunk of blocks is gathered on the device (a few
  kernels, not one copy per region) and crosses in one host copy on a side stream while the
  previous chunk moves between its staging buffer and the pool.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvpool_client.prefix import PrefixPool, RegionBlockIO
from kvpool_client.status import KVPoolError, Status

if TYPE_CHECKING:
    import torch

LAYOUTS = ("separate", "fused")


def import_torch() -> Any:
    """Return the ``torch`` module; ``ImportError`` naming the install line when it is missing."""
    try:
        return importlib.import_module("torch")
    except ImportError as exc:
        raise ImportError("kvpool_client.tensors needs PyTorch: pip install 'kvpool[model]' "
                          "(or pip install torch)") from exc


def device_module(device: torch.device) -> Any:
    """Return ``torch.cuda`` / ``torch.npu`` for an accelerator device, None for ``cpu``.

    ``npu`` needs ``torch_npu``; it is imported here, with a clear error when it is missing.
    """
    torch = import_torch()
    if device.type == "cpu":
        return None
    if device.type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise ImportError("an npu KV cache needs torch_npu (Ascend's PyTorch adapter)") from exc
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "Stream"):
        raise ValueError(f"unsupported KV-cache device {device}")
    return module


class PagedKVCache:
    """Every layer's K and V cache of one rank, paged in blocks of ``block_size`` tokens."""

    def __init__(self, k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                 *, layout: str = "separate") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not k_caches or len(k_caches) != len(v_caches):
            raise ValueError("need one K and one V cache per layer, at least one layer")
        first = k_caches[0]
        for t in (*k_caches, *v_caches):
            if t.dim() != 4:
                raise ValueError(f"a K/V cache is [num_blocks, block_size, heads, head_dim], "
                                 f"got shape {tuple(t.shape)}")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError("every K/V cache must have the same shape, dtype and device")
            if not t.is_contiguous():
                raise ValueError("K/V caches must be contiguous")
        self.k_caches = list(k_caches)
        self.v_caches = list(v_caches)
        self.layout = layout
        self.num_blocks, self.block_size, self.num_heads, self.head_dim = (int(d) for d in
                                                                           first.shape)
        self.dtype = first.dtype
        self.device = first.device
        #: bytes of one block of one layer's K (or V): one region of an object
        self.region_bytes = first[0].numel() * first.element_size()
        #: bytes of one pool object: every layer's K and V of one block
        self.object_bytes = 2 * len(self.k_caches) * self.region_bytes

    @classmethod
    def from_fused(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKVCache:
        """A cache over fused per-layer tensors ``[2, num_blocks, block_size, heads, head_dim]``."""
        for t in kv_caches:
            if t.dim() != 5 or t.shape[0] != 2:
                raise ValueError(f"a fused KV cache is [2, num_blocks, block_size, heads, "
                                 f"head_dim], got shape {tuple(t.shape)}")
        return cls([t[0] for t in kv_caches], [t[1] for t in kv_caches], layout="fused")

    @classmethod
    def allocate(cls, *, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                 head_dim: int, dtype: Any = None, device: Any = "cpu",
                 layout: str = "separate") -> PagedKVCache:
        """A zero-filled cache with the given geometry (fused: one tensor per layer)."""
        torch = import_torch()
        dtype = torch.float32 if dtype is None else dtype
        shape = (num_blocks, block_size, num_heads, head_dim)
        if layout == "fused":
            fused = [torch.zeros((2, *shape), dtype=dtype, device=device)
                     for _ in range(num_layers)]
            return cls.from_fused(fused)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   layout=layout)

    @property
    def num_layers(self) -> int:
        """Layers in the cache."""
        return len(self.k_caches)

    def _check_block(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")

    def block_tensors(self, block_id: int) -> list[torch.Tensor]:
        """The block's regions as flat byte tensors on the cache's device, in object order."""
        torch = import_torch()
        self._check_block(block_id)
        out = []
        for k, v in zip(self.k_caches, self.v_caches, strict=True):
            out.append(k[block_id].view(-1).view(torch.uint8))
            out.append(v[block_id].view(-1).view(torch.uint8))
        return out

    def block_regions(self, block_id: int) -> list[memoryview]:
        """The block's regions as memoryviews onto the tensors' own storage (CPU caches only)."""
        if self.device.type != "cpu":
            raise ValueError(f"a {self.device.type} cache has no host memoryviews: use staging")
        return [_host_view(t) for t in self.block_tensors(block_id)]

    def storage_views(self) -> list[memoryview]:
        """Byte views of every whole K and V tensor (CPU caches only), for buffer registration."""
        if self.device.type != "cpu":
            raise ValueError("only a CPU cache can be registered as host memory")
        torch = import_torch()
        return [_host_view(t.view(-1).view(torch.uint8)) for t in (*self.k_caches,
                                                                    *self.v_caches)]

    # --- sequence helpers for engines that keep a contiguous KV (e.g. transformers) -------

    def write_sequence(self, block_ids: Sequence[int],
                       layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy the first ``len(block_ids) * block_size`` tokens of a sequence into blocks.

        ``layer_kv`` holds per layer ``(k, v)`` as ``[1, heads, seq, head_dim]`` (the
        transformers layout) with ``seq >= len(block_ids) * block_size``.
        """
        torch = import_torch()
        if len(layer_kv) != self.num_layers:
            raise ValueError(f"need {self.num_layers} layers, got {len(layer_kv)}")
        for b in block_ids:
            self._check_block(b)
        num_tokens = len(block_ids) * self.block_size
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, (k, v) in enumerate(layer_kv):
            for src, dst in ((k, self.k_caches[layer]), (v, self.v_caches[layer])):
                if src.shape[-2] < num_tokens or src.shape[1] != self.num_heads:
                    raise ValueError(f"layer {layer}: {tuple(src.shape)} cannot fill "
                                     f"{len(block_ids)} blocks of {self.block_size} tokens")
                blocks = src[0, :, :num_tokens].transpose(0, 1).reshape(
                    len(block_ids), self.block_size, self.num_heads, self.head_dim)
                dst.index_copy_(0, index, blocks.to(dst.dtype))

    def read_sequence(self, block_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV of the given blocks, in order, per layer as ``[1, heads, tokens, head_dim]``."""
        torch = import_torch()
        for b in block_ids:
            self._check_block(b)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        num_tokens = len(block_ids) * self.block_size
        out = []
        for k, v in zip(self.k_caches, self.v_caches, strict=True):
            pair = tuple(
                t.index_select(0, index).reshape(num_tokens, self.num_heads, self.head_dim)
                .transpose(0, 1).unsqueeze(0).contiguous()
                for t in (k, v)
            )
            out.append((pair[0], pair[1]))
        return out


def _host_view(t: torch.Tensor) -> memoryview:
    # Tensor.numpy() shares storage and keeps the tensor alive as the array's base; the view
    # keeps the array alive.
    return t.numpy().data.cast("B")


class RegisteringPool(PrefixPool, Protocol):
    """A pool that also takes host buffer registrations (``KVPoolClient`` does)."""

    def register_buffer(self, buf: Any) -> None:
        """Register host memory that later transfers read from or write into."""
        ...


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


#: Bytes of blocks a staged transfer moves per pool call, by default. Each of the two host
#: staging buffers and the device staging buffer is this large. On an H100 host, 2 MiB blocks
#: saved / loaded 32 MiB per call moved at 8.3 / 7.6 GB/s, 128 MiB per call at 12.4 / 11.7
#: (``benchmarks/gpu_kv_bench.py``, 4 copy threads).
CHUNK_BYTES = 64 << 20


class StagedBlockIO:
    """Blocks move device <-> pinned host staging <-> pool, one chunk overlapping the next.

    A chunk of blocks is gathered on the device in a few kernels (one indexed gather per K or
    V tensor, one stack into object order) into a device staging buffer, which then crosses
    to pinned host memory in one copy; loading runs the same steps backwards. All device work
    is on one side stream, so one device staging buffer serves every chunk, while two host
    staging buffers let the pool move one chunk while the device copies the next.

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
        size = chunk_blocks * cache.object_bytes
        self.staging = [self._host_buffer(torch, size) for _ in range(2)]
        self.staging_views = [_host_view(t) for t in self.staging]
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
        #: CUDA caches over a pool that lets the caller move the bytes: blocks cross between
        #: the device staging buffer and the segments by DMA, with no host copy
        #: (None: whenever both hold; False: always through the host staging buffers)
        self.direct = cache.device.type == "cuda" and callable(
            getattr(pool, "batch_put_with", None)) and direct is not False
        if self.direct:
            _pin_segments_for_cuda(pool)

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
            if host is None:  # the objects are in the device staging buffer already
                objects = self._objects(self.device_staging, count)
            else:
                objects = self._objects(host, count)
            if host is not None and self.device_staging is not None:
                nbytes = count * self.cache.object_bytes
                self.device_staging[:nbytes].copy_(host[:nbytes], non_blocking=True)
                objects = self._objects(self.device_staging, count)
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
        ok: list[bool] = []
        for start in range(0, len(keys), self.chunk_blocks):
            chunk_keys = keys[start:start + self.chunk_blocks]
            self._wait(self._gather(block_ids[start:start + self.chunk_blocks], None))
            held: list[Any] = []  # host tensors over the views, alive until the copies end

            def fill(i: int, view: memoryview, held: list[Any] = held) -> None:
                held.append(self._dma(view, self.device_staging[i * size:(i + 1) * size],
                                      to_device=False))

            statuses = self.pool.batch_put_with(chunk_keys, [size] * len(chunk_keys), fill,
                                                done=self.stream.synchronize)
            ok += [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]
        return ok

    def _get_direct(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        size = self.cache.object_bytes
        ok: list[bool] = []
        event = None
        for start in range(0, len(keys), self.chunk_blocks):
            self._wait(event)  # the last chunk's scatter is done with the device staging
            held: list[Any] = []

            def consume(i: int, view: memoryview, held: list[Any] = held) -> None:
                if view.nbytes != size:
                    raise ValueError(f"object of {view.nbytes} bytes, a block is {size}")
                held.append(self._dma(view, self.device_staging[i * size:(i + 1) * size],
                                      to_device=True))

            got = self.pool.batch_get_with(keys[start:start + self.chunk_blocks], consume,
                                           done=self.stream.synchronize)
            chunk_ok = [n == size for n in got]
            arrived = [i for i, good in enumerate(chunk_ok) if good]
            event = self._scatter(block_ids[start:start + self.chunk_blocks], arrived, None)
            ok += chunk_ok
        self._wait(event)
        self.module.current_stream(self.cache.device).wait_stream(self.stream)
        return ok

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
        view = _host_view(staging)
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


# --- transformers glue: a contiguous-KV engine over the paged cache -----------------------


def dynamic_cache(cache: PagedKVCache, block_ids: Sequence[int], config: Any = None) -> Any:
    """A transformers ``DynamicCache`` holding the KV of ``block_ids`` (in order)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=cache.read_sequence(block_ids), config=config)


def layer_kv(past_key_values: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k, v)`` ``[batch, heads, seq, head_dim]`` of a transformers cache."""
    return [(layer.keys, layer.values) for layer in past_key_values.layers]


def forward_cached(model: Any, input_ids: Any, past: Any = None) -> tuple[Any, Any]:
    """Run ``model`` on ``input_ids`` after the KV in ``past`` (a transformers cache, or None);
    return (logits, the cache now holding the KV of ``input_ids`` too).

    transformers 5.24 renamed the argument and the output field ``past_key_values`` to
    ``cache`` (the old names warn); both spellings are served.
    """
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    out = model(input_ids, use_cache=True, **{name: past})
    cache = getattr(out, "cache", None)
    return out.logits, cache if cache is not None else out.past_key_values


def prefill(model: Any, tokens: Sequence[int], prefix: Any, cache: PagedKVCache,
            *, async_write: bool = False) -> tuple[torch.Tensor, int]:
    """Prefill ``tokens`` reusing every cached whole block; return (logits, reused tokens).

    ``prefix`` is a ``TieredPrefixCache`` over ``cache``'s blocks: blocks found on the device
    or in the pool are loaded and fed to the model as its KV cache; only the rest is
    computed, written into fresh blocks and saved. At least the last token is always computed
    (its logits are the answer).
    """
    torch = import_torch()
    match = prefix.match(tokens)
    try:
        prefix.load(match)
        block_size = cache.block_size
        usable = min(match.num_reused, (len(tokens) - 1) // block_size)
        start = usable * block_size
        past = dynamic_cache(cache, match.block_ids[:usable], model.config) if usable else None
        input_ids = torch.as_tensor([list(tokens[start:])], dtype=torch.long, device=cache.device)
        with torch.no_grad():
            logits, past = forward_cached(model, input_ids, past)
        new_ids = prefix.allocate(match)
        if new_ids:
            first = match.num_reused * block_size
            kv = [(k[:, :, first:], v[:, :, first:]) for k, v in layer_kv(past)]
            cache.write_sequence(new_ids, kv)
        prefix.save(match, async_write=async_write)
    finally:
        prefix.release(match)
    return logits, start
