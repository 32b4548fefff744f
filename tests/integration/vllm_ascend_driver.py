"""Drive vllm-ascend 0.23.0's own KV-pool transfer threads against kvpool, on CPU tensors.

``--src`` is a directory holding the files unpacked from the vllm-ascend wheel:
``vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/`` (and, for the ``mooncake``
backend, ``vllm_ascend/distributed/kv_transfer/utils/mooncake_transfer_engine.py``). Only the
few ``vllm.*`` names those files import are stubbed here (vLLM itself needs a GPU/NPU build);
every class under test is vllm-ascend's own code:

- the backend is looked up in vllm-ascend's ``backend_map`` after running the
  ``vllm.general_plugins`` entry points (``kvpool``), or is its ``MooncakeBackend`` over the
  ``mooncake`` drop-in package (whose ``set_device`` is replaced: an NPU cannot exist here);
- ``ChunkedTokenDatabase`` builds the keys and addresses, ``KVCacheStoreSendingThread`` saves
  (lookup, drop existing keys, put the rest) and ``KVCacheStoreRecvingThread`` loads the
  blocks after the on-chip hits.

Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import sys
import threading
import time
import types
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NewType

import torch

STORE_PKG = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def install_stubs(src: Path, tp_rank: int) -> None:
    """Stub the ``vllm`` names the unpacked files import, and make their packages importable
    without vllm-ascend's package ``__init__`` files (which import all of vLLM)."""

    class _Base:
        pass

    @dataclass
    class BlockStored:  # only built when KV events are on
        block_hashes: list[Any]
        parent_block_hash: Any
        token_ids: Any
        block_size: int
        lora_id: Any
        medium: Any
        lora_name: Any

    class _WorldGroup:
        local_rank = tp_rank

    _module("vllm")
    _module("vllm.config", ParallelConfig=type("ParallelConfig", (), {}),
            VllmConfig=type("VllmConfig", (), {}))
    _module("vllm.logger", logger=logging.getLogger("vllm"))
    _module("vllm.distributed")
    _module("vllm.distributed.kv_events", BlockStored=BlockStored)
    _module("vllm.distributed.parallel_state", get_world_group=lambda: _WorldGroup())
    _module("vllm.distributed.kv_transfer")
    _module("vllm.distributed.kv_transfer.kv_connector")
    _module("vllm.distributed.kv_transfer.kv_connector.v1")
    _module("vllm.distributed.kv_transfer.kv_connector.v1.base",
            KVConnectorMetadata=_Base, KVConnectorWorkerMetadata=_Base)
    _module("vllm.utils")
    _module("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    _module("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
            split_host_port=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])))
    _module("vllm.v1")
    _module("vllm.v1.core")
    _module("vllm.v1.core.kv_cache_utils", BlockHash=NewType("BlockHash", bytes),
            BlockHashList=list, maybe_convert_block_hash=lambda h: h)
    _module("vllm.v1.core.sched")
    _module("vllm.v1.core.sched.output", NewRequestData=type("NewRequestData", (), {}))
    root = src / "vllm_ascend"
    for name, path in (("vllm_ascend", root), ("vllm_ascend.distributed", root / "distributed"),
                       ("vllm_ascend.distributed.kv_transfer",
                        root / "distributed" / "kv_transfer")):
        _module(name, __path__=[str(path)])
    _module("vllm_ascend.memcache_comm_fence",
            AttentionComputeStartGate=type("AttentionComputeStartGate", (), {}))
    _module("vllm_ascend.distributed.parallel_state", get_global_rank=lambda config: tp_rank)


def load_backend(kind: str) -> Any:
    """Return the backend class as vllm-ascend's pool worker resolves it."""
    for plugin in entry_points(group="vllm.general_plugins"):
        if plugin.name == "kvpool":
            plugin.load()()  # what vLLM's load_general_plugins() does in every process
    backend_map = importlib.import_module(f"{STORE_PKG}.backend").backend_map
    entry = backend_map[kind]
    cls = getattr(importlib.import_module(entry["path"]), entry["name"])
    if kind == "mooncake":
        import mooncake

        assert getattr(mooncake, "BACKEND", "") == "kvpool", mooncake.__file__

        class CpuMooncakeBackend(cls):  # type: ignore[misc, valid-type]
            def set_device(self) -> None:  # torch.npu cannot exist on this machine
                pass

        return CpuMooncakeBackend
    return cls


class Recorder:
    """Wraps a backend's exists/put/get and records the keys each call carried."""

    def __init__(self, backend: Any) -> None:
        self.calls: dict[str, list[list[str]]] = {"exists": [], "put": [], "get": []}
        for name in self.calls:
            original = getattr(backend, name)

            def wrapper(keys: list[str], *rest: Any, _name: str = name,
                        _original: Any = original) -> Any:
                self.calls[_name].append(list(keys))
                return _original(keys, *rest)

            setattr(backend, name, wrapper)


def wait_finished(thread: Any, req_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if req_id in thread.get_and_clear_finished_requests({req_id}):
            return
        time.sleep(0.01)
    raise TimeoutError(f"request {req_id} did not finish")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", required=True, type=Path)
    parser.add_argument("--backend", choices=("kvpool", "mooncake"), required=True)
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=2)
    args = parser.parse_args()
    install_stubs(args.src, args.tp_rank)

    config_data = importlib.import_module(f"{STORE_PKG}.config_data")
    kv_transfer = importlib.import_module(f"{STORE_PKG}.kv_transfer")
    backend_cls = load_backend(args.backend)

    layers, num_blocks, block_size, heads, head_dim = 2, 24, 16, 2, 8
    shape = (num_blocks, block_size, heads, head_dim)
    generator = torch.Generator().manual_seed(1000 + args.tp_rank)
    caches = [(torch.randn(shape, generator=generator).half(),
               torch.randn(shape, generator=generator).half()) for _ in range(layers)]
    tensors = [t for pair in caches for t in pair]  # [L0.K, L0.V, L1.K, L1.V]
    block_len = tensors[0][0].numel() * tensors[0].element_size()
    stride = tensors[0].stride(0) * tensors[0].element_size()
    ptrs = [t.data_ptr() for t in tensors]
    lengths = [t.numel() * t.element_size() for t in tensors]

    def database() -> Any:
        metadata = [config_data.KeyMetadata("Qwen3-8B", args.tp_rank, 0, 0, 0)]
        db = config_data.ChunkedTokenDatabase(metadata, [block_size], None)
        db.set_group_buffers({0: ptrs}, {0: [block_len] * len(ptrs)},
                             {0: [stride] * len(ptrs)})
        return db

    # vLLM block hashes: a sha256 chain, the same on every rank of one request
    tokens = torch.randint(0, 50000, (12 * block_size,), generator=torch.Generator()
                           .manual_seed(7)).tolist()
    hashes, parent = [], b"\0" * 32
    for b in range(12):
        parent = hashlib.sha256(parent + repr(tokens[b * block_size:(b + 1) * block_size])
                                .encode()).digest()
        hashes.append(parent)

    saver = backend_cls(object())
    saver.register_buffer(ptrs, lengths)
    saves = Recorder(saver)
    ready = threading.Event()
    sending = kv_transfer.KVCacheStoreSendingThread(saver, database(), [block_size],
                                                    args.tp_rank, args.tp_size, 1, 1,
                                                    "kv_producer", ready)
    sending.start()
    assert ready.wait(60)
    src_blocks = [3, 1, 4, 0, 5, 9, 2, 6, 10, 11]

    def save(req_id: str, num: int) -> None:
        meta = config_data.ReqMeta(req_id=req_id, token_len_chunk=num * block_size,
                                   block_ids=src_blocks[:num], block_hashes=hashes[:num],
                                   can_save=True, num_prompt_tokens=num * block_size)
        sending.add_stored_request(req_id)
        sending.add_request(meta)
        wait_finished(sending, req_id)

    save("first", 8)
    save("again", 8)  # every key exists: the thread drops them all and puts nothing
    save("longer", 10)  # two more blocks: only those are put

    # load into other physical blocks, with a second client (another segment owner)
    loader = backend_cls(object())
    loader.register_buffer(ptrs, lengths)
    loads = Recorder(loader)
    dst_blocks = [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    for t in tensors:
        t[dst_blocks] = 0  # index_put: zero those blocks in place
    ready = threading.Event()
    receiving = kv_transfer.KVCacheStoreRecvingThread(loader, database(), [block_size],
                                                      args.tp_rank, args.tp_size, 1, ready)
    receiving.start()
    assert ready.wait(60)
    hits = 3  # blocks on chip already
    load_spec = config_data.LoadSpec(vllm_cached_tokens=hits * block_size,
                                     kvpool_cached_tokens=10 * block_size, can_load=True,
                                     token_len=10 * block_size)
    receiving.add_request(config_data.ReqMeta(req_id="load", token_len_chunk=10 * block_size,
                                              block_ids=dst_blocks, block_hashes=hashes[:10],
                                              load_spec=load_spec))
    wait_finished(receiving, "load")
    exact = all(torch.equal(t[dst_blocks[i]], t[src_blocks[i]])
                for t in tensors for i in range(hits, 10))
    untouched = all(not t[dst_blocks[i]].any() for t in tensors for i in range(hits))
    loaded_keys = list(loads.calls["get"])
    missing = loader.get([saves.calls["put"][0][0] + "-missing"], [[ptrs[0]]], [[block_len]])
    result = {
        "saved_keys": saves.calls["put"],
        "lookups": [len(k) for k in saves.calls["exists"]],
        "loaded_keys": loaded_keys,
        "exact": exact,
        "untouched": untouched,
        "missing_get": missing,
        "invalid_blocks": sorted(receiving._invalid_block_ids),
    }
    for backend in (saver, loader):
        store = backend.store if args.backend == "mooncake" else None
        if store is not None:
            store.close()
        else:
            backend.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
