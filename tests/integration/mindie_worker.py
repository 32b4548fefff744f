"""A MindIE-shaped worker or scheduler process, driven by JSON lines on stdin.

``--mode compat`` makes exactly the calls MindIE's Mooncake mempool makes (call by
call) on the ``mooncake`` package found first on ``sys.path`` (the test puts kvpool's
drop-in there); ``--mode native`` uses ``kvpool_client.connectors.mindie.KVPoolMempool``.

A worker owns per-layer K and V cache tensors ``[num_blocks, block_size, heads, head_dim]``
(torch, CPU), filled from a seed (``--fill data``) or zeros (``--fill zeros``, a worker that
only loads). Keys are MindIE's: ``f"{hash64}_{tp_rank}_{tp_size}_{model}"`` over the chained
64-bit block hashes of one prompt. Commands (one JSON object per line, one reply line each):

- ``{"op": "save", "blocks": [...], "async": true}``: put each block's
  ``[k[l][b], v[l][b]] for l`` (from a background thread when ``async``, as asyncWrite does);
- ``{"op": "load", "blocks": [...], "hits": h}``: get those blocks, then check them against the
  seeded data and that blocks below ``h`` (the on-chip hits) were not touched;
- ``{"op": "lookup", "first_block": f, "num_blocks": n}`` (scheduler): leading blocks from
  ``f`` whose keys exist for every TP rank;
- ``{"op": "exit"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

import torch

from kvpool_client.hashing import mindie_block_hashes, mindie_key

BASE_PORT = 8790


class MooncakeShapedMempool:
    """MindIE's ``MooncakeMempool`` calls (use_ascend_direct: true), over ``mooncake``."""

    _engine: Any = None

    def __init__(self, config_path: str, role: str, device_id: int = 0,
                 kv_caches: Any = None) -> None:
        with open(config_path) as f:
            config = json.load(f)
        for key in ("local_hostname", "metadata_server", "master_server_address"):
            assert str(config.get(key, "")).strip(), key
        assert config.get("protocol", "ascend") == "ascend"
        segment_size, buffer_size, protocol = (config["global_segment_size"],
                                               config.get("local_buffer_size", 1 << 30),
                                               "ascend")
        if role == "scheduler":
            segment_size, buffer_size, protocol = 0, 0, "ascend_no_transport"
        from mooncake.engine import TransferEngine
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        host = config["local_hostname"]
        if MooncakeShapedMempool._engine is None:  # one engine per process, shared
            engine = TransferEngine()
            assert engine.initialize(host, "P2PHANDSHAKE", "ascend", "") == 0
            MooncakeShapedMempool._engine = engine
        engine = MooncakeShapedMempool._engine
        self.local_seg = f"{host}:{engine.get_rpc_port()}"
        self.store = MooncakeDistributedStore()
        ret = self.store.setup(self.local_seg, config["metadata_server"], segment_size,
                               buffer_size, protocol, config.get("device_name", ""),
                               config["master_server_address"], engine.get_engine())
        assert ret == 0, ret
        self.rep_config = ReplicateConfig()
        self.rep_config.preferred_segment = self.local_seg
        self.rep_config.prefer_alloc_in_same_node = True
        if role == "worker":
            for k, v in kv_caches:
                assert self.store.register_buffer(k.data_ptr(), k.numel() * k.element_size()) == 0
                assert self.store.register_buffer(v.data_ptr(), v.numel() * v.element_size()) == 0

    @staticmethod
    def _addr_size(tensors: list[Any]) -> tuple[list[int], list[int]]:
        flat = [t for pair in tensors for t in pair]
        return [t.data_ptr() for t in flat], [t.numel() * t.element_size() for t in flat]

    def batch_exist(self, keys: list[str]) -> list[bool]:
        return [x == 1 for x in self.store.batch_is_exist(keys)]

    def put(self, keys: list[str], tensors: list[Any]) -> list[bool]:
        addrs, sizes = zip(*(self._addr_size(t) for t in tensors), strict=True)
        ret = self.store.batch_put_from_multi_buffers(keys, list(addrs), list(sizes),
                                                      self.rep_config)
        return [x == 0 for x in ret]

    def get(self, keys: list[str], tensors: list[Any]) -> list[bool]:
        addrs, sizes = zip(*(self._addr_size(t) for t in tensors), strict=True)
        ret = self.store.batch_get_into_multi_buffers(keys, list(addrs), list(sizes), True)
        return [x == sum(s) for x, s in zip(ret, sizes, strict=True)]

    def close(self) -> None:
        self.store.close()


def make_caches(args: argparse.Namespace, rank: int, fill: str) -> list[tuple[Any, Any]]:
    shape = (args.num_blocks, args.block_size, args.heads, args.head_dim)
    caches = []
    for layer in range(args.layers):
        pair = []
        for kind in range(2):
            if fill == "zeros":
                pair.append(torch.zeros(shape, dtype=torch.float16))
            else:
                generator = torch.Generator().manual_seed(args.seed * 1000 + rank * 100
                                                          + layer * 2 + kind)
                pair.append(torch.randn(shape, generator=generator).to(torch.float16))
        caches.append((pair[0], pair[1]))
    return caches


def block_tensors(caches: list[tuple[Any, Any]], block: int) -> list[list[Any]]:
    return [[k[block], v[block]] for k, v in caches]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("compat", "native"), required=True)
    parser.add_argument("--role", choices=("worker", "scheduler"), required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--fill", choices=("data", "zeros"), default="data")
    parser.add_argument("--model", default="qwen2-7b")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    if args.mode == "compat":
        import mooncake

        assert getattr(mooncake, "BACKEND", "") == "kvpool", mooncake.__file__
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, 32000, (args.num_blocks * args.block_size + 5,),
                           generator=generator).tolist()
    hashes = mindie_block_hashes(tokens, args.block_size)

    def keys_of(blocks: list[int], rank: int) -> list[str]:
        return [mindie_key(hashes[b], rank, args.tp_size, args.model) for b in blocks]

    caches = make_caches(args, args.tp_rank, args.fill) if args.role == "worker" else None
    pool: Any
    if args.mode == "compat":
        pool = MooncakeShapedMempool(args.config, args.role, kv_caches=caches)
    else:
        from kvpool_client.connectors.mindie import KVPoolMempool

        kwargs = {"device_id": 0, "kv_caches": caches} if args.role == "worker" else {}
        pool = KVPoolMempool(args.config, args.role, **kwargs)
    print(json.dumps({"ready": True}), flush=True)

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        reply: dict[str, Any]
        if op == "exit":
            break
        if op == "save":
            assert caches is not None
            blocks = command["blocks"]
            box: dict[str, Any] = {}

            def save(blocks: list[int] = blocks, box: dict[str, Any] = box) -> None:
                box["ok"] = pool.put(keys_of(blocks, args.tp_rank),
                                     [block_tensors(caches, b) for b in blocks])
                box["thread"] = threading.current_thread().name

            if command.get("async"):
                writer = threading.Thread(target=save, name="async-write")
                writer.start()
                writer.join(120)
            else:
                save()
            reply = box
        elif op == "load":
            assert caches is not None
            blocks, hits = command["blocks"], command["hits"]
            ok = pool.get(keys_of(blocks, args.tp_rank), [block_tensors(caches, b) for b in blocks])
            expected = make_caches(args, args.tp_rank, "data")
            exact = all(torch.equal(got[i][b], want[i][b])
                        for b in blocks for got, want in zip(caches, expected, strict=True)
                        for i in range(2))
            untouched = all(not got[i][b].any() for b in range(hits) for got in caches
                            for i in range(2))
            reply = {"ok": ok, "exact": exact, "untouched": untouched}
        elif op == "lookup":
            first, count = command["first_block"], command["num_blocks"]
            blocks = list(range(first, first + count))
            per_block = [[keys_of([b], r)[0] for r in range(args.tp_size)] for b in blocks]
            if args.mode == "native":
                reply = {"hits": pool.count_leading_hits(per_block)}
            else:  # MindIE's C++ scheduler: leading blocks whose keys exist on every rank
                found = pool.batch_exist([k for block in per_block for k in block])
                hits = 0
                for i in range(len(blocks)):
                    if not all(found[i * args.tp_size:(i + 1) * args.tp_size]):
                        break
                    hits += 1
                reply = {"hits": hits}
        else:
            reply = {"error": f"unknown op {op}"}
        print(json.dumps(reply), flush=True)
    pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
