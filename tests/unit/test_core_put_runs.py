"""Batched puts carve their extents in runs (``Mutations._carve_run``): whatever a batch
holds (sizes that change, keys already there, invalid keys, a pool that must evict), no two
live objects ever share a byte, every extent a run did not hand out is free again, and the
pool's used bytes are exactly what its objects hold."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_master.core.allocator import aligned
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo, Tier

A = ClientId("writer")
SEGMENT_BYTES = 64 << 10

item = st.tuples(st.integers(0, 40),                              # key (collisions likely)
                 st.sampled_from([1000, 1000, 1000, 4096, 100]),   # size (runs of one size)
                 st.booleans())                                    # an invalid key instead
batches = st.lists(st.tuples(st.lists(item, min_size=1, max_size=80),
                             st.booleans(),                        # commit the batch
                             st.integers(0, 40)),                  # a key to remove after
                   min_size=1, max_size=12)


def _check(core: MasterCore, segments: int) -> None:
    placed: dict[str, list[tuple[int, int]]] = {}
    for entry in core._objects.entries():
        for p in entry.extents():
            placed.setdefault(p.segment_id, []).append((p.offset, aligned(p.length)))
    total = 0
    for index in range(segments):
        state = core._segments.id_to_segment[SegmentId(f"s{index}")]
        extents = sorted(placed.get(f"s{index}", []))
        for (o1, s1), (o2, _) in zip(extents, extents[1:], strict=False):
            assert o1 + s1 <= o2, "two live objects share bytes"
        # nothing is held but what objects hold (no reads: no lease keeps a freed extent)
        assert state.allocator.used_bytes == sum(s for _, s in extents)
        assert state.allocator.num_extents == len(extents)
        total += state.allocator.used_bytes
    assert core._segments.tier_to_used_bytes[Tier.DRAM] == total


@settings(max_examples=150, deadline=None)
@given(batches, st.integers(1, 3))
def test_batched_puts_never_overlap_and_give_back_what_they_do_not_use(
        plan: list[tuple[list[tuple[int, int, bool]], bool, int]], segments: int) -> None:
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=0.9, eviction_ratio=0.1,
                                 write_capability_ttl_s=0.5))
    core.register_client(A, "h", b"k" * 32, 0.0)
    for index in range(segments):
        core.mount_segment(SegmentInfo(SegmentId(f"s{index}"), A, SEGMENT_BYTES), 0.0)
    now = 1.0
    for items, commit, removed in plan:
        keys = [ObjectKey(b"" if bad else b"k%d" % n) for n, _, bad in items]
        sizes = [size for _, size, _ in items]
        results = core.put_start(A, keys, sizes, PutOptions(), now)
        started = [k for k, (status, _) in zip(keys, results, strict=True)
                   if status == Status.OK]
        for (status, placements), size in zip(results, sizes, strict=True):
            if status == Status.OK:
                assert [p.length for p in placements] == [size]
        _check(core, segments)
        if commit:
            assert set(core.put_end(A, started, now)) <= {Status.OK}
        core.remove([ObjectKey(b"k%d" % removed)], False, now)
        now += 1.0
        _check(core, segments)
