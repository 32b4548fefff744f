"""CUDA paged KV caches through a real master and real clients (marker ``gpu``).

``StagedBlockIO`` both ways: direct (device <-> the segment's own page-locked memory by DMA,
or a host buffer over forced TCP) and through pinned host staging buffers, on a side stream.
Checks byte-exactness, ordering against work still queued on the caller's stream (both
directions), a missing block left untouched, the fused layout and async writes. Skipped
where torch has no CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from kvpool_client.client import KVPoolClient  # noqa: E402
from kvpool_client.config import ClientConfig  # noqa: E402
from kvpool_client.staging import StagedBlockIO  # noqa: E402
from kvpool_client.tensors import PagedKVCache  # noqa: E402

# 4 layers x K/V x 16 tokens x 8 heads x 128 dims x bf16: 32 KiB regions, 256 KiB objects
GEOMETRY = {"num_layers": 4, "num_blocks": 40, "block_size": 16, "num_heads": 8,
            "head_dim": 128, "dtype": torch.bfloat16, "device": "cuda"}


@pytest.fixture
def clients(master: Any, request: pytest.FixtureRequest) -> Iterator[tuple[KVPoolClient, ...]]:
    transport = getattr(request, "param", "auto")
    made = [KVPoolClient(ClientConfig.from_dict({
        "master_server_address": master.address, "local_hostname": "127.0.0.1",
        "global_segment_size": 64 << 20, "transport": transport})) for _ in range(2)]
    try:
        yield tuple(made)
    finally:
        for c in made:
            c.close()


def _fill_late(cache: PagedKVCache, seed: int) -> None:
    """Queue the cache's contents behind ~50 ms of spinning on the current stream; no wait."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    torch.cuda._sleep(100_000_000)  # GPU clock cycles
    for t in (*cache.k_caches, *cache.v_caches):
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype))


def _block_bytes(cache: PagedKVCache, block_id: int) -> bytes:
    return b"".join(r.cpu().numpy().tobytes() for r in cache.block_tensors(block_id))


@pytest.mark.parametrize("clients", ["auto", "tcp"], indirect=True)
@pytest.mark.parametrize(("chunk_blocks", "direct"), [(1, None), (8, None), (8, False)])
def test_device_blocks_round_trip_in_order_with_the_callers_stream(
        clients: tuple[KVPoolClient, KVPoolClient], chunk_blocks: int,
        direct: bool | None) -> None:
    writer, reader = clients
    src = PagedKVCache.allocate(**GEOMETRY)
    put_io = StagedBlockIO(src, writer, chunk_blocks=chunk_blocks, direct=direct)
    assert put_io.direct is (direct is None)
    _fill_late(src, seed=1)
    src_ids = list(range(3, 40, 2))[:17]  # 17 blocks: the last chunk is partial
    keys = [f"blk{i}" for i in src_ids]
    assert put_io.put_blocks(keys, src_ids) == [True] * 17
    # the pool holds what the queued fill wrote, not the zeros it replaced
    for key, block_id in zip(keys, src_ids, strict=True):
        assert reader.get(key) == _block_bytes(src, block_id)

    dst = PagedKVCache.allocate(**GEOMETRY)
    get_io = StagedBlockIO(dst, reader, chunk_blocks=chunk_blocks, direct=direct)
    dst_ids = list(range(20))
    wanted = keys[:5] + ["absent"] + keys[6:] + ["absent2", "absent3", "absent4"]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the caller works on its own stream
        got = get_io.get_blocks(wanted, dst_ids)
        # first use on the caller's stream, with no synchronize in between
        checksums = [float(dst.k_caches[0][b].float().sum()) for b in dst_ids]
    expected_ok = [True] * 5 + [False] + [True] * 11 + [False] * 3
    assert got == expected_ok
    for i, (key, block_id) in enumerate(zip(wanted, dst_ids, strict=True)):
        if not expected_ok[i]:
            assert not any(r.any() for r in dst.block_tensors(block_id)), key
            continue
        src_block = int(key.removeprefix("blk"))
        assert checksums[i] == float(src.k_caches[0][src_block].float().sum())
        for layer in range(GEOMETRY["num_layers"]):
            assert torch.equal(dst.k_caches[layer][block_id], src.k_caches[layer][src_block])
            assert torch.equal(dst.v_caches[layer][block_id], src.v_caches[layer][src_block])


def test_fused_cache_and_async_writes(clients: tuple[KVPoolClient, KVPoolClient]) -> None:
    writer, reader = clients
    src = PagedKVCache.allocate(**GEOMETRY, layout="fused")
    io = StagedBlockIO(src, writer, chunk_blocks=4)
    _fill_late(src, seed=2)
    keys = [f"fused{b}" for b in range(10)]
    assert io.put_blocks(keys, list(range(10)), async_write=True) == [True] * 10
    src.k_caches[0].zero_()  # the async write's staging already holds the bytes
    io.flush()
    assert io._async_buffers == []
    assert reader.query_prefix(keys) == 10
    dst = PagedKVCache.allocate(**GEOMETRY)
    assert StagedBlockIO(dst, reader).get_blocks(keys, list(range(10, 20))) == [True] * 10
    for b in range(10):
        assert torch.equal(dst.v_caches[3][10 + b], src.v_caches[3][b])
        assert dst.k_caches[0][10 + b].any()  # the bytes from before the zeroing
