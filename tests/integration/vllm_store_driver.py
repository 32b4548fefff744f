"""Make the ``mooncake.store`` calls of vLLM's ``MooncakeStoreConnector`` worker, in its order and
with its arguments, on CPU tensors. Checked against vLLM main,
``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py`` (commit 003df29):

- ``MooncakeStoreWorker.__init__``: ``MooncakeDistributedStore()``, ``setup`` with 7 positional
  arguments (local hostname, metadata server, global segment size, local buffer size, protocol,
  device name, master address; 0 means success) and a default ``ReplicateConfig()``;
- ``register_kv_caches``: ``register_buffer(storage.data_ptr(), storage.nbytes())`` once per
  KV cache storage (the whole cache, not per block), then the K/V segments found from the
  strides of FlashAttention's ``(2, num_blocks, block_size, heads, head_dim)`` layout;
- ``KVCacheStoreSendingThread``: ``batch_is_exist(keys)`` (1: stored), then
  ``batch_put_from_multi_buffers(missing keys, addrs, sizes, replicate_config)`` with one
  address list per key (every layer's K and V block; < 0: failed);
- ``KVCacheStoreRecvingThread``: with tier logging, ``batch_get_replica_desc(keys)`` and
  ``is_memory_replica()`` on each key's first replica, then
  ``batch_get_into_multi_buffers(keys, addrs, sizes)`` (bytes read, < 0: failed).

vLLM itself cannot be imported here (it needs its GPU build), so this is its exact call
sequence, not its module. ``--role put`` stores blocks and waits for a line on stdin (its
segment holds them); ``--role get`` loads them into other blocks of another process's cache.
Prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import torch

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 16, 4, 2, 8, 2


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM),
                                      generator=generator).to(torch.bfloat16)
            for i in range(LAYERS)}


def register(store: Any, caches: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """``register_kv_caches``: register each storage whole; find its K/V segments by stride."""
    addrs: list[int] = []
    block_lens: list[int] = []
    for cache in caches.values():
        storage = cache.untyped_storage()
        base, region_len = storage.data_ptr(), storage.nbytes()
        assert store.register_buffer(base, region_len) == 0
        element = cache.element_size()
        page_bytes = region_len // NUM_BLOCKS
        outer = [d for d in range(cache.ndim) if cache.stride(d) * element > page_bytes]
        stride = cache.stride(outer[0]) * element
        for index in range(cache.shape[outer[0]]):
            addrs.append(base + index * stride)
            block_lens.append(stride // NUM_BLOCKS)
    return addrs, block_lens


def block_values(addrs: list[int], lens: list[int], block_ids: list[int]
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """``prepare_value_for_block`` for each block: every segment's slice of that block."""
    return ([[a + b * n for a, n in zip(addrs, lens, strict=True)] for b in block_ids],
            [list(lens) for _ in block_ids])


def block_digest(caches: dict[str, torch.Tensor], block: int) -> str:
    digest = hashlib.sha256()
    for cache in caches.values():
        for kv in (0, 1):
            digest.update(cache[kv, block].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("put", "get"), required=True)
    parser.add_argument("--master", required=True)
    args = parser.parse_args()
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    result: dict[str, Any] = {"setup": store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20,
                                                   16 << 20, "tcp", "", args.master)}
    replicate_config = ReplicateConfig()
    caches = kv_caches(seed=1 if args.role == "put" else 2)
    addrs, lens = register(store, caches)
    keys = [f"Llama-3.1-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:032x}" for i in range(6)]
    if args.role == "put":
        stored_blocks = [3, 5, 7, 9]  # the first four keys
        exists = store.batch_is_exist(keys)
        missing = [i for i, e in enumerate(exists) if e != 1]
        put_addrs, put_sizes = block_values(addrs, lens, [stored_blocks[i] for i in missing[:4]])
        result["exists_before"] = exists
        result["put"] = store.batch_put_from_multi_buffers(
            [keys[i] for i in missing[:4]], put_addrs, put_sizes, replicate_config)
        result["exists_after"] = store.batch_is_exist(keys)
        result["digests"] = [block_digest(caches, b) for b in stored_blocks]
        print("RESULT " + json.dumps(result), flush=True)
        sys.stdin.readline()  # keep the segment until the reader is done
    else:
        descs = store.batch_get_replica_desc(keys)
        result["tiers"] = [
            "memory" if descs.get(key) and descs[key][0].is_memory_replica() else "unknown"
            for key in keys]
        into = [0, 1, 2, 11, 12, 13]  # blocks of this process's cache
        get_addrs, get_sizes = block_values(addrs, lens, into)
        result["get"] = store.batch_get_into_multi_buffers(keys, get_addrs, get_sizes)
        result["block_bytes"] = sum(lens)
        result["digests"] = [block_digest(caches, b) for b in into[:4]]
        store.close()
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
