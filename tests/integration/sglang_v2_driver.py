"""Drive ``KVPoolHiCacheStorage``'s v2 interface the way SGLang's hybrid cache controller does:
a KV anchor pool plus side pools registered with ``register_mem_host_pool_v2``, written and read
with ``batch_set_v2`` / ``batch_get_v2`` and looked up with ``batch_exists_v2`` under each hit
policy.

With ``--src DIR`` (files unpacked from the SGLang 0.5.23 wheel), the transfers are SGLang's own
``PoolTransfer`` / ``PoolName`` / ``PoolHitPolicy``, results must be SGLang's
``PoolTransferResult``, and every call also runs against SGLang's own reference backend,
``HiCacheFile`` (files under a temporary directory): both must answer the same. Only
``sglang.srt.environ`` and ``sglang.srt.utils.common`` are stubbed (importing SGLang's package
needs its GPU kernels). Without ``--src`` the transfers are plain objects with the same fields
and the answers are checked against the values SGLang's rules give (the test holds them).

The side pools are stand-ins for SGLang's host pools (those need its kernels): a Mamba-like
state pool (one slot per page, ``get_hybrid_pool_buffer``) and an indexer-like page pool.
Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from dataclasses import dataclass
from typing import Any

import torch
from sglang_driver import ConfigShape, PageFirstHostPool, install_sglang, parse_arguments


class SlotPool:
    """A host pool whose page is ``page_size`` consecutive rows of one byte tensor."""

    def __init__(self, rows: int, row_bytes: int, page_size: int, seed: int) -> None:
        self.page_size, self.row_bytes = page_size, row_bytes
        generator = torch.Generator().manual_seed(seed)
        self.buffer = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8,
                                    generator=generator)

    def get_hybrid_pool_buffer(self) -> list[torch.Tensor]:
        return [self.buffer]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        base, page_bytes = self.buffer.data_ptr(), self.row_bytes * self.page_size
        firsts = indices.tolist()[::self.page_size]
        return [base + i * self.row_bytes for i in firsts], [page_bytes] * len(firsts)

    # what SGLang's file backend calls
    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buffer[index:index + self.page_size].flatten()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.row_bytes * self.page_size, dtype=torch.uint8)

    def set_from_flat_data_page(self, index: int, data: torch.Tensor) -> None:
        self.buffer[index:index + self.page_size] = data.view(self.page_size, self.row_bytes)

    def page(self, index: int) -> bytes:
        return bytes(self.buffer[index:index + self.page_size].flatten().numpy())


@dataclass
class Transfer:
    """The fields of SGLang's PoolTransfer that storage backends read."""

    name: Any
    host_indices: Any = None
    keys: Any = None
    hit_policy: Any = "all_pages"
    group_pages: int = 0


def stub_utils() -> None:
    utils = types.ModuleType("sglang.srt.utils")
    utils.__path__ = []
    common = types.ModuleType("sglang.srt.utils.common")
    common.__dict__["human_readable_int"] = int
    sys.modules["sglang.srt.utils"] = utils
    sys.modules["sglang.srt.utils.common"] = common


def main() -> int:
    args, extra = parse_arguments()
    files = tempfile.TemporaryDirectory(prefix="kvpool-sglang-file-")
    names: dict[str, Any] = {"mamba": "mamba", "indexer": "indexer", "kv": "kv"}
    policies: dict[str, Any] = {p: p for p in ("all_pages", "trailing_pages", "block_groups")}
    make: Any = Transfer
    builders: dict[str, Any] = {}
    if args.src is not None:
        install_sglang(args.src)
        stub_utils()
        from sglang.srt.mem_cache import hicache_storage as hs
        from sglang.srt.mem_cache.storage import StorageBackendFactory

        names = {"mamba": hs.PoolName.MAMBA, "indexer": hs.PoolName.INDEXER,
                 "kv": hs.PoolName.KV}
        policies = {"all_pages": hs.PoolHitPolicy.ALL_PAGES,
                    "trailing_pages": hs.PoolHitPolicy.TRAILING_PAGES,
                    "block_groups": hs.PoolHitPolicy.BLOCK_GROUPS}
        make = hs.PoolTransfer

        def config(extra_config: dict[str, Any]) -> Any:
            return hs.HiCacheStorageConfig(
                tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                model_name="Qwen/Qwen3-Next-80B", extra_config=extra_config)

        builders["kvpool"] = lambda pool: StorageBackendFactory.create_backend(
            "dynamic", config(extra), pool)
        builders["file"] = lambda pool: hs.HiCacheFile(
            config({"file_storage_path": files.name}))
    else:
        from kvpool_client.connectors.sglang import KVPoolHiCacheStorage

        builders["kvpool"] = lambda pool: KVPoolHiCacheStorage(
            ConfigShape(0, 1, 0, 1, False, "Qwen/Qwen3-Next-80B", extra), {})

    page_size = 4
    hashes = [f"{i:064x}" for i in range(100, 112)]
    results: dict[str, Any] = {}
    for label, build in builders.items():
        kv = PageFirstHostPool(16 * page_size, page_size, 2, 2, 8, seed=1)
        mamba = SlotPool(16, 96, 1, seed=2)
        indexer = SlotPool(16 * page_size, 24, page_size, seed=3)
        backend = build(kv)
        backend.register_mem_pool_host(kv)
        backend.register_mem_host_pool_v2(kv, names["kv"])
        backend.register_mem_host_pool_v2(mamba, names["mamba"])
        backend.register_mem_host_pool_v2(indexer, names["indexer"])
        backend.on_host_pools_registered()

        def tokens(pages: list[int]) -> torch.Tensor:
            return torch.tensor([p * page_size + t for p in pages for t in range(page_size)])

        def mamba_at(slots: list[int], keys: list[str]) -> Any:
            return make(name=names["mamba"], host_indices=torch.tensor(slots), keys=keys,
                        hit_policy=policies["trailing_pages"])

        def indexer_at(pages: list[int], keys: list[str]) -> Any:
            return make(name=names["indexer"], host_indices=tokens(pages), keys=keys,
                        hit_policy=policies["all_pages"])

        out: dict[str, Any] = {}
        # KV pages 0..7 (the anchor's own path), states after pages 2 and 7, indexer 0..4
        out["kv_set"] = backend.batch_set(hashes[:8], [kv.page(p * page_size)
                                                       for p in range(8)])
        out["set_v2"] = {str(k): v for k, v in backend.batch_set_v2([
            mamba_at([2, 7], [hashes[2], hashes[7]]),
            indexer_at([0, 1, 2, 3, 4], hashes[:5])]).items()}

        def exists(transfers: list[Any], backend: Any = backend) -> list[Any]:
            r = backend.batch_exists_v2(hashes[:10], transfers)
            return [r.kv_hit_pages, {str(k): v for k, v in r.extra_pool_hit_pages.items()},
                    r.restorable_prefix_pages]

        one = [hashes[9]]  # a trailing window of one page
        out["exists_mamba"] = exists([mamba_at([0], one)])
        out["exists_both"] = exists([mamba_at([0], one), indexer_at([0], one)])
        out["exists_indexer_first"] = exists([indexer_at([0], one), mamba_at([0], one)])
        out["exists_none"] = exists([])
        # prefetch into other host slots and pages; a page never written fails alone
        got = backend.batch_get_v2([mamba_at([11, 12], [hashes[7], hashes[3]]),
                                    indexer_at([10, 11, 12], [hashes[4], hashes[0], hashes[6]])])
        out["get_v2"] = {str(k): v for k, v in got.items()}
        out["get_exact"] = [mamba.page(11) == mamba.page(7),
                            indexer.page(10 * page_size) == indexer.page(4 * page_size),
                            indexer.page(11 * page_size) == indexer.page(0)]
        results[label] = out
        if label == "kvpool":
            # kvpool only: a BLOCK_GROUPS verdict (SGLang's file backend refuses the policy),
            # an anchor that holds no bytes, and host indices that do not match the keys
            grouped = make(name=names["indexer"], host_indices=tokens([0]), keys=one,
                           hit_policy=policies["block_groups"])
            grouped.group_pages = 2
            out["exists_groups"] = exists([grouped])
            out["bad_indices"] = {str(k): v for k, v in backend.batch_get_v2(
                [indexer_at([1], hashes[:2])]).items()}
            kv.kv_buffer = None  # DeepSeek V4's anchor is logical: side pools carry the data
            out["anchorless_exists"] = exists([indexer_at([0], one)])
            out["anchorless_v1"] = backend.batch_get_v1(hashes[:2], tokens([5, 6]))
            backend.clear()
            backend.close()
    print("RESULT " + json.dumps(results), flush=True)
    files.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
