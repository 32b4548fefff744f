"""Device KV blocks <-> the pool, against the device's own copy speed measured in the same run.

A paged KV cache on the accelerator (default: an 8B-class model's geometry, 32 layers, 8 KV
heads of 128 dims, 16-token blocks, bfloat16: 64 regions of 32 KiB, 2 MiB objects) is saved
to the pool by one client and loaded into an empty cache by another, through a local
kvpool-master and real shared-memory segments:

- ``save`` / ``load``: ``StagedBlockIO.put_blocks`` / ``get_blocks`` (what the tensors glue
  and the prefix cache use), all blocks in one call: ``direct`` (CUDA with a kvpool client:
  DMA between the device and the segment's page-locked memory) and ``staged`` (through
  pinned host staging buffers and a host copy);
- ``pointer put`` / ``pointer get``: the MindIE connector handed the same device tensors, one
  pointer range per region (the Mooncake-style path, staged through host memory per range);
- ``--engine``: ``engine`` save / load: the same calls with a client whose transfer engine
  (Mooncake's ``TransferEngine``, its ``tcp`` protocol) moves each chunk between the registered
  device staging buffer and another process's segment on another host id (no shared memory);
- the limits: one contiguous device->pinned-host and pinned-host->device copy of the same
  bytes, and single-thread host memcpy.

Each figure is the median of --repeats; ratios are to the limits of the same run.

    python benchmarks/gpu_kv_bench.py [--blocks 256] [--device cuda] [--engine]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from client_bench import memcpy_gbps

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.connectors.mindie import KVPoolMempool
from kvpool_client.replay import spawned_master
from kvpool_client.staging import StagedBlockIO
from kvpool_client.tensors import PagedKVCache


def median_gbps(nbytes: int, run: Callable[[int], None], repeats: int, sync: Callable[[], None]
                ) -> float:
    """Median GB/s of ``run(repeat)`` over ``repeats`` (after one untimed warm-up run)."""
    times = []
    for repeat in range(repeats + 1):
        sync()
        started = time.perf_counter()
        run(repeat)
        sync()
        if repeat:
            times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def copy_limits(nbytes: int, device: torch.device, repeats: int, sync: Callable[[], None]
                ) -> tuple[float, float, float]:
    """GB/s of one contiguous device->pinned-host copy, the reverse, and host memcpy."""
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")
    d2h = median_gbps(nbytes, lambda _: pinned.copy_(flat, non_blocking=True), repeats, sync)
    h2d = median_gbps(nbytes, lambda _: flat.copy_(pinned, non_blocking=True), repeats, sync)
    return d2h, h2d, memcpy_gbps(pinned.numpy(), torch.empty_like(pinned).numpy())


OWNER = """
import json, sys
from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
client = KVPoolClient(ClientConfig.from_dict(json.loads(sys.argv[1])))
print(client.segment_ids[0], flush=True)
sys.stdin.readline()
client.close()
"""


@contextlib.contextmanager
def helper_process(script: str, argument: str, env: dict[str, str]) -> Iterator[str]:
    """A Python process running ``script ARGUMENT`` with ``env`` added: yields the first line
    it prints; on exit it is told to end (a line on its stdin), and killed by pid if it does
    not."""
    proc = subprocess.Popen([sys.executable, "-c", script, argument], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert proc.stdout is not None and proc.stdin is not None
        yield proc.stdout.readline().strip()
        proc.stdin.write("done\n")
        proc.stdin.flush()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


TARGET = """
import ctypes, mmap, sys
from kvpool_client.transfer.engine import open_engine
engine = open_engine("127.0.0.1", "tcp")
buf = mmap.mmap(-1, int(sys.argv[1]))
address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
assert engine.register_memory(address, len(buf)) == 0
print(f"127.0.0.1:{engine.get_rpc_port()} {address}", flush=True)
sys.stdin.readline()
"""


def raw_engine(flat: Any, chunk_bytes: int, repeats: int, sync: Callable[[], None]
               ) -> tuple[float, float]:
    """(write GB/s, read GB/s) of the engine alone: ``flat`` (registered device memory) to and
    from a host buffer of another process, ``chunk_bytes`` per op, one batch call each way:
    what the engine itself can do here, without kvpool."""
    from kvpool_client.transfer.engine import open_engine

    nbytes = flat.numel()
    with helper_process(TARGET, str(nbytes), {"GLOG_minloglevel": "2"}) as first_line:
        session, remote = first_line.split()
        engine = open_engine("127.0.0.1", "tcp")
        assert engine.register_memory(flat.data_ptr(), nbytes) == 0
        offsets = list(range(0, nbytes, chunk_bytes))
        local = [flat.data_ptr() + o for o in offsets]
        far = [int(remote) + o for o in offsets]
        lengths = [min(chunk_bytes, nbytes - o) for o in offsets]

        def write(_: int) -> None:
            assert engine.batch_transfer_sync_write(session, local, far, lengths) == 0

        def read(_: int) -> None:
            assert engine.batch_transfer_sync_read(session, local, far, lengths) == 0

        result = (median_gbps(nbytes, write, repeats, sync),
                  median_gbps(nbytes, read, repeats, sync))
        engine.unregister_memory(flat.data_ptr())
    return result


def engine_paths(address: str, src: PagedKVCache, dst: PagedKVCache, ids: list[int],
                 total: int, segment_bytes: int, args: Any, sync: Callable[[], None]
                 ) -> tuple[float, float, int]:
    """(save GB/s, load GB/s, blocks per call) through the transfer engine, into a segment of
    another process that believes it is on another host."""
    engine = {"master_server_address": address, "transport": "engine", "protocol": "tcp"}
    owner_config = json.dumps({**engine, "global_segment_size": segment_bytes})
    with helper_process(OWNER, owner_config, {"KVPOOL_HOST_ID": "bench-owner",
                                              "GLOG_minloglevel": "2"}) as segment:
        assert segment, "the owner process did not start"
        os.environ["KVPOOL_HOST_ID"] = "bench-caller"
        try:
            caller = KVPoolClient(ClientConfig.from_dict({**engine, "global_segment_size": 0,
                                                          "preferred_segment": segment}))
        finally:
            del os.environ["KVPOOL_HOST_ID"]
        with caller:
            put_io = StagedBlockIO(src, caller, chunk_blocks=args.chunk_blocks)
            get_io = StagedBlockIO(dst, caller, chunk_blocks=args.chunk_blocks)
            assert put_io.engine and get_io.engine

            def save(repeat: int) -> None:
                assert all(put_io.put_blocks([f"e{repeat}b{b}" for b in ids], ids))

            def load(repeat: int) -> None:
                assert all(get_io.get_blocks([f"e{repeat}b{b}" for b in ids], ids))

            for t in (*dst.k_caches, *dst.v_caches):
                t.zero_()
            result = (median_gbps(total, save, args.repeats, sync),
                      median_gbps(total, load, args.repeats, sync), put_io.chunk_blocks)
            assert all(torch.equal(a, b) for a, b in zip(
                (*src.k_caches, *src.v_caches), (*dst.k_caches, *dst.v_caches), strict=True))
            assert {t for (t, _) in caller.metrics.transfer_bytes} == {"engine"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per call")
    parser.add_argument("--chunk-blocks", type=int, default=None,
                        help="blocks per pool call (default: the StagedBlockIO default)")
    parser.add_argument("--pointer-blocks", type=int, default=32,
                        help="blocks per call on the (slower) pointer path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copy-threads", type=int, default=0,
                        help="client config copy_threads (0: the client's default)")
    parser.add_argument("--engine", action="store_true",
                        help="also the engine transport (needs mooncake.engine importable)")
    args = parser.parse_args()
    device = torch.device(args.device)
    module = getattr(torch, device.type)
    sync = lambda: module.synchronize(device)  # noqa: E731

    def cache() -> PagedKVCache:
        made = PagedKVCache.allocate(num_layers=args.layers, num_blocks=args.blocks,
                                     block_size=args.block_size, num_heads=args.kv_heads,
                                     head_dim=args.head_dim, dtype=torch.bfloat16,
                                     device=device)
        for t in (*made.k_caches, *made.v_caches):
            t.normal_()
        return made

    src, dst = cache(), cache()
    total = args.blocks * src.object_bytes
    d2h, h2d, host = copy_limits(total, device, args.repeats, sync)

    # every repetition's blocks stay until the loads: room for all of them below the master's
    # eviction watermark
    segment_bytes = (args.repeats + 1) * total * 5 // 4 + (256 << 20)
    with tempfile.TemporaryDirectory() as tmp, spawned_master(Path(tmp)) as address:
        def client(segment: int) -> KVPoolClient:
            return KVPoolClient(ClientConfig.from_dict({
                "master_server_address": address, "local_hostname": "127.0.0.1",
                "global_segment_size": segment, "copy_threads": args.copy_threads}))

        # one writer / reader pair per mode: a force-removed object's space comes back only
        # once its read leases have run out
        staged: dict[bool, tuple[float, float, int]] = {}
        ids = list(range(args.blocks))
        for direct in (True, False):
            with client(segment_bytes) as writer, client(64 << 20) as reader:
                put_io = StagedBlockIO(src, writer, chunk_blocks=args.chunk_blocks,
                                       direct=None if direct else False)
                get_io = StagedBlockIO(dst, reader, chunk_blocks=args.chunk_blocks,
                                       direct=None if direct else False)

                def save(repeat: int, io: StagedBlockIO = put_io) -> None:
                    assert all(io.put_blocks([f"r{repeat}b{b}" for b in ids], ids))

                def load(repeat: int, io: StagedBlockIO = get_io,
                         reader: KVPoolClient = reader) -> None:
                    keys = [f"r{repeat}b{b}" for b in ids]
                    ok = io.get_blocks(keys, ids)
                    bad = [k for k, good in zip(keys, ok, strict=True) if not good][:3]
                    assert not bad, (f"{ok.count(False)} blocks not loaded, e.g. {bad}: "
                                     f"exists {reader.batch_exists(bad)}")

                for t in (*dst.k_caches, *dst.v_caches):
                    t.zero_()
                staged[put_io.direct] = (median_gbps(total, save, args.repeats, sync),
                                         median_gbps(total, load, args.repeats, sync),
                                         put_io.chunk_blocks)
                assert all(torch.equal(a, b) for a, b in zip(
                    (*src.k_caches, *src.v_caches), (*dst.k_caches, *dst.v_caches),
                    strict=True))

        engine_rows = engine_paths(address, src, dst, ids, total, segment_bytes, args,
                                   sync) if args.engine else None

        pointer = args.pointer_blocks
        config = Path(tmp) / "mooncake.json"
        config.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "global_segment_size": (args.repeats + 2) * pointer
            * src.object_bytes, "master_server_address": address}))
        pool = KVPoolMempool(str(config), "worker", device_id=device.index or 0,
                             kv_caches=[(c.k_caches[i], c.v_caches[i]) for c in (src, dst)
                                        for i in range(args.layers)])
        try:
            def tensors(c: PagedKVCache) -> list[Any]:
                return [[[k[b], v[b]] for k, v in zip(c.k_caches, c.v_caches, strict=True)]
                        for b in range(pointer)]

            def pointer_put(repeat: int) -> None:
                assert all(pool.put([f"p{repeat}b{b}" for b in range(pointer)], tensors(src)))

            def pointer_get(repeat: int) -> None:
                assert all(pool.get([f"p{repeat}b{b}" for b in range(pointer)], tensors(dst)))

            pointer_bytes = pointer * src.object_bytes
            pointer_put_gbps = median_gbps(pointer_bytes, pointer_put, args.repeats, sync)
            pointer_get_gbps = median_gbps(pointer_bytes, pointer_get, args.repeats, sync)
        finally:
            pool.close()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"device: {name}; cache: {args.layers} layers, {args.kv_heads} KV heads x "
          f"{args.head_dim}, {args.block_size}-token blocks, bfloat16: "
          f"{src.region_bytes // 1024} KiB regions, {src.object_bytes / 2**20:g} MiB objects")
    print(f"client copy_threads: {args.copy_threads or 'default'}")
    print(f"limits: device->pinned {d2h:.1f} GB/s, pinned->device {h2d:.1f} GB/s, "
          f"host memcpy {host:.1f} GB/s")
    print(f"{'path':<36} {'blocks':>6} {'GB/s':>7} {'of copy':>8}")
    rows = []
    for direct, (save_gbps, load_gbps, chunk) in sorted(staged.items(), reverse=True):
        how = "direct" if direct else "staged"
        rows += [(f"save ({how}, {chunk}-block calls)", args.blocks, save_gbps, d2h),
                 (f"load ({how}, {chunk}-block calls)", args.blocks, load_gbps, h2d)]
    if engine_rows is not None:
        save_gbps, load_gbps, chunk = engine_rows
        raw_write, raw_read = raw_engine(torch.empty(total, dtype=torch.uint8, device=device),
                                         chunk * src.object_bytes, args.repeats, sync)
        rows += [(f"save (engine, {chunk}-block calls)", args.blocks, save_gbps, d2h),
                 (f"load (engine, {chunk}-block calls)", args.blocks, load_gbps, h2d),
                 ("engine alone: device -> remote host", args.blocks, raw_write, d2h),
                 ("engine alone: remote host -> device", args.blocks, raw_read, h2d)]
        ratio = (f"kvpool's engine path against the engine alone: save "
                 f"{save_gbps / raw_write:.0%}, load {load_gbps / raw_read:.0%}")
    rows += [("pointer put (MindIE connector)", pointer, pointer_put_gbps, d2h),
             ("pointer get (MindIE connector)", pointer, pointer_get_gbps, h2d)]
    for label, blocks, gbps, limit in rows:
        print(f"{label:<36} {blocks:>6} {gbps:>7.2f} {gbps / limit:>7.0%}")
    if engine_rows is not None:
        print(ratio)


if __name__ == "__main__":
    main()
