"""Mooncake's ``BufferPool`` on kvpool: what reusing a released lease's memory saves.

One store (the drop-in's ``MooncakeDistributedStore``) on a master it starts. A cycle acquires
a lease, fills every byte of it (as a transfer into it would) and releases it. "reused": one
pool, so each lease takes the region the last one released (mapped, faulted in, registered);
"fresh": a new pool each cycle, so each lease maps, faults in and registers new memory, as
every lease did before the pool kept released regions. Rounds alternate; the best of each is
printed, with the ratio.

    .venv/bin/python benchmarks/buffer_pool.py [--mib 64] [--cycles 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

from kvpool_client.compat.host_memory import BufferPool
from kvpool_client.compat.mooncake import MooncakeDistributedStore
from kvpool_client.replay import spawned_master


def cycle(pool: BufferPool, size: int) -> None:
    lease = pool.acquire(size)
    ctypes.memset(lease.ptr, 1, size)
    lease.release()


def round_ms(store: MooncakeDistributedStore, size: int, cycles: int, fresh: bool) -> float:
    pool = BufferPool(store)
    cycle(pool, size)   # the first lease maps its region in both cases
    started = time.perf_counter()
    for _ in range(cycles):
        if fresh:
            pool.close()
            pool = BufferPool(store)
        cycle(pool, size)
    elapsed_ms = (time.perf_counter() - started) / cycles * 1e3
    pool.close()
    return elapsed_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="lease size in MiB")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    size = args.mib << 20
    with tempfile.TemporaryDirectory() as tmp, spawned_master(Path(tmp)) as address:
        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 4 * size, "tcp", "",
                           address) == 0
        try:
            best = {"reused": float("inf"), "fresh": float("inf")}
            for _ in range(args.rounds):
                for name in best:
                    best[name] = min(best[name], round_ms(store, size, args.cycles,
                                                          name == "fresh"))
        finally:
            store.close()
    print(f"{args.mib} MiB lease, acquire + fill + release, best of {args.rounds} rounds of "
          f"{args.cycles}:")
    for name, ms in best.items():
        print(f"  {name:<7} {ms:8.1f} ms")
    print(f"  fresh / reused: {best['fresh'] / best['reused']:.1f}x")


if __name__ == "__main__":
    main()
