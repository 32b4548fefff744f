"""Paged KV caches <-> pool objects: layouts, region order, zero-copy views, staging chunks.

The staged (device) path runs here on CPU tensors: the same chunking and double buffering,
with synchronous copies instead of a side stream. CUDA and NPU streams cannot exist on this
machine; nothing is mocked for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvpool_wire.status import Status

torch = pytest.importorskip("torch", reason="tensors tests need torch (pip install torch==2.13.0)")

from kvpool_client.staging import StagedBlockIO, make_block_io  # noqa: E402
from kvpool_client.tensors import PagedKVCache, device_module  # noqa: E402

GEOMETRY = {"num_layers": 3, "num_blocks": 8, "block_size": 4, "num_heads": 2, "head_dim": 8}


class DictPool:
    """Objects in a dict; ``registered`` collects buffer registrations."""

    def __init__(self) -> None:
        self.key_to_bytes: dict[str, bytes] = {}
        self.registered: list[memoryview] = []
        self.async_puts = 0
        self.flushes = 0

    def flush(self, timeout_s: float | None = None) -> None:
        self.flushes += 1

    def register_buffer(self, buf: Any) -> None:
        self.registered.append(buf)

    def query_prefix(self, keys: Sequence[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.key_to_bytes:
            n += 1
        return n

    def batch_put_regions(self, keys: Sequence[str], regions: Sequence[Sequence[memoryview]],
                          options: Any = None, async_write: bool = False) -> list[Status]:
        self.async_puts += async_write
        for key, parts in zip(keys, regions, strict=True):
            self.key_to_bytes.setdefault(key, b"".join(bytes(p) for p in parts))
        return [Status.OK] * len(keys)

    def batch_get_regions(self, keys: Sequence[str],
                          regions: Sequence[Sequence[memoryview]]) -> list[int]:
        out = []
        for key, parts in zip(keys, regions, strict=True):
            data = self.key_to_bytes.get(key)
            if data is None:
                out.append(int(Status.NOT_FOUND))
                continue
            offset = 0
            for part in parts:
                part[:] = data[offset:offset + part.nbytes]
                offset += part.nbytes
            out.append(offset)
        return out


def _filled(layout: str, dtype: Any = torch.float32, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache.allocate(**GEOMETRY, dtype=dtype, layout=layout)
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.k_caches, *cache.v_caches):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return cache


@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_regions_are_views_onto_the_tensors_in_mindie_order(layout: str) -> None:
    cache = _filled(layout)
    assert cache.object_bytes == 2 * 3 * 4 * 2 * 8 * 4
    regions = cache.block_regions(5)
    assert len(regions) == 6
    expected = []
    for layer in range(3):
        expected += [cache.k_caches[layer][5], cache.v_caches[layer][5]]
    for region, tensor in zip(regions, expected, strict=True):
        assert region.nbytes == cache.region_bytes
        assert bytes(region) == tensor.numpy().tobytes()
        # zero copy: writing through the view changes the cache itself
        region[:4] = b"\x00\x00\x80\x3f"  # float32 1.0
        assert tensor.reshape(-1)[0].item() == 1.0


def test_fused_halves_are_the_k_and_v_caches() -> None:
    kv = [torch.randn(2, 8, 4, 2, 8) for _ in range(2)]
    cache = PagedKVCache.from_fused(kv)
    assert cache.k_caches[1].data_ptr() == kv[1][0].data_ptr()
    assert cache.v_caches[1].data_ptr() == kv[1][1].data_ptr()
    assert cache.layout == "fused"


@pytest.mark.parametrize("layout", ["separate", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_round_trip_through_the_pool(layout: str, dtype: Any) -> None:
    pool = DictPool()
    src, dst = _filled(layout, dtype, 1), _filled(layout, dtype, 2)
    src_io = make_block_io(src, pool)
    assert len(pool.registered) == 6  # every K and V tensor registered once
    keys = [f"k{i}" for i in range(3)]
    assert src_io.put_blocks(keys, [1, 4, 6]) == [True] * 3
    dst_io = make_block_io(dst, pool)
    assert dst_io.get_blocks(keys + ["missing"], [0, 2, 7, 3]) == [True, True, True, False]
    for layer in range(3):
        for mine, theirs in ((dst.k_caches, src.k_caches), (dst.v_caches, src.v_caches)):
            assert torch.equal(mine[layer][0], theirs[layer][1])
            assert torch.equal(mine[layer][2], theirs[layer][4])
            assert torch.equal(mine[layer][7], theirs[layer][6])
    assert not torch.equal(dst.k_caches[0][3], src.k_caches[0][3])  # untouched


@pytest.mark.parametrize("chunk_blocks", [1, 3, 16])
def test_staged_path_round_trip_in_chunks(chunk_blocks: int) -> None:
    pool = DictPool()
    src, dst = _filled("separate", seed=3), _filled("fused", seed=4)
    put_io = StagedBlockIO(src, pool, chunk_blocks=chunk_blocks)
    keys = [f"s{i}" for i in range(7)]
    assert put_io.put_blocks(keys, [7, 6, 5, 4, 3, 2, 1]) == [True] * 7
    # the staged bytes are the same objects the in-place path writes
    assert pool.key_to_bytes["s0"] == b"".join(bytes(r) for r in src.block_regions(7))
    get_io = StagedBlockIO(dst, pool, chunk_blocks=chunk_blocks)
    order = [0, 1, 2, 3, 4, 5, 6]
    wanted = keys[:3] + ["nope"] + keys[4:]
    assert get_io.get_blocks(wanted, order) == [True, True, True, False, True, True, True]
    for i, src_block in enumerate([7, 6, 5, 4, 3, 2, 1]):
        if i == 3:
            continue
        for layer in range(3):
            assert torch.equal(dst.k_caches[layer][i], src.k_caches[layer][src_block])
            assert torch.equal(dst.v_caches[layer][i], src.v_caches[layer][src_block])


def test_staged_async_write_keeps_its_staging_until_flush() -> None:
    pool = DictPool()
    src = _filled("separate", seed=5)
    io = StagedBlockIO(src, pool, chunk_blocks=2)
    assert io.put_blocks(["a", "b", "c"], [0, 1, 2], async_write=True) == [True] * 3
    assert pool.async_puts == 1 and len(io._async_buffers) == 1
    io.flush()
    assert pool.flushes == 1 and io._async_buffers == []


def test_sequence_helpers_round_trip_transformers_layout() -> None:
    cache = PagedKVCache.allocate(**GEOMETRY)
    seq = 10  # two whole blocks and two tokens
    layer_kv = [(torch.randn(1, 2, seq, 8), torch.randn(1, 2, seq, 8)) for _ in range(3)]
    cache.write_sequence([5, 2], layer_kv)
    back = cache.read_sequence([5, 2])
    for (k, v), (k2, v2) in zip(layer_kv, back, strict=True):
        assert torch.equal(k[:, :, :8], k2) and torch.equal(v[:, :, :8], v2)
    assert torch.equal(cache.k_caches[0][2][1], layer_kv[0][0][0, :, 5])
    with pytest.raises(ValueError):
        cache.write_sequence([0, 1, 3], layer_kv)  # 12 tokens wanted, 10 given
    with pytest.raises(ValueError):
        cache.read_sequence([8])


def test_bad_caches_are_refused() -> None:
    with pytest.raises(ValueError):
        PagedKVCache([torch.zeros(2, 4, 2)], [torch.zeros(2, 4, 2)])
    with pytest.raises(ValueError):
        PagedKVCache([torch.zeros(2, 4, 2, 8)], [torch.zeros(3, 4, 2, 8)])
    with pytest.raises(ValueError):
        PagedKVCache([torch.zeros(2, 4, 2, 8)], [])
    with pytest.raises(ValueError):
        PagedKVCache([torch.zeros(2, 4, 2, 8).transpose(1, 2)], [torch.zeros(2, 2, 4, 8)])
    with pytest.raises(ValueError):
        PagedKVCache.from_fused([torch.zeros(3, 2, 4, 2, 8)])
    with pytest.raises(ValueError):
        PagedKVCache([torch.zeros(2, 4, 2, 8)], [torch.zeros(2, 4, 2, 8)], layout="nz")
    with pytest.raises(ValueError):
        StagedBlockIO(_filled("separate"), DictPool(), chunk_blocks=0)


def test_device_modules() -> None:
    assert device_module(torch.device("cpu")) is None
    with pytest.raises(ValueError):
        device_module(torch.device("meta"))
    meta = PagedKVCache([torch.zeros(2, 4, 2, 8, device="meta")],
                        [torch.zeros(2, 4, 2, 8, device="meta")])
    with pytest.raises(ValueError):
        meta.block_regions(0)
