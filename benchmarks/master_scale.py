"""One master, many clients: heartbeats over the lean framing under a put/get mix with eviction.

``--clients`` simulated clients are spread over ``--procs`` processes (one lean connection
each, asyncio, as few processes as the machine allows). Each client registers, mounts a
segment of its own (no memory behind it: the master never touches bytes) and heartbeats every
``client_ttl / 3``. Each process also drives a put/get mix through its clients: 100-key
``PutStart`` + ``PutEnd`` batches of 4 KiB objects and 100-key ``GetReplicas`` of keys put
before, as fast as the master answers. The master is first filled with ``--objects`` objects
into a segment that holds just them, and every client's segment holds 64 objects, so the pool
is full and eviction runs throughout.

It prints, per call kind, the count and p50 / p99 / p99.9 latency, how many heartbeats were
answered UNKNOWN_CLIENT (a false expiry: every client heartbeats on time) and the master's
``kvpool_clients_expired_total``. Every process listens on 127.0.0.1 and is stopped by pid.

    .venv/bin/python benchmarks/master_scale.py [--clients 1000] [--procs 4] [--objects 1000000]
        [--seconds 60] [--client-ttl 10] [--state] [--partitions N]

With ``--partitions N`` the master runs N partitions (README, "Partitions"): each client
registers with, mounts on and heartbeats every partition, and the figures of the master
(expiries, evictions, memory, collector pauses) are summed or taken over all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from master_rpc import start_master  # noqa: E402  (a sibling benchmark)

from kvpool_client.rpc import MasterRpc  # noqa: E402
from kvpool_wire.status import Status  # noqa: E402
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo  # noqa: E402

OBJECT_BYTES = 4096
BATCH = 100


async def _client(address: str, name: str, segment_bytes: int, ttl_s: float
                  ) -> MasterRpc:
    rpc = MasterRpc(address, timeout_s=max(30.0, ttl_s * 3))
    await rpc.register_client(name, f"host-{name}", "")
    segment = SegmentInfo(SegmentId(f"{name}-seg"), ClientId(name), segment_bytes)
    assert await rpc.mount_segment(name, segment) == Status.OK
    return rpc


async def _heartbeats(rpc: MasterRpc, name: str, ttl_s: float, deadline: float,
                      out: dict[str, Any]) -> None:
    await asyncio.sleep(random.random() * ttl_s / 3)
    while time.monotonic() < deadline:
        started = time.monotonic()
        status = await rpc.heartbeat(name)
        out["heartbeat"].append(time.monotonic() - started)
        if status != Status.OK:
            out["false_expiries"] += 1
        await asyncio.sleep(ttl_s / 3)


async def _mix(rpc: MasterRpc, name: str, deadline: float, out: dict[str, Any]) -> None:
    written: list[bytes] = []
    n = 0
    while time.monotonic() < deadline:
        keys = [f"{name}-{n + i}".encode() for i in range(BATCH)]
        n += BATCH
        started = time.monotonic()
        answers = await rpc.put_start(name, keys, [OBJECT_BYTES] * BATCH,
                                      PutOptions(preferred_segment=f"{name}-seg"))
        ok = [k for k, (s, _) in zip(keys, answers, strict=True) if s == Status.OK]
        if ok:
            await rpc.put_end(name, ok)
        out["put_batch"].append(time.monotonic() - started)
        written += ok
        written = written[-20 * BATCH:]
        started = time.monotonic()
        await rpc.get_replicas(name, random.sample(written, min(BATCH, len(written))))
        out["get_batch"].append(time.monotonic() - started)


async def _worker(address: str, index: int, num_clients: int, mixers: int, ttl_s: float,
                  seconds: float, segment_bytes: int, out_path: str) -> None:
    names = [f"c{index}-{i}" for i in range(num_clients)]
    rpcs = []
    for start in range(0, num_clients, 50):
        rpcs += await asyncio.gather(*(_client(address, n, segment_bytes, ttl_s)
                                       for n in names[start:start + 50]))
    out: dict[str, Any] = {"heartbeat": [], "put_batch": [], "get_batch": [],
                           "false_expiries": 0}
    print("ready", flush=True)
    sys.stdin.readline()  # everyone is registered: go
    deadline = time.monotonic() + seconds
    tasks = [_heartbeats(r, n, ttl_s, deadline, out) for r, n in zip(rpcs, names, strict=True)]
    tasks += [_mix(r, n, deadline, out) for r, n in zip(rpcs[:mixers], names[:mixers],
                                                         strict=True)]
    await asyncio.gather(*tasks)
    for rpc, name in zip(rpcs, names, strict=True):
        await rpc.unregister_client(name)
        await rpc.close()
    Path(out_path).write_text(json.dumps(out))


async def _fill(address: str, num_objects: int) -> asyncio.Task[None]:
    rpc = MasterRpc(address, timeout_s=120)
    await rpc.register_client("filler", "filler-host", "")
    segment = SegmentInfo(SegmentId("filler-seg"), ClientId("filler"),
                          num_objects * OBJECT_BYTES)  # full: eviction runs from the start
    assert await rpc.mount_segment("filler", segment) == Status.OK
    beat = time.monotonic()
    for i in range(0, num_objects, 1000):
        chunk = [f"fill-{j:09d}".encode() for j in range(i, min(i + 1000, num_objects))]
        await rpc.put_start("filler", chunk, [OBJECT_BYTES] * len(chunk), PutOptions())
        await rpc.put_end("filler", chunk)
        if time.monotonic() - beat > 1:
            await rpc.heartbeat("filler")
            beat = time.monotonic()
    return asyncio.get_running_loop().create_task(_keep_alive(rpc))


async def _keep_alive(rpc: MasterRpc) -> None:
    while True:
        await asyncio.sleep(1)
        await rpc.heartbeat("filler")


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3 if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--mixers", type=int, default=4, help="clients per process that also put "
                    "and get (the others only heartbeat)")
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--client-ttl", type=float, default=10.0)
    ap.add_argument("--state", action="store_true",
                    help="the master persists its index (--state-dir in a temporary "
                         "directory, log at info level: its compaction lines), so state-log "
                         "compactions run under the load")
    ap.add_argument("--partitions", type=int, default=1,
                    help="run the master as this many partitions")
    ap.add_argument("--_worker", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        address, index, count, mixers, ttl, seconds, out = args._worker
        asyncio.run(_worker(address, int(index), int(count), int(mixers), float(ttl),
                            float(seconds), 64 * OBJECT_BYTES, out))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        state = ["--state-dir", f"{tmp}/state", "--log-level", "info"] if args.state else []
        master, ready = start_master(Path(tmp), "--client-ttl", str(args.client_ttl), *state,
                                     "--partitions", str(args.partitions))
        partitions = ready.get("partitions") or [ready]
        procs: list[subprocess.Popen[str]] = []
        try:
            address = f"127.0.0.1:{ready['grpc_port']}"
            started = time.monotonic()
            loop = asyncio.new_event_loop()
            keep_alive = loop.run_until_complete(_fill(address, args.objects))
            print(f"filled {args.objects:,} objects in {time.monotonic() - started:.1f} s; "
                  f"master RSS {_master_rss(partitions) / 2**30:.2f} GiB", flush=True)
            per = args.clients // args.procs
            for index in range(args.procs):
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--_worker", address, str(index), str(per),
                     str(args.mixers), str(args.client_ttl), str(args.seconds),
                     f"{tmp}/out-{index}.json"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            for proc in procs:
                assert proc.stdout is not None
                while proc.stdout.readline().strip() != "ready":
                    loop.run_until_complete(asyncio.sleep(0.1))
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            # the filler keeps heartbeating on this loop while the workers run
            loop.run_until_complete(asyncio.sleep(args.seconds + 5))
            for proc in procs:
                proc.wait(args.seconds + 120)
            keep_alive.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            merged: dict[str, Any] = {"heartbeat": [], "put_batch": [], "get_batch": [],
                                      "false_expiries": 0}
            for index in range(args.procs):
                part = json.loads(Path(f"{tmp}/out-{index}.json").read_text())
                for key in ("heartbeat", "put_batch", "get_batch"):
                    merged[key] += part[key]
                merged["false_expiries"] += part["false_expiries"]
            metrics = ""
            for partition in partitions:
                url = f"http://127.0.0.1:{partition['metrics_port']}/metrics"
                with urllib.request.urlopen(url, timeout=10) as response:
                    metrics += response.read().decode()
            expired = sum(float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("kvpool_clients_expired_total"))
            evicted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("kvpool_evicted_objects_total"))
            print(f"{per * args.procs} clients in {args.procs} processes"
                  f"{f', {args.partitions} partitions' if args.partitions > 1 else ''}, "
                  f"{args.procs * args.mixers} of them putting and getting, "
                  f"{args.seconds:g} s, client_ttl {args.client_ttl:g} s, "
                  f"{args.objects:,} objects to start with")
            print(f"  {'call':<22} {'count':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9}")
            for key, label in (("heartbeat", "Heartbeat"),
                               ("put_batch", f"PutStart+PutEnd x{BATCH}"),
                               ("get_batch", f"GetReplicas x{BATCH}")):
                values = merged[key]
                print(f"  {label:<22} {len(values):>8} {_pct(values, 0.5):>8.2f} "
                      f"{_pct(values, 0.99):>8.2f} {_pct(values, 0.999):>9.2f}")
            longest = max((float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("kvpool_master_gc_longest_pause_seconds")),
                          default=0.0)
            print(f"  master RSS at the end {_master_rss(partitions) / 2**30:.2f} GiB, "
                  f"peak {_master_rss(partitions, 'VmHWM') / 2**30:.2f} GiB; its longest "
                  f"collector pause {longest * 1e3:.1f} ms")
            print(f"  false expiries (heartbeats answered UNKNOWN_CLIENT): "
                  f"{merged['false_expiries']}; kvpool_clients_expired_total {expired:g}; "
                  f"objects evicted {evicted:g}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            master.send_signal(signal.SIGTERM)
            try:
                master.wait(30)
            except subprocess.TimeoutExpired:
                master.kill()
    return 0


def _master_rss(partitions: list[dict[str, Any]], field: str = "VmRSS") -> int:
    """The memory of every process of the master (each partition's), summed."""
    return sum(_rss_bytes(int(p["pid"]), field) for p in partitions)


def _rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    sys.exit(main())
