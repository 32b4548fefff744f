"""Object table against a simple model (no eviction), and invariants under eviction pressure.

The eviction-pressure property runs derandomized (the same examples every run, so it cannot
fail by chance) with a modest count in the normal suite, and with many random examples in the
slow suite. Sequences it once found are pinned as explicit tests below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_master.core.allocator import aligned
from kvpool_master.core.events import ObjectRemoved
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, ObjectKey, Pin, PutOptions, SegmentId, SegmentInfo

CLIENTS = [ClientId("a"), ClientId("b")]
KEYS = [ObjectKey(b"k%d" % i) for i in range(6)]
TTL = 2.0


@dataclass
class ModelObject:
    writer: ClientId | None   # None once READY
    size: int
    lease_until: float = 0.0
    pin: Pin = Pin.NONE


def make_core(segment_bytes: int, num_segments: int = 2) -> MasterCore:
    core = MasterCore(CoreConfig(default_lease_ttl_s=TTL, client_ttl_s=1e9,
                                 put_start_discard_timeout_s=1e9,
                                 eviction_high_watermark_ratio=0.9, eviction_ratio=0.2))
    for client in CLIENTS:
        core.register_client(client, "h", b"x" * 16, 0.0)
    for i in range(num_segments):
        client = CLIENTS[i % len(CLIENTS)]
        core.mount_segment(SegmentInfo(SegmentId(f"s{i}"), client, segment_bytes), 0.0)
    return core


op = st.tuples(
    st.sampled_from(["put_start", "put_start", "put_end", "revoke", "get", "exist", "prefix",
                     "remove", "advance"]),
    st.integers(0, len(CLIENTS) - 1),
    st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=3),
    st.integers(1, 5000),
    st.booleans(),
    st.sampled_from(list(Pin)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=60))
def test_object_table_matches_a_model(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    core = make_core(1 << 30)   # large: no eviction, so the model is exact
    model: dict[ObjectKey, ModelObject] = {}
    now = 1.0
    for name, client_index, key_indexes, size, force, pin in operations:
        client = CLIENTS[client_index]
        keys = [KEYS[i] for i in key_indexes]
        if name == "advance":
            now += size / 1000.0
            core.tick(now)
            continue
        if name == "put_start":
            results = core.put_start(client, keys, [size] * len(keys), PutOptions(pin=pin), now)
            for key, (status, placements) in zip(keys, results, strict=True):
                known = model.get(key)
                if known is None:
                    assert status == Status.OK and len(placements) == 1
                    model[key] = ModelObject(client, size, pin=pin)
                elif known.writer == client:
                    assert status == (Status.OK if known.size == size
                                      else Status.INVALID_ARGUMENT)
                else:
                    assert status == Status.ALREADY_EXISTS
        elif name == "put_end":
            statuses = core.put_end(client, keys, now)
            for key, status in zip(keys, statuses, strict=True):
                known = model.get(key)
                if known is None:
                    assert status == Status.NOT_FOUND
                elif known.writer is None:
                    assert status == Status.OK
                elif known.writer != client:
                    assert status == Status.PERMISSION_DENIED
                else:
                    assert status == Status.OK
                    known.writer = None
        elif name == "revoke":
            statuses = core.put_revoke(client, keys, now)
            for key, status in zip(keys, statuses, strict=True):
                known = model.get(key)
                if known is None:
                    assert status == Status.NOT_FOUND
                elif known.writer is None:
                    assert status == Status.INVALID_ARGUMENT
                elif known.writer != client:
                    assert status == Status.PERMISSION_DENIED
                else:
                    assert status == Status.OK
                    del model[key]
        elif name in ("get", "exist"):
            if name == "get":
                results = core.get_replicas(keys, now)
                got = [(Status(r.status), r.size_bytes) for r in results]
            else:
                statuses, sizes = core.exist(keys, now)
                got = list(zip(statuses, sizes, strict=True))
            for key, (status, got_size) in zip(keys, got, strict=True):
                known = model.get(key)
                if known is None or known.writer is not None:
                    assert (status, got_size) == (Status.NOT_FOUND, 0)
                else:
                    assert (status, got_size) == (Status.OK, known.size)
                    known.lease_until = max(known.lease_until, now + TTL)
        elif name == "prefix":
            expected = 0
            for key in keys:
                known = model.get(key)
                if known is None or known.writer is not None:
                    break
                expected += 1
                known.lease_until = max(known.lease_until, now + TTL)
            assert core.query_prefix(keys, now) == expected
        elif name == "remove":
            statuses = core.remove(keys, force, now)
            for key, status in zip(keys, statuses, strict=True):
                known = model.get(key)
                if known is None:
                    assert status == Status.NOT_FOUND
                elif known.writer is not None:
                    assert status == Status.NOT_READY
                elif known.lease_until > now and not force:
                    assert status == Status.HAS_LEASE
                else:
                    assert status == Status.OK
                    del model[key]
        stats = core.stats()
        assert stats.num_objects == sum(1 for m in model.values() if m.writer is None)
        assert stats.num_pending == sum(1 for m in model.values() if m.writer is not None)


def check_no_overlap(core: MasterCore, now: float) -> None:
    """Every live extent (objects' replicas, leased extents of removed objects) is disjoint,
    and each segment's used bytes are exactly those extents."""
    seg_to_extents: dict[str, list[tuple[int, int]]] = {}
    for entry in core._objects.entries():
        for p in entry.extents():
            seg_to_extents.setdefault(p.segment_id, []).append((p.offset, aligned(p.length)))
    for segment_id, offset, size in core._deferred.extents():
        seg_to_extents.setdefault(segment_id, []).append((offset, aligned(size)))
    for stats in core.stats().segments:
        extents = sorted(seg_to_extents.get(stats.segment_id, []))
        for (o1, s1), (o2, _) in zip(extents, extents[1:], strict=False):
            assert o1 + s1 <= o2, f"overlap in {stats.segment_id}"
        assert stats.used_bytes == sum(s for _, s in extents)


pressure_op = st.tuples(
    st.sampled_from(["put", "put", "put", "read", "remove", "advance", "pending", "bounce"]),
    st.lists(st.integers(0, 40), min_size=1, max_size=4),
    st.sampled_from([4096, 4096, 4096, 9000, 20_000]),
    st.sampled_from([Pin.NONE, Pin.NONE, Pin.NONE, Pin.SOFT, Pin.HARD]),
    st.integers(1, 3000),
)


def run_pressure(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    core = make_core(16 * 4096)
    writer = CLIENTS[0]
    lease_until: dict[ObjectKey, float] = {}
    pins: dict[ObjectKey, Pin] = {}
    pending: set[ObjectKey] = set()
    now = 1.0
    def check_events() -> None:
        for event in core.take_events():
            if isinstance(event, ObjectRemoved):
                if event.reason == "evict":
                    assert lease_until.get(event.key, 0.0) <= now, "evicted a leased object"
                    assert pins[event.key] != Pin.HARD, "evicted a hard-pinned object"
                    assert event.key not in pending, "evicted a PENDING object"
                # A lease belongs to the object that was read, not to its key: after a
                # forced remove the old object's bytes stay parked until its lease ends,
                # and a new object put under the same key has never been read.
                lease_until.pop(event.key, None)
                pins.pop(event.key, None)
                pending.discard(event.key)

    for name, indexes, size, pin, step in operations:
        keys = [ObjectKey(b"p%d" % i) for i in indexes]
        if name == "advance":
            now += step / 1000.0
            core.tick(now)
            check_events()
        elif name in ("put", "pending"):
            results = core.put_start(writer, keys, [size] * len(keys), PutOptions(pin=pin), now)
            check_events()   # evictions in this call happened before its new objects
            for key, (status, _) in zip(keys, results, strict=True):
                if status == Status.OK and key not in pins:
                    pins[key] = pin
                    pending.add(key)
                if status == Status.NO_SPACE:
                    # Nothing evictable was left: every READY object is leased or hard-pinned.
                    for entry in core._objects.entries():
                        if entry.writer_id is None:
                            assert entry.lease_expiry_s > now or entry.pin == Pin.HARD, \
                                entry.key
            if name == "put":
                core.put_end(writer, keys, now)
                pending.difference_update(keys)
        elif name == "read":
            for key, result in zip(keys, core.get_replicas(keys, now), strict=True):
                if result.status == Status.OK:
                    lease_until[key] = now + TTL
                    assert key not in pending
        elif name == "remove":
            core.remove(keys, step % 2 == 0, now)
            check_events()
        elif name == "bounce":   # the second segment goes away and comes back empty
            owner = CLIENTS[1]
            assert core.unmount_segment(owner, SegmentId("s1"), now) == Status.OK
            check_events()
            assert core.mount_segment(SegmentInfo(SegmentId("s1"), owner, 16 * 4096), now) == (
                Status.OK)
            for entry in core._objects.entries():
                assert all(p.segment_id == "s0" for p in entry.extents())
        for key in pending:
            assert core.exist([key], now) == ([Status.NOT_FOUND], [0])
        check_no_overlap(core, now)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(pressure_op, max_size=80))
def test_invariants_under_eviction_pressure(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    run_pressure(operations)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None)
@given(st.lists(pressure_op, max_size=120))
def test_invariants_under_eviction_pressure_many(operations: list[tuple]) -> None:  # type: ignore[type-arg]
    run_pressure(operations)


def test_a_key_put_again_after_a_forced_remove_has_no_lease() -> None:
    """Read p0, remove it by force, put p0 again: the new p0 may be evicted (nobody leased
    it), while the old p0's bytes stay held until the old lease ends."""
    run_pressure([("put", [0], 4096, Pin.NONE, 1), ("read", [0], 4096, Pin.NONE, 1),
                  ("remove", [0], 4096, Pin.NONE, 2), ("put", [0], 4096, Pin.NONE, 1),
                  ("put", [1, 2, 3, 4], 20_000, Pin.NONE, 1),
                  ("put", [5, 6, 7, 8], 20_000, Pin.NONE, 1)])
    core = make_core(16 * 4096, num_segments=1)
    writer = CLIENTS[0]
    p0 = ObjectKey(b"p0")
    [(_, [old])] = core.put_start(writer, [p0], [4096], PutOptions(), 1.0)
    core.put_end(writer, [p0], 1.0)
    assert core.get_replicas([p0], 1.0)[0].status == Status.OK
    assert core.remove([p0], True, 1.0) == [Status.OK]
    core.put_start(writer, [p0], [4096], PutOptions(), 1.0)
    core.put_end(writer, [p0], 1.0)
    big = [ObjectKey(b"big%d" % i) for i in range(3)]
    core.put_start(writer, big, [20_000] * 3, PutOptions(), 1.5)
    evicted = [e.key for e in core.take_events()
               if isinstance(e, ObjectRemoved) and e.reason == "evict"]
    assert p0 in evicted
    assert ("s0", old.offset, old.length) in core._deferred.extents()
    check_no_overlap(core, 1.5)


@pytest.mark.parametrize("removed_first", [True, False])
def test_a_remounted_segment_keeps_leased_extents_held(removed_first: bool) -> None:
    """put, read (lease), [remove by force,] unmount the segment and mount it again empty: the
    leased extent stays held on the remounted segment (same memory, a reader may still be
    copying it) until the lease ends."""
    run_pressure([("put", [0], 4096, Pin.NONE, 1), ("read", [0], 4096, Pin.NONE, 1),
                  ("remove", [0], 4096, Pin.NONE, 2), ("bounce", [0], 4096, Pin.NONE, 1)])
    core = make_core(16 * 4096)
    owner = CLIENTS[1]
    key = ObjectKey(b"leased")
    options = PutOptions(preferred_segment="s1")
    [(_, [extent])] = core.put_start(owner, [key], [4096], options, 1.0)
    core.put_end(owner, [key], 1.0)
    assert core.get_replicas([key], 1.0)[0].status == Status.OK   # leased until 1 + TTL
    if removed_first:
        assert core.remove([key], True, 1.0) == [Status.OK]
    assert core.unmount_segment(owner, SegmentId("s1"), 1.1) == Status.OK
    assert core.mount_segment(SegmentInfo(SegmentId("s1"), owner, 16 * 4096), 1.2) == Status.OK
    [s1] = [s for s in core.stats().segments if s.segment_id == "s1"]
    assert s1.used_bytes == 4096
    # Filling the remounted segment never hands out the leased extent.
    fill = [ObjectKey(b"fill%d" % i) for i in range(16)]
    results = core.put_start(owner, fill, [4096] * 16, options, 1.5)
    given_out = {p.offset for status, ps in results if status == Status.OK for p in ps
                 if p.segment_id == "s1"}
    assert extent.offset not in given_out and len(given_out) == 15
    check_no_overlap(core, 1.5)
    core.tick(1.0 + TTL)   # the lease is over: the extent is free again
    [s1] = [s for s in core.stats().segments if s.segment_id == "s1"]
    assert s1.used_bytes == 15 * 4096
