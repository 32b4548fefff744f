"""Proof 2 on a slice of the real trace: the live replay agrees with ``--simulate``.

Live: three worker processes, each a real client with a real shared-memory segment and its own
level-1 cache, against a real master spawned with the replay's eviction settings. Simulated:
the same level-1 code against the model pool. They must agree within 1 % absolute on the
level-1, pool and combined hit ratios, with a master of one process and of two partitions;
every reused block must hold the bytes its id was stamped with; and the pool must beat
local-only caches of the same per-worker size.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool_client.replay import ReplayConfig, run_live, simulated_pool
from kvpool_client.replay_sim import load_trace, route, simulate

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
NUM_REQUESTS = 500
CONFIG = ReplayConfig(num_workers=3, device_blocks=240, pool_blocks=8000,
                      object_bytes=4096, lease_ttl_ms=50, reply_timeout_s=60.0)


def _trace() -> Path:
    if not TRACE.exists():
        pytest.skip(f"trace not found at {TRACE} (shared/ lies beside the repository)")
    return TRACE


@pytest.mark.parametrize("partitions", [1, 2])
def test_live_replay_agrees_with_simulation_on_a_trace_slice(partitions: int) -> None:
    # with partitions, each evicts by its own LRU: the model's one global LRU still holds
    # within 1 %, and every block read back is the one stamped
    config = dataclasses.replace(CONFIG, partitions=partitions)
    requests = load_trace(_trace(), limit=NUM_REQUESTS)
    assert max(len(ids) for ids in requests) <= CONFIG.device_blocks
    workers_of = route(requests, CONFIG.num_workers, CONFIG.routing)
    pool = simulated_pool(CONFIG)
    simulated = simulate(requests, workers_of, CONFIG.num_workers, CONFIG.device_blocks, pool)
    local = simulate(requests, workers_of, CONFIG.num_workers, CONFIG.device_blocks, None)
    assert pool.evicted_objects > 0  # the pool is small enough to evict: the model is tested

    live = run_live(requests, config)

    assert live.overall.verify_failures == 0
    assert live.overall.blocks == simulated.overall.blocks
    for name in ("device", "pool", "combined"):
        got, want = live.overall.ratios()[name], simulated.overall.ratios()[name]
        assert abs(got - want) <= 0.01, (name, got, want)
    for mine, theirs in zip(live.workers, simulated.workers, strict=True):
        assert mine.requests == theirs.requests
        assert abs(mine.ratios()["combined"] - theirs.ratios()["combined"]) <= 0.01
    # the level-1 state does not depend on where a block came from
    assert live.overall.device_hits == local.overall.device_hits
    print("live", live.overall.ratios(), "simulated", simulated.overall.ratios(),
          "local-only", local.overall.ratios())
    assert live.overall.ratios()["combined"] > 2 * local.overall.ratios()["combined"]


def test_replay_command_simulate_prints_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvpool_client.cli", "replay", str(_trace()), "--simulate",
         "--requests", "300", "--workers", "2", "--device-blocks", "300", "--pool-blocks",
         "3000", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "simulated:" in done.stdout and "local-only" in done.stdout
    report = json.loads(out.read_text())
    assert report["config"]["requests"] == 300
    overall = report["simulated"]["overall"]
    assert overall["requests"] == 300
    assert overall["combined_hit_ratio"] >= report["local_only"]["overall"]["combined_hit_ratio"]


def test_replay_command_refuses_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    for args in ([str(bad), "--simulate"],
                 [str(_trace()), "--simulate", "--workers", "0"],
                 [str(_trace()), "--simulate", "--object-size", "lots"],
                 [str(_trace()), "--partitions", "65"],
                 [str(_trace()), "--master", "127.0.0.1:9", "--partitions", "2"]):
        done = subprocess.run([sys.executable, "-m", "kvpool_client.cli", "replay", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "error" in done.stderr


def test_live_replay_with_an_ssd_tier_keeps_what_dram_evicts() -> None:
    """The same slice with a DRAM pool a quarter as large: live, SSD segments on each worker
    turn evictions into demotions, so the pool answers more blocks; every reused block still
    holds its own bytes."""
    requests = load_trace(_trace(), limit=NUM_REQUESTS)
    small = ReplayConfig(num_workers=3, device_blocks=240, pool_blocks=2000, object_bytes=4096,
                         lease_ttl_ms=50, reply_timeout_s=60.0)
    tiered = ReplayConfig(num_workers=3, device_blocks=240, pool_blocks=2000, object_bytes=4096,
                          lease_ttl_ms=50, reply_timeout_s=60.0, ssd_blocks=4000)
    dram_only = run_live(requests, small)
    with_ssd = run_live(requests, tiered)
    assert dram_only.overall.verify_failures == 0 and with_ssd.overall.verify_failures == 0
    print("DRAM only", dram_only.overall.ratios(), "DRAM + SSD", with_ssd.overall.ratios())
    assert with_ssd.overall.pool_hits > dram_only.overall.pool_hits * 1.1
