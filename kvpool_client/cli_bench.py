"""`kvpool bench`: a quick put/get throughput check of N objects of one size against a live pool.

It joins the pool as a client (contributing ``--segment-size`` of DRAM, by default enough for
the objects twice), puts and gets the objects with each chosen API, checks every object read
byte for byte, removes them, and prints ops/s, GB/s and per-call latency. For the full benchmark
(two processes, memcpy and loopback-TCP ratios) see ``benchmarks/client_bench.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool_client.cli_status import add_master_arguments, client_config_from_args
from kvpool_client.config import ConfigError
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import parse_size_bytes

APIS = ("single", "batch", "zc", "batch_zc")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool bench`."""
    add_master_arguments(parser)
    parser.add_argument("-n", "--num-objects", type=int, default=1000,
                        help="objects per API (default 1000)")
    parser.add_argument("--size", default="64kb", help="object size, e.g. 4kb, 1mb (default 64kb)")
    parser.add_argument("--batch", type=int, default=32, help="keys per batch call (default 32)")
    parser.add_argument("--api", default="single,batch_zc",
                        help=f"comma-separated APIs among {', '.join(APIS)} (default "
                             "single,batch_zc)")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                        help="force a transport (default auto)")
    parser.add_argument("--segment-size", default=None,
                        help="DRAM this client contributes (default: twice the objects, at "
                             "least 64mb; 0 to use only other clients' segments)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0, 1 when objects failed or read back wrong, 2 on bad
    arguments or an unreachable master."""
    from kvpool_client.client import KVPoolClient

    try:
        size_bytes = parse_size_bytes(args.size)
        apis = [a.strip() for a in args.api.split(",") if a.strip()]
        bad = [a for a in apis if a not in APIS]
        if bad or not apis or size_bytes <= 0 or args.num_objects <= 0 or args.batch <= 0:
            raise ValueError(f"bad --api {bad}" if bad else "need --size, -n and --batch > 0")
        segment = parse_size_bytes(args.segment_size) if args.segment_size is not None \
            else max(2 * args.num_objects * size_bytes, 64 << 20)
        config = client_config_from_args(args, global_segment_size=segment,
                                         transport=args.transport)
    except (ValueError, ConfigError) as exc:
        print(f"kvpool bench: {exc}", file=sys.stderr)
        return 2
    try:
        client = KVPoolClient(config)
    except KVPoolError as exc:
        print(f"kvpool bench: cannot join the pool: {exc}", file=sys.stderr)
        return 2
    results = []
    try:
        for api in apis:
            results.append(bench_api(client, api, args.num_objects, size_bytes, args.batch))
    finally:
        client.close()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"kvpool bench: {args.num_objects} objects of {size_bytes} bytes, batch "
              f"{args.batch}, transport {args.transport}, master {config.master_server_address}")
        print(f"  {'api':<9} {'op':<4} {'ops/s':>10} {'GB/s':>8} {'p50 us':>9} {'p99 us':>9} "
              f"{'failed':>7}")
        for r in results:
            for op in ("put", "get"):
                row = r[op]
                print(f"  {r['api']:<9} {op:<4} {row['ops_s']:10.0f} {row['GBps']:8.3f} "
                      f"{row['p50_us']:9.0f} {row['p99_us']:9.0f} {row['failed']:7d}")
    failed = sum(r["put"]["failed"] + r["get"]["failed"] for r in results)
    return 1 if failed else 0


def bench_api(client: Any, api: str, num: int, size_bytes: int, batch: int) -> dict[str, Any]:
    """Put then get ``num`` objects with one API; returns the put and get figures."""
    prefix = f"kvpool-bench-{os.getpid()}-{api}-{time.monotonic_ns()}"
    keys = [f"{prefix}-{i}" for i in range(num)]
    src = np.random.default_rng(len(prefix)).integers(0, 256, num * size_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    client.register_buffer(src)
    client.register_buffer(dst)
    payloads = [src[i * size_bytes:(i + 1) * size_bytes].tobytes() for i in range(num)] \
        if api in ("single", "batch") else []
    try:
        put = _timed(_put_calls(client, api, keys, payloads, src, size_bytes, batch), num,
                     size_bytes)
        got = _timed(_get_calls(client, api, keys, dst, size_bytes, batch), num, size_bytes)
        if api in ("single", "batch"):
            got["failed"] += sum(1 for i, value in enumerate(got.pop("values"))
                                 if value != payloads[i])
        else:
            got.pop("values")
            mismatched = ~np.all(src.reshape(num, size_bytes) == dst.reshape(num, size_bytes),
                                 axis=1)
            got["failed"] = max(got["failed"], int(mismatched.sum()))
        put.pop("values")
    finally:
        client.batch_remove(keys, force=True)
        client.unregister_buffer(src)
        client.unregister_buffer(dst)
    return {"api": api, "put": put, "get": got}


def _put_calls(client: Any, api: str, keys: list[str], payloads: list[bytes], src: Any,
               size_bytes: int, batch: int) -> list[tuple[list[int], Callable[[], Any]]]:
    calls: list[tuple[list[int], Callable[[], Any]]] = []
    for start in range(0, len(keys), 1 if api in ("single", "zc") else batch):
        idx = list(range(start, min(start + (1 if api in ("single", "zc") else batch),
                                    len(keys))))
        if api == "single":
            i = idx[0]
            calls.append((idx, functools.partial(client.put, keys[i], payloads[i])))
        elif api == "zc":
            i = idx[0]
            calls.append((idx, functools.partial(client.put_from, keys[i], src, i * size_bytes,
                                                 size_bytes)))
        elif api == "batch":
            calls.append((idx, functools.partial(client.put_batch, [keys[i] for i in idx],
                                                 [payloads[i] for i in idx])))
        else:
            calls.append((idx, functools.partial(
                client.batch_put_from, [keys[i] for i in idx], src,
                [i * size_bytes for i in idx], [size_bytes] * len(idx))))
    return calls


def _listed(call: Callable[[], Any]) -> Callable[[], list[Any]]:
    """``call`` with its result wrapped in a one-item list (the single-key gets)."""
    return lambda: [call()]


def _get_calls(client: Any, api: str, keys: list[str], dst: Any, size_bytes: int,
               batch: int) -> list[tuple[list[int], Callable[[], Any]]]:
    calls: list[tuple[list[int], Callable[[], Any]]] = []
    for start in range(0, len(keys), 1 if api in ("single", "zc") else batch):
        idx = list(range(start, min(start + (1 if api in ("single", "zc") else batch),
                                    len(keys))))
        if api == "single":
            calls.append((idx, _listed(functools.partial(client.get, keys[idx[0]]))))
        elif api == "zc":
            i = idx[0]
            calls.append((idx, _listed(functools.partial(client.get_into, keys[i], dst,
                                                         i * size_bytes, size_bytes))))
        elif api == "batch":
            calls.append((idx, functools.partial(client.get_batch, [keys[i] for i in idx])))
        else:
            calls.append((idx, functools.partial(
                client.batch_get_into, [keys[i] for i in idx], dst,
                [i * size_bytes for i in idx], [size_bytes] * len(idx))))
    return calls


def _timed(calls: list[tuple[list[int], Callable[[], Any]]], num: int,
           size_bytes: int) -> dict[str, Any]:
    latencies: list[float] = []
    values: list[Any] = []
    failed = 0
    started = time.perf_counter()
    for _, call in calls:
        t0 = time.perf_counter()
        try:
            answer = call()
        except KVPoolError:
            answer = None
            failed += 1
        latencies.append(time.perf_counter() - t0)
        if isinstance(answer, list):
            failed += sum(1 for a in answer if a is None or (isinstance(a, int) and a < 0)
                          or (isinstance(a, Status) and a != Status.OK))
            values.extend(answer)
        else:
            values.append(answer)
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"ops_s": num / elapsed, "GBps": num * size_bytes / elapsed / 1e9,
            "p50_us": statistics.median(latencies) * 1e6,
            "p99_us": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e6,
            "failed": failed, "values": values}
