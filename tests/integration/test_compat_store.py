"""``MooncakeDistributedStore`` over kvpool where it goes beyond (or deliberately differs from)
Mooncake 0.3.13: pointers outside registered memory, Ascend protocols on a host without an NPU,
the non-direct Ascend calls, use from other threads, and two processes sharing objects."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import drop_in_store, free_ports, wait_until

from kvpool_client.compat.mooncake import (
    MooncakeDistributedStore,
    ReplicateConfig,
    TransferEngine,
)

MiB = 1 << 20


def free_port() -> int:
    return free_ports(1)


@pytest.fixture
def store(master: Any) -> Iterator[MooncakeDistributedStore]:
    with drop_in_store(master.address, 32 * MiB, 16 * MiB, remove_all=True) as s:
        yield s


def test_pointers_outside_registered_memory_fail_cleanly(store: MooncakeDistributedStore) -> None:
    registered = ctypes.create_string_buffer(b"inside", 4096)
    other = ctypes.create_string_buffer(b"outside", 4096)
    base, elsewhere = ctypes.addressof(registered), ctypes.addressof(other)
    assert store.register_buffer(base, 4096) == 0
    assert store.put_from("k", elsewhere, 7) == -600
    assert store.put_from("k", base + 4090, 16) == -600  # runs past the end of the region
    assert store.is_exist("k") == 0
    assert store.put_from("k", base, 6) == 0
    assert store.get_into("k", elsewhere, 64) == -600
    assert other.raw[:7] == b"outside"  # nothing was written outside registered memory
    assert store.batch_get_into(["k", "k"], [elsewhere, base + 100], [64, 64]) == [-600, 6]
    assert store.batch_put_from_multi_buffers(["m"], [[base, elsewhere]], [[4, 4]]) == [-600]
    assert store.batch_get_into_multi_buffers(["k"], [[base + 200, 16]], [[3, 3]]) == [-600]
    assert store.register_buffer(0x10, 4096) == -600  # not memory of this process
    assert store.unregister_buffer(base) == 0
    assert store.put_from("k2", base, 6) == -600


def test_kvpool_only_limits(store: MooncakeDistributedStore) -> None:
    assert store.put("k" * 1025, b"v") == -400  # kvpool keys are at most 1 KiB (Mooncake: any)
    assert store.put("", b"v") == -400
    assert store.get_size("k" * 1025) == -400
    buf = ctypes.create_string_buffer(16)
    assert store.register_buffer(ctypes.addressof(buf), 16) == 0
    assert store.put_from("z", ctypes.addressof(buf), 0) == -600  # Mooncake stores 0 bytes
    bad = ReplicateConfig(replica_num=0)
    assert store.put("c", b"v", bad) == -600
    assert store.batch_put_from(["c"], [ctypes.addressof(buf)], [4], bad) == [-600]


def test_a_put_batch_with_a_bad_value_stores_nothing(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["z1", "z2"], [b"a", b""]) == -600
    assert store.put_batch(["z1", "z2"], [b"a", "not bytes"]) == -600
    assert store.batch_is_exist(["z1", "z2"]) == [0, 0]
    assert store.put_batch(["z1", "z2"], [b"a", b"b"]) == 0


def test_calls_before_setup_and_after_close_fail_without_raising(master: Any) -> None:
    s = MooncakeDistributedStore()
    assert s.health_check() == 1   # Mooncake's "not set up"
    assert s.put("k", b"v") == -1
    assert s.get("k") == b""
    assert s.batch_is_exist(["a", "b"]) == [-1, -1]
    assert s.get_hostname() == ""
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", MiB, 0, "tcp", "", "no-port") == -600
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", MiB, 0, "tcp", "", master.address) == 0
    assert s.health_check() == 0
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", MiB, 0, "tcp", "", master.address) == -600
    assert s.close() == 0
    assert s.health_check() == 1
    assert s.get_batch(["k"]) == [b""]
    assert s.batch_get_into_multi_buffers(["k"], [[1]], [[1]]) == [-600]


def test_the_dict_vllms_store_connector_passes_sets_up(master: Any) -> None:
    """vLLM's MooncakeStoreWorker: every value a string, and its own ``enable_offload`` key
    when offloading is on (Mooncake ignores keys it does not know; so does kvpool)."""
    s = MooncakeDistributedStore()
    config = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
              "global_segment_size": str(32 * MiB), "local_buffer_size": str(16 * MiB),
              "protocol": "tcp", "rdma_devices": "", "master_server_addr": master.address,
              "enable_offload": "true"}
    assert s.setup(config) == 0
    try:
        assert s.put("from-vllm", b"kv" * 100) == 0
        assert s.get("from-vllm") == b"kv" * 100
    finally:
        s.close()


def test_health_check_says_when_the_master_stops_answering(start_master: Any) -> None:
    """Mooncake's codes: 0 while the master answers this client's heartbeats, 2 from the
    first one that goes unanswered (the master killed), 0 again once one answers (the master
    restarted on its port; the client registers again by itself)."""
    flags = {"host": "127.0.0.1", "port": free_port(), "fast_port": 0, "metrics_port": 0,
             "client_ttl": 2}
    master = start_master(default_ports=False, **flags)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 16 * MiB, "tcp", "",
                   master.address) == 0
    try:
        assert s.health_check() == 0
        master.kill()
        assert wait_until(lambda: s.health_check() == 2, 10)
        start_master(default_ports=False, **flags)
        assert wait_until(lambda: s.health_check() == 0, 15)
        assert s.put("after", b"v") == 0
    finally:
        s.close()


def test_mindie_ascend_setup_works_on_a_host_without_an_npu(master: Any) -> None:
    """MindIE's worker and scheduler calls with protocol ascend: host memory moves through
    kvpool's own transports (device pointers would need the ACL runtime)."""
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "ascend", "") == 0
    segment = f"127.0.0.1:{engine.get_rpc_port()}"
    worker, scheduler = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        assert worker.setup(segment, "P2PHANDSHAKE", 16 * MiB, 1073741824, "ascend", "",
                            master.address, engine.get_engine()) == 0
        assert scheduler.setup(segment, "P2PHANDSHAKE", 0, 0, "ascend_no_transport", "",
                               master.address, engine.get_engine()) == 0
        k_cache = ctypes.create_string_buffer(bytes(range(256)) * 4, 1024)
        v_cache = ctypes.create_string_buffer(bytes(reversed(range(256))) * 4, 1024)
        k, v = ctypes.addressof(k_cache), ctypes.addressof(v_cache)
        assert worker.register_buffer(k, 1024) == 0 and worker.register_buffer(v, 1024) == 0
        config = ReplicateConfig()
        config.preferred_segment = segment
        config.prefer_alloc_in_same_node = True
        keys = ["h1_0_1_m", "h2_0_1_m"]
        assert worker.batch_put_from_multi_buffers(
            keys, [[k, v], [k + 128, v + 128]], [[128, 128], [128, 128]], config) == [0, 0]
        assert scheduler.batch_is_exist(keys + ["h3_0_1_m"]) == [1, 1, 0]
        assert scheduler.is_exist(keys[1]) == 1
        out = ctypes.create_string_buffer(512)
        o = ctypes.addressof(out)
        assert worker.register_buffer(o, 512) == 0
        assert worker.batch_get_into_multi_buffers(keys, [[o, o + 128], [o + 256, o + 384]],
                                                   [[128, 128], [128, 128]], True) == [256, 256]
        assert out.raw[:128] == k_cache.raw[:128] and out.raw[128:256] == v_cache.raw[:128]
        assert out.raw[256:384] == k_cache.raw[128:256]
    finally:
        for s in (worker, scheduler):
            s.remove_all(True)
            s.close()
        engine.close()


def test_non_direct_ascend_calls_take_unregistered_host_memory(master: Any) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1:8790:npu_0", "P2PHANDSHAKE", 16 * MiB, MiB, "ascend", "",
                   master.address) == 0
    try:
        src = ctypes.create_string_buffer(b"K" * 64 + b"V" * 64, 128)
        a = ctypes.addressof(src)
        assert s.batch_put_from_ascend("key", [a, a + 64], [64, 64]) == [0]
        assert s.batch_put_from_ascend("key", [a, a + 64], [64, 64]) == [0]  # re-put: harmless
        dst = ctypes.create_string_buffer(128)
        d = ctypes.addressof(dst)
        assert s.batch_get_into_ascend("key", [d, d + 64], [64, 64]) == [128]
        assert dst.raw == src.raw
        assert s.batch_get_into_ascend("nope", [d], [64]) == [-704]
        assert s.batch_put_from_ascend("bad", [0x10], [64]) == [-600]
    finally:
        s.remove_all(True)
        s.close()


def test_store_is_not_tied_to_the_thread_that_set_it_up(master: Any) -> None:
    holder: dict[str, MooncakeDistributedStore] = {}

    def create() -> None:
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 0, "tcp", "", master.address) == 0
        holder["store"] = s

    creator = threading.Thread(target=create)
    creator.start()
    creator.join(60)
    s = holder["store"]  # its creating thread has exited
    buffers = [ctypes.create_string_buffer(bytes([i]) * 4096, 4096) for i in range(4)]
    for b in buffers:
        assert s.register_buffer(ctypes.addressof(b), 4096) == 0
    results: dict[int, list[int]] = {}

    def writer(i: int) -> None:
        base = ctypes.addressof(buffers[i])
        keys = [f"t{i}-{j}" for j in range(16)]
        results[i] = s.batch_put_from_multi_buffers(
            keys, [[base + 256 * j, base + 256 * j + 128] for j in range(16)],
            [[128, 128]] * 16)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert results == {i: [0] * 16 for i in range(4)}
        assert s.get("t3-5") == bytes([3]) * 256
    finally:
        s.remove_all(True)
        s.close()


def test_objects_written_by_one_process_are_read_by_another(master: Any, tmp_path: Any) -> None:
    writer = textwrap.dedent(f"""
        import ctypes, sys
        from kvpool_client.compat.mooncake import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", "{master.address}") == 0
        buf = ctypes.create_string_buffer(bytes(range(256)) * 16, 4096)
        assert s.register_buffer(ctypes.addressof(buf), 4096) == 0
        a = ctypes.addressof(buf)
        print(s.batch_put_from_multi_buffers(["x"], [[a, a + 1024]], [[1000, 2000]]), flush=True)
        sys.stdin.readline()  # keep the segment (and the object) alive until told to go
        s.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    s = MooncakeDistributedStore()
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "[0]"
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", master.address) == 0
        expected = (bytes(range(256)) * 16)[:1000] + (bytes(range(256)) * 16)[1024:3024]
        assert s.get("x") == expected
        assert s.get_size("x") == 3000
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        s.close()
