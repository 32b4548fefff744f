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
                e.pin, e.lease_expiry_s) for e in objects.entries()]
    segments = sorted((s.info.segment_id, s.allocator.free_bytes)
                      for s in core._segments.id_to_segment.values())
    children = [dict(sorted(c.items())) for c in objects.child_counts or []]
    return (entries, list(objects.pending_key_to_started_s.items()), objects.ready_bytes,
            dict(core._segments.tier_to_used_bytes), segments, children, core.stats())


def _core(batch_paths: bool, policy: str, defer: bool) -> MasterCore:
    core = MasterCore(CoreConfig(eviction_policy=policy, put_start_discard_timeout_s=30.0))
    core.batch_paths = batch_paths
    core.defer_upkeep = defer
    for i, writer in enumerate(WRITERS):
        assert core.register_client(writer, "h", bytes([i + 1]) * 32, 0.0)[0] == Status.OK
    return core


def _keys(rng: random.Random, made: list[ObjectKey], n: int) -> list[ObjectKey]:
    """Fresh keys mostly; sometimes one that exists, one twice, or a malformed one."""
    keys = [ObjectKey(b"k%06d" % (len(made) + i)) for i in range(n)]
    made.extend(keys)
    roll = rng.random()
    if roll < 0.08 and len(made) > n:
        keys[rng.randrange(n)] = rng.choice(made[:-n])
    elif roll < 0.14 and n > 1:
        keys[rng.randrange(n)] = keys[0]
    elif roll < 0.18:
        keys[rng.randrange(n)] = ObjectKey(rng.choice([b"", b"x" * 2000]))
    return keys


def _calls(seed: int) -> list[tuple[str, Any]]:
    rng = random.Random(seed)
    made: list[ObjectKey] = []
    started: list[tuple[ClientId, list[ObjectKey]]] = []
    calls: list[tuple[str, Any]] = []
    for i in range(3):
        calls.append(("mount", SegmentInfo(SegmentId(f"s{i}"), WRITERS[i % 2],
                                          rng.choice([40, 64, 96]) * 65536)))
    for _ in range(120):
        roll = rng.random()
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
        elif roll < 0.88 and started:   # revoked, and often committed later all the same
            writer, keys = started[rng.randrange(len(started))]
            calls.append(("revoke", (writer, keys[: rng.randrange(1, len(keys) + 1)])))
        elif roll < 0.92 and made:
            calls.append(("exist", rng.sample(made, min(len(made), 50))))
        elif made:
            calls.append(("remove", rng.sample(made, min(len(made), 20))))
    return calls


def _apply(core: MasterCore, call: tuple[str, Any], now: float) -> Any:
    what, args = call
    if what == "mount":
        return core.mount_segment(args, now)
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
    return core.remove(args, False, now)


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
        if isinstance(results, PlacedBatch) and results.runs:
            runs += 1
        return results

    fast.put_start = counting  # type: ignore[method-assign]
    for step, call in enumerate(_calls(seed)):
        now = 1.0 + step * 0.01
        assert _apply(fast, call, now) == _apply(slow, call, now), (step, call[0])
        if defer:
            while fast.upkeep(now) | slow.upkeep(now):
                pass
        assert _state(fast) == _state(slow), (step, call[0])
        assert each_commit(fast.take_events()) == slow.take_events(), (step, call[0])
    assert runs >= 5  # the batch paths ran, not only the loop


def _runs_then_rest(core: MasterCore) -> PlacedBatch:
    """A batch of 100 plain puts into a segment with room for 80: runs, then the loop."""
    assert core.mount_segment(SegmentInfo(SegmentId("s"), WRITERS[0], 80 * 4096), 0.0) \
        == Status.OK
    keys = [ObjectKey(b"a%d" % i) for i in range(100)]
    results = core.put_start(WRITERS[0], keys, [4096] * 100, PutOptions(), 1.0)
    assert isinstance(results, PlacedBatch) and results.num_run_keys and results.rest
    return results


def test_a_placed_batch_reads_as_its_list() -> None:
    results = _runs_then_rest(_core(True, "lru", False))
    as_list = list(results)
    assert results == as_list and as_list == results and len(results) == 100
    assert [results[i] for i in range(-100, 100)] == as_list + as_list
    assert results[3:90:7] == as_list[3:90:7]
    assert results.statuses() == [s for s, _ in as_list]
    assert Status.NO_SPACE in results.statuses()
    assert results != as_list[:-1] and results != [(Status.NO_SPACE, ())] + as_list[1:]
    with pytest.raises(IndexError):
        results[100]


def test_a_placed_batch_encodes_as_its_list() -> None:
    """Its runs go into the columns as they are, signed a run at a time: the same answer."""
    core = _core(True, "lru", False)
    results = _runs_then_rest(core)
    one = capability.extent_signer(core.segment_key, Op.WRITE, 5000, 7, 3)
    run = capability.run_signer(core.segment_key, Op.WRITE, 5000, 7, 3)
    for first_index in (0, 512):
        by_runs = convert.encode_put_start(results, 5000, one, 3, True, first_index, run)
        by_keys = convert.encode_put_start(list(results), 5000, one, 3, True, first_index)
        assert by_runs.SerializeToString() == by_keys.SerializeToString()
        assert by_runs.columns.capabilities[0] != b""
    nested = convert.encode_put_start(results, 5000, one, 3, False, 0, run)
    assert nested == convert.encode_put_start(list(results), 5000, one, 3, False, 0)
