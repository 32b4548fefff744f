"""`kvpool replay TRACE`: replay a request trace through worker processes sharing one pool.

Each worker is a process with a real ``KVPoolClient`` (contributing a real shared-memory
segment) and a level-1 ``TieredPrefixCache`` over its own host buffer standing in for device
memory (``--device-blocks`` blocks of ``--object-size`` bytes). Requests go to workers by a
deterministic routing and are processed one at a time (the coordinator waits for each reply),
so the pool sees the same sequence of operations as ``--simulate``, which replays the same
configuration against a model of the master's eviction (``replay_sim.SimulatedPool``).

Every block a worker computes is stamped with its block id and every block it reuses (level 1
or pool) is checked against that stamp, so a hit that returned the wrong bytes is counted.
The local-only figures (the same level-1 caches and no pool) come from the same level-1 code
without a pool, which needs no master.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvpool_client.replay_sim import (
    ROUTINGS,
    HitCounts,
    ReplayResult,
    SimulatedPool,
    aligned,
    begin,
    block_key,
    end,
    iter_progress,
    load_trace,
    route,
    simulate,
)
from kvpool_wire.partitions import MAX_PARTITIONS
from kvpool_wire.types import parse_size_bytes

STAMP_BYTES = 8
READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay: who serves, how much memory each level has, how the master evicts."""

    num_workers: int = 4
    device_blocks: int = 2000
    pool_blocks: int = 20000
    object_bytes: int = 64 * 1024
    routing: str = "round-robin"
    high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    lease_ttl_ms: int = 1000
    reply_timeout_s: float = 60.0
    ssd_blocks: int = 0  # per worker: each worker's SSD segment, in blocks
    partitions: int = 1  # of the spawned master (README, "Partitions")

    def __post_init__(self) -> None:
        if self.num_workers <= 0 or self.device_blocks <= 0 or self.pool_blocks <= 0:
            raise ValueError("workers, device blocks and pool blocks must be positive")
        if self.ssd_blocks < 0:
            raise ValueError("SSD blocks must be >= 0")
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be in [1, {MAX_PARTITIONS}]")
        if self.pool_blocks < self.num_workers:
            raise ValueError("need at least one pool block per worker")
        if self.object_bytes < STAMP_BYTES:
            raise ValueError(f"object size must be at least {STAMP_BYTES} bytes")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")

    @property
    def segment_bytes(self) -> int:
        """Bytes each worker contributes: an equal share of the pool, whole objects only."""
        return self.pool_blocks // self.num_workers * aligned(self.object_bytes)

    @property
    def capacity_bytes(self) -> int:
        """Pool capacity as the master counts it."""
        return self.segment_bytes * self.num_workers


def simulated_pool(config: ReplayConfig) -> SimulatedPool:
    """The model of the pool ``config`` describes."""
    return SimulatedPool(config.capacity_bytes, config.object_bytes,
                         high_watermark_ratio=config.high_watermark_ratio,
                         eviction_ratio=config.eviction_ratio,
                         ssd_capacity_bytes=config.ssd_blocks * config.num_workers
                         * aligned(config.object_bytes))


# --- the master ---------------------------------------------------------------------------


@contextlib.contextmanager
def spawned_master(workdir: Path, extra_args: Sequence[str] = ()) -> Iterator[str]:
    """A local ``kvpool-master`` on 127.0.0.1 (plus ``extra_args``); yields its address.

    The master is stopped (SIGTERM, then SIGKILL) by pid on exit.
    """
    ready = workdir / "master-ready.json"
    log_path = workdir / "master.log"
    command = [sys.executable, "-m", "kvpool_master.cli", "--host", "127.0.0.1", "--port", "0",
               "--fast-port", "0", "--metrics-port", "off", "--ready-file", str(ready),
               "--log-level", "warning", *extra_args]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        address = ""
        while not address:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvpool-master did not start:\n"
                                   + log_path.read_text(errors="replace"))
            with contextlib.suppress(OSError, ValueError, KeyError):
                address = f"127.0.0.1:{int(json.loads(ready.read_text())['grpc_port'])}"
            time.sleep(0.05)
        yield address
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


# --- workers ------------------------------------------------------------------------------


def _stamp(block_id: int) -> bytes:
    return block_id.to_bytes(STAMP_BYTES, "big")


def _worker_main(conn: Connection, client_config: dict[str, Any], device_blocks: int,
                 object_bytes: int) -> None:
    """One worker: a client, a level-1 cache over host memory, requests from ``conn``."""
    try:
        from kvpool_client.client import KVPoolClient
        from kvpool_client.config import ClientConfig
        from kvpool_client.prefix import RegionBlockIO, TieredPrefixCache

        client = KVPoolClient(ClientConfig.from_dict(client_config))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        memory = bytearray(device_blocks * object_bytes)
        view = memoryview(memory)
        client.register_buffer(view)

        def regions_of(block_id: int) -> list[memoryview]:
            return [view[block_id * object_bytes:(block_id + 1) * object_bytes]]

        cache = TieredPrefixCache(device_blocks, key_fn=block_key, pool=client,
                                  io=RegionBlockIO(client, regions_of))
        conn.send(("ready", os.getpid()))
        while True:
            ids = conn.recv()
            if ids is None:
                break
            match = begin(cache, ids)
            bad = 0
            for i in range(match.num_reused):
                start = match.block_ids[i] * object_bytes
                bad += view[start:start + STAMP_BYTES] != _stamp(ids[i])
            for i in range(match.num_reused, match.num_blocks):
                start = match.block_ids[i] * object_bytes
                view[start:start + STAMP_BYTES] = _stamp(ids[i])
            end(cache, match)
            conn.send(("done", match.num_device_hits, match.num_loaded, bad))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        client.close()


def _receive(conn: Connection, timeout_s: float, worker: int) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"worker {worker} did not answer within {timeout_s} s")
    reply: tuple[Any, ...] = conn.recv()
    if reply[0] == "error":
        raise RuntimeError(f"worker {worker} failed:\n{reply[1]}")
    return reply


def run_live(requests: Sequence[Sequence[int]], config: ReplayConfig, *,
             master_address: str = "", progress: bool = False) -> ReplayResult:
    """Replay through ``config.num_workers`` worker processes against a real master.

    Spawns a local master with the replay's eviction settings unless ``master_address`` is
    given. Raises ``RuntimeError`` when a worker or the master fails.
    """
    longest = max((len(ids) for ids in requests), default=0)
    if longest > config.device_blocks:
        raise ValueError(f"a request has {longest} blocks but a worker has only "
                         f"{config.device_blocks} device blocks")
    workers_of = route(requests, config.num_workers, config.routing)
    with tempfile.TemporaryDirectory(prefix="kvpool-replay-") as tmp, \
            contextlib.ExitStack() as stack:
        flags = ["--eviction-high-watermark-ratio", str(config.high_watermark_ratio),
                 "--eviction-ratio", str(config.eviction_ratio),
                 "--default-kv-lease-ttl", str(config.lease_ttl_ms),
                 "--partitions", str(config.partitions)]
        address = master_address or stack.enter_context(spawned_master(Path(tmp), flags))
        return _drive(requests, workers_of, config, address, progress, Path(tmp) / "ssd")


def _drive(requests: Sequence[Sequence[int]], workers_of: Sequence[int], config: ReplayConfig,
           address: str, progress: bool, ssd_dir: Path) -> ReplayResult:
    ctx = multiprocessing.get_context("spawn")
    client_config: dict[str, Any] = {
        "master_server_address": address, "local_hostname": "127.0.0.1",
        "global_segment_size": config.segment_bytes, "local_buffer_size": 0,
        "cluster_id": f"replay{os.getpid()}"}
    if config.ssd_blocks:
        client_config.update(ssd_path=str(ssd_dir),
                             ssd_segment_size=config.ssd_blocks * aligned(config.object_bytes))
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        for _ in range(config.num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, daemon=True,
                               args=(child, client_config, config.device_blocks,
                                     config.object_bytes))
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        for worker, conn in enumerate(conns):
            _receive(conn, READY_TIMEOUT_S, worker)
        result = ReplayResult([HitCounts() for _ in range(config.num_workers)])
        for index in iter_progress(range(len(requests)), progress, "replay"):
            worker = workers_of[index]
            conns[worker].send(list(requests[index]))
            _, device_hits, pool_hits, bad = _receive(conns[worker], config.reply_timeout_s,
                                                      worker)
            blocks = len(requests[index])
            result.workers[worker].add(blocks, device_hits, pool_hits, bad)
            result.overall.add(blocks, device_hits, pool_hits, bad)
        return result
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in procs:
            proc.join(15)
            if proc.is_alive():
                proc.kill()  # by pid, only the processes started here
                proc.join(5)


# --- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool replay`."""
    parser.add_argument("trace", help="JSONL trace, one request per line with 'hash_ids'")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--device-blocks", type=int, default=2000,
                        help="level-1 capacity of each worker, in blocks (default 2000)")
    parser.add_argument("--pool-blocks", type=int, default=20000,
                        help="pool capacity in blocks, split evenly across workers (default 20000)")
    parser.add_argument("--object-size", default="64KiB",
                        help="bytes of one block object (default 64KiB)")
    parser.add_argument("--routing", choices=ROUTINGS, default="round-robin",
                        help="request i -> worker i %% N, or by a hash of the first two "
                             "block ids (default round-robin)")
    parser.add_argument("--start", type=int, default=0, help="skip this many requests")
    parser.add_argument("--requests", type=int, default=None, help="replay only this many")
    parser.add_argument("--whole-blocks-only", action="store_true",
                        help="drop a request's last block id when its tokens do not fill it")
    parser.add_argument("--eviction-high-watermark-ratio", type=float, default=0.95)
    parser.add_argument("--eviction-ratio", type=float, default=0.05)
    parser.add_argument("--lease-ttl-ms", type=int, default=1000,
                        help="read lease of the spawned master (default 1000 ms)")
    parser.add_argument("--master", default="",
                        help="use this running master (its eviction flags must match) instead "
                             "of spawning one")
    parser.add_argument("--partitions", type=int, default=1,
                        help="split the spawned master's index across this many processes "
                             "(default 1)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--simulate", action="store_true",
                      help="offline LRU model of the same configuration, no processes")
    mode.add_argument("--compare", action="store_true",
                      help="run live and simulated, and print how far apart they are")
    parser.add_argument("--ssd-blocks-per-worker", type=int, default=0,
                        help="SSD space each worker adds to the pool, in blocks (a file under "
                             "a temporary directory, live): DRAM victims are demoted there and "
                             "promoted back on a hit (default 0, DRAM only)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run `kvpool replay`; returns the exit code (2 for bad arguments)."""
    try:
        config = ReplayConfig(
            num_workers=args.workers, device_blocks=args.device_blocks,
            pool_blocks=args.pool_blocks, object_bytes=parse_size_bytes(args.object_size),
            routing=args.routing, high_watermark_ratio=args.eviction_high_watermark_ratio,
            eviction_ratio=args.eviction_ratio, lease_ttl_ms=args.lease_ttl_ms,
            ssd_blocks=args.ssd_blocks_per_worker, partitions=args.partitions)
        if args.master and args.partitions != 1:
            raise ValueError("--partitions applies to the master replay spawns, not to --master")
        requests = load_trace(args.trace, start=args.start, limit=args.requests,
                              whole_blocks_only=args.whole_blocks_only)
    except (ValueError, OSError) as exc:
        print(f"kvpool replay: error: {exc}", file=sys.stderr)
        return 2
    workers_of = route(requests, config.num_workers, config.routing)
    local = simulate(requests, workers_of, config.num_workers, config.device_blocks, None)
    report: dict[str, Any] = {"config": {
        "requests": len(requests), "workers": config.num_workers, "routing": config.routing,
        "device_blocks_per_worker": config.device_blocks,
        "pool_blocks": config.capacity_bytes // aligned(config.object_bytes),
        "object_bytes": config.object_bytes, "high_watermark": config.high_watermark_ratio,
        "eviction_ratio": config.eviction_ratio,
        "ssd_blocks_per_worker": config.ssd_blocks}}
    report["local_only"] = local.to_dict()
    print(_header(config, requests))
    progress = not args.no_progress
    runs: list[tuple[str, ReplayResult]] = []
    try:
        if args.simulate or args.compare:
            pool = simulated_pool(config)
            runs.append(("simulated", simulate(requests, workers_of, config.num_workers,
                                               config.device_blocks, pool)))
            if config.ssd_blocks:
                report["ssd"] = {"dram_hit_objects": pool.dram_hit_objects,
                                 "ssd_hit_objects": pool.ssd_hit_objects,
                                 "demoted_objects": pool.demoted_objects,
                                 "promoted_objects": pool.promoted_objects,
                                 "ssd_evicted_objects": pool.ssd_evicted_objects}
                print("SSD tier (simulated): pool reads served from DRAM "
                      f"{pool.dram_hit_objects}, from SSD {pool.ssd_hit_objects}; demoted "
                      f"{pool.demoted_objects}, promoted {pool.promoted_objects}, evicted "
                      f"from SSD {pool.ssd_evicted_objects}")
        if not args.simulate:
            runs.insert(0, ("live", run_live(requests, config, master_address=args.master,
                                             progress=progress)))
    except (ValueError, RuntimeError) as exc:
        print(f"kvpool replay: error: {exc}", file=sys.stderr)
        return 1
    for name, result in runs:
        report[name] = result.to_dict()
        print(_table(name, result, local))
    if len(runs) == 2:
        diffs = {k: abs(runs[0][1].overall.ratios()[k] - runs[1][1].overall.ratios()[k])
                 for k in ("device", "pool", "combined")}
        report["live_vs_simulated_abs_diff"] = diffs
        print("live vs simulated, absolute difference: "
              + ", ".join(f"{k} {v * 100:.3f} pp" for k, v in diffs.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    failures = sum(result.overall.verify_failures for _, result in runs)
    if failures:
        print(f"kvpool replay: {failures} reused blocks held the wrong bytes", file=sys.stderr)
        return 1
    return 0


def _header(config: ReplayConfig, requests: Sequence[Sequence[int]]) -> str:
    blocks = sum(len(ids) for ids in requests)
    pool_blocks = config.capacity_bytes // aligned(config.object_bytes)
    return (f"{len(requests)} requests, {blocks} blocks; {config.num_workers} workers "
            f"({config.routing}), level 1 = {config.device_blocks} blocks each, pool = "
            f"{pool_blocks} blocks of {config.object_bytes} bytes (watermark "
            f"{config.high_watermark_ratio}, eviction ratio {config.eviction_ratio})"
            + (f" + SSD {config.ssd_blocks} blocks per worker" if config.ssd_blocks else ""))


def _table(name: str, result: ReplayResult, local: ReplayResult) -> str:
    lines = [f"{name}:",
             f"  {'worker':>6} {'requests':>8} {'blocks':>8} {'level-1':>8} {'pool':>8} "
             f"{'combined':>8} {'local-only':>10} {'gain':>6}"]
    rows = [(str(i), w, local.workers[i]) for i, w in enumerate(result.workers)]
    rows.append(("all", result.overall, local.overall))
    for label, counts, alone in rows:
        r = counts.ratios()
        alone_ratio = alone.ratios()["combined"]
        gain = f"{r['combined'] / alone_ratio:5.2f}x" if alone_ratio else "   -  "
        lines.append(f"  {label:>6} {counts.requests:>8} {counts.blocks:>8} "
                     f"{r['device']:>8.2%} {r['pool']:>8.2%} {r['combined']:>8.2%} "
                     f"{alone_ratio:>10.2%} {gain:>6}")
    return "\n".join(lines)
