"""Mooncake's host memory (``BufferPool``, ``MooncakeHostMemAllocator``) and tensor codec on
kvpool's ``mooncake.store``, against a real master: leases of registered memory that the
store's pointer calls take, with Mooncake's limits and errors; a host KV pool allocated and
registered the way SGLang HiCache does it; tensor payloads in the very layout the store's
tensor objects have."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import drop_in_store

from kvpool_client.compat import store_surface as mooncake_store
from kvpool_client.compat.mooncake import MooncakeDistributedStore

MiB = 1 << 20


@pytest.fixture
def store(start_master: Any) -> Iterator[MooncakeDistributedStore]:
    with drop_in_store(start_master().address, 64 * MiB, 16 * MiB) as s:
        yield s


def test_a_lease_is_registered_memory_the_pointer_calls_take(
        store: MooncakeDistributedStore) -> None:
    pool = mooncake_store.BufferPool(store, max_regions=2)
    assert pool.max_bytes == 32 * MiB  # twice the local buffer
    payload = bytes(range(256)) * 64
    with pool.acquire(len(payload)) as lease, pool.acquire(len(payload)) as into:
        assert lease.size == len(payload) and lease.ptr % (8 * MiB) == 0
        view = lease.buffer
        view[:] = payload
        del view
        assert store.put_from("leased", lease.ptr, len(payload)) == 0
        assert store.get_into("leased", into.ptr, len(payload)) == len(payload)
        assert ctypes.string_at(into.ptr, len(payload)) == payload
        released_ptr, into_ptr = lease.ptr, into.ptr
    with pytest.raises(RuntimeError, match="buffer lease is closed"):
        _ = lease.ptr
    with pool.acquire(0, block=False) as empty:   # takes a byte of the pool, views none
        assert empty.size == 0 and len(empty.buffer) == 0
    # a released lease's memory stays registered for the next lease of a like size ...
    with pool.acquire(len(payload) - 100) as again:
        assert again.ptr in (released_ptr, into_ptr)
    assert mooncake_store.RegisteredBufferPool is mooncake_store.BufferPool
    pool.close()
    # ... until the pool closes: then it is neither registered nor mapped, and refused
    assert store.put_from("after-close", released_ptr, len(payload)) == -600
    assert store.is_exist("after-close") == 0


def test_the_pool_waits_refuses_and_times_out_as_mooncake(
        store: MooncakeDistributedStore) -> None:
    pool = mooncake_store.BufferPool(store, max_bytes=32 * MiB, max_regions=1,
                                     alignment=4096)
    held = pool.acquire(MiB)
    with pytest.raises(RuntimeError, match="buffer pool is exhausted"):
        pool.acquire(MiB, block=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out waiting for buffer"):
        pool.acquire(MiB, timeout=0.2)
    assert time.monotonic() - started >= 0.2
    with pytest.raises(RuntimeError, match="exceeds pool capacity"):
        pool.acquire(33 * MiB)
    with pytest.raises(RuntimeError, match="timeout must be non-negative"):
        pool.acquire(MiB, timeout=-1)
    with pytest.raises(TypeError):
        pool.acquire(-1)

    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(MiB, timeout=10)))
    waiter.start()
    time.sleep(0.1)
    assert not got  # still waiting for the held lease
    held.release()
    waiter.join(timeout=10)
    assert len(got) == 1 and got[0].size == MiB
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    dropped = got.pop()
    del dropped  # a lease dropped without release gives its share back
    gc.collect()
    pool.acquire(MiB, block=False).release()
    pool.close()
    with pytest.raises(RuntimeError, match="buffer pool is closed"):
        pool.acquire(MiB)


def test_a_lease_with_a_live_view_is_not_released(store: MooncakeDistributedStore) -> None:
    pool = mooncake_store.BufferPool(store)
    lease = pool.acquire(4096)
    view = lease.buffer
    with pytest.raises(RuntimeError, match="exported views exist"):
        lease.release()
    view[:5] = b"still"   # the bytes are still mapped, and still registered
    assert store.put_from("viewed", lease.ptr, 5) == 0
    assert store.get("viewed") == b"still"
    del view
    lease.release()
    lease.release()  # idempotent
    pool.close()


def test_a_pool_reuses_released_memory_but_never_memory_a_view_still_sees(
        store: MooncakeDistributedStore) -> None:
    pool = mooncake_store.BufferPool(store, max_bytes=32 * MiB)
    first = pool.acquire(MiB)
    ptr = first.ptr
    first.release()
    second = pool.acquire(MiB)
    assert second.ptr == ptr          # the same registered mapping, leased again
    view = second.buffer
    view[:4] = b"kept"
    del second                        # dropped while its view is alive
    gc.collect()
    third = pool.acquire(MiB)
    third_ptr = third.ptr
    assert third_ptr != ptr and bytes(view[:4]) == b"kept"
    third.release()
    del view
    # a pool at capacity frees idle memory for a lease of another size
    big = pool.acquire(32 * MiB, block=False)
    assert big.size == 32 * MiB
    assert store.put_from("idle-freed", third_ptr, 16) == -600   # unregistered, unmapped
    big.release()
    pool.close()


def test_a_pool_needs_a_set_up_store_with_a_local_buffer(start_master: Any) -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        mooncake_store.BufferPool(MooncakeDistributedStore())
    master = start_master()
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 0, "tcp", "", master.address) == 0
    try:
        with pytest.raises(RuntimeError, match="local buffer"):
            mooncake_store.BufferPool(s)
    finally:
        s.close()


def test_bad_pool_arguments_are_refused(store: MooncakeDistributedStore) -> None:
    with pytest.raises(RuntimeError, match="power of two"):
        mooncake_store.BufferPool(store, alignment=3)
    with pytest.raises(RuntimeError, match="must be positive"):
        mooncake_store.BufferPool(store, min_size_class=0)


def test_the_tensor_codec_speaks_the_store_tensor_layout(
        store: MooncakeDistributedStore) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)[:, 1:3]  # not contiguous
    metadata, data_ptr, nbytes, owner = mooncake_store._serialize_tensor(tensor)
    assert len(metadata) == mooncake_store._tensor_metadata_size() == 304
    assert nbytes == tensor.numel() * 4 and owner.is_contiguous()
    payload = metadata + ctypes.string_at(data_ptr, nbytes)
    # the same bytes as the object put_tensor stores
    assert store.put_tensor("as-object", tensor) == 0
    assert store.get("as-object") == payload
    back = mooncake_store._deserialize_tensor(payload)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    assert torch.equal(mooncake_store._deserialize_tensor(store.get("as-object")), tensor)
    for bad in (b"", payload[:-1], b"\0" * len(payload)):
        with pytest.raises(ValueError, match="invalid serialized Mooncake tensor"):
            mooncake_store._deserialize_tensor(bad)
    negated = torch._neg_view(torch.tensor([2.0, 4.0]))   # bytes not negated yet (lazily)
    header, address, length, kept = mooncake_store._serialize_tensor(negated)   # (kept alive)
    assert negated.is_neg() and mooncake_store._deserialize_tensor(
        header + ctypes.string_at(address, length)).tolist() == [-2.0, -4.0]
    del kept
    assert store.put_tensor("negated", negated) == 0
    assert store.get_tensor("negated").tolist() == [-2.0, -4.0]
    with pytest.raises(ValueError):
        mooncake_store._serialize_tensor([1, 2, 3])
    with pytest.raises(ValueError):
        mooncake_store._serialize_tensor(torch.zeros(2, dtype=torch.complex64))


def test_a_host_kv_pool_from_the_allocator_serves_zero_copy_calls(
        store: MooncakeDistributedStore) -> None:
    torch = pytest.importorskip("torch")
    allocator = mooncake_store.MooncakeHostMemAllocator()
    size = 4 * MiB
    ptr = allocator.alloc(size)
    # as SGLang's MooncakeHostTensorAllocator wraps it, then registers the pool with the store
    pool = torch.frombuffer((ctypes.c_byte * size).from_address(ptr), dtype=torch.uint8,
                            count=size).view(torch.bfloat16)
    pool[: 1 << 20] = torch.arange(1 << 20, dtype=torch.float32).to(torch.bfloat16)
    assert store.register_buffer(ptr, size) == 0
    page = 64 * 1024
    keys = [f"page-{i}" for i in range(4)]
    assert store.batch_put_from(keys, [ptr + i * page for i in range(4)], [page] * 4) == [0] * 4
    expected = ctypes.string_at(ptr, 4 * page)
    ctypes.memset(ptr, 0, 4 * page)
    assert store.batch_get_into(keys, [ptr + i * page for i in range(4)],
                                [page] * 4) == [page] * 4
    assert ctypes.string_at(ptr, 4 * page) == expected
    assert store.unregister_buffer(ptr) == 0
    del pool
    assert mooncake_store.MooncakeHostMemAllocator().free(ptr) == 0  # any allocator frees it
    assert allocator.free(ptr) == -1  # freed already
    with pytest.raises(RuntimeError, match="map shared memory"):
        allocator.alloc(0)


def test_the_c_allocator_addresses_allocate_memory_the_store_takes(
        store: MooncakeDistributedStore) -> None:
    # as LMCache's Mooncake allocators call them: through ctypes function pointers
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(
        mooncake_store.get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(mooncake_store.get_free_func_addr())
    size = MiB
    ptr = alloc(size)
    assert ptr and ptr % 4096 == 0
    try:
        ctypes.memmove(ptr, b"c-allocated" * 100, 1100)
        assert store.register_buffer(ptr, size) == 0
        assert store.put_from("c-alloc", ptr, 1100) == 0
        ctypes.memset(ptr, 0, 1100)
        assert store.get_into("c-alloc", ptr, 1100) == 1100
        assert ctypes.string_at(ptr, 1100) == b"c-allocated" * 100
        assert store.unregister_buffer(ptr) == 0
    finally:
        free(ptr)
