"""The rest of Mooncake 0.3.13's store surface over kvpool: ReplicateConfig's fields and
SoftPinAction, upserts, parts, buffer handles, range reads, replica clears, the local-buffer
limit of the bytes API, and the calls kvpool cannot serve (-1012, never AttributeError)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import drop_in_store

from kvpool_client.compat.extras import UNSUPPORTED_CALLS
from kvpool_client.compat.mooncake import (
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from kvpool_client.compat.replicate import put_options
from kvpool_wire.status import KVPoolError
from kvpool_wire.types import Pin

MiB = 1 << 20
LEASE_S = 2.0


@pytest.fixture
def store(start_master: Any) -> Iterator[MooncakeDistributedStore]:
    master = start_master(default_kv_lease_ttl=int(LEASE_S * 1000))
    with drop_in_store(master.address, 32 * MiB, 1 * MiB) as s:
        yield s


def test_replicate_config_has_mooncakes_fields_and_checks_them() -> None:
    config = ReplicateConfig()
    assert config.soft_pin_action == SoftPinAction.PRESERVE and config.soft_pin_ttl_ms is None
    for name in ("nof_replica_num", "dfs_replica_num", "preferred_nof_segments", "data_type",
                 "group_ids", "preferred_segments", "with_hard_pin", "replica_num"):
        getattr(config, name)
    config.soft_pin_ttl_ms = 1000
    assert config.soft_pin_ttl_ms == 1000
    for bad in (-1, 1 << 64, 1.5, True):
        with pytest.raises(TypeError):
            config.soft_pin_ttl_ms = bad
    with pytest.raises(AttributeError):
        config.sof_pin_action = SoftPinAction.ENABLE  # type: ignore[attr-defined]
    config.soft_pin_action = SoftPinAction.ENABLE
    options = put_options(config, str)
    assert options is not None and options.pin == Pin.SOFT and config.with_soft_pin
    config.soft_pin_action = SoftPinAction.DISABLE
    with pytest.raises(KVPoolError, match="soft_pin_ttl_ms"):
        put_options(config, str)                       # a TTL without ENABLE


def test_upsert_replaces_and_checks_its_config_first(store: MooncakeDistributedStore) -> None:
    assert store.put("u", b"first") == 0
    assert store.put("u", b"second") == 0              # put keeps the first value
    assert store.get("u") == b"first"
    ttl_without_enable = ReplicateConfig()
    ttl_without_enable.soft_pin_ttl_ms = 1000
    assert store.upsert("u", b"third", ttl_without_enable) == -600
    assert store.get("u") == b"first"                  # a refused upsert changes nothing
    assert store.upsert("u", b"third") == 0
    assert store.get("u") == b"third"
    assert store.upsert("new", b"fresh") == 0
    assert store.upsert_batch(["u", "new"], [b"4", b"5"]) == 0
    assert store.get_batch(["u", "new"]) == [b"4", b"5"]
    buf = ctypes.create_string_buffer(b"from-a-pointer", 64)
    assert store.register_buffer(ctypes.addressof(buf), 64) == 0
    assert store.upsert_from("u", ctypes.addressof(buf), 14) == 0
    assert store.get("u") == b"from-a-pointer"
    assert store.batch_upsert_from(["u"], [ctypes.addressof(buf)], [4]) == [0]
    assert store.get("u") == b"from"


def test_put_parts_stores_the_concatenation(store: MooncakeDistributedStore) -> None:
    assert store.put_parts("p", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("p") == b"abcdef"
    assert store.upsert_parts("p", b"x", b"y") == 0
    assert store.get("p") == b"xy"


def test_buffer_handles(store: MooncakeDistributedStore) -> None:
    assert store.put("b1", b"one") == 0 and store.put("b2", b"three") == 0
    one, missing, three = store.batch_get_buffer(["b1", "absent", "b2"])
    assert missing is None and one is not None and three is not None
    assert bytes(one) == b"one" and one.size() == len(one) == 3
    assert ctypes.string_at(three.ptr(), three.size()) == b"three"
    assert store.batch_get_buffer([]) == []
    assert store.get_buffer("absent") is None


def test_get_into_ranges(store: MooncakeDistributedStore) -> None:
    data1, data2 = b"0123456789ABCDEF", b"abcdefghijklmnop"
    assert store.put("r1", data1) == 0 and store.put("r2", data2) == 0
    buf = (ctypes.c_ubyte * 32)()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, 32) == 0
    results = store.get_into_ranges([ptr], [["r1", "r2", "absent"]],
                                    [[[0, 10], [20], [28]]], [[[1, 8], [3], [0]]],
                                    [[[4, 2], [5], [2]]])
    assert results == [[[4, 2], [5], [-704]]]
    assert bytes(buf[0:4]) == data1[1:5] and bytes(buf[10:12]) == data1[8:10]
    assert bytes(buf[20:25]) == data2[3:8]
    assert store.get_into_ranges([ptr], [["r1"]], [[[0]]], [[[15]]], [[[4]]])[0][0][0] == -600
    assert store.get_into_ranges([ptr], [["r1"]], [[[30]]], [[[0]]], [[[4]]])[0][0][0] == -600
    assert store.get_into_ranges([ptr], [["r1"]], [[[0]]], [[[0, 1]]], [[[1]]])[0][0][0] == -600


def test_batch_replica_clear_removes_what_no_lease_protects(
        store: MooncakeDistributedStore) -> None:
    assert store.put("c1", b"x") == 0 and store.put("c2", b"y") == 0
    assert store.batch_replica_clear([]) == []
    assert store.get("c1") == b"x"                     # c1 is leased now
    time.sleep(LEASE_S)  # the put's commit is no lease; the get's runs out
    assert store.get("c2") == b"y"
    assert store.batch_replica_clear(["c1", "c2", "absent"]) == ["c1"]
    assert store.batch_replica_clear(["c2"], segment_name="10.9.9.9:1") == []
    time.sleep(LEASE_S)
    assert store.batch_replica_clear(["c2"], segment_name=store.get_hostname()) == ["c2"]
    assert store.get("c1") == b"" and store.get("c2") == b""


def test_the_bytes_api_stages_through_the_local_buffer_as_mooncake(start_master: Any) -> None:
    master = start_master()
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 0, "tcp", "", master.address) == 0
    try:
        assert s.put("k", b"value") == -600            # Mooncake: no room to stage it
        assert s.is_exist("k") == 0
        buf = ctypes.create_string_buffer(b"value", 8)
        assert s.register_buffer(ctypes.addressof(buf), 8) == 0
        assert s.put_from("k", ctypes.addressof(buf), 5) == 0   # zero-copy needs no buffer
    finally:
        s.close()


def test_calls_kvpool_cannot_serve_answer_not_supported(store: MooncakeDistributedStore) -> None:
    assert "put_tensor_with_parallelism" in UNSUPPORTED_CALLS
    assert "create_copy_task" in UNSUPPORTED_CALLS and "put_tensor" not in UNSUPPORTED_CALLS
    for name in UNSUPPORTED_CALLS:
        assert getattr(store, name)("anything") == -1012, name
    with pytest.raises(AttributeError):
        store.put_tensr("k", None)  # type: ignore[attr-defined]


def test_keyword_names_are_mooncakes(store: MooncakeDistributedStore) -> None:
    buf = ctypes.create_string_buffer(b"kw", 8)
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(buffer_ptr=ptr, size=8) == 0
    assert store.put_from(key="kw", buffer_ptr=ptr, size=2) == 0
    assert store.batch_put_from(keys=["kw2"], buffer_ptrs=[ptr], sizes=[2]) == [0]
    assert store.get_into(key="kw", buffer_ptr=ptr + 4, size=4) == 2
    assert store.batch_get_into(keys=["kw2"], buffer_ptrs=[ptr + 4], sizes=[4]) == [2]
    assert store.unregister_buffer(buffer_ptr=ptr) == 0


def test_session_calls_save_and_load_layer_by_layer(store: MooncakeDistributedStore) -> None:
    """Mooncake's documented flow: open sessions, move one layer's range per call, end."""
    import numpy as np

    page, layers, keys = 1024, 4, ["block0", "block1"]
    src = [np.full(page, i + 1, dtype=np.uint8) for i in range(layers)]
    dst = [np.zeros(page, dtype=np.uint8) for _ in range(layers)]
    for buf in src + dst:
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    assert store.batch_put_session_start(keys, [page * layers] * 2) == [0, 0]
    assert store.is_exist("block0") == 0              # nothing readable before the end
    for layer in range(layers):
        moved = store.batch_put_from_multi_buffer_ranges(
            keys, [[src[layer].ctypes.data]] * 2, [[page]] * 2, [[layer * page]] * 2)
        assert moved == [page, page]
    assert store.batch_put_session_end(keys) == [0, 0]
    assert store.get("block1") == b"".join(bytes([i + 1]) * page for i in range(layers))

    assert store.batch_get_session_start(keys + ["absent"]) == [0, 0, -704]
    for layer in range(layers):
        moved = store.batch_get_into_multi_buffer_ranges(
            keys[:1], [[dst[layer].ctypes.data]], [[page]], [[layer * page]])
        assert moved == [page]
        assert (dst[layer] == layer + 1).all()
    assert store.batch_get_session_end(keys) == 0
    # Without an open session, out of the object, or outside registered memory: -600.
    assert store.batch_get_into_multi_buffer_ranges(
        keys[:1], [[dst[0].ctypes.data]], [[page]], [[0]]) == [-600]
    assert store.batch_put_from_multi_buffer_ranges(
        ["nope"], [[src[0].ctypes.data]], [[page]], [[0]]) == [-600]
    assert store.batch_put_session_start(["small"], [page]) == [0]
    assert store.batch_put_from_multi_buffer_ranges(
        ["small"], [[src[0].ctypes.data]], [[page]], [[1]]) == [-600]
    outside = ctypes.create_string_buffer(page)
    assert store.batch_put_from_multi_buffer_ranges(
        ["small"], [[ctypes.addressof(outside)]], [[page]], [[0]]) == [-600]
    assert store.batch_put_session_revoke(["small", "nope"]) == [0, -600]
    assert store.batch_put_session_end(["small"]) == [-600]
    assert store.is_exist("small") == 0               # a revoked session left nothing
    assert store.batch_put_session_start(["block0"], [page]) == [-705]   # it exists
    assert store.batch_put_session_end(["block0"]) == [-600]


@pytest.mark.parametrize("fabric", ["1", "0"])
def test_ascend_fabric_memory_mode_takes_unregistered_buffers(
        start_master: Any, monkeypatch: pytest.MonkeyPatch, fabric: str) -> None:
    # vllm-ascend on A3 with ASCEND_ENABLE_USE_FABRIC_MEM=1: setup without an engine and with
    # no local buffer, and no buffer is ever registered.
    monkeypatch.setenv("ASCEND_ENABLE_USE_FABRIC_MEM", fabric)
    master = start_master()
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 0, "ascend", "", master.address) == 0
    try:
        src = ctypes.create_string_buffer(b"fabric-kv" * 100, 900)
        dst = ctypes.create_string_buffer(900)
        put = s.batch_put_from_multi_buffers(["k"], [[ctypes.addressof(src)]], [[900]])
        got = s.batch_get_into_multi_buffers(["k"], [[ctypes.addressof(dst)]], [[900]])
        if fabric == "1":
            assert (put, got) == ([0], [900]) and dst.raw == src.raw
            # still checked: a pointer into nothing this process maps moves no byte
            assert s.batch_put_from_multi_buffers(["bad"], [[8]], [[900]]) == [-600]
        else:
            assert (put, got) == ([-600], [-600])  # unregistered memory is refused
        assert s.is_exist("bad") == 0
    finally:
        s.close()


def test_replica_descriptors_say_where_objects_lie(store: MooncakeDistributedStore) -> None:
    from kvpool_client.compat.store_types import ReplicaStatus

    assert store.put("a", b"x" * 1000) == 0 and store.put("b", b"y" * 10) == 0
    (replica,) = store.get_replica_desc("a")
    assert replica.status == ReplicaStatus.COMPLETE and replica.is_memory_replica()
    assert not replica.is_disk_replica() and not replica.is_local_disk_replica()
    buffer = replica.get_memory_descriptor().buffer_descriptor
    assert buffer.size == 1000 and buffer.transport_endpoint == store.get_hostname()
    with pytest.raises(RuntimeError, match="Expected DiskDescriptor"):
        replica.get_disk_descriptor()
    assert store.get_replica_desc("missing") == []
    found = store.batch_get_replica_desc(["a", "missing", "b"])
    assert sorted(found) == ["a", "b"]  # missing keys are left out, as Mooncake does
    assert found["b"][0].get_memory_descriptor().buffer_descriptor.size == 10
    a_at = found["a"][0].get_memory_descriptor().buffer_descriptor.buffer_address
    b_at = found["b"][0].get_memory_descriptor().buffer_descriptor.buffer_address
    assert a_at != b_at  # each its own extent of the segment
    assert store.get("a") == b"x" * 1000  # nothing was consumed by looking
