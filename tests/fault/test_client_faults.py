"""Client faults: writers killed mid-put, masters killed and restarted or unreachable, paused
clients, expired leases, corrupted bytes. Each test prints the figure it measured."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import importlib.util
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import metric_value

from kvpool_client.cli_status import fetch_stats
from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.liveness import MasterAddress
from kvpool_client.segments import SHM_DIR
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions


def _load_worker() -> Any:
    path = Path(__file__).parents[1] / "integration" / "client_worker.py"
    spec = importlib.util.spec_from_file_location("kvpool_test_client_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cw = _load_worker()


def config(address: str, **changes: Any) -> ClientConfig:
    values: dict[str, Any] = {"master_server_address": address, "global_segment_size": "16mb",
                              "rpc_timeout_s": 2}
    values.update(changes)
    return ClientConfig.from_dict(values)


def stats(address: str) -> dict[str, Any]:
    return asyncio.run(fetch_stats(MasterAddress(address, 5.0, None, "", True)))


def segment_clients(address: str) -> set[str]:
    return {s["client_id"] for s in stats(address)["segments"]["list"] if s.get("mounted", True)}


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float:
    """Poll ``predicate`` until true; return the seconds it took (fails after timeout_s)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_writer_killed_mid_put_leaves_no_partial_object(start_master: Any) -> None:
    master = start_master(client_ttl=2)
    size, batch = 2 << 20, 8
    # A cluster of its own: no other client on this host cleans the writer's memory meanwhile.
    cluster = f"killtest{os.getpid()}"
    with KVPoolClient(config(master.address, global_segment_size="256mb")) as reader:
        target = reader.segment_ids[0]
        writer = cw.Worker({"master_server_address": master.address,
                            "global_segment_size": "16mb", "cluster_id": cluster})
        try:
            own = writer.info["segment_ids"][0]
            assert writer.call("put", keys=["own-0", "own-1"], size=4096,
                               segment=own)["statuses"] == ["OK", "OK"]
            writer.send("put_loop", prefix="kill", size=size, batch=batch, count=10_000,
                        segment=target)
            reported = 0
            while reported < 4:
                answer = writer.read(timeout_s=60)
                assert answer["statuses"] == ["OK"] * batch, answer
                reported += 1
            writer.kill()  # somewhere inside the next put_batch
            killed_at = time.monotonic()
        finally:
            writer.stop()
        keys = [f"kill-{n}-{i}" for n in range(reported + 3) for i in range(batch)]
        values = reader.get_batch(keys)
        outcome = {"ok": 0, "missing": 0, "mismatch": 0}
        for key, value in zip(keys, values, strict=True):
            state = "missing" if value is None else \
                ("ok" if value == cw.payload(key, size) else "mismatch")
            outcome[state] += 1
        print(f"after SIGKILL mid-put: {outcome}")
        assert outcome["mismatch"] == 0
        # every batch that returned before the last reported one is committed for sure
        assert outcome["ok"] >= (reported - 1) * batch
        assert reader.get("own-0") == cw.payload("own-0", 4096)  # its segment is still mounted
        wait_until(lambda: writer.info["client_id"] not in segment_clients(master.address),
                   timeout_s=10)
        elapsed_s = time.monotonic() - killed_at
        print(f"writer segments gone {elapsed_s:.2f} s after SIGKILL (client_ttl 2 s)")
        assert elapsed_s <= 2 + 1.5
        assert reader.get("own-0") is None  # objects on the vanished segment went with it
        assert reader.get_batch(keys) == values  # what was readable stays readable
        wait_until(lambda: stats(master.address)["objects"]["pending"] == 0, timeout_s=10)
    leftovers = glob.glob(os.path.join(SHM_DIR, f"kvpool.{cluster}.*.{writer.pid}.*"))
    assert leftovers, "the killed writer's shared memory stays until the next start cleans it"
    with KVPoolClient(config(master.address, global_segment_size=0, cluster_id=cluster)):
        pass  # starting a client removes shared memory of dead processes
    assert not any(os.path.exists(p) for p in leftovers)


def test_master_killed_and_restarted_clients_recover(start_master: Any) -> None:
    port = free_port()
    flags = {"host": "127.0.0.1", "port": port, "fast_port": 0, "metrics_port": 0,
             "client_ttl": 2}
    master = start_master(default_ports=False, **flags)
    address = master.address
    worker = None
    with KVPoolClient(config(address, heartbeat_interval_s=0.2)) as c:
        worker = cw.Worker({"master_server_address": address, "global_segment_size": "16mb",
                            "heartbeat_interval_s": 0.2, "rpc_timeout_s": 2})
        try:
            c.put("before", b"1" * 1000)
            assert c.get("before") == b"1" * 1000
            master.kill()
            restarted = start_master(default_ports=False, **flags)
            started = time.monotonic()
            # The first put may meet UNKNOWN_CLIENT: the client re-registers by itself.
            deadline = time.monotonic() + 15
            while True:
                try:
                    c.put("after", b"2" * 1000)
                    break
                except KVPoolError as exc:
                    assert exc.retryable, exc
                    assert time.monotonic() < deadline, exc
                    time.sleep(0.1)
            print(f"first put after master restart succeeded in "
                  f"{time.monotonic() - started:.2f} s")
            assert c.get("after") == b"2" * 1000
            assert c.get("before") is None  # a master without --state-dir forgot it
            # Both clients remount by themselves (heartbeat thread); a put aimed at c's
            # segment needs that segment mounted again first.
            wait_until(lambda: {c.client_id, worker.info["client_id"]} <=
                       segment_clients(restarted.address), timeout_s=10)
            # Like c's first put above, the worker's first call may meet its old connection
            # to the killed master: RPC_FAILED is retryable, so retry within a bound.
            for _ in range(50):
                statuses = worker.call("put", keys=["w-after"], size=5000,
                                       segment=c.segment_ids[0])["statuses"]
                if statuses != ["RPC_FAILED"]:
                    break
                time.sleep(0.1)
            assert statuses == ["OK"]
            assert c.get("w-after") == cw.payload("w-after", 5000)
            assert c.metrics.reregistrations >= 1
        finally:
            worker.stop()


def _served(metrics_url: str, method: str, transport: str) -> float:
    """Calls of ``method`` the master served over ``transport`` (0 when none)."""
    return metric_value(metrics_url, f'kvpool_rpc_requests_total{{method="{method}",'
                                     f'transport="{transport}"}}') or 0.0


def test_clients_come_back_soon_after_a_long_master_outage(start_master: Any,
                                                           tmp_path: Path) -> None:
    """Heartbeats go over the lean framing (the heartbeat's stub never registers itself: it
    follows the session's endpoints), and gRPC reconnects back off to at most 2 s: after a
    master was away 20 s (as a restart restoring millions of objects is), both a lean client
    and a gRPC-only one re-register and read their restored objects within seconds, where
    gRPC's own backoff (up to two minutes) kept them away for longer and longer."""
    port, fast_port = free_port(), free_port()
    flags = {"host": "127.0.0.1", "port": port, "fast_port": fast_port, "metrics_port": 0,
             "state_dir": str(tmp_path / "state")}
    master = start_master(default_ports=False, **flags)
    lean = KVPoolClient(config(master.address, heartbeat_interval_s=0.2))
    grpc_only = KVPoolClient(config(master.address, heartbeat_interval_s=0.2,
                                    use_fast_path=False))
    try:
        lean.put("lean-key", b"L" * 1000)
        grpc_only.put("grpc-key", b"G" * 1000)
        time.sleep(1.0)
        assert _served(master.metrics_url, "Heartbeat", "lean") >= 4
        # the gRPC-only client's heartbeats are all gRPC has
        assert _served(master.metrics_url, "Heartbeat", "grpc") <= \
            _served(master.metrics_url, "Heartbeat", "lean") + 3
        master.kill()
        time.sleep(20.0)
        start_master(default_ports=False, **flags)
        back = time.monotonic()
        came_back: dict[str, float] = {}
        while len(came_back) < 2 and time.monotonic() - back < 30:
            for name, client, key in (("lean", lean, "lean-key"), ("grpc", grpc_only, "grpc-key")):
                if name not in came_back:
                    with contextlib.suppress(KVPoolError):
                        if client.get(key) is not None:
                            came_back[name] = time.monotonic() - back
            time.sleep(0.05)
        print(f"restored objects readable again after a 20 s outage: {came_back}")
        assert set(came_back) == {"lean", "grpc"}
        assert max(came_back.values()) < 5.0, came_back
    finally:
        lean.close()
        grpc_only.close()


def test_master_unreachable_fails_within_deadline(start_master: Any) -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(KVPoolError) as info:
        KVPoolClient(config(f"127.0.0.1:{port}", rpc_timeout_s=1, client_id="unreachable-1"))
    elapsed_s = time.monotonic() - started
    print(f"start against a closed port failed in {elapsed_s:.2f} s ({info.value.status.name})")
    assert info.value.status in (Status.RPC_FAILED, Status.TIMEOUT)
    assert elapsed_s < 3
    assert not glob.glob(os.path.join(SHM_DIR, "kvpool.*.unreachable-1.*"))  # nothing left

    master = start_master()
    with KVPoolClient(config(master.address, rpc_timeout_s=1)) as c:
        c.put("k", b"v")
        os.kill(master.pid, signal.SIGSTOP)
        try:
            for call in (lambda: c.put("k2", b"v"), lambda: c.get("k"),
                         lambda: c.exists("k")):
                started = time.monotonic()
                with pytest.raises(KVPoolError) as info:
                    call()
                elapsed_s = time.monotonic() - started
                print(f"call to a stopped master failed in {elapsed_s:.2f} s "
                      f"({info.value.status.name})")
                assert info.value.status in (Status.TIMEOUT, Status.RPC_FAILED)
                assert elapsed_s < 2.5
        finally:
            os.kill(master.pid, signal.SIGCONT)
        c.put("k3", b"v3")
        assert c.get("k3") == b"v3"


def test_lease_expired_read_never_returns_bytes(start_master: Any) -> None:
    master = start_master(default_kv_lease_ttl=1)  # 1 ms: every read outlives its lease
    with KVPoolClient(config(master.address)) as c:
        c.put("short-lease", b"secret" * 100)
        with pytest.raises(KVPoolError) as info:
            c.get("short-lease")
        assert info.value.status == Status.LEASE_EXPIRED
        buf = bytearray(600)
        with pytest.raises(KVPoolError) as info:
            c.get_into("short-lease", buf, 0, 600)
        assert info.value.status == Status.LEASE_EXPIRED
        assert c.get_batch(["short-lease"]) == [None]
        assert c.batch_get_into(["short-lease"], buf, [0], [600]) == [int(Status.LEASE_EXPIRED)]
        assert c.metrics.op_failures[("get", "LEASE_EXPIRED")] == 1


def test_checksum_mismatch_is_detected(master: Any) -> None:
    with KVPoolClient(config(master.address, checksum=True, global_segment_size="4mb")) as c:
        value = cw.payload("guarded", 100_000)
        c.put("guarded", value)
        segment = next(iter(c.async_client.member.segments.values()))  # corrupt the bytes in place
        offset = bytes(segment.buffer).find(value)
        assert offset >= 0
        segment.buffer[offset + 500] ^= 0xFF
        with pytest.raises(KVPoolError) as info:
            c.get("guarded")
        assert info.value.status == Status.CHECKSUM_MISMATCH


def test_paused_client_is_expired_reregisters_and_refuses_old_capabilities(
        start_master: Any) -> None:
    master = start_master(client_ttl=1, default_kv_lease_ttl=60_000)
    worker = cw.Worker({"master_server_address": master.address, "global_segment_size": "16mb",
                        "rpc_timeout_s": 1})
    try:
        seg = worker.info["segment_ids"][0]
        assert worker.call("put", keys=["paused-x"], size=8192, segment=seg)["statuses"] == \
            ["OK"]
        with KVPoolClient(config(master.address, transport="tcp", global_segment_size=0)) as r:
            assert r.get("paused-x") == cw.payload("paused-x", 8192)
            path = r.async_client.member.datapath
            assert path is not None
            results, _, _ = _run(r, path.rpc.get_replicas(r.client_id, [b"paused-x"]))
            old_placement = results[0].placements[0]
            os.kill(worker.pid, signal.SIGSTOP)
            try:
                expired_s = wait_until(lambda: worker.info["client_id"] not in
                                       segment_clients(master.address), timeout_s=10)
                print(f"paused client expired after {expired_s:.2f} s (client_ttl 1 s)")
                assert r.get("paused-x") is None  # the master dropped it
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            back_s = wait_until(lambda: worker.info["client_id"] in
                                segment_clients(master.address), timeout_s=10)
            print(f"resumed client re-registered and remounted in {back_s:.2f} s")
            info = _run(r, path.resolve([seg]))[seg]
            with pytest.raises(KVPoolError) as refused:
                _run(r, path.tcp.read(info, old_placement, [memoryview(bytearray(8192))]))
            assert refused.value.status == Status.PERMISSION_DENIED  # old incarnation's key
            assert worker.call("put", keys=["paused-y"], size=8192,
                               segment=seg)["statuses"] == ["OK"]
            assert r.get("paused-y") == cw.payload("paused-y", 8192)
    finally:
        worker.stop()


def _run(client: KVPoolClient, coro: Any) -> Any:
    """Run a coroutine on the client's private loop (to reach the data plane directly)."""
    return client._thread.run(coro)


def test_lapsed_liveness_or_new_incarnation_abandons_writes(master: Any,
                                                             monkeypatch: Any) -> None:
    with KVPoolClient(config(master.address, heartbeat_interval_s=30)) as c:
        liveness = c.async_client.member.liveness
        path = c._path  # the blocking driver runs the sync client's puts
        assert liveness is not None and path is not None
        liveness.alive_until = time.monotonic() - 1  # as if the process had been paused
        with pytest.raises(KVPoolError) as info:
            c.put("during-lapse", b"x" * 4096)
        assert info.value.status == Status.TIMEOUT
        assert not c.exists("during-lapse")  # revoked, never committed
        c.async_client.member.liveness.request_reregister().result(timeout=10)
        c.put("after-lapse", b"y")
        assert c.get("after-lapse") == b"y"

        original = type(path).resolve

        def resolve_then_reregister(self: Any, segment_ids: Any) -> Any:
            liveness._epoch += 1  # a re-registration lands between put_start and the copy
            return original(self, segment_ids)

        monkeypatch.setattr(type(path), "resolve", resolve_then_reregister)
        with pytest.raises(KVPoolError) as info:
            c.put("abandoned", b"z" * 4096, options=PutOptions())
        assert info.value.status == Status.UNKNOWN_CLIENT
        monkeypatch.undo()
        assert not c.exists("abandoned")


def test_heartbeats_are_not_starved_by_a_busy_data_path(start_master: Any) -> None:
    # A short lease: the space of removed (leased) objects is free again 0.1 s later. Until
    # then it stays reserved, so the segment holds every round that fits in one lease: a round
    # copies 256 MiB, at least 10 ms even at 25 GB/s, so at most 10 rounds (1.25 GiB) wait.
    master = start_master(client_ttl=2, default_kv_lease_ttl=100)
    with KVPoolClient(config(master.address, global_segment_size="2gb")) as c:
        import numpy as np

        size = 8 << 20
        src = np.ones(16 * size, dtype=np.uint8)
        keys = [f"busy-{i}" for i in range(16)]
        offsets = [i * size for i in range(16)]
        deadline = time.monotonic() + 5  # 2.5 client_ttl of back-to-back 128 MiB batches
        rounds = 0
        while time.monotonic() < deadline:
            assert c.batch_put_from(keys, src, offsets, [size] * 16) == [Status.OK] * 16
            assert c.batch_get_into(keys, src, offsets, [size] * 16) == [size] * 16
            assert c.batch_remove(keys, force=True) == [Status.OK] * 16
            rounds += 1
        print(f"{rounds} rounds of 128 MiB puts and gets; heartbeat failures "
              f"{c.metrics.heartbeat_failures}, re-registrations {c.metrics.reregistrations}")
        assert c.metrics.reregistrations == 0  # never expired
        assert stats(master.address)["totals"]["clients_expired_total"] == 0
