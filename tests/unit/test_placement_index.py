"""The placement index: the order of candidate segments it yields is exactly "DRAM segments
only (puts never land on SSD), most free bytes first, earlier mount first", after any sequence
of allocations, frees, mounts and unmounts; and its cost does not grow with the number of
segments."""

from __future__ import annotations

import random
from typing import Any

import kvpool_master.core.segments as segments_module
from kvpool_master.core.allocator import Allocator
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.segments import SegmentState, SegmentTable
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo, Tier

MIB = 1 << 20
OWNER = ClientId("owner")


def _expected(table: SegmentTable) -> list[str]:
    ranked = sorted((s for s in table.mounted if s.info.tier == Tier.DRAM),
                    key=lambda s: (-s.allocator.free_bytes, s.mount_no))
    return [s.info.segment_id for s in ranked]


def _indexed(table: SegmentTable) -> list[str]:
    ranked = table._by_rank()
    try:
        return [s.info.segment_id for s in ranked]
    finally:
        ranked.close()


def test_the_index_order_matches_a_full_sort_after_random_operations() -> None:
    rng = random.Random(7)
    table = SegmentTable()
    live: list[tuple[str, int, int]] = []  # (segment id, offset, size)
    next_id = 0
    for step in range(3000):
        roll = rng.random()
        if roll < 0.05 or not table.mounted:
            tier = rng.choice([Tier.DRAM, Tier.DRAM, Tier.SSD])
            info = SegmentInfo(SegmentId(f"s{next_id}"), OWNER, 64 * MIB, tier=tier)
            next_id += 1
            table.add(SegmentState(info, Allocator(64 * MIB), mounted=True))
        elif roll < 0.08 and len(table.mounted) > 1:
            victim = rng.choice(table.mounted)
            table.discard(victim)
            live = [x for x in live if x[0] != victim.info.segment_id]
        elif roll < 0.6:
            size = rng.choice([4096, 64 << 10, MIB, 3 * MIB])
            # a preferred segment now and then: an allocation made off the index
            preferred = rng.choice(table.mounted).info.segment_id if roll < 0.2 else ""
            placements = table.allocate(size, rng.choice([1, 1, 2]), preferred, "")
            for p in placements or ():
                live.append((p.segment_id, p.offset, p.length))
        elif live:
            segment_id, offset, size = live.pop(rng.randrange(len(live)))
            from kvpool_wire.types import Placement
            table.free([Placement(SegmentId(segment_id), offset, size)])
        if step % 50 == 0:
            assert _indexed(table) == _expected(table), step
    assert _indexed(table) == _expected(table)


def test_a_put_among_many_segments_goes_to_the_emptiest_and_the_index_stays_small() -> None:
    core = MasterCore(CoreConfig())
    owners = [ClientId(f"owner-{n}") for n in range(4)]  # at most 1024 segments a client
    for owner in owners:
        assert core.register_client(owner, "host", b"k" * 32, 0.0)[0] == Status.OK
    for i in range(2000):
        size = (i % 7 + 1) * MIB
        info = SegmentInfo(SegmentId(f"seg-{i}"), owners[i % 4], size)
        assert core.mount_segment(info, 0.0) == Status.OK
    for i in range(500):
        [(status, _)] = core.put_start(owners[0], [ObjectKey(b"k%d" % i)], [MIB],
                                       PutOptions(), 1.0)
        assert status == Status.OK
        core.put_end(owners[0], [ObjectKey(b"k%d" % i)], 1.0)
    segments = core._segments  # every 7 MiB segment took one object before any other
    taken = {p.segment_id for k in range(500)
             for p in core.get_replicas([ObjectKey(b"k%d" % k)], 2.0)[0].placements}
    sevens = {f"seg-{i}" for i in range(2000) if i % 7 == 6}
    assert sevens <= taken
    assert len(segments._by_free) <= 2 * len(segments.mounted) + 64


def test_a_put_after_many_frees_pops_the_index_about_once(monkeypatch: Any) -> None:
    # One segment churned as a put -> remove loop does: each free pushes an entry, and a put
    # must not wade through all of them (each entry is popped at most once, ever).
    core = MasterCore(CoreConfig())
    assert core.register_client(OWNER, "host", b"k" * 32, 0.0)[0] == Status.OK
    assert core.mount_segment(SegmentInfo(SegmentId("seg"), OWNER, 256 * MIB), 0.0) == Status.OK
    pops = [0]
    real_pop = segments_module.heapq.heappop

    def counting_pop(heap: list[Any]) -> Any:
        pops[0] += 1
        return real_pop(heap)

    monkeypatch.setattr(segments_module.heapq, "heappop", counting_pop)
    keys = [ObjectKey(b"k%d" % i) for i in range(192)]
    for round_ in range(5):
        pops[0] = 0
        for i in range(0, len(keys), 32):
            results = core.put_start(OWNER, keys[i:i + 32], [MIB] * 32, PutOptions(), 1.0)
            assert [status for status, _ in results] == [Status.OK] * 32
            core.put_end(OWNER, keys[i:i + 32], 1.0)
        assert pops[0] <= 2 * len(keys), (round_, pops[0])
        for key in keys:
            assert core.remove([key], True, 2.0) == [Status.OK]
