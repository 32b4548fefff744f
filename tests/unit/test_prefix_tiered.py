"""TieredPrefixCache against an in-memory pool: level-1 LRU, one pool query, load, save."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvpool_client.hashing import BlockHash, BlockHasher, HashNamespace
from kvpool_client.prefix import RegionBlockIO, TieredPrefixCache
from kvpool_wire.status import KVPoolError, Status

BLOCK_BYTES = 32


class InMemoryPool:
    """A dict standing in for the pool; records every call so tests can count them."""

    def __init__(self) -> None:
        self.key_to_bytes: dict[str, bytes] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail_get: set[str] = set()
        self.fail_put: set[str] = set()
        self.async_puts = 0
        self.flushes = 0

    def flush(self, timeout_s: float | None = None) -> None:
        self.flushes += 1

    def query_prefix(self, keys: Sequence[str]) -> int:
        self.calls.append(("query_prefix", len(keys)))
        n = 0
        while n < len(keys) and keys[n] in self.key_to_bytes:
            n += 1
        return n

    def batch_put_regions(self, keys: Sequence[str], regions: Sequence[Sequence[memoryview]],
                          options: Any = None, async_write: bool = False) -> list[Status]:
        self.calls.append(("put", len(keys)))
        self.async_puts += async_write
        out = []
        for key, parts in zip(keys, regions, strict=True):
            if key in self.fail_put:
                out.append(Status.TRANSFER_FAILED)
                continue
            self.key_to_bytes.setdefault(key, b"".join(bytes(p) for p in parts))
            out.append(Status.OK)
        return out

    def batch_get_regions(self, keys: Sequence[str],
                          regions: Sequence[Sequence[memoryview]]) -> list[int]:
        self.calls.append(("get", len(keys)))
        out = []
        for key, parts in zip(keys, regions, strict=True):
            data = self.key_to_bytes.get(key)
            if data is None or key in self.fail_get:
                out.append(int(Status.NOT_FOUND))
                continue
            offset = 0
            for part in parts:
                part[:] = data[offset:offset + part.nbytes]
                offset += part.nbytes
            out.append(offset)
        return out


class Worker:
    """A device of ``num_blocks`` blocks of bytes plus its prefix cache."""

    def __init__(self, num_blocks: int, pool: InMemoryPool | None) -> None:
        self.memory = bytearray(num_blocks * BLOCK_BYTES)
        view = memoryview(self.memory)
        hasher = BlockHasher(HashNamespace("m", "float16", "kv-split", 4))
        io = None if pool is None else RegionBlockIO(
            pool, lambda b: [view[b * BLOCK_BYTES:b * BLOCK_BYTES + 16],
                             view[b * BLOCK_BYTES + 16:(b + 1) * BLOCK_BYTES]])
        self.cache = TieredPrefixCache(num_blocks, key_fn=hasher.key, pool=pool, io=io,
                                       hasher=hasher)

    def block_bytes(self, block_id: int) -> bytes:
        return bytes(self.memory[block_id * BLOCK_BYTES:(block_id + 1) * BLOCK_BYTES])

    def serve(self, tokens: list[int]) -> tuple[int, int]:
        """Run one request: returns (device hits, loaded blocks); computed blocks get content."""
        m = self.cache.match(tokens)
        self.cache.load(m)
        new_ids = self.cache.allocate(m)
        for i, block_id in enumerate(new_ids):
            block = m.num_reused + i
            content = bytes(str(tokens[block * 4:(block + 1) * 4]), "ascii").ljust(BLOCK_BYTES)
            self.memory[block_id * BLOCK_BYTES:(block_id + 1) * BLOCK_BYTES] = content
        self.cache.save(m)
        self.cache.release(m)
        return m.num_device_hits, m.num_loaded


def test_whole_blocks_only_and_on_chip_reuse() -> None:
    w = Worker(8, None)
    assert w.serve([1, 2, 3]) == (0, 0)  # shorter than a block: nothing cached
    assert w.cache.hash_to_block_id == {}
    assert w.serve(list(range(10))) == (0, 0)  # 2 whole blocks
    assert w.serve(list(range(9)) + [77]) == (2, 0)
    assert w.serve([0, 1, 2, 3, 9, 9, 9, 9]) == (1, 0)


def test_pool_is_asked_once_and_only_after_on_chip_misses() -> None:
    pool = InMemoryPool()
    w = Worker(16, pool)
    tokens = list(range(16))  # 4 blocks
    w.serve(tokens)
    assert pool.calls == [("query_prefix", 4), ("put", 4)]
    pool.calls.clear()
    assert w.serve(tokens) == (4, 0)
    assert pool.calls == []  # level 1 covered everything: the pool is not asked
    assert w.serve(tokens + [5, 5, 5, 5]) == (4, 0)
    assert pool.calls == [("query_prefix", 1), ("put", 1)]


def test_a_lookup_the_pool_cannot_answer_pins_nothing() -> None:
    pool = InMemoryPool()
    w = Worker(4, pool)
    w.serve(list(range(8)))   # 2 blocks on chip
    free = w.cache.num_free_blocks

    def unreachable(keys: Sequence[str]) -> int:
        raise KVPoolError(Status.UNAVAILABLE, "master unreachable")

    pool.query_prefix = unreachable  # type: ignore[method-assign]
    for _ in range(3):
        with pytest.raises(KVPoolError):
            w.cache.match(list(range(16)))   # 2 on-chip hits, then the pool is asked
    assert w.cache.num_free_blocks == free


def test_fresh_worker_loads_the_shared_prefix_from_the_pool() -> None:
    pool = InMemoryPool()
    first, second = Worker(16, pool), Worker(16, pool)
    prompt = list(range(100, 116))  # 4 blocks
    first.serve(prompt)
    follow_up = prompt + [7, 7, 7, 7, 8, 8]  # one more whole block and a partial one
    pool.calls.clear()
    m = second.cache.match(follow_up)
    assert (m.num_device_hits, m.num_pool_hits) == (0, 4)
    assert pool.calls == [("query_prefix", 5)]
    assert second.cache.load(m) == 4
    for i in range(4):
        assert second.block_bytes(m.block_ids[i]) == first.block_bytes(
            first.cache.hash_to_block_id[m.block_hashes[i]])
    new_ids = second.cache.allocate(m)
    assert len(new_ids) == 1 and len(m.block_ids) == 5
    assert second.cache.save(m) == 1  # only the computed block is written
    assert pool.calls[-1] == ("put", 1)
    second.cache.release(m)
    assert second.serve(follow_up) == (5, 0)


def test_level1_lru_evicts_least_recent_and_tails_first() -> None:
    w = Worker(4, None)
    a = [1] * 4 + [2] * 4  # blocks A0 A1
    b = [3] * 4 + [4] * 4  # blocks B0 B1
    w.serve(a)
    w.serve(b)
    assert w.cache.num_free_blocks == 4
    # one new block evicts the least recently used: A's tail (released before A's head)
    w.serve([5] * 4)  # takes the block of A1 (A's tail was released first)
    assert w.serve(a) == (1, 0)  # A0 still there; recomputing A1 evicts B1 (B's tail)
    assert w.serve(b) == (1, 0)
    assert w.cache.stats.device_evictions == 3


def test_failed_load_truncates_the_prefix_and_gives_blocks_back() -> None:
    pool = InMemoryPool()
    Worker(16, pool).serve(list(range(16)))
    second = Worker(16, pool)
    m = second.cache.match(list(range(16)))
    assert m.num_pool_hits == 4
    pool.fail_get.add(m.keys[2])
    assert second.cache.load(m) == 2
    assert second.cache.stats.failed_loads == 2
    assert len(second.cache.allocate(m)) == 2
    second.cache.save(m)
    second.cache.release(m)
    assert second.cache.num_free_blocks == 16


def test_failed_save_keeps_block_on_device() -> None:
    pool = InMemoryPool()
    w = Worker(8, pool)
    keys = [w.cache.key_fn(h) for h in w.cache.hasher.hash_blocks(list(range(8)))]  # type: ignore[union-attr]
    pool.fail_put.add(keys[1])
    m = w.cache.match(list(range(8)))
    w.cache.allocate(m)
    assert w.cache.save(m) == 1
    assert w.cache.stats.failed_saves == 1
    w.cache.release(m)
    assert w.serve(list(range(8))) == (2, 0)


def test_allocate_without_room_changes_nothing() -> None:
    w = Worker(2, None)
    m = w.cache.match(list(range(12)))
    with pytest.raises(KVPoolError) as info:
        w.cache.allocate(m)
    assert info.value.status == Status.NO_SPACE
    assert m.block_ids == [] and w.cache.num_free_blocks == 2


def test_pinned_hits_survive_allocation_pressure() -> None:
    w = Worker(3, None)
    w.serve([1] * 4 + [2] * 4)
    m = w.cache.match([1] * 4 + [2] * 4 + [3] * 4)
    assert m.num_device_hits == 2
    assert w.cache.allocate(m) != m.block_ids[:2]
    w.cache.save(m)
    w.cache.release(m)
    assert w.serve([1] * 4 + [2] * 4 + [3] * 4) == (3, 0)


def test_misuse_is_refused() -> None:
    w = Worker(4, None)
    m = w.cache.match(list(range(4)))
    with pytest.raises(ValueError):
        w.cache.save(m)  # not allocated
    w.cache.allocate(m)
    w.cache.save(m)
    with pytest.raises(ValueError):
        w.cache.save(m)
    w.cache.release(m)
    with pytest.raises(ValueError):
        w.cache.release(m)
    with pytest.raises(ValueError):
        TieredPrefixCache(0, key_fn=str)
    with pytest.raises(ValueError):
        TieredPrefixCache(4, key_fn=str, pool=InMemoryPool())
    with pytest.raises(ValueError):
        TieredPrefixCache(4, key_fn=lambda h: h.hex()).match([1, 2, 3, 4])
    cache = TieredPrefixCache(4, key_fn=lambda h: h.hex())
    assert cache.match_hashes([BlockHash(b"x")]).num_device_hits == 0


def test_async_save_keeps_blocks_pinned_until_flush() -> None:
    pool = InMemoryPool()
    w = Worker(4, pool)
    m = w.cache.match(list(range(8)))
    w.cache.allocate(m)
    assert w.cache.save(m, async_write=True) == 2
    assert pool.async_puts == 1
    w.cache.release(m)
    # the async write still reads both blocks: they cannot be handed out
    assert w.cache.num_free_blocks == 2
    w.cache.flush()
    assert pool.flushes == 1 and w.cache.num_free_blocks == 4
    assert w.serve(list(range(8))) == (2, 0)  # still cached on the device
