"""Drive ``KVPoolHiCacheStorage`` the way SGLang's HiCache cache controller does.

With ``--src DIR`` (files unpacked from the SGLang 0.5.23 wheel: ``mem_cache/hicache_storage.py``
and ``mem_cache/storage/``), the backend is built by SGLang's own
``StorageBackendFactory.create_backend("dynamic", ...)`` and subclasses SGLang's own
``HiCacheStorage``; only ``sglang.srt.environ`` (read by the factory's test-injection hook) is
stubbed, because importing SGLang's package needs its GPU kernels. Without ``--src`` SGLang is
absent and the class is checked against the interface_v1 shape alone.

The host pool is a stand-in for SGLang's ``MHATokenToKVPoolHost`` with layout ``page_first``
(that class cannot be imported without SGLang's kernels): a ``kv_buffer`` tensor
``[2, size, layers, heads, head_dim]`` and ``get_page_buffer_meta`` with the same pointer
arithmetic (pool_host/mha.py). Prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class PageFirstHostPool:
    """SGLang's MHA host pool geometry, layout ``page_first``."""

    layout = "page_first"

    def __init__(self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int,
                 seed: int) -> None:
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, torch.bfloat16
        generator = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn((2, size, layer_num, head_num, head_dim),
                                     generator=generator).to(self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        ptrs = []
        for index in indices.tolist()[::self.page_size]:
            k_ptr = base + index * self.layer_num * self.head_num * self.head_dim * item
            ptrs += [k_ptr, k_ptr + v_offset]
        element = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [element] * len(ptrs)

    def page(self, first_index: int) -> torch.Tensor:
        span = slice(first_index, first_index + self.page_size)
        return torch.cat([self.kv_buffer[0, span].flatten(), self.kv_buffer[1, span].flatten()])


@dataclass
class ConfigShape:
    """The fields of SGLang's HiCacheStorageConfig that storage backends read."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla_model: bool
    model_name: str | None
    extra_config: dict[str, Any] | None


def install_sglang(src: Path) -> None:
    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    class _Unset:
        def get(self) -> None:
            return None

    class _Envs:
        def __getattr__(self, name: str) -> _Unset:
            return _Unset()

    root = src / "sglang"
    module("sglang", __path__=[str(root)])
    module("sglang.srt", __path__=[str(root / "srt")])
    module("sglang.srt.mem_cache", __path__=[str(root / "srt" / "mem_cache")])
    module("sglang.srt.environ", envs=_Envs())


def parse_arguments() -> tuple[argparse.Namespace, dict[str, Any]]:
    """The drivers' arguments (``--src``, ``--master``) and the extra config SGLang passes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", type=Path)
    parser.add_argument("--master", required=True)
    args = parser.parse_args()
    extra = {"backend_name": "kvpool", "module_path": "kvpool_client.connectors.sglang",
             "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
             "kvpool": {"master_server_address": args.master, "global_segment_size": "32mb"}}
    return args, extra


def main() -> int:
    args, extra = parse_arguments()
    page_size, num_pages = 4, 16
    pools = [PageFirstHostPool(num_pages * page_size, page_size, 3, 2, 8, seed=rank)
             for rank in (0, 1)]

    if args.src is not None:
        install_sglang(args.src)
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        def build(rank: int) -> Any:
            config = HiCacheStorageConfig(
                tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                model_name="meta-llama/Llama-3.1-8B", extra_config=extra)
            backend = StorageBackendFactory.create_backend("dynamic", config, pools[rank])
            assert isinstance(backend, HiCacheStorage)
            return backend
    else:
        from kvpool_client.connectors.sglang import KVPoolHiCacheStorage

        assert KVPoolHiCacheStorage.__mro__[1] is object  # SGLang is not importable here

        def build(rank: int) -> Any:
            config = ConfigShape(rank, 2, 0, 1, False, "meta-llama/Llama-3.1-8B", extra)
            return KVPoolHiCacheStorage(config, {})

    backends = [build(rank) for rank in (0, 1)]
    for backend, pool in zip(backends, pools, strict=True):
        backend.register_mem_pool_host(pool)  # what the cache controller does next
    hashes = [f"{i:064x}" for i in range(1, 9)]

    def indices(pages: list[int]) -> torch.Tensor:
        return torch.tensor([p * page_size + t for p in pages for t in range(page_size)])

    result: dict[str, Any] = {"base": type(backends[0]).__mro__[1].__name__}
    # backup pages 0..5 of each rank (the controller's _page_set_zero_copy)
    result["set"] = [b.batch_set_v1(hashes[:6], indices(list(range(6)))) for b in backends]
    result["set_again"] = backends[0].batch_set_v1(hashes[:3], indices([0, 1, 2]))
    # storage hit query (leading hits) and prefetch into other host pages
    result["exists"] = [b.batch_exists(hashes) for b in backends]
    result["exists_one"] = [backends[0].exists(hashes[0]), backends[0].exists(hashes[7])]
    dst = list(range(8, 14))
    result["get"] = [b.batch_get_v1(hashes[:6], indices(dst)) for b in backends]
    result["exact"] = all(torch.equal(pool.page(dst[i] * page_size), pool.page(i * page_size))
                          for pool in pools for i in range(6))
    result["get_missing"] = backends[0].batch_get_v1(hashes[5:8], indices([14, 15, 13]))
    # the older value interface
    page = torch.zeros(2 * 3 * page_size * 2 * 8, dtype=torch.bfloat16)
    result["legacy_get"] = backends[1].get(hashes[2], page) is page
    result["legacy_exact"] = torch.equal(page, pools[1].page(2 * page_size))
    result["legacy_set"] = backends[1].batch_set(["extra"], [pools[1].page(0)])
    result["legacy_get_missing"] = backends[1].batch_get(["nope"], [page]) == [None]
    backends[0].clear()  # removes rank 0's pages only
    result["after_clear"] = [b.batch_exists(hashes) for b in backends]
    result["bad_pages"] = backends[0].batch_set_v1(hashes[:2], indices([0]))
    for backend in backends:
        backend.clear()
        backend.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
