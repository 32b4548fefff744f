"""The floor of one small read: one client, a 4 KiB get of its own segment, on the caller's
thread (shared memory, a lean master call, the lease handed back with the next call).

Prints the best of --rounds rounds of --gets gets, in microseconds per get. To compare two
trees on this noisy machine, run it alternately against each (``PYTHONPATH=/other/tree``
makes both this client and the master it starts come from there):

    python benchmarks/single_get.py [--gets 2000] [--rounds 7] [--size 4096]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.replay import spawned_master


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gets", type=int, default=2000, help="gets per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=4096, help="object bytes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, spawned_master(Path(tmp)) as address:
        config = ClientConfig.from_dict({"master_server_address": address,
                                         "global_segment_size": 64 << 20})
        with KVPoolClient(config) as client:
            client.put("single-get", b"x" * args.size)
            client.flush()
            best_s = float("inf")
            for _ in range(args.rounds):
                started = time.perf_counter()
                for _ in range(args.gets):
                    client.get("single-get")
                best_s = min(best_s, (time.perf_counter() - started) / args.gets)
    print(f"{best_s * 1e6:.1f} us per {args.size}-byte get (best of {args.rounds} x {args.gets})")


if __name__ == "__main__":
    main()
