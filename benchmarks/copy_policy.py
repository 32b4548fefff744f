#!/usr/bin/env python3
"""How the sync client copies large shared-memory batches, against the previous policy.

Two client processes and a master on 127.0.0.1, as in ``client_bench.py`` phase d: this process
(client B) reads 32-key batches from client A's segment and writes 32-key batches into it,
zero-copy, alternating three policies round by round in one run:

  caller   (the client as it is) the calling thread copies half of a large batch and a helper
           thread the other half (the blocking driver); the batch stays whole;
           pieces of STREAM_MIN_BYTES or more are copied with streaming stores (``_ntcopy``,
           where it was built)
  numpy    the same, every piece copied with numpy.copyto
  previous one thread copies inline with numpy.copyto

Each round measures single-thread memcpy (numpy, 256 MiB) first; ratios are medians of
per-round ratios. It also prints where a call's time goes: the master calls and the copy, per
call, as the client times them. The other policies are emulated on the current code (streaming
switched off; one copy thread); nothing else differs.

Usage:  python benchmarks/copy_policy.py [--size-mib 1] [--calls 32] [--rounds 6]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import client_bench as cb  # noqa: E402  (Procs, Master, Worker: the same processes)

from kvpool_client.transfer import copy as copy_module  # noqa: E402

MiB = 1 << 20
BATCH = 32
STREAM_MIN_BYTES = copy_module.STREAM_MIN_BYTES  # the client's, before any policy changes it
POLICIES = ("previous", "numpy", "caller")


def use_policy(client: Any, policy: str) -> None:
    """Switch ``client`` (a KVPoolClient) between the copy policies."""
    copy_module.STREAM_MIN_BYTES = STREAM_MIN_BYTES if policy == "caller" else 1 << 62
    client._path.parts.shm._copier.num_threads = 1 if policy == "previous" else 2


def timed(timers: dict[str, float], obj: Any, name: str) -> None:
    """Accumulate the seconds spent in method ``obj.name`` under ``timers[name]``."""
    original: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timers[name] += time.perf_counter() - started

    setattr(obj, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1, help="object size (MiB)")
    ap.add_argument("--calls", type=int, default=32, help="batch calls per round and direction")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if not (1 <= args.size_mib <= 64 and 1 <= args.calls <= 256 and 1 <= args.rounds <= 50):
        ap.error("--size-mib 1..64, --calls 1..256, --rounds 1..50")

    import numpy as np

    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_wire.types import PutOptions

    size = args.size_mib * MiB
    total_bytes = args.calls * BATCH * size
    segment_bytes = max(4 << 30, 3 * total_bytes)
    procs = cb.Procs()
    logdir = tempfile.mkdtemp(prefix="kvpool-copy-policy-")
    big_src = np.ones(256 * MiB, np.uint8)
    big_dst = np.zeros(256 * MiB, np.uint8)
    try:
        master = cb.Master(procs, logdir, "master")
        config = {"master_server_address": master.addr, "global_segment_size": segment_bytes,
                  "rpc_timeout_s": 30, "transfer_timeout_s": 60}
        a = cb.Worker(procs, logdir, "client-A", {"client": config, "zc_bytes": BATCH * size})
        a_segment = a.info["segment_ids"][0]
        client = KVPoolClient(ClientConfig.from_dict(config))
        src = np.random.default_rng(1).integers(0, 256, BATCH * size, dtype=np.uint8)
        dst = np.ones(BATCH * size, np.uint8)
        client.register_buffer(src)
        client.register_buffer(dst)
        # Map A's segment in this process and fault in its pages, as client_bench does.
        warm_size = cb.warm_object_bytes(BATCH * size)  # what A's fill writes
        warm = a.call("fill", total_bytes=int(0.9 * segment_bytes) // warm_size * warm_size,
                      preferred=a_segment)
        for start in range(0, len(warm), BATCH):
            chunk = warm[start:start + BATCH]
            got = client.batch_get_into(chunk, dst, [j * warm_size for j in range(len(chunk))],
                                        [warm_size] * len(chunk))
            if any(n != warm_size for n in got):
                raise RuntimeError(f"warm-up read failed: {got}")
        a.call("remove_all")
        time.sleep(cb.LEASE_TTL_MS / 1000 + 0.5)  # the warm-up's read leases lapse
        read_keys = [f"r-{i}" for i in range(args.calls * BATCH)]
        a.call("put", api="batch_zc", size=size, keys=read_keys, preferred=a_segment)
        offsets = [j * size for j in range(BATCH)]
        sizes = [size] * BATCH
        options = PutOptions(preferred_segment=a_segment)
        datapath = client._path  # the blocking driver, which runs the sync client's calls
        timers: dict[str, float] = collections.defaultdict(float)
        for name in ("get_replicas", "put_start", "put_end"):
            timed(timers, datapath.rpc, name)
        timed(timers, datapath, "transfer")
        ratios = {p: {"get": [], "put": []} for p in POLICIES}
        per_call_ms = {p: collections.defaultdict(list) for p in POLICIES}
        for round_index in range(args.rounds):
            for policy in POLICIES:
                use_policy(client, policy)
                limit = cb.memcpy_gbps(big_src, big_dst)
                timers.clear()
                started = time.perf_counter()
                for c in range(args.calls):
                    got = client.batch_get_into(read_keys[c * BATCH:(c + 1) * BATCH], dst,
                                                offsets, sizes)
                    if any(n != size for n in got):
                        raise RuntimeError(f"get failed: {got}")
                get_gbps = total_bytes / (time.perf_counter() - started) / 1e9
                transfer_get = timers.pop("transfer", 0.0)
                keys = [f"w-{round_index}-{policy}-{i}" for i in range(args.calls * BATCH)]
                started = time.perf_counter()
                for c in range(args.calls):
                    statuses = client.batch_put_from(keys[c * BATCH:(c + 1) * BATCH], src,
                                                     offsets, sizes, options=options)
                    if any(statuses):
                        raise RuntimeError(f"put failed: {statuses}")
                put_gbps = total_bytes / (time.perf_counter() - started) / 1e9
                client.batch_remove(keys, force=True)
                ratios[policy]["get"].append(get_gbps / limit)
                ratios[policy]["put"].append(put_gbps / limit)
                timers["transfer_get"] = transfer_get
                timers["transfer_put"] = timers.pop("transfer", 0.0)
                for name, seconds in timers.items():
                    per_call_ms[policy][name].append(seconds / args.calls * 1e3)
        print(f"batches of {BATCH} x {args.size_mib} MiB, {args.calls} calls per round and "
              f"direction, {args.rounds} rounds; ratio = GB/s / single-thread memcpy "
              f"(median of per-round ratios, min-max in brackets); streaming copies "
              f"{'built' if copy_module._stream_copy is not None else 'NOT built: caller = numpy'}")
        for policy in POLICIES:
            g, p = ratios[policy]["get"], ratios[policy]["put"]
            print(f"  {policy:9s} get {statistics.median(g):6.0%} ({min(g):.0%}-{max(g):.0%})"
                  f"   put {statistics.median(p):6.0%} ({min(p):.0%}-{max(p):.0%})")
        print("per call (ms, medians; with 'previous' the two sub-batches' times add up):")
        for policy in POLICIES:
            parts = "  ".join(f"{name} {statistics.median(values):.2f}"
                              for name, values in sorted(per_call_ms[policy].items()))
            print(f"  {policy:9s} {parts}")
        client.close()
    finally:
        procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
