"""In-process speed and memory of the master core (no RPC).

Prints keys/s for put_start+put_end, get_replicas, exist and query_prefix at batch sizes 1, 32
and 1000; the time of one eviction pass over a full pool; the resident memory per million
objects; and the allocator's fragmentation on a KV-like workload.

    .venv/bin/python benchmarks/master_core.py            # ~1 min: 200k objects
    .venv/bin/python benchmarks/master_core.py --full     # one million objects (~3 min)

Keys are 64-byte hex strings (a sha256 block hash), objects 64 KiB, one replica.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Callable

from kvpool_client.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo
from kvpool_master.core.allocator import Allocator
from kvpool_master.core.master import CoreConfig, MasterCore

OBJECT_BYTES = 64 << 10
CLIENT = ClientId("bench-client")
OPTIONS = PutOptions()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def make_core(num_objects: int, fill_ratio: float, num_segments: int = 8) -> MasterCore:
    """A core whose capacity holds ``num_objects`` at ``fill_ratio`` of capacity."""
    core = MasterCore(CoreConfig())
    core.register_client(CLIENT, "bench-host", b"k" * 32, 0.0)
    capacity = int(num_objects * OBJECT_BYTES / fill_ratio)
    per_segment = -(-capacity // num_segments // 4096) * 4096
    for i in range(num_segments):
        core.mount_segment(SegmentInfo(SegmentId(f"seg-{i}"), CLIENT, per_segment), 0.0)
    return core


def keys_of(start: int, count: int) -> list[ObjectKey]:
    return [ObjectKey(b"%064x" % i) for i in range(start, start + count)]


def fill(core: MasterCore, keys: list[ObjectKey], batch: int = 1000, now: float = 1.0) -> None:
    """Put and commit ``keys`` as the RPC layer would: fresh int objects per size and a
    64-bit checksum per object (what a decoded request carries)."""
    rng = random.Random(len(keys))
    zero = int("0")
    for i in range(0, len(keys), batch):
        chunk = keys[i:i + batch]
        sizes = [OBJECT_BYTES + zero for _ in chunk]
        checksums = [rng.getrandbits(64) for _ in chunk]
        core.put_start(CLIENT, chunk, sizes, OPTIONS, now)
        core.put_end(CLIENT, chunk, now, checksums)
        core.take_events()


def rate(label: str, batch: int, total_keys: int, run: Callable[[list[ObjectKey]], object],
         batches: list[list[ObjectKey]]) -> None:
    gc.collect()
    started = time.perf_counter()
    for chunk in batches:
        run(chunk)
    elapsed = time.perf_counter() - started
    print(f"  {label:<22} batch {batch:>5}: {total_keys / elapsed / 1e6:7.3f} M keys/s"
          f"  ({elapsed / len(batches) * 1e6:9.1f} us/call)")


def bench_ops(num_objects: int) -> None:
    print(f"ops (table of {num_objects:,} READY objects, 64-byte keys)")
    core = make_core(num_objects + 300_000, 0.5)
    fill(core, keys_of(0, num_objects))
    rng = random.Random(1)
    next_key = num_objects
    for batch in (1, 32, 1000):
        total = 32_000 if batch > 1 else 10_000
        fresh = keys_of(next_key, total)
        next_key += total
        batches = [fresh[i:i + batch] for i in range(0, total, batch)]
        sizes = [OBJECT_BYTES] * batch

        def put(chunk: list[ObjectKey], sizes: list[int] = sizes) -> None:
            core.put_start(CLIENT, chunk, sizes, OPTIONS, 2.0)
            core.put_end(CLIENT, chunk, 2.0)
            core.take_events()

        rate("put_start+put_end", batch, total, put, batches)
        hits = [ObjectKey(b"%064x" % rng.randrange(num_objects)) for _ in range(total)]
        batches = [hits[i:i + batch] for i in range(0, total, batch)]
        rate("get_replicas", batch, total, lambda c: core.get_replicas(c, 3.0), batches)
        rate("exist", batch, total, lambda c: core.exist(c, 3.0), batches)
        chain = keys_of(rng.randrange(num_objects - total), total)
        batches = [chain[i:i + batch] for i in range(0, total, batch)]
        rate("query_prefix", batch, total, lambda c: core.query_prefix(c, 3.0), batches)
    misses = keys_of(10**12, 1000)
    started = time.perf_counter()
    for _ in range(100):
        core.exist(misses, 4.0)
    print(f"  exist of 1000 absent keys: {(time.perf_counter() - started) / 100 * 1e6:.1f} us")
    started = time.perf_counter()
    hits = keys_of(0, 1000)
    for _ in range(100):
        core.exist(hits, 4.0)
    print(f"  exist of 1000 present keys: {(time.perf_counter() - started) / 100 * 1e6:.1f} us")


def bench_memory_and_eviction(num_objects: int) -> None:
    print(f"memory and eviction ({num_objects:,} objects)")
    gc.collect()
    before = rss_bytes()
    # Capacity such that the table sits exactly at the 95 % high watermark when full.
    core = make_core(num_objects, 0.95)
    fill(core, keys_of(0, num_objects))
    gc.collect()
    grown = rss_bytes() - before
    stats = core.stats()
    print(f"  RSS {rss_bytes() / 2**20:.0f} MiB in all; growth {grown / 2**20:.0f} MiB for "
          f"{stats.num_objects:,} objects "
          f"= {grown / stats.num_objects:.0f} B/object "
          f"= {grown / stats.num_objects * 1e6 / 2**20:.0f} MiB per million")
    # Read a tenth of them so the LRU order is not insertion order, then let leases lapse.
    rng = random.Random(2)
    core.get_replicas([ObjectKey(b"%064x" % rng.randrange(num_objects))
                       for _ in range(num_objects // 10)], 5.0)
    started = time.perf_counter()
    core.put_start(CLIENT, keys_of(10**12, 1), [OBJECT_BYTES], OPTIONS, 100.0)
    elapsed = time.perf_counter() - started
    evicted = num_objects - core.stats().num_objects
    events = core.take_events()
    print(f"  put_start that crossed the watermark: evicted {evicted:,} objects "
          f"({evicted / num_objects:.1%}) in {elapsed * 1e3:.1f} ms, {len(events):,} events")


def bench_fragmentation() -> None:
    print("allocator fragmentation (KV-like: 95% 64 KiB blocks, 5% odd sizes, 2M ops of churn)")
    rng = random.Random(3)
    allocator = Allocator(4 << 30)
    live: list[tuple[int, int]] = []
    odd = (4096, 12_000, 100_000, 300_000)
    failures = 0
    for _ in range(2_000_000):
        if rng.random() < 0.5 or not live:
            size = OBJECT_BYTES if rng.random() < 0.95 else rng.choice(odd)
            offset = allocator.allocate(size)
            if offset < 0:
                failures += 1
                if live:
                    offset, size = live.pop(rng.randrange(len(live)))
                    allocator.free(offset, size)
                continue
            live.append((offset, size))
        else:
            index = rng.randrange(len(live))
            live[index], live[-1] = live[-1], live[index]
            offset, size = live.pop()
            allocator.free(offset, size)
    print(f"  used {allocator.used_bytes / allocator.size_bytes:.1%} of 4 GiB, "
          f"{allocator.num_free_extents:,} free extents, fragmentation "
          f"{allocator.fragmentation():.3f} (1 - largest free / free), "
          f"{failures:,} failed allocations")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="memory/eviction at 1M objects")
    parser.add_argument("--skip-fragmentation", action="store_true")
    args = parser.parse_args()
    bench_ops(200_000)
    bench_memory_and_eviction(1_000_000 if args.full else 200_000)
    if not args.skip_fragmentation:
        bench_fragmentation()


if __name__ == "__main__":
    main()
