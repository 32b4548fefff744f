"""The batch paths of ``put_start`` / ``put_end`` (C-level maps for a plain batch) against the
key-by-key loop: two cores, one with ``batch_paths`` off, take the same random calls and must
answer them alike and end in the same state, field by field and in recency order.

The calls mix what the batch paths take (plain batches of one size, chains of parents, a
writer's own commits) with what they must leave to the loop (a key already there, a key twice,
mixed sizes, a malformed key or parent, another writer's commit, checksums out of range, a
commit of revoked keys, some of them put again), in
pools small enough that runs cross the high watermark and evict. Seeds are fixed, so the test
cannot fail by chance; it also checks that the batch paths did run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from helpers import each_commit

from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire import capability, convert
from kvpool_wire.placed import PlacedBatch
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, Op, Pin, PutOptions, SegmentId, SegmentInfo

WRITERS = [ClientId("w0"), ClientId("w1")]
SIZES = [4096, 65536]


def _state(core: MasterCore) -> Any:
    objects = core._objects
    entries = [(e.key, e.size_bytes, e.extents(), e.writer_id, e.checksum, e.parent_key,
                e.pin, e.lease_expiry_s, e.holds) for e in objects.entries()]
    segments = sorted((s.info.segment_id, s.allocator.free_bytes)
                      for s in core._segments.id_to_segment.values())
    children = [dict(sorted(c.items())) for c in objects.child_counts or []]
    return (entries, list(objects.pending_key_to_started_s.items()), objects.ready_bytes,
            dict(core._segments.tier_to_used_bytes), segments, children, core.stats())


def _core(batch_paths: bool, policy: str, defer: bool) -> MasterCore:
    core = MasterCore(CoreConfig(eviction_policy=policy, put_start_discard_timeout_s=30.0,
                                 default_lease_ttl_s=0.2))
    core.batch_paths = batch_paths
    core.defer_upkeep = defer
    for i, writer in enumerate(WRITERS):
        assert core.register_client(writer, "h", bytes([i + 1]) * 32, 0.0)[0] == Status.OK
    return core


def _keys(rng: random.Random, made: list[ObjectKey], n: int) -> list[ObjectKey]:
    """Fresh keys mostly; sometimes one that exists, a leading stretch of keys put before
    (a chain whose first blocks the pool has), some put before here and there, one twice,
    or a malformed one."""
    keys = [ObjectKey(b"k%06d" % (len(made) + i)) for i in range(n)]
    made.extend(keys)
    older = made[:-n]
    roll = rng.random()
    if roll < 0.08 and older:
        keys[rng.randrange(n)] = rng.choice(older)
    elif roll < 0.16 and older:
        lead = rng.randrange(1, n + 1)
        keys[:lead] = older[-lead:] if len(older) >= lead else older + keys[len(older):lead]
    elif roll < 0.24 and older:
        spots = sorted({min(n - 1, at + i) for at in rng.sample(range(n), min(n, 4))
                        for i in range(rng.choice([1, 2, 9]))})
        for spot, key in zip(spots, rng.sample(older, min(len(older), len(spots))),
                             strict=False):
            keys[spot] = key
    elif roll < 0.30 and n > 1:
        keys[rng.randrange(n)] = keys[0]
    elif roll < 0.34:
        keys[rng.randrange(n)] = ObjectKey(rng.choice([b"", b"x" * 2000]))
    return keys


def _calls(seed: int) -> list[tuple[str, Any]]:
    rng = random.Random(seed)
    made: list[ObjectKey] = []
    started: list[tuple[ClientId, list[ObjectKey]]] = []
    committed: list[list[ObjectKey]] = []
    calls: list[tuple[str, Any]] = []
    mounted = [SegmentInfo(SegmentId(f"s{i}"), WRITERS[i % 2], rng.choice([40, 64, 96]) * 65536)
               for i in range(3)]
    calls += [("mount", info) for info in mounted]
    gone: list[SegmentInfo] = []
    for _ in range(160):
        roll = rng.random()
        if gone and rng.random() < 0.2:   # mounted again: what is parked on it stays held
            mounted.append(gone.pop())
            calls.append(("mount", mounted[-1]))
        elif len(mounted) > 1 and rng.random() < 0.03:   # its objects swept, leased ones parked
            gone.append(mounted.pop(rng.randrange(len(mounted))))
            calls.append(("unmount", gone[-1]))
        if roll < 0.5:
            n = rng.choice([2, 3, 17, 64, 65, 130, 200])
            writer = rng.choice(WRITERS)
            keys = _keys(rng, made, n)
            size = rng.choice(SIZES)
            sizes = [size] * n
            if rng.random() < 0.1:
                sizes[rng.randrange(n)] = rng.choice(SIZES + [0])
            parents: list[ObjectKey] | None = None
            if rng.random() < 0.5:
                parents = [ObjectKey(b"")] + keys[:-1]
                if rng.random() < 0.3:
                    parents[0] = rng.choice(made)
                if rng.random() < 0.05:
                    parents[rng.randrange(n)] = ObjectKey(b"p" * 2000)
            calls.append(("put_start", (writer, keys, sizes, parents)))
            started.append((writer, keys))
        elif roll < 0.85 and started:
            writer, keys = started.pop(rng.randrange(len(started)))
            if rng.random() < 0.1:
                writer = WRITERS[1 - WRITERS.index(writer)]
            elif rng.random() < 0.2:
                keys = keys[: rng.randrange(1, len(keys) + 1)]
            checksums: list[int] | None = None
            if rng.random() < 0.4:
                checksums = [rng.randrange(1 << 64) for _ in keys]
                if rng.random() < 0.1:
                    checksums[-1] = -1
            calls.append(("put_end", (writer, keys, checksums)))
            committed.append(keys)
            for _ in range(rng.choice([0, 0, 1, 2])):   # read at once (READY, in the pool)
                reads = rng.sample(keys, rng.randrange(1, len(keys) + 1))
                calls.append(("read", (reads, rng.choice([None, *WRITERS]))))
        elif roll < 0.88 and started:   # revoked, and often committed later all the same
            writer, keys = started[rng.randrange(len(started))]
            calls.append(("revoke", (writer, keys[: rng.randrange(1, len(keys) + 1)])))
        elif roll < 0.92 and made:
            calls.append(("exist", rng.sample(made, min(len(made), 50))))
        elif roll < 0.96 and made:   # leases (a reader's holds, or leases nobody can end)
            if committed and rng.random() < 0.7:   # a batch committed (all READY, mostly)
                batch = rng.choice(committed)
                reads = rng.sample(batch, rng.randrange(1, len(batch) + 1))
            else:
                reads = rng.sample(made, min(len(made), 40))
            calls.append(("read", (reads, rng.choice([None, *WRITERS]))))
        elif made:   # forced now and then: leased objects go too, their bytes parked
            calls.append(("remove", (rng.sample(made, min(len(made), 20)),
                                     rng.random() < 0.5)))
    return calls


def _apply(core: MasterCore, call: tuple[str, Any], now: float) -> Any:
    what, args = call
    if what == "mount":
        return core.mount_segment(args, now)
    if what == "unmount":
        return core.unmount_segment(args.client_id, args.segment_id, now)
    if what == "put_start":
        writer, keys, sizes, parents = args
        return list(core.put_start(writer, keys, sizes, PutOptions(pin=Pin.NONE), now, parents))
    if what == "put_end":
        writer, keys, checksums = args
        return core.put_end(writer, keys, now, checksums)
    if what == "revoke":
        return core.put_revoke(args[0], args[1], now)
    if what == "exist":
        return core.exist(args, now)
    if what == "read":
        return core.get_replicas(args[0], now, args[1])
    return core.remove(args[0], args[1], now)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy,defer", [("lru", False), ("prefix-lru", True)])
def test_batch_paths_answer_and_change_as_the_loop_does(seed: int, policy: str,
                                                         defer: bool) -> None:
    fast, slow = _core(True, policy, defer), _core(False, policy, defer)
    runs = 0
    real_put_start = fast.put_start

    def counting(*args: Any, **kwargs: Any) -> Sequence[Any]:
        nonlocal runs
        results = real_put_start(*args, **kwargs)
        runs += isinstance(results, PlacedBatch) and bool(results.runs)
        return results

    fast.put_start = counting  # type: ignore[method-assign]
    for step, call in enumerate(_calls(seed)):
        now = 1.0 + step * 0.01
        assert _apply(fast, call, now) == _apply(slow, call, now), (step, call[0])
        while fast.upkeep(now) | slow.upkeep(now):   # sweeps; deferred watermark passes
            pass
        assert _state(fast) == _state(slow), (step, call[0])
        assert each_commit(fast.take_events()) == slow.take_events(), (step, call[0])
    assert runs >= 5  # the batch paths ran, not only the loop
    # (runs that go on after keys the loop answered: most seeds meet them, and the test
    # below always does)


def test_runs_resumed_after_keys_the_loop_answered_change_as_the_loop_does() -> None:
    """Runs, the loop's answers for five keys the pool has, runs again: the same answers,
    state and events as the loop's (the random traces above meet this too, most seeds)."""
    fast, slow = _core(True, "lru", False), _core(False, "lru", False)
    placed = _runs_between_keys(fast)
    slow_placed = _runs_between_keys_by(slow)
    assert list(placed) == slow_placed
    assert _state(fast) == _state(slow)
    assert each_commit(fast.take_events()) == slow.take_events()


def _runs_then_rest(core: MasterCore) -> PlacedBatch:
    """A batch of 100 plain puts into a segment with room for 80: runs, then the loop."""
    assert core.mount_segment(SegmentInfo(SegmentId("s"), WRITERS[0], 80 * 4096), 0.0) \
        == Status.OK
    keys = [ObjectKey(b"a%d" % i) for i in range(100)]
    results = core.put_start(WRITERS[0], keys, [4096] * 100, PutOptions(), 1.0)
    assert isinstance(results, PlacedBatch) and results.runs \
        and isinstance(results.pieces[-1], list)
    return results


def _runs_between_keys_by(core: MasterCore) -> Sequence[Any]:
    """A batch of 60 plain puts, five of them keys the pool has (two alone, a stretch of
    three), put into ``core``."""
    assert core.mount_segment(SegmentInfo(SegmentId("s"), WRITERS[0], 200 * 4096), 0.0) \
        == Status.OK
    had = [ObjectKey(b"h%d" % i) for i in range(5)]
    assert [status for status, _ in core.put_start(WRITERS[1], had, [4096] * 5, PutOptions(),
                                                   1.0)] == [Status.OK] * 5
    keys = [ObjectKey(b"a%d" % i) for i in range(60)]
    keys[10:13], keys[30], keys[50] = had[:3], had[3], had[4]
    return core.put_start(WRITERS[0], keys, [4096] * 60, PutOptions(), 1.0)


def _runs_between_keys(core: MasterCore) -> PlacedBatch:
    """``_runs_between_keys_by`` on the batch paths: runs, the loop's answers, runs again."""
    results = _runs_between_keys_by(core)
    assert isinstance(results, PlacedBatch)
    kinds = [isinstance(piece, tuple) for piece in results.pieces]
    assert kinds[0] and kinds[-1] and False in kinds
    assert [i for i, s in enumerate(results.statuses()) if s != Status.OK] == [10, 11, 12, 30,
                                                                               50]
    return results


@pytest.mark.parametrize("made", [_runs_then_rest, _runs_between_keys])
def test_a_placed_batch_reads_as_its_list(made: Any) -> None:
    results = made(_core(True, "lru", False))
    as_list = list(results)
    n = len(as_list)
    assert results == as_list and as_list == results and len(results) == n
    assert [results[i] for i in range(-n, n)] == as_list + as_list
    assert results[3:90:7] == as_list[3:90:7]
    assert results.statuses() == [s for s, _ in as_list]
    assert set(results.statuses()) - {Status.OK}
    assert results != as_list[:-1] and results != [(Status.NO_SPACE, ())] + as_list[1:]
    with pytest.raises(IndexError):
        results[n]


@pytest.mark.parametrize("made", [_runs_then_rest, _runs_between_keys])
def test_a_placed_batch_encodes_as_its_list(made: Any) -> None:
    """Its runs go into the columns as they are, signed a run at a time: the same answer."""
    core = _core(True, "lru", False)
    results = made(core)
    one = capability.extent_signer(core.segment_key, Op.WRITE, 5000, 7, 3)
    run = capability.run_signer(core.segment_key, Op.WRITE, 5000, 7, 3)
    for first_index in (0, 512):
        by_runs = convert.encode_put_start(results, 5000, one, 3, True, first_index, run)
        by_keys = convert.encode_put_start(list(results), 5000, one, 3, True, first_index)
        assert by_runs.SerializeToString() == by_keys.SerializeToString()
        assert by_runs.columns.capabilities[0] != b""
    nested = convert.encode_put_start(results, 5000, one, 3, False, 0, run)
    assert nested == convert.encode_put_start(list(results), 5000, one, 3, False, 0)


@pytest.mark.parametrize("reader", [None, WRITERS[1]])
def test_a_lost_segment_is_swept_as_the_loop_sweeps_it(reader: ClientId | None) -> None:
    """Objects of a segment lost, half of them leased (by leases nobody can end, or by a
    reader's holds), swept in batches: the leased ones' bytes stay parked, also once the
    segment is mounted again, exactly as the key-by-key drop parks them."""
    cores = [_core(True, "lru", False), _core(False, "lru", False)]
    lost = SegmentInfo(SegmentId("lost"), WRITERS[0], 8192 * 4096)
    keys = [ObjectKey(b"o%05d" % i) for i in range(6000)]
    for core in cores:
        assert core.mount_segment(lost, 0.0) == Status.OK
        for i in range(0, len(keys), 500):
            placed = core.put_start(WRITERS[0], keys[i:i + 500], [4096] * 500, PutOptions(), 1.0)
            assert [status for status, _ in placed] == [Status.OK] * 500
            assert core.put_end(WRITERS[0], keys[i:i + 500], 1.0) == [Status.OK] * 500
        assert core.mount_segment(SegmentInfo(SegmentId("kept"), WRITERS[1], 64 * 4096),
                                  1.0) == Status.OK
        assert all(r.status == Status.OK for r in core.get_replicas(keys[::2], 1.0, reader))
        assert core.unmount_segment(WRITERS[0], SegmentId("lost"), 1.1) == Status.OK
        while core.upkeep(1.1):
            pass
    fast, slow = cores
    assert _state(fast) == _state(slow)
    assert each_commit(fast.take_events()) == slow.take_events()
    for core in cores:
        assert core.mount_segment(lost, 1.2) == Status.OK   # within the leases: still held
    assert _state(fast) == _state(slow)
    state = fast._segments.id_to_segment[SegmentId("lost")]
    assert state.allocator.free_bytes == lost.size_bytes - 3000 * 4096
