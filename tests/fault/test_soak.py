"""Soak: several client processes do mixed puts, gets and removes against one master under
constant eviction pressure (a pool much smaller than what is written, high watermark 0.8) for
KVPOOL_SOAK_S seconds (default 300, bounded to [10, 3600]), once against a master of one
process and once against one of two partitions (the clients route every batch). Every read is
checked by an xxhash checksum of the bytes derived from its key: zero mismatches. The master's
RSS (VmRSS in /proc/PID/status, every partition's summed) is sampled after a warm-up and at the
end: its growth stays under RSS_GROWTH_BOUND_BYTES while the load runs, i.e. its memory is flat
under sustained load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import metric_value

WORKERS = 3
SEGMENT = "16mb"  # per worker: a 48 MiB pool, written over many times
RSS_GROWTH_BOUND_BYTES = 16 << 20
WORKER_PATH = Path(__file__).with_name("_workers.py")


def soak_seconds() -> float:
    return min(3600.0, max(10.0, float(os.environ.get("KVPOOL_SOAK_S", "300"))))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def master_rss_bytes(pids: list[int]) -> int:
    """The resident memory of every process of the master (its partitions), summed."""
    return sum(rss_bytes(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.timeout(soak_seconds() + 300)
@pytest.mark.parametrize("partitions", [1, 2])
def test_soak_mixed_load_under_eviction(start_master: Any, partitions: int) -> None:
    duration_s = soak_seconds()
    master = start_master("--partitions", str(partitions), eviction_high_watermark_ratio=0.8,
                          eviction_ratio=0.1, default_kv_lease_ttl=2000)
    config = {"master_server_address": master.address, "global_segment_size": SEGMENT,
              "rpc_timeout_s": 10}
    master_pids = [int(p["pid"]) for p in master.partitions] or [master.pid]
    assert len(master_pids) == partitions
    procs: list[subprocess.Popen[str]] = []
    try:
        for worker in range(WORKERS):
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER_PATH), "soak", json.dumps(config), str(duration_s),
                 str(1000 + worker), str(worker), str(WORKERS)],
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
        warmup_s = min(30.0, duration_s / 5)
        time.sleep(warmup_s)
        rss_start = master_rss_bytes(master_pids)
        samples = [rss_start]
        end = time.monotonic() + duration_s - warmup_s - 2
        while time.monotonic() < end:
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))
            samples.append(master_rss_bytes(master_pids))
        rss_end = master_rss_bytes(master_pids)
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=duration_s + 120)
            assert proc.returncode == 0, f"worker {proc.pid} exited with {proc.returncode}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
    total = {k: sum(r[k] for r in results) for k in results[0] if isinstance(results[0][k], int)
             and k != "pid"}
    metrics_urls = ([f"http://127.0.0.1:{p['metrics_port']}" for p in master.partitions]
                    or [master.metrics_url])
    evicted = sum(metric_value(url, "kvpool_evicted_objects_total") or 0.0
                  for url in metrics_urls)
    # every partition expires a silent client on its own: the most of any
    expired = max(metric_value(url, "kvpool_clients_expired_total") or 0.0
                  for url in metrics_urls)
    growth = rss_end - rss_start
    print(f"soak {duration_s:.0f} s, {partitions} master process(es), {WORKERS} client "
          f"processes, pool {WORKERS} x {SEGMENT}: "
          f"{total['puts']} puts ({total['bytes_put'] / 2**30:.2f} GiB), {total['gets']} gets "
          f"({total['hits']} hits, {total['misses']} misses), {total['removes']} removes, "
          f"{total['put_failed']} puts refused, {total['errors']} errors, evicted objects "
          f"{evicted:.0f}")
    # (a worker starved of the cores past its ttl expires: its puts in flight are refused)
    print(f"read checksum mismatches: {total['mismatches']}; clients expired: {expired:.0f}")
    print(f"master RSS: {rss_start / 2**20:.1f} MiB after {warmup_s:.0f} s warm-up -> "
          f"{rss_end / 2**20:.1f} MiB at end, growth {growth / 2**20:+.1f} MiB "
          f"(max sample {max(samples) / 2**20:.1f} MiB; bound "
          f"{RSS_GROWTH_BOUND_BYTES >> 20} MiB)")
    for r in results:
        if r.get("error_statuses"):
            print(f"worker {r['pid']} errors: {r['error_statuses']}")
        if r.get("refused_statuses"):
            print(f"worker {r['pid']} puts refused: {r['refused_statuses']}")
    assert total["mismatches"] == 0
    assert total["hits"] > 0 and total["puts"] > 0 and total["removes"] > 0
    assert total["bytes_put"] > 2 * WORKERS * (16 << 20), "the pool was not written over"
    assert growth < RSS_GROWTH_BOUND_BYTES
    assert master.proc.poll() is None
    assert all(os.path.exists(f"/proc/{pid}") for pid in master_pids)
