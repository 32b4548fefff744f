"""Every form of the client API against a real master on 127.0.0.1 (one client process)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool_client.buffers import alloc_bytes
from kvpool_client.client import AsyncKVPoolClient, KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions


def make_config(master: Any, **changes: Any) -> ClientConfig:
    values: dict[str, Any] = {"master_server_address": master.address,
                              "global_segment_size": "64mb", "rpc_timeout_s": 5}
    values.update(changes)
    return ClientConfig.from_dict(values)


@pytest.fixture
def client(master: Any) -> Iterator[KVPoolClient]:
    with KVPoolClient(make_config(master)) as c:
        yield c


def run_in_threads(work: Any, count: int, timeout_s: float = 60.0) -> None:
    """Run ``work(index)`` on ``count`` threads at once and wait for all of them."""
    threads = [threading.Thread(target=work, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    assert not any(thread.is_alive() for thread in threads)


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_alloc_bytes_fills_the_returned_object() -> None:
    obj, view = alloc_bytes(10)
    view[:] = b"0123456789"
    assert obj == b"0123456789" and isinstance(obj, bytes)
    assert alloc_bytes(0)[0] == b""


def test_put_get_exists_size(client: KVPoolClient) -> None:
    client.put("alpha", b"hello")
    client.put(b"\x00raw-key", bytearray(b"bytes key"))
    assert client.get("alpha") == b"hello"
    assert client.get(b"\x00raw-key") == b"bytes key"
    assert client.get("absent") is None
    assert client.exists("alpha") and not client.exists("absent")
    assert client.get_size("alpha") == 5 and client.get_size("absent") is None
    client.put("alpha", b"second value")  # write-once: succeeds, keeps the first value
    assert client.get("alpha") == b"hello"
    assert client.hostname.startswith("127.0.0.1:") and len(client.segment_ids) == 1


@pytest.mark.parametrize("bad_key", ["", "k" * 1025, 17])
def test_bad_keys_are_refused(client: KVPoolClient, bad_key: Any) -> None:
    with pytest.raises(KVPoolError) as info:
        client.put(bad_key, b"x")
    assert info.value.status == Status.INVALID_KEY
    assert client.put_batch([bad_key, "good"], [b"x", b"y"]) == [Status.INVALID_KEY, Status.OK]


def test_empty_object_is_refused(client: KVPoolClient) -> None:
    with pytest.raises(KVPoolError) as info:
        client.put("empty", b"")
    assert info.value.status == Status.INVALID_ARGUMENT
    assert not client.exists("empty")


def test_zero_copy_single(client: KVPoolClient) -> None:
    src = pattern(1, 1 << 20)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    client.register_buffer(src)
    client.register_buffer(dst)
    client.put_from("zc", src, 4096, 100_000)
    assert client.get_into("zc", dst, 10, 200_000) == 100_000
    assert np.array_equal(dst[10:100_010], src[4096:104_096])
    with pytest.raises(KVPoolError) as info:
        client.get_into("zc", dst, 0, 99_999)  # buffer smaller than the object
    assert info.value.status == Status.BUFFER_OVERFLOW
    with pytest.raises(KVPoolError) as info:
        client.get_into("zc", dst, (1 << 20) - 10, 100)  # range outside the buffer
    assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KVPoolError) as info:
        client.get_into("zc", b"\x00" * 200_000, 0, 200_000)  # read-only destination
    assert info.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KVPoolError) as info:
        client.get_into("missing", dst, 0, 10)
    assert info.value.status == Status.NOT_FOUND
    client.unregister_buffer(dst)
    with pytest.raises(KVPoolError):
        client.unregister_buffer(dst)
    unregistered = bytearray(100_000)  # registration is optional for the native API
    assert client.get_into("zc", unregistered, 0, 100_000) == 100_000
    assert bytes(unregistered) == src[4096:104_096].tobytes()


def test_batch_bytes_forms(client: KVPoolClient) -> None:
    keys = [f"b{i}" for i in range(40)]
    datas = [pattern(i, 1000 + i).tobytes() for i in range(40)]
    assert client.put_batch(keys, datas) == [Status.OK] * 40
    assert client.get_batch([*keys, "nope"]) == [*datas, None]
    # duplicates in one batch: stored once, the first value wins, both answer OK
    assert client.put_batch(["dup", "dup"], [b"first", b"second"]) == [Status.OK, Status.OK]
    assert client.get("dup") == b"first"
    with pytest.raises(KVPoolError) as info:
        client.put_batch(["a", "b"], [b"x"])
    assert info.value.status == Status.INVALID_ARGUMENT


def test_batch_zero_copy_forms(client: KVPoolClient) -> None:
    size = 64 << 10
    src = pattern(7, 8 * size)
    client.register_buffer(src)
    keys = [f"bzc{i}" for i in range(8)]
    offsets = [i * size for i in range(8)]
    assert client.batch_put_from(keys, src, offsets, [size] * 8) == [Status.OK] * 8
    dst = np.zeros(8 * size, dtype=np.uint8)
    sizes = [size] * 7 + [size - 1]  # the last destination is one byte short
    got = client.batch_get_into([*keys[:7], keys[7]], dst, offsets, sizes)
    assert got == [size] * 7 + [int(Status.BUFFER_OVERFLOW)]
    assert np.array_equal(dst[:7 * size], src[:7 * size])
    # one buffer per key
    per_key = [np.zeros(size, dtype=np.uint8) for _ in range(3)]
    assert client.batch_get_into(["bzc0", "missing", "bzc2"], per_key, [0, 0, 0],
                                 [size] * 3) == [size, int(Status.NOT_FOUND), size]
    assert np.array_equal(per_key[2], src[2 * size:3 * size])
    parts = [pattern(100 + i, 5000) for i in range(2)]
    assert client.batch_put_from(["pk0", "pk1"], parts, [0, 1000], [5000, 4000]) == \
        [Status.OK, Status.OK]
    assert client.get("pk1") == parts[1][1000:].tobytes()
    # a bad range fails its key alone
    assert client.batch_put_from(["ok", "bad"], src, [0, len(src)], [10, 10]) == \
        [Status.OK, Status.INVALID_ARGUMENT]


def test_scatter_gather_regions(client: KVPoolClient) -> None:
    layers = [pattern(i, 3000 + 100 * i) for i in range(6)]  # e.g. [L0.K, L0.V, L1.K, ...]
    whole = b"".join(layer.tobytes() for layer in layers)
    assert client.batch_put_regions(["sg"], [layers]) == [Status.OK]
    assert client.get("sg") == whole
    # read back split differently: the object is the concatenation, in order
    out = np.zeros(len(whole), dtype=np.uint8)
    regions = [out[:1], out[1:7000], out[7000:]]
    assert client.batch_get_regions(["sg", "missing"], [regions, [np.zeros(4, np.uint8)]]) == \
        [len(whole), int(Status.NOT_FOUND)]
    assert out.tobytes() == whole
    small = [np.zeros(100, np.uint8)]
    assert client.batch_get_regions(["sg"], [small]) == [int(Status.BUFFER_OVERFLOW)]
    assert client.batch_put_regions(["bad-regions"], [[b"x", 42]]) == [Status.INVALID_ARGUMENT]


def test_lookups_leases_and_removal(client: KVPoolClient) -> None:
    chain = [f"chain-{i}" for i in range(6)]
    client.put_batch(chain[:3], [b"a", b"b", b"c"])
    client.put("chain-4", b"e")
    assert client.query_prefix(chain) == 3
    assert client.batch_exists(chain) == [True, True, True, False, True, False]
    assert client.get("chain-0") == b"a"  # grants a read lease
    with pytest.raises(KVPoolError) as info:
        client.remove("chain-0")
    assert info.value.status == Status.HAS_LEASE
    client.remove("chain-0", force=True)
    with pytest.raises(KVPoolError) as info:
        client.remove("chain-0")
    assert info.value.status == Status.NOT_FOUND
    assert client.batch_remove(["chain-3", "chain-4"], force=True) == \
        [Status.NOT_FOUND, Status.OK]
    client.put_batch(["rx-1", "rx-2", "keep"], [b"1", b"2", b"3"])
    assert client.remove_by_regex("^rx-", force=True) == 2
    with pytest.raises(KVPoolError) as info:
        client.remove_by_regex("(", force=True)
    assert info.value.status == Status.INVALID_ARGUMENT
    assert client.remove_all(force=True) >= 3
    assert client.batch_exists(["keep", "chain-1"]) == [False, False]


def test_read_your_writes_from_many_threads(client: KVPoolClient) -> None:
    errors: list[str] = []

    def work(thread: int) -> None:
        for i in range(60):
            key = f"ryw-{thread}-{i}"
            value = f"{thread}:{i}".encode() * 10
            client.put(key, value)
            if client.get(key) != value or not client.exists(key):
                errors.append(key)

    run_in_threads(work, 4)
    assert errors == []


def test_async_writes_flush(master: Any) -> None:
    with KVPoolClient(make_config(master, async_write_queue_size=4)) as c:
        values = {f"aw-{i}": pattern(i, 2048).tobytes() for i in range(50)}
        for key, value in values.items():
            c.put(key, value, async_write=True)  # the bounded queue makes later puts wait
        assert c.batch_put_regions(["aw-r"], [[b"ab", b"cd"]], async_write=True) == [Status.OK]
        c.flush(timeout_s=30)
        assert c.get_batch(list(values)) == list(values.values())
        assert c.get("aw-r") == b"abcd"
        assert c.metrics.async_queue_depth == 0


def test_async_write_failures_are_reported(master: Any) -> None:
    with KVPoolClient(make_config(master, global_segment_size="1mb")) as c:
        c.put("fits", b"x" * 1000, async_write=True)
        c.put("too-big-1", b"x" * (2 << 20), async_write=True)
        c.put("too-big-2", b"x" * (2 << 20), async_write=True)
        with pytest.raises(KVPoolError) as info:
            c.flush(timeout_s=30)
        assert info.value.status == Status.NO_SPACE
        assert "2 async writes failed" in str(info.value)
        assert c.metrics.async_failures == 2
        c.flush()  # reported once, then counted afresh
        assert c.get("fits") == b"x" * 1000


def test_close_flushes_and_reports(master: Any) -> None:
    c = KVPoolClient(make_config(master, global_segment_size="1mb"))
    c.put("late", b"y" * 100, async_write=True)
    c.put("late-too-big", b"y" * (2 << 20), async_write=True)
    with pytest.raises(KVPoolError) as info:
        c.close()
    assert info.value.status == Status.NO_SPACE
    c.close()  # idempotent
    with pytest.raises(KVPoolError) as info:
        c.put("after-close", b"z")
    assert info.value.status == Status.UNAVAILABLE


def test_metrics_server(client: KVPoolClient) -> None:
    port = client.start_metrics_server(0)
    client.put("m1", b"z" * 4096)
    assert client.get("m1") == b"z" * 4096
    assert client.get("m-missing") is None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'kvpool_client_transfer_bytes_total{op="write",transport="shm"} 4096.0' in text
    assert 'kvpool_client_transfer_bytes_total{op="read",transport="shm"} 4096.0' in text
    assert "kvpool_client_lookup_keys_total 2.0" in text
    assert "kvpool_client_lookup_hits_total 1.0" in text
    assert 'kvpool_client_op_seconds_count{op="put"} 1.0' in text
    assert 'kvpool_client_op_failures_total{op="get",status="NOT_FOUND"} 1.0' in text
    assert "kvpool_client_data_server_refusals_total" in text


def test_put_options_and_scheduler_role(master: Any, client: KVPoolClient) -> None:
    scheduler = make_config(master, protocol="ascend_no_transport", global_segment_size=0)
    with KVPoolClient(scheduler) as lookup_only:
        assert lookup_only.segment_ids == [] and lookup_only.hostname == "127.0.0.1"
        # it contributes nothing but can still write into the pool and look keys up
        lookup_only.put("from-scheduler", b"s",
                        options=PutOptions(preferred_segment=client.segment_ids[0]))
        assert client.get("from-scheduler") == b"s"
        assert lookup_only.query_prefix(["from-scheduler", "x"]) == 1


def test_checksums_round_trip(master: Any) -> None:
    with KVPoolClient(make_config(master, checksum=True)) as c:
        c.put_batch(["c1", "c2"], [b"abc" * 1000, b"def"])
        assert c.get_batch(["c1", "c2"]) == [b"abc" * 1000, b"def"]


def test_by_default_a_small_object_is_checked_and_a_large_one_is_not(master: Any) -> None:
    # "checksum": "auto" (the default): objects up to 256 KiB carry a committed checksum, so
    # bytes that changed under a small object are an error, never a silent wrong answer.
    import asyncio
    import mmap

    from kvpool_client.rpc import MasterRpc

    with KVPoolClient(make_config(master)) as c:
        c.put_batch(["small", "large"], [b"s" * (256 << 10), b"l" * ((256 << 10) + 1)])

        async def placements() -> list[Any]:
            rpc = MasterRpc(master.address)
            try:
                results, _, _ = await rpc.get_replicas("x", [b"small", b"large"])
                (info,) = await rpc.get_segments([results[0].placements[0].segment_id])
                return [results, info]
            finally:
                await rpc.close()

        results, info = asyncio.run(placements())
        assert results[0].checksum != 0 and results[1].checksum == 0
        placement = results[0].placements[0]
        with open(f"/dev/shm/{info.shm_name.lstrip('/')}", "r+b") as f, \
                mmap.mmap(f.fileno(), 0) as shm:
            shm[placement.offset] ^= 0xFF            # one flipped byte under "small"
        with pytest.raises(KVPoolError) as error:
            c.get("small")
        assert error.value.status == Status.CHECKSUM_MISMATCH
        assert c.get("large") == b"l" * ((256 << 10) + 1)


async def test_async_client(master: Any) -> None:
    async with AsyncKVPoolClient(make_config(master)) as c:
        await c.put("async-key", b"async value")
        assert await c.get("async-key") == b"async value"
        assert await c.batch_exists(["async-key", "nope"]) == [True, False]
        buf = bytearray(32)
        assert await c.get_into("async-key", buf, 0, 32) == 11
        await c.flush()


def _large_batch_round_trip(put: Any, get: Any, seed: int) -> None:
    """8 x 3 MiB (24 MiB, enough to be cut into sub-batches on a loop), read back with a
    missing key and a destination one byte short."""
    size = 3 << 20
    src = pattern(seed, 8 * size)
    keys = [f"big-{seed}-{i}" for i in range(8)]
    offsets = [i * size for i in range(8)]
    assert put(keys, src, offsets, [size] * 8) == [Status.OK] * 8
    dst = np.zeros(8 * size, dtype=np.uint8)
    wanted = [*keys[:5], "big-missing", keys[6], keys[7]]
    sizes = [size] * 7 + [size - 1]  # the last destination is one byte short
    got = get(wanted, dst, offsets, sizes)
    assert got == [size] * 5 + [int(Status.NOT_FOUND), size, int(Status.BUFFER_OVERFLOW)]
    assert np.array_equal(dst[:5 * size], src[:5 * size])
    assert np.array_equal(dst[6 * size:7 * size], src[6 * size:7 * size])
    assert get(keys[7:], dst, [0], [size]) == [size]
    assert np.array_equal(dst[:size], src[7 * size:])


@pytest.fixture
def copy_record(monkeypatch: Any) -> tuple[list[int], list[str]]:
    """(ids of the threads that ran large copies, the batch calls the data path made)."""
    from kvpool_client.drivers.aio import AsyncDataPath
    from kvpool_client.drivers.blocking import BlockingDataPath
    from kvpool_client.transfer import copy

    threads: list[int] = []
    batches: list[str] = []
    copy_nogil = copy.copy_nogil

    def recording_copy(copies: Any) -> None:
        threads.append(threading.get_ident())
        copy_nogil(copies)

    monkeypatch.setattr(copy, "copy_nogil", recording_copy)
    for name in ("_write", "_read"):  # one call per (sub-)batch on a loop
        original = getattr(AsyncDataPath, name)

        async def recording_batch(self: Any, *args: Any, _original: Any = original,
                                  _name: str = name) -> Any:
            batches.append(_name)
            return await _original(self, *args)

        monkeypatch.setattr(AsyncDataPath, name, recording_batch)
    for name in ("write", "read"):  # one call per batch on the caller's thread
        blocking = getattr(BlockingDataPath, name)

        def recording_call(self: Any, *args: Any, _original: Any = blocking,
                           _name: str = name) -> Any:
            batches.append(f"_{_name}")
            return _original(self, *args)

        monkeypatch.setattr(BlockingDataPath, name, recording_call)
    return threads, batches


def test_large_batches_are_copied_by_the_calling_thread_and_a_helper(
        client: KVPoolClient, copy_record: tuple[list[int], list[str]]) -> None:
    """The sync client runs a large batch on the calling thread: one master call per phase
    (not cut into sub-batches), its copies shared between the calling thread and a helper."""
    from kvpool_client.member import copy_threads

    threads, batches = copy_record
    _large_batch_round_trip(client.batch_put_from, client.batch_get_into, 42)
    assert batches == ["_write", "_read", "_read"]
    if copy_threads() > 1:
        assert threading.get_ident() in threads
        assert 2 <= len(set(threads)) <= copy_threads()


@pytest.mark.parametrize("count", [1, 3])
def test_copy_threads_config_sets_how_many_threads_copy_a_large_batch(
        master: Any, copy_record: tuple[list[int], list[str]], count: int) -> None:
    threads, _ = copy_record
    with KVPoolClient(make_config(master, copy_threads=count)) as c:
        _large_batch_round_trip(c.batch_put_from, c.batch_get_into, 43)
    if count == 1:  # the calling thread copies everything inline, no parts handed out
        assert threads == []
    else:  # the calling thread and up to two helpers share each batch
        assert threading.get_ident() in threads and 2 <= len(set(threads)) <= 3


async def test_async_client_cuts_large_batches_into_concurrent_sub_batches(
        master: Any, copy_record: tuple[list[int], list[str]]) -> None:
    """On a loop, large batches run as concurrent sub-batches (master calls overlap copies),
    copied by worker threads while the loop stays free."""
    threads, batches = copy_record
    async with AsyncKVPoolClient(make_config(master)) as c:
        size = 3 << 20
        src = pattern(7, 8 * size)
        keys = [f"abig-{i}" for i in range(8)]
        offsets = [i * size for i in range(8)]
        put_results = await c.batch_put_from(keys, src, offsets, [size] * 8)
        assert put_results == [Status.OK] * 8
        dst = np.zeros(8 * size, dtype=np.uint8)
        assert await c.batch_get_into(keys, dst, offsets, [size] * 8) == [size] * 8
        assert np.array_equal(dst, src)
    assert batches == ["_write"] * 2 + ["_read"] * 2
    assert threads and threading.get_ident() not in threads


def test_from_config_file_and_environment(master: Any, tmp_path: Any, monkeypatch: Any) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                "global_segment_size": "8mb", "protocol": "tcp",
                                "device_name": "", "master_server_address": master.address}))
    with KVPoolClient.from_config(str(path)) as c:
        c.put("from-file", b"1")
        assert c.config.global_segment_size == 8 << 20
    monkeypatch.delenv("KVPOOL_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4mb")
    with KVPoolClient.from_config() as c:
        assert c.config.global_segment_size == 4 << 20
        assert c.get("from-file") is None  # the first client left: its objects went with it


def test_read_falls_back_to_another_replica(master: Any, monkeypatch: Any) -> None:
    config = make_config(master, global_segment_size="16mb", max_segment_size="8mb",
                         replica_num=2)
    with KVPoolClient(config) as c:
        assert len(c.segment_ids) == 2
        value = pattern(9, 100_000).tobytes()
        c.put("two-replicas", value)
        path = c._path
        assert path is not None
        results, _, _ = path.rpc.get_replicas(c.client_id, [b"two-replicas"])
        placements = results[0].placements
        assert len({p.segment_id for p in placements}) == 2
        broken = placements[0].segment_id  # the replica tried first fails
        shm = type(path.parts.shm)
        original = shm.copy_batch
        tried: list[str] = []

        def failing_copy_batch(self: Any, items: Any, *, writing: bool) -> list[Status]:
            if writing:
                return original(self, items, writing=writing)
            tried.extend(item[1].segment_id for item in items)
            if any(item[1].segment_id == broken for item in items):
                return [Status.TRANSFER_FAILED] * len(items)
            return original(self, items, writing=writing)

        monkeypatch.setattr(shm, "copy_batch", failing_copy_batch)
        assert c.get("two-replicas") == value
        assert tried == [broken, placements[1].segment_id]


def test_grpc_only_client_from_several_threads(master: Any) -> None:
    """Every call over gRPC (no lean framing), made from the main thread and from workers at
    the same time."""
    with KVPoolClient(make_config(master, use_fast_path=False)) as client:
        assert client.async_client.member.rpc.fast_port == 0
        client.put("grpc-main", b"from main")
        errors: list[BaseException] = []

        def work(index: int) -> None:
            try:
                for j in range(20):
                    key = f"grpc-{index}-{j}"
                    client.put(key, key.encode())
                    assert client.get(key) == key.encode()
            except BaseException as exc:  # reported below
                errors.append(exc)

        run_in_threads(work, 3)
        assert not errors
        assert client.get("grpc-main") == b"from main"
        assert client.batch_exists([f"grpc-{i}-19" for i in range(3)]) == [True] * 3


def test_single_ops_run_on_the_calling_thread_over_a_blocking_connection(
        master: Any, monkeypatch: Any) -> None:
    from kvpool_client.rpc.lean_blocking import BlockingLeanConnection

    callers: list[int] = []
    original = BlockingLeanConnection.call

    def recording_call(self: Any, *args: Any) -> Any:
        callers.append(threading.get_ident())
        return original(self, *args)

    monkeypatch.setattr(BlockingLeanConnection, "call", recording_call)
    with KVPoolClient(make_config(master)) as client:
        callers.clear()
        client.put("direct", b"bytes")
        assert client.get("direct") == b"bytes" and client.exists("direct")
        # PutStart, PutEnd, GetReplicas, Exist: each on this thread's blocking connection
        assert callers == [threading.get_ident()] * 4
        assert client._path is not None and client._path.rpc._legs[0]._idle
    # Pipelined commits travel on the loop's connection: later calls must queue behind them.
    with KVPoolClient(make_config(master, commit_nowait=True)) as client:
        callers.clear()
        client.put("nowait", b"bytes")
        assert client.get("nowait") == b"bytes"
        assert client._path is None and callers == []


def test_a_start_that_fails_after_joining_leaves_nothing_behind(master: Any) -> None:
    """The metrics port is taken: start fails after the client joined the pool; it leaves the
    pool (the master forgets it at once) and frees its segments and data server."""
    import asyncio
    import os
    import socket

    from kvpool_client.rpc import MasterRpc

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = make_config(master, metrics_port=port, client_id=f"short-lived-{os.getpid()}")
        client = AsyncKVPoolClient(config)

        async def start_and_count() -> tuple[BaseException | None, int]:
            failure: BaseException | None = None
            try:
                await client.start()
            except OSError as exc:
                failure = exc
            rpc = MasterRpc(master.address, timeout_s=5.0)
            try:
                return failure, (await rpc.get_stats())["clients"]
            finally:
                await rpc.close()

        failure, clients = asyncio.run(start_and_count())
    assert isinstance(failure, OSError)
    assert clients == 0
    assert not [name for name in os.listdir("/dev/shm") if config.client_id in name]
    with pytest.raises(KVPoolError) as err:
        asyncio.run(client.exists("anything"))
    assert err.value.status == Status.UNAVAILABLE


def test_batches_longer_than_the_masters_limit(start_master: Any) -> None:
    """A master that takes at most 64 keys a call: every batched operation of 200 keys goes
    as several calls (the client learnt the limit at registration), in key order."""
    master = start_master(max_batch_keys=64)
    keys = [f"many-{i}" for i in range(200)]
    datas = [pattern(i, 100 + i).tobytes() for i in range(200)]
    with KVPoolClient(make_config(master)) as c:
        assert c.put_batch(keys, datas) == [Status.OK] * 200
        assert c.get_batch([*keys, "nope"]) == [*datas, None]
        assert c.batch_exists(keys[:150] + ["nope"]) == [True] * 150 + [False]
        assert c.query_prefix(keys) == 200
        assert c.query_prefix(keys[:100] + ["nope"] + keys[100:]) == 100
        assert c.batch_remove(keys[::2], force=True) == [Status.OK] * 100
        assert c.get_batch(keys) == [None if i % 2 == 0 else d for i, d in enumerate(datas)]

    async def in_async() -> None:
        async with AsyncKVPoolClient(make_config(master)) as c:
            more = [f"async-many-{i}" for i in range(200)]
            assert await c.put_batch(more, datas) == [Status.OK] * 200
            assert await c.get_batch(more) == datas
            assert await c.batch_exists(more) == [True] * 200
            assert await c.query_prefix(more) == 200
    asyncio.run(in_async())
