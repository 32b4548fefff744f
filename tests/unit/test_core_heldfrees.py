"""A removal job holds the extents of what it removed and frees them in offset order."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_master.core import heldfrees
from kvpool_master.core.allocator import OFFSET_BITS
from kvpool_master.core.heldfrees import FREE_STEP_EXTENTS
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.objects import SHARD_MASK
from kvpool_master.core.segments import SegmentState
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo

A = ClientId("client-a")
SEGMENT = SegmentInfo(SegmentId("seg-a"), A, 64 << 20, host_id="host-1")
NUM_OBJECTS = 6000


def filled_core() -> MasterCore:
    core = MasterCore(CoreConfig(eviction_high_watermark_ratio=1.0))
    assert core.register_client(A, "host-1", b"k" * 32, 0.0)[0] == Status.OK
    assert core.mount_segment(SEGMENT, 0.0) == Status.OK
    keys = [ObjectKey(b"key-%d" % i) for i in range(NUM_OBJECTS)]
    for i in range(0, NUM_OBJECTS, 1000):
        started = core.put_start(A, keys[i:i + 1000], [4000] * 1000, PutOptions(), 1.0)
        assert {status for status, _ in started} == {Status.OK}
        core.put_end(A, keys[i:i + 1000], 1.0)
    core.take_events()
    return core


def spy_frees(core: MasterCore, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The offsets of each call that frees held extents, in call order."""
    calls: list[list[int]] = []
    segments = core._segments
    real = segments.free_packed_on

    def free_packed_on(state: SegmentState, packed: list[int], seq: int) -> None:
        calls.append([p >> OFFSET_BITS for p in packed])
        real(state, packed, seq)
    monkeypatch.setattr(segments, "free_packed_on", free_packed_on)
    return calls


def state_of(core: MasterCore) -> SegmentState:
    return core._segments.id_to_segment[SEGMENT.segment_id]


@pytest.mark.parametrize("split", [False, True], ids=["buckets sorted", "buckets split"])
def test_a_removal_job_frees_what_it_removed_in_offset_order_after_its_walk(
        split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if split:   # one bucket for the whole segment, split (by 16 bits) until pieces of 64
        monkeypatch.setattr(heldfrees, "_EXTENTS_PER_BUCKET", 1 << 30)
        monkeypatch.setattr(heldfrees, "SORT_MAX_EXTENTS", 64)
    core = filled_core()
    allocator = state_of(core).allocator
    used_bytes = allocator.used_bytes
    calls = spy_frees(core, monkeypatch)
    job = core.start_remove(None, False, 2.0)
    assert not job.done
    while job.shards_left:   # the walk: objects go, their extents stay allocated
        assert core.sweep(2.0)
    assert core.stats().num_objects == 0 and not calls
    assert allocator.used_bytes == used_bytes and allocator.num_extents == NUM_OBJECTS
    assert core.stats().held_extents == NUM_OBJECTS   # what the gauge shows meanwhile
    while core.sweep(2.0):
        assert not job.done
        assert core.stats().held_extents == NUM_OBJECTS - sum(map(len, calls))
    assert job.done and job.removed == NUM_OBJECTS
    freed = [offset for call in calls for offset in call]
    assert freed == sorted(freed) and len(freed) == NUM_OBJECTS
    assert max(map(len, calls)) <= FREE_STEP_EXTENTS
    # neighbours merged as they were freed: the segment is one free extent again
    assert allocator.free_extents() == [(0, SEGMENT.size_bytes)]
    assert allocator.num_extents == 0 and core.stats().tier_to_used_bytes[SEGMENT.tier] == 0
    assert core.stats().held_extents == 0


def test_a_job_that_matches_some_keys_frees_exactly_their_extents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_master.core.keyregex import compile_key_pattern
    core = filled_core()
    kept = [ObjectKey(b"key-%d" % i) for i in range(NUM_OBJECTS) if b"7" not in b"%d" % i]
    placements = core.get_replicas(kept, 2.0)
    live = sorted((p.offset, p.length) for result in placements for p in result.placements)
    pattern = compile_key_pattern("7")
    assert pattern is not None
    job = core.start_remove(pattern, False, 3.0)
    while core.sweep(3.0):
        pass
    assert job.done and job.removed == NUM_OBJECTS - len(kept)
    assert all(status == Status.OK for status in core.exist(kept, 3.0)[0])
    rebuilt: Any = type(state_of(core).allocator).from_used(SEGMENT.size_bytes, live)
    assert state_of(core).allocator.free_extents() == rebuilt.free_extents()


def test_held_extents_of_a_segment_lost_meanwhile_are_dropped_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core = filled_core()
    job = core.start_remove(None, False, 2.0)
    while job.shards_left:
        core.sweep(2.0)
    assert job.held and core.held_extents() == NUM_OBJECTS
    calls = spy_frees(core, monkeypatch)
    # the owner takes the segment away and mounts it again: fresh memory, all of it free
    assert core.unmount_segment(A, SEGMENT.segment_id, 3.0) == Status.OK
    assert core.mount_segment(SEGMENT, 3.0) == Status.OK
    while core.sweep(3.0):
        pass
    assert job.done and not calls and core.held_extents() == 0
    assert state_of(core).allocator.free_extents() == [(0, SEGMENT.size_bytes)]


def test_a_removal_at_once_frees_every_extent_too() -> None:
    core = filled_core()
    assert core.remove_all(False, 2.0) == NUM_OBJECTS
    allocator = state_of(core).allocator
    assert allocator.free_extents() == [(0, SEGMENT.size_bytes)] and not core.sweeping


def test_a_job_s_frees_and_a_lost_segment_s_sweep_take_turns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core = filled_core()
    other = SegmentInfo(SegmentId("seg-b"), A, 64 << 20, host_id="host-1")
    assert core.mount_segment(other, 1.0) == Status.OK
    keys = [ObjectKey(b"b-%d" % i) for i in range(2000)]
    core.put_start(A, keys, [4000] * len(keys), PutOptions(preferred_segment="seg-b"), 1.0)
    core.put_end(A, keys, 1.0)
    from kvpool_master.core.keyregex import compile_key_pattern
    pattern = compile_key_pattern("^key-")
    assert pattern is not None
    job = core.start_remove(pattern, False, 2.0)
    while job.shards_left:
        core.sweep(2.0)
    calls = spy_frees(core, monkeypatch)
    assert core.unmount_segment(A, other.segment_id, 3.0) == Status.OK
    backlog = core.sweep_backlog_keys()
    assert backlog > 0
    core.sweep(3.0)
    core.sweep(3.0)
    assert len(calls) == 1 and core.sweep_backlog_keys() < backlog   # one of each
    while core.sweep(3.0):
        pass
    assert job.done and core.stats().num_objects == 0
    assert state_of(core).allocator.free_extents() == [(0, SEGMENT.size_bytes)]


@pytest.mark.parametrize("budget_keys", [3, 1024], ids=["shard listed between steps",
                                                     "a shard a step"])
@pytest.mark.parametrize("pattern", [None, "key-"], ids=["RemoveAll", "RemoveByRegex"])
def test_a_removal_job_leaves_the_objects_put_after_it_started(pattern: str | None,
                                                              budget_keys: int) -> None:
    """As one call would: what was READY when the job started goes; what is put (and
    committed) while it walks stays, also under a key it already removed, and so does what
    was PENDING when it started and is committed while it walks."""
    from kvpool_master.core.keyregex import compile_key_pattern
    core = filled_core()
    early = [ObjectKey(b"key-early-%d" % i) for i in range(50)]
    assert all(s == Status.OK for s, _ in core.put_start(A, early, [4000] * 50, PutOptions(),
                                                         1.0))
    job = core.start_remove(None if pattern is None else compile_key_pattern(pattern), False,
                            2.0)
    later: list[ObjectKey] = []
    near_left = {True, False} if budget_keys < 6 else {True}   # (6: the entries of a shard)
    step = 0
    while job.shards_left:
        core.sweep(2.0, budget_keys)
        step += 1
        if step % 50 == 0:   # puts between the walk's steps, also of keys it removed already
            keys = [ObjectKey(b"key-late-%d" % step), ObjectKey(b"key-%d" % (step % 3000))]
            if core._objects.get(keys[1]) is None:   # (removed already; no read: a lease)
                started = core.put_start(A, keys, [4000, 4000], PutOptions(), 2.0)
                assert [s for s, _ in started] == [Status.OK, Status.OK]
                core.put_end(A, keys, 2.0)
                later += keys
        if step == 100:
            core.put_end(A, early, 2.0)
        walk = core._walk
        if step >= 100 and (walk.entries is None) in near_left:
            # keys for the shard the walk is in and the next ones, once with that shard
            # listed (what is put into it now is never met) and once not yet
            near_left.discard(walk.entries is None)
            wanted = {(walk.shard + ahead) & SHARD_MASK for ahead in range(3)}
            near = [key for key in (ObjectKey(b"near-%d-%d" % (step, i)) for i in range(20000))
                    if hash(key) & SHARD_MASK in wanted][:12]
            assert core.put_start(A, near, [4000] * len(near), PutOptions(), 2.0)
            core.put_end(A, near, 2.0)
            later += near
    while core.sweep(2.0):
        pass
    assert job.done and later
    statuses = core.exist(later + early, 3.0)[0]
    assert statuses == [Status.OK] * (len(later) + len(early))
    assert core.stats().num_objects == len(later) + len(early)
    assert job.removed == NUM_OBJECTS   # (a key is put again only once removed)
    assert not job.spared and not near_left   # let go of once the walk is done
