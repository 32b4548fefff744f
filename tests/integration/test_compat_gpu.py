"""CUDA device memory behind Mooncake pointers and MindIE tensors (marker ``gpu``).

Registered CUDA regions are found through libcudart and staged through host memory around
every transfer; puts may come from a thread other than the one that registered. Skipped where
torch has no CUDA device.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import drop_in_store

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_regions_round_trip_through_the_pool(master: Any) -> None:
    from kvpool_client.compat.memory import RegionRegistry
    from kvpool_client.compat.mooncake import MooncakeDistributedStore

    k = torch.randn(8, 16, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(8, 16, 2, 64, device="cuda", dtype=torch.float16)
    out_k, out_v = torch.zeros_like(k), torch.zeros_like(v)
    assert RegionRegistry().register(k.data_ptr(), k.numel() * 2).kind == "cuda"
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 << 20, 0, "tcp", "", master.address) == 0
    try:
        for t in (k, v, out_k, out_v):
            assert store.register_buffer(t.data_ptr(), t.numel() * t.element_size()) == 0
        block = k[0].numel() * 2
        keys = [f"b{b}" for b in range(8)]
        results: list[list[int]] = []
        writer = threading.Thread(target=lambda: results.append(
            store.batch_put_from_multi_buffers(
                keys, [[k[b].data_ptr(), v[b].data_ptr()] for b in range(8)],
                [[block, block]] * 8)))
        writer.start()
        writer.join(120)
        assert results == [[0] * 8]
        got = store.batch_get_into_multi_buffers(
            keys, [[out_k[b].data_ptr(), out_v[b].data_ptr()] for b in range(8)],
            [[block, block]] * 8, True)
        assert got == [2 * block] * 8
        torch.cuda.synchronize()
        assert torch.equal(out_k, k) and torch.equal(out_v, v)
        assert store.get("b3") == k[3].cpu().numpy().tobytes() + v[3].cpu().numpy().tobytes()
    finally:
        store.remove_all(True)
        store.close()


def test_mindie_connector_with_cuda_kv_caches(master: Any, tmp_path: Path) -> None:
    from kvpool_client.connectors.mindie import KVPoolMempool

    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"local_hostname": "127.0.0.1", "protocol": "ascend",
                                  "metadata_server": "P2PHANDSHAKE",
                                  "global_segment_size": 32 << 20,
                                  "master_server_address": master.address}))
    caches = [(torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16),
               torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16))
              for _ in range(2)]
    pool = KVPoolMempool(str(config), "worker", device_id=0, kv_caches=caches)
    try:
        keys = [f"h{b}_0_1_m" for b in range(4)]
        assert pool.put(keys, [[[k[b], v[b]] for k, v in caches] for b in range(4)]) == [True] * 4
        expected = [(k.clone(), v.clone()) for k, v in caches]
        for k, v in caches:
            k.zero_()
            v.zero_()
        assert pool.get(keys[1:], [[[k[b], v[b]] for k, v in caches] for b in range(1, 4)]) == \
            [True] * 3
        torch.cuda.synchronize()
        for (k, v), (ek, ev) in zip(caches, expected, strict=True):
            assert torch.equal(k[1:], ek[1:]) and torch.equal(v[1:], ev[1:])
            assert not k[0].any() and not v[0].any()
    finally:
        pool.close()


def test_cuda_runtime_moves_many_ranges_through_scratch_and_directly() -> None:
    """Small ranges go through the device scratch (over its 16 MiB, in several batches),
    large ones on their own, all landing back to back in one host buffer and back."""
    from kvpool_client.compat.devices import CUDA_SCRATCH_MAX_BYTES, CudaRuntime

    runtime = CudaRuntime.load()
    assert runtime is not None
    gen = torch.Generator(device="cuda").manual_seed(5)
    sizes = [512 << 10] * 20 + [3 << 20] + [512 << 10] * 20 + [7] + [2 << 20]
    assert sum(s for s in sizes if s < 1 << 20) > CUDA_SCRATCH_MAX_BYTES
    tensors = [torch.randint(0, 256, (s,), dtype=torch.uint8, device="cuda", generator=gen)
               for s in sizes]
    torch.cuda.synchronize()
    host = memoryview(bytearray(sum(sizes)))
    runtime.to_host(0, host, [(t.data_ptr(), t.numel()) for t in tensors])
    assert bytes(host) == b"".join(t.cpu().numpy().tobytes() for t in tensors)

    targets = [torch.zeros_like(t) for t in tensors]
    flipped = (255 - torch.frombuffer(host, dtype=torch.uint8)).numpy().tobytes()
    runtime.from_host(0, memoryview(bytearray(flipped)),
                      [(t.data_ptr(), t.numel()) for t in targets])
    assert b"".join(t.cpu().numpy().tobytes() for t in targets) == flipped


def test_a_threads_cuda_scratch_is_given_back_when_the_thread_ends() -> None:
    """A thread that staged small device ranges holds its scratch while it lives; once it has
    ended, the device memory is free again (measured with cudaMemGetInfo)."""
    import gc

    from kvpool_client.compat.devices import CudaRuntime

    runtime = CudaRuntime.load()
    assert runtime is not None
    sizes = [256 << 10] * 48  # 12 MiB of small ranges: gathered through a 12 MiB scratch
    tensors = [torch.full((s,), i, dtype=torch.uint8, device="cuda") for i, s in enumerate(sizes)]
    torch.cuda.synchronize()
    host = memoryview(bytearray(sum(sizes)))
    free_bytes: list[int] = []

    def work() -> None:
        runtime.to_host(0, host, [(t.data_ptr(), t.numel()) for t in tensors])
        free_bytes.append(torch.cuda.mem_get_info()[0])

    gc.collect()
    before_bytes = torch.cuda.mem_get_info()[0]
    worker = threading.Thread(target=work)
    worker.start()
    worker.join(60)
    gc.collect()
    after_bytes = torch.cuda.mem_get_info()[0]
    print(f"device free: {before_bytes >> 20} MiB before, {free_bytes[0] >> 20} MiB while the "
          f"thread held its scratch, {after_bytes >> 20} MiB after it ended")
    assert bytes(host) == b"".join(bytes([i]) * s for i, s in enumerate(sizes))
    assert before_bytes - free_bytes[0] >= 12 << 20
    assert after_bytes >= before_bytes - (2 << 20)  # back, to the allocation granularity


def test_a_pinned_host_kv_pool_from_the_allocator_moves_device_blocks(master: Any) -> None:
    """SGLang HiCache's host pool on the mooncake backend: memory from
    ``MooncakeHostMemAllocator``, page-locked with ``cudaHostRegister``, filled from device
    blocks by async copies, put and got by pointer, and copied back to the device byte-exact."""
    import ctypes

    from kvpool_client.compat import store_surface as mooncake_store

    pages, page_elems = 8, 64 * 1024  # 8 pages of 128 KiB of bf16
    size = 2 * pages * page_elems * 2
    allocator = mooncake_store.MooncakeHostMemAllocator()
    ptr = allocator.alloc(size)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(ptr, size, 0)) == 0
    host = torch.frombuffer((ctypes.c_byte * size).from_address(ptr), dtype=torch.uint8,
                            count=size).view(torch.bfloat16).view(2, pages, page_elems)
    device = torch.randn(pages, page_elems, device="cuda", dtype=torch.bfloat16)
    try:
        with drop_in_store(master.address, 32 << 20, 0, remove_all=True) as store:
            assert host.is_pinned()
            host[0].copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            assert store.register_buffer(ptr, size) == 0
            page_bytes = page_elems * 2
            keys = [f"hicache-{p}" for p in range(pages)]
            assert store.batch_put_from(keys, [host[0, p].data_ptr() for p in range(pages)],
                                        [page_bytes] * pages) == [0] * pages
            assert store.batch_get_into(keys, [host[1, p].data_ptr() for p in range(pages)],
                                        [page_bytes] * pages) == [page_bytes] * pages
            back = torch.empty_like(device)
            back.copy_(host[1], non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, device)
            assert store.unregister_buffer(ptr) == 0
    finally:
        del host
        assert int(cudart.cudaHostUnregister(ptr)) == 0
        assert allocator.free(ptr) == 0
