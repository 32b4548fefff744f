"""Loop stalls of a real master while its heaviest operations run: a probe's latency.

A probe process calls single-key ``Exist`` over the lean framing back to back and records the
start time and latency of every call. Meanwhile this process fills the master with ``--objects``
objects (raw ``PutStart`` / ``PutEnd`` into a segment no memory backs: the master never touches
bytes), then runs one operation on them and notes when it started and ended:

- ``remove_all``: ``RemoveAll(force)`` of every object;
- ``unmount``: the owner unmounts the segment that holds them;
- ``unregister``: the owner leaves the pool;
- ``expiry``: the owner stops heartbeating and the master expires it (``--client-ttl`` 1 s);
- ``evict``: the owner's segment holds only the objects: once they are in, it puts as many
  fresh ones again, each batch evicting as much as it puts (the least recently used first);
- ``read`` / ``exist``: ``GetReplicas`` (the owner as a proven reader) / ``Exist`` of every
  object, in calls of ``--batch-keys`` keys (with ``--batch-keys`` as large as ``--objects``:
  one call of that many keys);
- ``scrape``: ``--segments`` segments are mounted (by owners of up to 1,000 each, no objects),
  then ``/metrics`` is scraped 20 times, one after another, as Prometheus would every
  interval (each scrape renders three gauges per segment);
- ``status``: the same segments, then 20 ``GetStats`` calls, as ``kvpool status`` makes (the
  document lists every segment);
- ``fill``: the fill itself (batched puts of ``--batch-keys``, 1,000), as a baseline (with
  ``--batch-keys`` as large as ``--objects``: what one call of that many keys holds the master
  for); with ``--state`` the master persists, and the fill's log grows past the size that
  starts compactions (the master then logs at info level: its compaction lines give the fork
  and swap times).

Per operation it prints how long the operation took (until the master's sweep backlog, which
``/status`` reports, is empty again) and the probe's p50 / p99 / p99.9 / max while it ran: the
goal is no stall over 10 ms. Every process it starts listens on 127.0.0.1 and
is stopped by pid.

    .venv/bin/python benchmarks/master_stall.py [--objects 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from master_rpc import BATCH_KEYS, start_master  # noqa: E402  (a sibling benchmark)

from kvpool_client.rpc import MasterRpc  # noqa: E402
from kvpool_wire.status import Status  # noqa: E402
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo  # noqa: E402

SCENARIOS = ("fill", "read", "exist", "remove_all", "unmount", "unregister", "expiry", "evict",
             "scrape", "status")
SCRAPES = 20
SEGMENTS_PER_OWNER = 1000
CLIENT_TTL_S = 1.0


# -- the probe, in its own process ----------------------------------------------------------------

async def probe(address: str, out_path: str) -> None:
    """Exist one key back to back until stdin closes; write [(start, seconds)] to out_path."""
    rpc = MasterRpc(address, timeout_s=30)
    await rpc.register_client("probe", "probe-host", "")
    samples: list[tuple[float, float]] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)
    last_beat = time.monotonic()
    while not stop.is_set() and len(samples) < 5_000_000:
        started = time.monotonic()
        await rpc.exist("probe", [b"probe-key"])
        samples.append((started, time.monotonic() - started))
        if started - last_beat > 0.3:
            await rpc.heartbeat("probe")
            last_beat = started
    with open(out_path, "w") as f:
        json.dump(samples, f)
    await rpc.close()


# -- the operations --------------------------------------------------------------------------------

async def owner(address: str, name: str, num_objects: int, evicting: bool = False
                ) -> MasterRpc:
    rpc = MasterRpc(address, timeout_s=120)
    await rpc.register_client(name, "bench-host", "")
    # twice what the objects take: no eviction while they go in; or, ``evicting``, as much
    # as they take: the pool passes its high watermark as they go in and stays there
    size_bytes = num_objects * 4096 if evicting else num_objects * 8192 + (1 << 20)
    segment = SegmentInfo(SegmentId(f"{name}-seg"), ClientId(name), size_bytes)
    assert await rpc.mount_segment(name, segment) == Status.OK
    return rpc


async def fill(rpc: MasterRpc, name: str, num_objects: int, batch_keys: int = BATCH_KEYS,
               first: int = 0) -> None:
    for i in range(first, first + num_objects, batch_keys):
        chunk = [f"{name}-{j:09d}".encode()
                 for j in range(i, min(i + batch_keys, first + num_objects))]
        started = await rpc.put_start(name, chunk, [4096] * len(chunk), PutOptions())
        assert all(s == Status.OK for s, _ in started), started[:3]
        assert all(s == Status.OK for s in await rpc.put_end(name, chunk))


async def scrapes(address: str, metrics_port: int, num_segments: int,
                  kind: str) -> tuple[float, float]:
    """Mount ``num_segments`` segments, then scrape /metrics (``kind`` "scrape") or call
    GetStats ("status") ``SCRAPES`` times; return the (start, end) monotonic times of those."""
    owners: list[tuple[MasterRpc, str]] = []
    beating = []
    try:
        for first in range(0, num_segments, SEGMENTS_PER_OWNER):
            name = f"owner-scrape-{first // SEGMENTS_PER_OWNER}"
            rpc = MasterRpc(address, timeout_s=120)
            await rpc.register_client(name, "bench-host", "")
            owners.append((rpc, name))
            beating.append(asyncio.get_running_loop().create_task(heartbeat(rpc, name)))
            for i in range(first, min(first + SEGMENTS_PER_OWNER, num_segments)):
                segment = SegmentInfo(SegmentId(f"{name}-seg-{i}"), ClientId(name), 1 << 20)
                assert await rpc.mount_segment(name, segment) == Status.OK
        await asyncio.sleep(0.5)  # let the probe settle
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        started = time.monotonic()
        for _ in range(SCRAPES):
            if kind == "scrape":   # a thread fetches: the heartbeats go on meanwhile
                text = await asyncio.to_thread(_fetch, url)
                listed = text.count("kvpool_segment_used_bytes{")
            else:
                listed = len((await owners[0][0].get_stats())["segments"]["list"])
        ended = time.monotonic()
        assert listed == num_segments, f"{listed} of {num_segments} segments listed"
        return started, ended
    finally:
        for task in beating:
            task.cancel()
        for rpc, name in owners:
            await rpc.unregister_client(name)
            await rpc.close()


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return str(answer.read().decode())


async def scenario(address: str, kind: str, num_objects: int,
                   batch_keys: int = BATCH_KEYS) -> tuple[float, float]:
    """Run one scenario; return the (start, end) monotonic times of its operation."""
    name = f"owner-{kind}"
    rpc = await owner(address, name, num_objects, evicting=kind == "evict")
    beating = asyncio.get_running_loop().create_task(heartbeat(rpc, name))
    try:
        if kind == "fill":
            started = time.monotonic()
            await fill(rpc, name, num_objects, batch_keys)
            return started, time.monotonic()
        await fill(rpc, name, num_objects)
        await asyncio.sleep(0.5)  # let the probe settle
        started = time.monotonic()
        if kind == "evict":
            await fill(rpc, name, num_objects, batch_keys, first=num_objects)
            return started, time.monotonic()
        if kind in ("read", "exist"):
            for i in range(0, num_objects, batch_keys):
                chunk = [f"{name}-{j:09d}".encode()
                         for j in range(i, min(i + batch_keys, num_objects))]
                if kind == "read":
                    results = (await rpc.get_replicas(name, chunk)).results
                    assert all(r.status == Status.OK for r in results), \
                        {Status(r.status) for r in results}
                else:
                    assert (await rpc.exist(name, chunk))[0] == [Status.OK] * len(chunk)
            return started, time.monotonic()
        if kind == "remove_all":
            removed = await rpc.remove_all(name, force=True)
            assert removed == num_objects, removed
        elif kind == "unmount":
            assert await rpc.unmount_segment(name, f"{name}-seg") == Status.OK
        elif kind == "unregister":
            assert await rpc.unregister_client(name) == Status.OK
        elif kind == "expiry":
            beating.cancel()
            while await rpc.exist("probe", [f"{name}-000000000".encode()]) != (
                    [Status.NOT_FOUND], [0]):
                await asyncio.sleep(0.005)  # expired once its objects are gone
        await swept(rpc)
        return started, time.monotonic()
    finally:
        beating.cancel()
        if kind in ("fill", "read", "exist", "remove_all", "unmount", "evict"):
            await rpc.unregister_client(name)
        await rpc.close()


async def swept(rpc: MasterRpc) -> None:
    """Wait until the master has swept what the operation left (a master that sweeps in
    steps answers before it is done; one that does not has nothing left)."""
    while True:
        document = await rpc.get_stats()
        if not document["objects"].get("sweep_backlog_keys", 0):
            return
        await asyncio.sleep(0.005)


async def heartbeat(rpc: MasterRpc, name: str) -> None:
    while True:
        await asyncio.sleep(CLIENT_TTL_S / 4)
        await rpc.heartbeat(name)


# -- orchestration ---------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--only", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    ap.add_argument("--state", action="store_true",
                    help="the master persists its index (--state-dir in a temporary "
                         "directory), so state-log compactions run during the operations")
    ap.add_argument("--batch-keys", type=int, default=BATCH_KEYS,
                    help="keys per PutStart / PutEnd of the fill, and per read or exist call "
                         "(default 1,000)")
    ap.add_argument("--segments", type=int, default=1000,
                    help="segments mounted for the scrape and status scenarios (default "
                         "1,000)")
    ap.add_argument("--_probe", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._probe:
        asyncio.run(probe(*args._probe))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-stall-"))
    # with --state the master logs at info: its compaction lines give the fork and swap times
    state = ["--state-dir", str(workdir / "state"), "--log-level", "info"] if args.state else []
    master, ready = start_master(workdir, "--client-ttl", str(CLIENT_TTL_S), *state)
    address = f"127.0.0.1:{ready['grpc_port']}"
    probe_out = workdir / "probe.json"
    prober = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_probe", address,
                               str(probe_out)], stdin=subprocess.PIPE)
    windows: dict[str, tuple[float, float]] = {}
    try:
        time.sleep(1.0)
        for kind in args.only.split(","):
            if kind in ("scrape", "status"):
                windows[kind] = asyncio.run(scrapes(address, ready["metrics_port"],
                                                    args.segments, kind))
            else:
                windows[kind] = asyncio.run(scenario(address, kind, args.objects,
                                                     args.batch_keys))
            time.sleep(0.5)
        exposition = master_metrics(ready)
    finally:
        assert prober.stdin is not None
        prober.stdin.close()
        prober.wait(60)
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(30)
        except subprocess.TimeoutExpired:
            master.kill()
    samples = json.loads(probe_out.read_text())
    print(f"master loop stalls, {args.objects:,} objects: a probe's single-key Exist (lean "
          "framing) while each operation ran")
    print(f"  {'operation':<12} {'took':>9} {'calls':>8} {'p50 µs':>8} {'p99 µs':>8} "
          f"{'p99.9 µs':>9} {'max ms':>8}")
    for kind, (started, ended) in windows.items():
        during = sorted(s for t, s in samples if started <= t <= ended or
                        (t < started and t + s > started))
        print(f"  {kind:<12} {ended - started:>8.2f}s {len(during):>8} "
              f"{percentile(during, 0.5) * 1e6:>8.0f} {percentile(during, 0.99) * 1e6:>8.0f} "
              f"{percentile(during, 0.999) * 1e6:>9.0f} {max(during, default=0) * 1e3:>8.1f}")
    gc_pauses = {line.split('"')[1]: value for line, value in exposition.items()
                 if line.startswith('kvpool_master_gc_longest_pause_seconds{generation="')}
    print("  the master's own longest collector pause, whole run (ms, generation 0 / 1 / 2): "
          + " / ".join(f"{gc_pauses.get(g, 0.0) * 1e3:.1f}" for g in ("0", "1", "2")))
    evicted = sum(value for line, value in exposition.items()
                  if line.startswith("kvpool_evicted_objects_total"))
    print(f"  objects evicted, whole run: {evicted:,.0f}")
    lag_samples = exposition["kvpool_master_loop_lag_seconds_count"]
    late = lag_samples - exposition['kvpool_master_loop_lag_seconds_bucket{le="0.01"}']
    print(f"  the master's own loop lag, whole run: {lag_samples:,.0f} samples, {late:,.0f} "
          f"over 10 ms, the longest "
          f"{exposition['kvpool_master_loop_lag_max_seconds'] * 1e3:.1f} ms")
    return 0


def master_metrics(ready: dict[str, Any]) -> dict[str, float]:
    """The master's exposition: the value of each sample line by its name and labels."""
    text = _fetch(f"http://127.0.0.1:{ready['metrics_port']}/metrics")
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


if __name__ == "__main__":
    sys.exit(main())
