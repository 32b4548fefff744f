"""The replay's model pool against the real MasterCore, and the offline replay itself.

``SimulatedPool`` must answer every lookup exactly as the master would for the same sequence
of calls, or ``kvpool replay --simulate`` would not predict the live replay. Both are driven
here with the calls a prefix cache makes (query_prefix, a read of the hits, a put of the new
blocks), with leases left to lapse between requests (the model does not track them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvpool_client.replay_sim import (
    HitCounts,
    SimulatedPool,
    block_hash,
    block_key,
    load_trace,
    route,
    simulate,
)
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo

OBJECT_BYTES = 4096


def _chains(seed: int, num_requests: int) -> list[list[int]]:
    """Requests sharing prefixes, like conversations: ids are prefix-closed."""
    rng = random.Random(seed)
    prefix_to_id: dict[tuple[int, ...], int] = {}
    requests = []
    for _ in range(num_requests):
        base = rng.randrange(30)
        tokens = [base] + [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        ids = []
        for n in range(1, len(tokens) + 1):
            ids.append(prefix_to_id.setdefault(tuple(tokens[:n]), len(prefix_to_id)))
        requests.append(ids)
    return requests


@pytest.mark.parametrize(("watermark", "ratio", "capacity_objects"),
                         [(0.95, 0.05, 100), (0.8, 0.1, 64), (0.99, 0.02, 37)])
def test_model_pool_answers_like_the_master_core(watermark: float, ratio: float,
                                                 capacity_objects: int) -> None:
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=watermark, eviction_ratio=ratio,
                                 default_lease_ttl_s=0.5, client_ttl_s=1e9))
    now = 1.0
    client = ClientId("c1")
    assert core.register_client(client, "host", b"k" * 32, now)[0] == Status.OK
    # two segments, as two workers contribute them
    per_segment = capacity_objects // 2 * OBJECT_BYTES
    for i in range(2):
        segment = SegmentInfo(SegmentId(f"s{i}"), client, per_segment, host_id="host")
        assert core.mount_segment(segment, now) == Status.OK
    model = SimulatedPool(2 * per_segment, OBJECT_BYTES, high_watermark_ratio=watermark,
                          eviction_ratio=ratio)
    all_keys: set[str] = set()
    for ids in _chains(7, 400):
        now += 1.0  # every lease granted so far has lapsed
        keys = [block_key(block_hash(i)) for i in ids]
        raw = [ObjectKey(k.encode()) for k in keys]
        hits = core.query_prefix(raw, now)
        assert hits == model.query_prefix(keys)
        reads = core.get_replicas(raw[:hits], now)
        assert all(r.status == Status.OK for r in reads)
        assert model.get(keys[:hits]) == [True] * hits
        new = raw[hits:]
        started = core.put_start(client, new, [OBJECT_BYTES] * len(new), PutOptions(), now)
        ok = [s in (Status.OK, Status.ALREADY_EXISTS) for s, _ in started]
        assert ok == model.put(keys[hits:])
        committed = [k for k, (s, _) in zip(new, started, strict=True) if s == Status.OK]
        assert core.put_end(client, committed, now) == [Status.OK] * len(committed)
        all_keys.update(keys)
    # the same objects survive in both, in the same LRU order
    ordered = sorted(all_keys)
    statuses, _ = core.exist([ObjectKey(k.encode()) for k in ordered], now + 1)
    present = {k for k, s in zip(ordered, statuses, strict=True) if s == Status.OK}
    assert present == set(model.ready_keys)
    assert model.evicted_objects > 0
    assert core.stats().evicted_objects_total == model.evicted_objects


def test_offline_replay_counts_and_local_only() -> None:
    requests = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9], [1, 2, 4, 6]]
    workers_of = route(requests, 2, "round-robin")
    assert workers_of == [0, 1, 0, 1, 0]
    pool = SimulatedPool(100 * OBJECT_BYTES, OBJECT_BYTES)
    pooled = simulate(requests, workers_of, 2, 8, pool)
    alone = simulate(requests, workers_of, 2, 8, None)
    # worker 0: [1,2,3] cold; [1,2,3,5]: 3 on chip; [1,2,4,6]: 1,2 on chip, 4 from the pool
    assert (pooled.workers[0].device_hits, pooled.workers[0].pool_hits) == (5, 1)
    # worker 1: [1,2,4]: 1,2 from the pool (worker 0 saved them); [9] cold
    assert (pooled.workers[1].device_hits, pooled.workers[1].pool_hits) == (0, 2)
    assert alone.overall.device_hits == pooled.overall.device_hits == 5
    assert alone.overall.pool_hits == 0
    assert pooled.overall.ratios()["combined"] == pytest.approx(8 / 15)
    by_prefix = route(requests, 3, "prefix-hash")
    assert by_prefix[0] == by_prefix[2] and by_prefix[1] == by_prefix[4]  # same first 2 ids
    assert by_prefix == route(requests, 3, "prefix-hash")
    with pytest.raises(ValueError):
        route(requests, 0, "round-robin")
    with pytest.raises(ValueError):
        route(requests, 2, "random")


def test_trace_loading(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"input_length": 1000, "hash_ids": [0, 1]}, {"input_length": 1024,
                                                         "hash_ids": [0, 2]},
             {"input_length": 10, "hash_ids": [3]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert load_trace(path) == [[0, 1], [0, 2], [3]]
    assert load_trace(path, start=1, limit=1) == [[0, 2]]
    assert load_trace(path, whole_blocks_only=True) == [[0], [0, 2], []]
    path.write_text('{"hash_ids": [1, -2]}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_trace(path)
    assert HitCounts().ratios()["combined"] == 0.0


def test_the_ssd_tier_of_the_model_demotes_victims_and_promotes_hits() -> None:
    """DRAM of two objects (evicting one at a time), SSD of two."""
    pool = SimulatedPool(2 * OBJECT_BYTES, OBJECT_BYTES, high_watermark_ratio=1.0,
                         eviction_ratio=0.5, ssd_capacity_bytes=2 * OBJECT_BYTES)
    assert pool.put(["a", "b"]) == [True] * 2
    assert pool.put(["c"]) == [True]                         # a demoted to make room for c
    assert (list(pool.ready_keys), list(pool.ssd_keys)) == (["b", "c"], ["a"])
    assert pool.query_prefix(["a", "b", "x"]) == 2          # a lookup finds a on SSD, moves none
    assert (list(pool.ready_keys), list(pool.ssd_keys)) == (["c", "b"], ["a"])
    assert pool.put(["a"]) == [True]                         # already stored (on SSD): no copy
    assert pool.get(["a", "x"]) == [True, False]            # a read promotes a, demotes c
    assert (list(pool.ready_keys), list(pool.ssd_keys)) == (["b", "a"], ["c"])
    assert pool.put(["d"]) == [True] and pool.put(["e"]) == [True]  # b, a demoted; c dropped
    assert (list(pool.ready_keys), list(pool.ssd_keys)) == (["d", "e"], ["b", "a"])
    assert (pool.dram_hit_objects, pool.ssd_hit_objects, pool.promoted_objects,
            pool.demoted_objects, pool.ssd_evicted_objects) == (0, 1, 1, 4, 1)
    assert pool.get(["c"]) == [False]                        # gone from both tiers


def test_without_an_ssd_the_model_loses_what_dram_evicts() -> None:
    pool = SimulatedPool(2 * OBJECT_BYTES, OBJECT_BYTES, high_watermark_ratio=1.0,
                         eviction_ratio=0.5)
    assert pool.put(["a", "b"]) == [True] * 2 and pool.put(["c"]) == [True]
    assert pool.get(["a"]) == [False] and not pool.ssd_keys and pool.demoted_objects == 0


def test_replay_takes_an_ssd_capacity_in_the_simulated_run_only(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    import argparse

    from kvpool_client import replay

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"hash_ids": ids}) + "\n"
                             for ids in _chains(7, 400)))
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    common = [str(trace), "--workers", "2", "--device-blocks", "16", "--pool-blocks", "16",
              "--object-size", "4KiB", "--no-progress"]
    assert replay.run(parser.parse_args([*common, "--ssd-blocks-per-worker", "-1"])) == 2
    assert "SSD blocks must be >= 0" in capsys.readouterr().err
    out_json = tmp_path / "ssd.json"
    assert replay.run(parser.parse_args([*common, "--simulate", "--ssd-blocks-per-worker", "50",
                                         "--json", str(out_json)])) == 0
    with_ssd = json.loads(out_json.read_text())
    assert replay.run(parser.parse_args([*common, "--simulate", "--json", str(out_json)])) == 0
    dram_only = json.loads(out_json.read_text())
    assert with_ssd["ssd"]["demoted_objects"] > 0 and with_ssd["ssd"]["ssd_hit_objects"] > 0
    assert with_ssd["simulated"]["overall"]["pool_hits"] > \
        dram_only["simulated"]["overall"]["pool_hits"]
