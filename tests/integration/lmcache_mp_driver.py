"""Run LMCache 0.5.6's own multiprocess storage path (``StorageManager``: its L1 manager, store
controller and prefetch controller) with kvpool's L2 adapter loaded as a plugin, against a real
master, on CPU. Runs in the LMCache environment (``make lmcache-env``).

Writes six chunks into L1; the store controller pushes them to the pool through the adapter;
the chunks are dropped from L1; a prefetch of seven (six stored, one never stored) brings the
six back from the pool (L2 hits), byte for byte. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.storage_manager import StorageManager

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.connectors.lmcache_mp import object_key_name


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    args = parser.parse_args()
    pool = {"master_server_address": args.master, "global_segment_size": "64mb"}
    adapter = {"type": "plugin", "module_path": "kvpool_client.connectors.lmcache_mp",
               "class_name": "KVPoolL2Adapter", "adapter_params": pool}
    manager = StorageManager(parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU",
                                         "--l2-adapter", json.dumps(adapter)]))
    observer = KVPoolClient(ClientConfig.from_dict(dict(pool, global_segment_size=0)))
    result: dict[str, object] = {}
    try:
        layout = MemoryLayoutDesc(shapes=[torch.Size([64, 2, 128])], dtypes=[torch.bfloat16])
        keys = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1000 + i), model_name="Qwen3-8B",
                          kv_rank=0) for i in range(7)]
        stored, missing = keys[:6], keys[6]
        objects = manager.reserve_write(stored, layout)
        result["reserved"] = len(objects)
        generator = torch.Generator().manual_seed(7)
        written = {}
        for key, obj in objects.items():
            obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=generator))
            written[key] = bytes(obj.byte_array)
        manager.finish_write(stored)
        names = [object_key_name("lmcache@", key) for key in stored]
        deadline = time.monotonic() + 30
        while not all(observer.batch_exists(names)) and time.monotonic() < deadline:
            time.sleep(0.05)
        result["in_pool"] = observer.batch_exists(names + [object_key_name("lmcache@", missing)])
        result["dropped_from_l1"] = list(manager.delete_l1_keys(stored, force=True))
        handle = manager.submit_prefetch_task(PrefetchTaskSpec(key_groups=[
            GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]))
        result["prefetched"] = manager.wait_prefetch_status(handle, 30.0)
        status = manager.query_prefetch_status(handle)
        result["hits"] = status.hit_cells[0].get_indices_list()
        result["l2_hits"] = status.l2_hit_cells[0].get_indices_list()
        with manager.read_prefetched_results(stored) as read:
            result["exact"] = read is not None and all(
                bytes(obj.byte_array) == written[key]
                for key, obj in zip(stored, read, strict=True))
        manager.finish_read_prefetched(stored)
    finally:
        manager.close()
        observer.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
