"""The master's Prometheus exposition on a live process: names, values, promtool lint."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest

from kvpool_client.rpc import MasterRpc
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo

SEGMENT_BYTES = 1 << 20


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return response.read().decode()


def _value(text: str, sample: str) -> float:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert match, f"{sample} not in exposition"
    return float(match.group(1))


async def _traffic(address: str) -> None:
    rpc = MasterRpc(address)
    grpc_rpc = MasterRpc(address, use_fast_path=False)
    try:
        await rpc.register_client("m", "h", "")
        segment = SegmentInfo(SegmentId("m/0"), ClientId("m"), SEGMENT_BYTES)
        assert await rpc.mount_segment("m", segment) == Status.OK
        keys = [f"b{i}".encode() for i in range(4)]
        await rpc.put_start("m", keys, [1000] * 4, PutOptions())
        assert await rpc.put_end("m", keys) == [Status.OK] * 4
        assert await rpc.query_prefix("m", [*keys[:3], b"miss", keys[3]]) == 3
        assert await grpc_rpc.query_prefix("m", [b"miss"]) == 0
        results, _, _ = await grpc_rpc.get_replicas("m", [keys[0], b"miss"])
        assert [r.status for r in results] == [Status.OK, Status.NOT_FOUND]
    finally:
        await rpc.close()
        await grpc_rpc.close()


async def test_metrics_follow_traffic(master) -> None:
    await _traffic(master.address)
    with grpc.insecure_channel(master.address) as channel, pytest.raises(grpc.RpcError):
        channel.unary_unary("/kvpool.v1.Master/Exist")(b"\xff")
    text = _scrape(master.metrics_url)
    assert _value(text, 'kvpool_rpc_requests_total{method="PutStart",transport="lean"}') == 1
    assert _value(text, 'kvpool_rpc_requests_total{method="QueryPrefix",transport="grpc"}') == 1
    assert _value(text, 'kvpool_rpc_failures_total{method="Exist",transport="grpc"}') == 1
    assert _value(text, 'kvpool_rpc_duration_seconds_count{method="PutEnd",transport="lean"}'
                  ) == 1
    assert _value(text, "kvpool_lookup_queries_total") == 2
    assert _value(text, "kvpool_lookup_blocks_total") == 6
    assert _value(text, "kvpool_lookup_hit_blocks_total") == 3
    assert _value(text, "kvpool_read_keys_total") == 2
    assert _value(text, "kvpool_read_hit_keys_total") == 1
    assert _value(text, 'kvpool_objects{state="ready"}') == 4
    assert _value(text, 'kvpool_capacity_bytes{tier="DRAM"}') == SEGMENT_BYTES
    assert _value(text, 'kvpool_used_bytes{tier="DRAM"}') >= 4000
    assert _value(text, 'kvpool_segment_capacity_bytes{client="m",segment="m/0",tier="DRAM"}'
                  ) == SEGMENT_BYTES
    assert _value(text, "kvpool_clients") == 1
    assert _value(text, "kvpool_puts_committed_total") == 4
    assert _value(text, "kvpool_clients_registered_total") == 1
    for name in ("kvpool_evicted_objects_total", "kvpool_evicted_bytes_total",
                 "kvpool_eviction_passes_total", "kvpool_pending_reclaimed_total",
                 "kvpool_clients_expired_total", "kvpool_leases_granted_total",
                 "kvpool_leases_expired_total", "kvpool_master_stalled_seconds_total",
                 "kvpool_master_gc_frozen_objects"):
        assert re.search(rf"^{name} ", text, re.M), name
    for generation in "012":  # the collector's pauses, per generation
        assert _value(text, f'kvpool_master_gc_collections_total{{generation="{generation}"}}'
                      ) >= 0


async def test_mooncake_admin_paths_list_the_mounted_segments(master) -> None:
    def listed() -> str:
        with urllib.request.urlopen(master.metrics_url + "/get_all_segments",
                                    timeout=10) as reply:
            assert reply.status == 200
            return str(reply.read().decode())

    rpc = MasterRpc(master.address)
    try:
        await rpc.register_client("n", "h", "")
        assert listed() == ""
        for name in ("n/0", "n/1"):
            segment = SegmentInfo(SegmentId(name), ClientId("n"), SEGMENT_BYTES)
            assert await rpc.mount_segment("n", segment) == Status.OK
        assert sorted(listed().splitlines()) == ["n/0", "n/1"]
        assert await rpc.unmount_segment("n", "n/0") == Status.OK
        assert listed() == "n/1\n"
    finally:
        await rpc.close()


async def test_promtool_accepts_the_exposition(master) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run "
                    "installs it)")
    await _traffic(master.address)
    text = _scrape(master.metrics_url)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", \
        result.stdout + result.stderr


async def test_eviction_and_reclaim_show_in_metrics(start_master) -> None:
    master = start_master(eviction_high_watermark_ratio=0.5, eviction_ratio=0.2,
                          put_start_discard_timeout=0.3)
    rpc = MasterRpc(master.address)
    try:
        await rpc.register_client("e", "h", "")
        segment = SegmentInfo(SegmentId("e/0"), ClientId("e"), 64 * 1024)
        assert await rpc.mount_segment("e", segment) == Status.OK
        for i in range(100):
            key = f"obj{i}".encode()
            [(status, _)] = await rpc.put_start("e", [key], [1024], PutOptions())
            assert status == Status.OK
            assert await rpc.put_end("e", [key]) == [Status.OK]
        await rpc.put_start("e", [b"never-committed"], [1024], PutOptions())
        deadline = asyncio.get_running_loop().time() + 10
        while asyncio.get_running_loop().time() < deadline:
            text = _scrape(master.metrics_url)
            if _value(text, "kvpool_pending_reclaimed_total") >= 1:
                break
            await asyncio.sleep(0.1)
    finally:
        await rpc.close()
    assert _value(text, "kvpool_pending_reclaimed_total") == 1
    assert _value(text, "kvpool_evicted_objects_total") > 0
    assert _value(text, "kvpool_evicted_bytes_total") >= 1024 * _value(
        text, "kvpool_evicted_objects_total")
    assert _value(text, "kvpool_eviction_passes_total") > 0
    assert _value(text, 'kvpool_used_bytes{tier="DRAM"}') <= 0.5 * 64 * 1024 + 1024


async def test_a_batch_that_crosses_the_watermark_is_relieved_between_requests(
        start_master) -> None:
    """The master runs the eviction pass a put batch made due as a step of its own, after
    the batch's answer: the pool comes back under its high watermark with no further call,
    the least recently used objects going first."""
    master = start_master(eviction_high_watermark_ratio=0.5, eviction_ratio=0.1)
    rpc = MasterRpc(master.address)
    try:
        await rpc.register_client("w", "h", "")
        segment = SegmentInfo(SegmentId("w/0"), ClientId("w"), 100 * 1024)
        assert await rpc.mount_segment("w", segment) == Status.OK
        keys = [b"obj%03d" % i for i in range(80)]
        started = await rpc.put_start("w", keys, [1024] * len(keys), PutOptions())
        assert [s for s, _ in started] == [Status.OK] * len(keys)   # all fit: none evicted
        assert await rpc.put_end("w", keys) == [Status.OK] * len(keys)
        deadline = asyncio.get_running_loop().time() + 10
        while _value(_scrape(master.metrics_url), 'kvpool_used_bytes{tier="DRAM"}') > 50 * 1024:
            assert asyncio.get_running_loop().time() < deadline, "still above the watermark"
            await asyncio.sleep(0.05)
        text = _scrape(master.metrics_url)
        evicted = int(_value(text, "kvpool_evicted_objects_total"))
        assert 30 <= evicted <= 40   # down to 50 %, in passes of 10 % of the capacity
        statuses, _ = await rpc.exist("w", keys)
        assert statuses == [Status.NOT_FOUND] * evicted + [Status.OK] * (len(keys) - evicted)
    finally:
        await rpc.close()


async def test_a_stalled_loop_shows_in_the_loop_lag(master) -> None:
    """The master's loop stopped for 300 ms (SIGSTOP, as a VM freeze or a long step would):
    the lag histogram and its maximum show it."""
    await _traffic(master.address)
    deadline = time.monotonic() + 10
    while _value(_scrape(master.metrics_url), "kvpool_master_loop_lag_seconds_count") == 0:
        assert time.monotonic() < deadline, "no lag sample in 10 s"
        time.sleep(0.05)
    os.kill(master.pid, signal.SIGSTOP)
    try:
        time.sleep(0.3)
    finally:
        os.kill(master.pid, signal.SIGCONT)
    text = _scrape(master.metrics_url)
    assert _value(text, "kvpool_master_loop_lag_max_seconds") >= 0.25
    assert _value(text, 'kvpool_master_loop_lag_seconds_bucket{le="0.1"}') < \
        _value(text, 'kvpool_master_loop_lag_seconds_bucket{le="+Inf"}')


async def test_compactions_show_in_metrics(start_master, tmp_path) -> None:
    master = start_master(state_dir=str(tmp_path / "state"), state_compact_bytes=4096,
                          state_compact_ratio=0)
    text = _scrape(master.metrics_url)
    assert _value(text, "kvpool_state_compactions_total") == 0
    assert _value(text, "kvpool_state_last_compaction_seconds") == 0
    await _traffic(master.address)
    rpc = MasterRpc(master.address)
    try:   # 100 more objects: the log passes 4 KiB, which starts a compaction in steps
        await rpc.register_client("m2", "h", "")
        assert await rpc.mount_segment("m2", SegmentInfo(SegmentId("m2/0"), ClientId("m2"),
                                                         SEGMENT_BYTES)) == Status.OK
        keys = [b"%064d" % i for i in range(100)]
        await rpc.put_start("m2", keys, [1000] * 100, PutOptions())
        assert await rpc.put_end("m2", keys) == [Status.OK] * 100
    finally:
        await rpc.close()
    deadline = time.monotonic() + 30
    while _value(text, "kvpool_state_compactions_total") < 1:
        assert time.monotonic() < deadline, "no compaction finished"
        time.sleep(0.05)
        text = _scrape(master.metrics_url)
    assert _value(text, "kvpool_state_last_compaction_objects") >= 1
    assert 0 < _value(text, "kvpool_state_last_compaction_longest_step_seconds") <= \
        _value(text, "kvpool_state_last_compaction_seconds")
