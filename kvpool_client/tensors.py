"""Paged KV-cache tensors <-> pool objects (device caches through ``staging``).

Rules of this file:
- torch (and torch_npu, for ``npu`` devices) is imported on first use, never at import time,
  so ``kvpool_client`` stays importable without it (here and in ``staging``, the only other
  module that touches tensors).
- A cache holds, per layer, a K and a V tensor ``[num_blocks, block_size, heads, head_dim]``
  (or one fused ``[2, num_blocks, block_size, heads, head_dim]`` tensor, whose two halves are
  exactly those). One pool object holds one block of one rank: every layer's K and V of that
  block, as regions in the order ``[L0.K, L0.V, L1.K, L1.V, ...]`` (MindIE's order).
- No extra copies. A CPU cache is read and written in place: each region is a ``memoryview``
  onto the tensor's own storage. A device cache (``cuda``, ``npu``) moves through
  ``staging.StagedBlockIO``: a chunk of blocks is gathered or scattered on the device in a few
  kernels and crosses by DMA straight to the segments (CUDA over a kvpool client) or through
  pinned host staging buffers. ``staging.make_block_io`` picks the one for a cache; this
  module does not import ``staging`` (which builds on it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvpool_client.prefix import PrefixPool

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
        return [host_view(t) for t in self.block_tensors(block_id)]

    def storage_views(self) -> list[memoryview]:
        """Byte views of every whole K and V tensor (CPU caches only), for buffer registration."""
        if self.device.type != "cpu":
            raise ValueError("only a CPU cache can be registered as host memory")
        torch = import_torch()
        return [host_view(t.view(-1).view(torch.uint8)) for t in (*self.k_caches,
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


def host_view(t: torch.Tensor) -> memoryview:
    """A byte view onto a CPU tensor's own storage (no copy)."""
    # Tensor.numpy() shares storage and keeps the tensor alive as the array's base; the view
    # keeps the array alive.
    return t.numpy().data.cast("B")


class RegisteringPool(PrefixPool, Protocol):
    """A pool that also takes host buffer registrations (``KVPoolClient`` does)."""

    def register_buffer(self, buf: Any) -> None:
        """Register host memory that later transfers read from or write into."""
        ...


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
