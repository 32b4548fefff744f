"""Allocator: no overlap ever, frees coalesce, best fit, against a simple model."""

from __future__ import annotations

import random
from array import array
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_master.core import allocator as allocator_module
from kvpool_master.core.allocator import ALIGN_BYTES, Allocator, aligned

SEGMENT = 64 * ALIGN_BYTES * 16


def check_invariants(allocator: Allocator, live: dict[int, int]) -> None:
    """Free extents and live extents tile the segment exactly; free ones never touch."""
    free = allocator.free_extents()
    tiles = sorted([(o, aligned(s)) for o, s in live.items()] + free)
    cursor = 0
    for offset, size in tiles:
        assert offset == cursor, f"gap or overlap at {offset} (expected {cursor})"
        assert offset % ALIGN_BYTES == 0 and size > 0
        cursor = offset + size
    assert cursor == allocator.size_bytes
    for (o1, s1), (o2, _) in zip(free, free[1:], strict=False):
        assert o1 + s1 < o2, "two free extents touch: a free did not coalesce"
    assert allocator.used_bytes == sum(aligned(s) for s in live.values())
    assert allocator.largest_free_bytes == max((s for _, s in free), default=0)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "run", "free", "free_many",
                                          "rebuild"]),
                         st.integers(1, SEGMENT // 4), st.integers(0, 2**32)),
               max_size=200)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_allocator_matches_a_model(operations: list[tuple[str, int, int]]) -> None:
    _run_model(operations)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_allocator_with_its_edge_maps_split_matches_the_model(
        operations: list[tuple[str, int, int]]) -> None:
    # The edge maps of a large segment are split by position (one dict per 64 MiB): here 13
    # dicts over this small segment, so free extents start, end and merge across them.
    with mock.patch.object(allocator_module, "_EDGE_SHARD_BYTES", SEGMENT // 13):
        _run_model(operations, shards=13)


def _run_model(operations: list[tuple[str, int, int]], shards: int = 1) -> None:
    allocator = Allocator(SEGMENT)
    assert len(allocator._start_to_size) == shards
    live: dict[int, int] = {}
    for op, size, pick in operations:
        if op == "alloc":
            free_before = dict(allocator.free_extents())
            best = min((s for s in free_before.values() if s >= aligned(size)), default=None)
            offset = allocator.allocate(size)
            if best is None:
                assert offset == -1
            else:
                # Best fit: carved from the start of a smallest extent that fits.
                assert free_before.get(offset) == best
                live[offset] = size
        elif op == "run":
            count = 1 + pick % 9
            size = max(1, size // 8)
            step = aligned(size)
            free_before = dict(allocator.free_extents())
            holding = [s for s in free_before.values() if s >= step * count]
            offsets = allocator.allocate_run(size, count)
            if holding:   # back to back from the smallest extent that holds all of them
                assert offsets == [offsets[0] + k * step for k in range(count)]
                assert free_before.get(offsets[0]) == min(holding)
            else:   # else from the smallest extents that hold one or more, in turn
                fitting = sorted((s, o) for o, s in free_before.items() if s >= step)
                expected: list[int] = []
                for extent_size, start in fitting:
                    got = min(count - len(expected), extent_size // step)
                    expected += [start + k * step for k in range(got)]
                    if len(expected) == count:
                        break
                assert offsets == expected
            for offset in offsets:   # each an extent of its own
                live[offset] = size
        elif op == "free" and live:
            offset = sorted(live)[pick % len(live)]
            allocator.free(offset, live.pop(offset))
        elif op == "free_many" and live:
            chosen = [o for i, o in enumerate(sorted(live)) if (pick >> (i % 32)) & 1]
            allocator.free_many([(o, live.pop(o)) for o in chosen])
        elif op == "rebuild":   # as a restore does: from the live extents, in any order
            order = sorted(live, key=lambda o: (o * (pick | 1)) % 1_000_003)
            rebuilt = Allocator.from_columns(SEGMENT, np.array(order, np.uint64),
                                             np.array([aligned(live[o]) for o in order],
                                                      np.uint64))
            assert rebuilt.free_extents() == allocator.free_extents()
            assert rebuilt.num_extents == allocator.num_extents
            allocator = rebuilt   # and go on with it: its edge maps must be whole
        check_invariants(allocator, live)


def test_best_fit_takes_the_smallest_hole() -> None:
    allocator = Allocator(100 * ALIGN_BYTES)
    a = allocator.allocate(10 * ALIGN_BYTES)
    b = allocator.allocate(ALIGN_BYTES)
    c = allocator.allocate(3 * ALIGN_BYTES)
    allocator.allocate(ALIGN_BYTES)
    allocator.free(a, 10 * ALIGN_BYTES)
    allocator.free(c, 3 * ALIGN_BYTES)
    # Holes: 10 blocks at 0, 3 blocks at 11*64, and the tail. A 3-block request fits the
    # 3-block hole exactly and leaves the big hole whole.
    assert allocator.allocate(2 * ALIGN_BYTES + 1) == c
    assert b == 10 * ALIGN_BYTES
    assert allocator.allocate(ALIGN_BYTES) == 0


def test_frees_coalesce_into_one_extent() -> None:
    allocator = Allocator(SEGMENT)
    offsets = [allocator.allocate(1000) for _ in range(10)]
    for offset in offsets[::2] + offsets[1::2]:
        allocator.free(offset, 1000)
    assert allocator.free_extents() == [(0, SEGMENT)]
    assert allocator.used_bytes == 0 and allocator.fragmentation() == 0.0


def test_double_free_and_out_of_range_raise_and_change_nothing() -> None:
    allocator = Allocator(SEGMENT)
    offset = allocator.allocate(100)
    allocator.free(offset, 100)
    snapshot = allocator.free_extents()
    with pytest.raises(ValueError):
        allocator.free(offset, 100)
    with pytest.raises(ValueError):
        allocator.free(SEGMENT, 64)
    with pytest.raises(ValueError):
        allocator.free(-64, 64)
    with pytest.raises(ValueError):
        allocator.free(1, 64)
    x = allocator.allocate(64)
    y = allocator.allocate(64)
    with pytest.raises(ValueError):
        allocator.free_many([(x, 64), (x, 64), (y, 64)])
    assert allocator.used_bytes == 128
    allocator.free_many([(y, 64), (x, 64)])
    assert allocator.free_extents() == snapshot


def test_sizes_are_rounded_to_the_alignment() -> None:
    allocator = Allocator(SEGMENT + 10)
    assert allocator.size_bytes == SEGMENT   # a ragged tail is unusable
    assert allocator.allocate(1) == 0
    assert allocator.allocate(1) == ALIGN_BYTES
    assert allocator.allocate(SEGMENT) == -1
    with pytest.raises(ValueError):
        Allocator(0)


def test_from_used_rebuilds_the_same_free_space() -> None:
    rng = random.Random(5)
    allocator = Allocator(SEGMENT)
    live = {}
    for _ in range(200):
        size = rng.randrange(1, 3000)
        offset = allocator.allocate(size)
        if offset >= 0:
            live[offset] = size
        if live and rng.random() < 0.4:
            victim = rng.choice(list(live))
            allocator.free(victim, live.pop(victim))
    rebuilt = Allocator.from_used(SEGMENT, live.items())
    assert rebuilt.free_extents() == allocator.free_extents()
    assert rebuilt.used_bytes == allocator.used_bytes
    with pytest.raises(ValueError):
        Allocator.from_used(SEGMENT, [(0, 128), (64, 64)])
    # the columns a restore keeps (machine words, in any order) rebuild it the same
    offsets = array("Q", reversed(live))
    sizes = array("Q", (aligned(live[o]) for o in reversed(live)))
    from_columns = Allocator.from_columns(SEGMENT, offsets, sizes)
    assert from_columns.free_extents() == allocator.free_extents()
    assert from_columns.num_extents == len(live)
    with pytest.raises(ValueError):
        Allocator.from_columns(SEGMENT, array("Q", [0, 64]), array("Q", [128, 64]))


@pytest.mark.parametrize("offsets, sizes", [
    ([0, 64], [128, 64]),                # overlap
    ([64], [100]),                      # aligned offset, unaligned size
    ([32], [64]),                       # unaligned offset
    ([0], [0]),                         # empty extent
    ([SEGMENT - 64], [128]),            # past the end
    ([2**63], [64]),                    # far past the end: no sum may wrap around
    ([0, 64], [64]),                    # ragged columns
    ([-64], [64]),                      # not an unsigned word
])
def test_from_columns_refuses_extents_that_cannot_be_allocated(offsets: list[int],
                                                              sizes: list[int]) -> None:
    with pytest.raises(ValueError):
        Allocator.from_columns(SEGMENT, offsets, sizes)


def test_from_columns_of_nothing_and_of_everything() -> None:
    assert Allocator.from_columns(SEGMENT, [], []).free_extents() == [(0, SEGMENT)]
    full = Allocator.from_columns(SEGMENT, array("Q", [SEGMENT // 2, 0]),
                                  array("Q", [SEGMENT // 2, SEGMENT // 2]))
    assert full.free_extents() == [] and full.allocate(1) == -1
    full.free(0, SEGMENT // 2)
    full.free(SEGMENT // 2, SEGMENT // 2)
    assert full.free_extents() == [(0, SEGMENT)] and full.num_extents == 0


def test_fragmentation_on_a_kv_like_workload() -> None:
    """Uniform 16 KiB blocks with 5 % odd sizes, churned at the edge of a full segment: an
    allocation is refused only when the segment is at least 97 % used (98 % on average), so
    fragmentation wastes under 3 % of it."""
    block = 16 << 10
    allocator = Allocator(2048 * block)
    rng = random.Random(11)
    live: list[tuple[int, int]] = []
    refused_at: list[float] = []
    for _ in range(30_000):
        size = block if rng.random() < 0.95 else rng.choice((4096, 12_000, 40_000))
        offset = allocator.allocate(size)
        if offset >= 0:
            live.append((offset, size))
            continue
        refused_at.append(allocator.used_bytes / allocator.size_bytes)
        for _ in range(3):   # make room as an eviction would, at random places
            index = rng.randrange(len(live))
            live[index], live[-1] = live[-1], live[index]
            allocator.free(*live.pop())
    assert len(refused_at) > 1000, "the workload never pressed the allocator"
    assert min(refused_at) > 0.97
    assert sum(refused_at) / len(refused_at) > 0.98


def test_uniform_blocks_pack_perfectly() -> None:
    allocator = Allocator(1000 * 4096)
    rng = random.Random(3)
    live = [allocator.allocate(4096) for _ in range(1000)]
    assert -1 not in live and allocator.free_bytes == 0
    for _ in range(5000):
        victim = live.pop(rng.randrange(len(live)))
        allocator.free(victim, 4096)
        offset = allocator.allocate(4096)
        assert offset >= 0
        live.append(offset)
    assert allocator.free_bytes == 0


def test_a_run_in_a_turned_over_segment_takes_its_holes_in_one_call() -> None:
    """After LRU eviction freed every other block, no free extent holds two blocks: a run
    takes the holes, smallest first, then the larger free tail; each is its own extent."""
    block = 4096
    allocator = Allocator(40 * block)
    assert allocator.allocate_run(block, 32) == [k * block for k in range(32)]
    for k in range(0, 32, 2):
        allocator.free(k * block, block)
    assert allocator.num_free_extents == 17
    holes = allocator.allocate_run(block, 20)
    assert holes == [k * block for k in range(0, 32, 2)] + [32 * block + k * block
                                                            for k in range(4)]
    assert allocator.free_extents() == [(36 * block, 4 * block)]
    assert allocator.allocate_run(block, 8) == [36 * block + k * block for k in range(4)]
    assert allocator.allocate_run(block, 8) == [] and allocator.free_bytes == 0
    for offset in holes:
        allocator.free(offset, block)
    assert allocator.num_extents == 40 - len(holes)
